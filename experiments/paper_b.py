"""
Paper B (STARS) at CPU scale: 4-digit addition at every depth 1..100, each recipe on five seeds by default
(the page lists the seeds each row ran).

    python experiments/paper_b.py                 # every row on seeds 1-5, two runs at once, and the page paper_b.md
    python experiments/paper_b.py --rows baseline --seeds 6,7   # more seeds of one row (the page then has them)
    python experiments/paper_b.py --rows baseline,stars          # run two rows only (the page: every finished run)
    python experiments/paper_b.py --device cuda --jobs 8        # on a GPU, eight runs at once

The rows: config/addition_cpu.py (the fixed-4 baseline), Paper B's two ingredients on top of it (depth sampling,
then the Jacobian penalty: STARS), the penalty at the supervised positions only, the penalty alone at fixed depth
(stars_fixed), the baseline without the preset's curriculum (no_curriculum), depth sampling from step 0 as in Paper
B rather than from the preset's step 400 (sampling_from0), and capped at Paper B's 100 rather than the preset's 32,
without and with the penalty (sampling_cap100, stars_cap100), and STARS on Paper B's own schedule (stars_paper:
none of the preset's departures but its size and learning rate); then sampling, STARS and sampling from step 0 with
the gradient through the last 4 loops only (the _grad4 rows: cheaper, and this preset's setting until the study
showed it costs depth).
Every run is scored on the same held-out problems (strict: space, digits and § teacher-forced, which equals
greedy decoding) and on the first 100 by Paper B's own protocol.
"""
import study

ROWS = {
    "baseline": "config/addition_cpu.py",                                                 # fixed 4 loops
    "sampling": "config/addition_cpu.py --loop_sampling lognormal",                       # Paper B's depth sampling
    "stars": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1",      # + the Jacobian penalty
    "no_curriculum": "config/addition_cpu.py --zero_digits_steps 0",                     # the baseline, uniform problems
    "stars_supervised": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1 --stars_supervised",
    "stars_fixed": "config/addition_cpu.py --stars_lambda 0.1",                          # the penalty alone, 4 loops
    "sampling_from0": "config/addition_cpu.py --loop_sampling lognormal --loop_start 0",  # sampled from step 0, as Paper B
    "sampling_cap100": "config/addition_cpu.py --loop_sampling lognormal --loop_max 100",  # Paper B's cap, not 32
    "stars_cap100": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1 --loop_max 100",  # STARS to 100
    # Paper B's own schedule at this size and the preset's LR (1e-3; Paper B 1e-4): sampled to 100 from step 0, no
    # curriculum, the LR's and the penalty's warm-ups at its 20% of training
    "stars_paper": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1 --loop_max 100 --loop_start 0 "
                   "--zero_digits_steps 0 --warmup_iters 200 --stars_warmup 200",
    # ... with the gradient through the last 4 loops only, not every loop as in Paper B (cheaper)
    "sampling_grad4": "config/addition_cpu.py --loop_sampling lognormal --grad_loops 4",
    "stars_grad4": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1 --grad_loops 4",
    "sampling_from0_grad4": "config/addition_cpu.py --loop_sampling lognormal --loop_start 0 --grad_loops 4",
}
QUICK = "--max_iters 4 --loop_start 2 --stars_warmup 2 --eval_interval 2 --eval_problems 40 --eval_loops 4 --batch_size 16"
DEPTHS = (1, 2, 4, 8, 16, 32, 64, 100)


def plateau_exit(log):
    """The first evaluation step with ≥ 50% strict exact match at the trained depth (None: never). An addition
    run logs val_loss = 1 − that exact match (report.evaluate), so it is val_loss ≤ 0.5."""
    return next((r["iter"] for r in log if "val_loss" in r and r["val_loss"] <= 0.5), None)


def page(runs, args):
    import matplotlib.pyplot as plt
    from checkpoint import read_log
    from report import training_loops
    mr = study.mean_range
    depths = [k for k in DEPTHS if all(str(k) in rep["addition"]["accuracy"] for r in runs.values() for _, rep in r.values())]
    acc = lambda rep, k, proto="accuracy": rep["addition"].get(proto, {}).get(str(k))
    rho = lambda rep, k: rep["addition"].get("spectral_radius_answer", {}).get(str(k))  # at the answer positions
    pct = lambda v: study.mean_range([v], ".1f", 100)  # one seed's value in %, "n/a" if its report lacks it
    n_test = next(iter(next(iter(runs.values())).values()))[1]["config"]["eval_problems"]
    K = next(iter(next(iter(runs.values())).values()))[1]["config"]["n_loops"]
    lines = ["# Paper B at CPU scale: addition at every depth\n", study.provenance(runs, args), *holds(runs, depths, K),
             *shared_start(runs)]
    lines.append("\n## The recipes\n\n`python train.py` options; each run adds `--seed S`. Loops a step: the mean over the "
                 "training steps' depths, all / with gradient (`report.training_loops`, the first seed's draws): the compute a "
                 "recipe spends, which depth sampling raises. Names: before commit ce25268 the preset cut the gradient "
                 "to the last 4 loops (`grad_loops` 4); the rows now named `_grad4` had the plain names, and the "
                 "full-gradient ones were `_fullgrad` (older commit messages use those names).\n")
    lines += [f"- `{name}`: `{ROWS[name]}` (loops a step: {training_loops(next(iter(seeds.values()))[1]['config'])})"
              for name, seeds in runs.items()]
    lines.append("\nA seed fixes the initial weights and each step's problems, depth, STARS direction and dropout "
                 "(`train.step_streams`: each random stream has its own generator): every recipe of one seed trains on "
                 "the same problems in the same order (except `no_curriculum` and `stars_paper`, whose problems are "
                 "uniform until step 400, where the others' are easy), with the same dropout masks at the steps where their depths agree.")
    for proto, title in (("accuracy", f"Strict exact match (%, {n_test:,} held-out problems: space, digits and § right)"),
                         ("accuracy_public", "Paper B's protocol (%, first 100 problems, greedy for the answer's "
                                             "length, digits compared as an integer)")):
        lines.append(f"\n## {title}: mean (min–max) over seeds\n")
        lines.append("| recipe | seeds | " + " | ".join(f"{k} loops" for k in depths) + " |")
        lines.append("|---|---|" + "---|" * len(depths))
        for name, seeds in runs.items():
            lines.append(f"| {name} | {len(seeds)} | " + " | ".join(
                mr([acc(rep, k, proto) for _, rep in seeds.values()], ".1f", 100) for k in depths) + " |")
    deep = sorted({K, 2 * K, 32, 64, 100} & set(depths))  # the trained depth, where the baseline collapses, deep
    if deep:
        lines.append("\n## Fixed points: ρ of the loop map at the answer positions, relative step ‖h_k − h_{k−1}‖/‖h_{k−1}‖\n")
        lines.append("ρ(∂h_k/∂h_{k−1}) at loop k's input, exactly (`report.loop_rho`: causal attention makes the map's "
                     "Jacobian block lower-triangular over positions, so its eigenvalues are those of each position's "
                     "own block): the largest over the answer positions, the ones that decide the output, averaged over "
                     "16 held-out problems. At a fixed point (relative step → 0) ρ < 1 means small perturbations "
                     "shrink under repeated loops; at a state still moving, one loop's ρ is a local reading that "
                     "guarantees nothing (a non-normal J can grow a perturbation for a few loops). The relative step: at the "
                     "answer positions, over every held-out problem.\n")
        lines.append("| recipe | " + " | ".join(f"ρ at {k}" for k in deep) + " | "
                     + " | ".join(f"relative step at {k}" for k in deep) + " |")
        lines.append("|---|" + "---|" * (2 * len(deep)))
    for name, seeds in (runs.items() if deep else ()):
        reps = [rep["addition"] for _, rep in seeds.values()]
        lines.append(f"| {name} | " + " | ".join(mr([rho(rep, k) for _, rep in seeds.values()], ".3f") for k in deep)
                     + " | " + " | ".join(mr([a.get("relative_step", {}).get(str(k)) for a in reps], ".1e") for k in deep) + " |")
    logged = {name: [logged_jv(meta) for meta, _ in seeds.values()] for name, seeds in runs.items()} if deep else {}
    penalized = {name: mr(v, ".2f") for name, v in logged.items() if any(x is not None for x in v)}  # the STARS rows
    if penalized:
        lines.append("\nThe penalty's own estimate, ‖vᵀJ‖ from log.jsonl (mean over the last 10% of training steps): "
                     + "; ".join(f"`{name}` {v}" for name, v in penalized.items()) + ". It is taken on other states "
                     "than ρ above (a training batch at the step's depth, dropout on, every position; "
                     "`stars_supervised`: the supervised ones), and its square estimates the mean squared singular "
                     "value, not ρ² (`stars.py`): do not compare the two.")
    lines.append(f"\n## Each seed: strict exact match (%) at {K}, 64 and 100 loops; when it left the plateau\n")
    has_pos = any("answer_positions" in rep["addition"] for r in runs.values() for _, rep in r.values())
    lines.append("On the loss plateau the model gets the space and the last answer position right and every other digit "
                 "at chance. \"left\" is the first evaluation with ≥ 50% strict exact match at the trained depth; a seed that "
                 "never reaches it may still have learnt some digits" + (" (the column \"each answer digit right\")"
                                                                          if has_pos else "") + ".\n")
    lines.append("| recipe | seed | " + " | ".join(f"{k} loops" for k in (K, 64, 100) if k in depths)
                 + " | left the plateau at step |" + (" each answer digit right at the end, units first (%) |" if has_pos
                                                        else "") + " wall (min) |")
    lines.append("|---|---|" + "---|" * (len([k for k in (K, 64, 100) if k in depths]) + 2 + has_pos))
    for name, seeds in runs.items():
        for seed, (meta, rep) in sorted(seeds.items()):
            dig = rep["addition"].get("answer_positions")
            dcells = " / ".join(f"{100 * v:.0f}" for key, v in dig.items() if key.startswith("digit") and "_" not in key) \
                if dig else "n/a"
            out = plateau_exit(read_log(meta["out_dir"])) if "out_dir" in meta else None
            lines.append(f"| {name} | {seed} | " + " | ".join(pct(acc(rep, k)) for k in (K, 64, 100) if k in depths)
                         + f" | {out if out is not None else 'never'} |" + (f" {dcells} |" if has_pos else "")
                         + f" {meta.get('wall_s', 0) / 60:.1f} |")
    # two panels: Paper B's recipe and its parts, with their min-max bands (left); the variants, means only, with
    # `sampling` again to compare against (right: eight bands would hide each other)
    main = [n for n in ("baseline", "sampling", "stars", "stars_fixed") if n in runs]
    panels = [(True, "Paper B's parts", main)] if main else []  # (with bands, title, rows)
    if any(n not in main for n in runs):
        panels.append((not main, "variants" + ", against sampling" * ("sampling" in runs),
                       [n for n in runs if n not in main or n == "sampling"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), sharey=True, squeeze=False)
    colour = dict(zip(runs, study.colours()))  # one colour per row, the same in both panels
    for ax, (bands, title, names) in zip(axes[0], panels):
        for name in names:
            seeds = runs[name]
            ks = sorted(int(k) for k in next(iter(seeds.values()))[1]["addition"]["accuracy"])
            vals = [[100 * acc(rep, k) for _, rep in seeds.values()] for k in ks]
            ax.plot(ks, [sum(v) / len(v) for v in vals], color=colour[name], label=f"{name} (mean of {len(seeds)})")
            if bands:
                ax.fill_between(ks, [min(v) for v in vals], [max(v) for v in vals], color=colour[name], alpha=0.15)
        ax.set(xlabel="loops at inference", xscale="log", title=f"addition, held out: {title}")
        ax.legend(fontsize=7, **({"loc": "center left", "bbox_to_anchor": (0.55, 0.35)} if ax is axes[0][0] and main
                                 else {"loc": "upper left", "bbox_to_anchor": (1.01, 1)}))
    axes[0][0].set_ylabel("strict exact match (%)")
    png = study.savefig(fig, args, "accuracy")
    lines.insert(2, f"\n![strict exact match against loops: seed means; left, with the min–max band]({png})\n")
    return "\n".join(lines) + "\n", [png]


def logged_jv(meta):
    """The penalty's ‖vᵀJ‖ in the run's log, averaged over the last 10% of its steps (None: not logged)."""
    from checkpoint import read_log
    rows = [r for r in read_log(meta["out_dir"]) if "jv_norm" in r]
    last = [r["jv_norm"] for r in rows if rows and r["iter"] > 0.9 * rows[-1]["iter"]]
    return sum(last) / len(last) if last else None


def shared_start(runs, base="baseline"):
    """The first logged step where each recipe's loss differs from the baseline's, seed by seed: until then it is the
    same run (same weights, problems and dropout), so the recipes of one seed branch from one model."""
    from checkpoint import read_log
    losses = lambda meta: {r["iter"]: r["loss"] for r in read_log(meta["out_dir"]) if "loss" in r}
    parts = []
    for name, seeds in runs.items():
        both = [s for s in seeds if name != base and s in runs.get(base, {})]
        split = [next((i for i in sorted(theirs) if mine.get(i) != theirs[i]), None)
                 for mine, theirs in ((losses(seeds[s][0]), losses(runs[base][s][0])) for s in both)]
        if split and None not in split:
            parts.append(f"`{name}` at step {min(split)}" + (f"–{max(split)}" if max(split) != min(split) else "")
                         + f" ({len(split)} of {len(seeds)} seeds)")
    return [f"- The first logged loss that differs from `{base}`'s: {'; '.join(parts)}. Until then a recipe is the same "
            "run as the baseline: the recipes that split late branch from one model, so their comparison is paired."] if parts else []


def holds(runs, depths, K):
    """What holds on how many seeds, counted from the reports (the plateau: from the logs): per recipe, then a recipe
    against the one it changes."""
    acc = lambda rep, k: rep["addition"]["accuracy"].get(str(k))
    rho = lambda rep, k: rep["addition"].get("spectral_radius_answer", {}).get(str(k))  # at the answer positions
    from checkpoint import read_log
    n = lambda seeds, ok: f"{sum(ok(rep) for _, rep in seeds.values())} of {len(seeds)}"
    deep = [k for k in depths if k >= 16]  # none in a --quick run: those cells read n/a, not a vacuous "all"
    left = lambda logs: "n/a" if not all(logs) else sum(plateau_exit(log) is not None for log in logs)
    top = max(k for k in depths if k <= 64)
    lines = ["\n## What holds on how many seeds\n",
             f"Each cell: on how many seeds it holds. Left the plateau: strict exact match at {K} loops reached 50% "
             "at some evaluation during training (from the logs).\n",
             f"| recipe | left the plateau | ≥ 99% at {K} loops | ≥ 99% at every depth {K} to {top} "
             "| < 10% at every depth from 16 on |" + (" ρ < 1 at 64 loops |" if 64 in depths else ""),
             "|---|---|---|---|---|" + ("---|" if 64 in depths else "")]
    for name, seeds in runs.items():
        logs = [read_log(m["out_dir"]) for m, _ in seeds.values()]
        lines.append(f"| `{name}` | {left(logs)} of {len(seeds)} | {n(seeds, lambda r: acc(r, K) >= 0.99)} "
                     f"| {n(seeds, lambda r: all(acc(r, k) >= 0.99 for k in range(K, top + 1)))} "
                     f"| {n(seeds, lambda r: all(acc(r, k) < 0.1 for k in deep)) if deep else 'n/a'} |"
                     + (f" {n(seeds, lambda r: rho(r, 64) is not None and rho(r, 64) < 1)} |" if 64 in depths else ""))
    pairs = []
    for new, old in (("stars", "sampling"), ("stars_supervised", "stars"), ("sampling_grad4", "sampling"),
                     ("stars_grad4", "sampling_grad4"), ("stars_grad4", "stars"), ("sampling_cap100", "sampling"),
                     ("stars_cap100", "sampling_cap100"), ("stars_cap100", "stars"),
                     ("stars_paper", "stars_cap100"),
                     ("sampling_from0_grad4", "sampling_from0")):
        for k in (32, 64, 100) if {new, old} <= runs.keys() else ():
            both = [s for s in runs[new] if s in runs[old]]
            if k in depths and both:
                m = {name: sum(acc(runs[name][s][1], k) for s in both) / len(both) for name in (new, old)}
                diff = [acc(runs[new][s][1], k) - acc(runs[old][s][1], k) for s in both]
                pairs.append(f"| {k} | `{new}` | `{old}` | {100 * m[new]:.1f} | {100 * m[old]:.1f} "
                             f"| {sum(d > 0 for d in diff)} of {len(both)} | {sum(d < 0 for d in diff)} of {len(both)} |")
    if pairs:
        lines += ["", "A recipe against the one it changes, on the seeds both ran (strict exact match, seed means):\n",
                  "| loops | recipe | against | recipe's % | against's % | recipe higher on | lower on |",
                  "|---|---|---|---|---|---|---|", *pairs]
    lines.append("")
    return lines


if __name__ == "__main__":
    args = study.parse("paper_b", __doc__, "1,2,3,4,5", QUICK)
    runs = study.run_all(ROWS, args)
    study.write_page(args, *page(runs, args))
