"""
Depth as a dial on text: which recipe keeps a looped LM no worse at 16, 32 and 64 loops than at its training
depth K, at no cost at K? Every recipe on two seeds; the page is a frontier: the cost at K against the worst rise.

    python experiments/depth.py                                  # every row on seeds 1, 2: depth.md
    python experiments/depth.py --rows baseline,mean4 --seeds 3  # some rows, another seed
    python experiments/depth.py --train_args "--data_dir DIR"    # offline: a folder of WikiText-2's valid.txt, test.txt

config/depth_cpu.py: WikiText-2 bytes, d 128, 2 layers, K 4, 600 steps, evaluated at every depth 1..64.
The goal: CE at 16, 32 and 64 within 0.01 nats of CE at K, with CE at K within 0.02 of the fixed-depth baseline.
"""
import study

P = "config/depth_cpu.py"
LONG = "--max_iters 2400 --eval_interval 2400"  # 4x the steps, evaluated once, at the end
ROWS = {
    "baseline": f"{P} --loop_sampling fixed",                             # fixed 4 loops
    "mean4": P,                                                           # depth ~ LogNormal, mean 4 loops
    "deep": f"{P} --loop_mu 2 --grad_loops 4",                            # Paper B's distribution, truncated
    "raw-mean4": f"{P} --readout raw",                                    # Paper A's three fixes
    "penalty-mean4": f"{P} --norm_penalty 0.01",
    "loopnorm-mean4": f"{P} --loop_norm",
    "stars-mean4": f"{P} --stars_lambda 0.1 --stars_warmup 120 --stars_rows 4",   # Paper B's penalty
    "sandwich-mean4": f"{P} --block_norm sandwich",                       # Paper B's block
    "damp0.5-mean4": f"{P} --loop_damping 0.5",                           # each loop half of F's step
    "inject-loopnorm-mean4": f"{P} --inject --loop_norm",                 # a recurrent-depth model's loop
    "inject-loopnorm-noise1-mean4": f"{P} --inject --loop_norm --state_noise 1",  # + Huginn's random start
    "deq16-inject-loopnorm": f"{P} --loop_sampling fixed --inject --loop_norm --n_loops 16 --grad_loops 4",  # DEQ-style
    # given 4x the steps: is a cost at K a cost of 600 steps? (each held against the baseline of as many steps)
    "baseline-2400": f"{P} --loop_sampling fixed {LONG}",
    "mean4-2400": f"{P} {LONG}",
}
PARTS = {  # a recipe's name is its parts, joined by "-": the page's key to the names
    "baseline": "fixed 4 loops", "mean4": "depth sampled from LogNormal(1.14, 0.7) ≤ 32, mean 4 loops (the preset)",
    "deep": "Paper B's depth distribution, LogNormal(2, 0.7), capped at 32, gradient through the last 4 loops (Paper "
            "B: up to 100, through every loop)",
    "raw": "raw readout", "penalty": "the norm penalty", "loopnorm": "`--loop_norm`, RMSNorm between loops",
    "stars": "the STARS penalty", "sandwich": "the sandwich norm placement of Paper B's block",
    "damp0.5": "a damped loop after the first, h + 0.5·(F(h) − h)",
    "inject": "input injection: every loop after the first adds H_0",
    "noise1": "Huginn's random start: in training loop 1 sees H_0 + noise of H_0's RMS",
    "deq16": "DEQ-style: 16 fixed loops, gradient through the last 4", "2400": "4x the steps (2,400)"}
BASELINES = ("baseline", "baseline-2400")  # the fixed-depth baselines, one a number of steps
QUICK = "--max_iters 4 --eval_interval 4 --eval_iters 1 --batch_size 4 --eval_loops 16 --dataset pydoc --stars_warmup 2"
DEPTHS = (1, 2, 4, 8, 16, 32, 64)
COST_GOAL, RISE_GOAL = 0.02, 0.01  # nats/byte: CE at K over the baseline's, CE past 4K over CE at K
RHO_AT = (8, 32, 64)  # the loops where the page gives ρ (report.loop_rho, in each run's report.json)


def rho_table(runs):
    """ρ of the loop map at RHO_AT, all directions and off the state's, from the runs' reports."""
    get = lambda rep, k, key: rep["per_loop"][k - 1].get(key) if k <= len(rep["per_loop"]) else None
    lines = [f"\n## ρ of the loop map at {', '.join(map(str, RHO_AT))} loops: mean (min–max) over seeds\n",
             "ρ(∂H_k/∂H_{k−1}) at loop k's input, on the first validation sequence, exactly (`report.loop_rho`): "
             "under causal attention the map's Jacobian is block lower-triangular over positions, so ρ is the largest "
             "of the 128 positions' own d × d blocks' ρ. **All directions**: with pre-norm blocks the state's own "
             "direction has an eigenvalue near 1 (a branch reads N(H), blind to its scale): the scale the loop "
             "carries, which a norm readout does not see. **Off the state**: each block with that direction projected "
             "out, the directions a readout sees; where the two columns agree, the largest eigenvalue is not the "
             "state's own. At a fixed point (relative step → 0) ρ < 1 means small perturbations shrink under "
             "repeated loops; at a state still moving, one loop's ρ is a local reading that guarantees nothing (a "
             "non-normal J can grow a perturbation for a few loops).\n"]
    head = " | ".join(f"at {k}" for k in RHO_AT)
    lines.append(f"| recipe | all directions: {head} | off the state: {head} |\n|---|" + "---|" * 2 * len(RHO_AT))
    for name, seeds in runs.items():
        lines.append(f"| {name} | " + " | ".join(study.mean_range([get(rep, k, key) for _, rep in seeds.values()], ".3f")
                                               for key in ("spectral_radius", "spectral_radius_off_state")
                                               for k in RHO_AT) + " |")
    K = RHO_AT[-1]
    have = [(n, rep) for n, seeds in runs.items() for _, rep in seeds.values() if get(rep, K, "spectral_radius")]
    above = sum(get(rep, K, "spectral_radius") > 1 for _, rep in have)
    off_above = sum(get(rep, K, "spectral_radius_off_state") > 1 for _, rep in have)
    off_below = [n for n, seeds in runs.items()
                 if all((get(rep, K, "spectral_radius_off_state") or 2) < 1 for _, rep in seeds.values())]
    named = f": {', '.join(f'`{n}`' for n in off_below)}" if 0 < len(off_below) < len(runs) else ""
    lines.append(f"\nAt {K} loops ρ > 1 in {above} of {len(have)} runs, and off the state's own direction (not the carried "
                 f"scale) in {off_above} of {len(have)}. Off the state ρ is below 1 on every seed for "
                 f"{len(off_below)} of {len(runs)} recipes{named}.")
    return lines


def ce_at(rep, k):
    """CE at k loops: report row k (loop k of the K-loop run for k ≤ K, the model run k loops past it)."""
    return rep["per_loop"][k - 1]["ce"]


def rise_depths(rep):
    """The depths the rise reads: 16, 32 and 64 loops, those evaluated and at least 4K."""
    return [k for k in (16, 32, 64) if k <= len(rep["per_loop"]) and k >= 4 * rep["config"]["n_loops"]]


def rise(rep):
    """The worst CE at the rise's depths minus CE at the trained depth K."""
    deep = [ce_at(rep, k) for k in rise_depths(rep)]
    return max(deep) - ce_K(rep) if deep else None


def ce_K(rep):
    return ce_at(rep, rep["config"]["n_loops"])


def points(runs):
    """{recipe: {seed: (cost at K, rise)}}: the cost against the fixed-depth baseline of the same seed and steps."""
    steps = lambda seeds: next(iter(seeds.values()))[1]["config"]["max_iters"]
    base = {steps(runs[name]): runs[name] for name in BASELINES if name in runs}
    out = {}
    for name, seeds in runs.items():
        b = base.get(steps(seeds), {})
        out[name] = {s: (ce_K(rep) - ce_K(b[s][1]), rise(rep)) for s, (_, rep) in seeds.items()
                     if s in b and rise(rep) is not None}
    return out


def goal(runs):
    """The goal, seed by seed, against the fixed-depth baseline of the same seed and number of steps; then the
    frontier: the recipes that no other beats on both the seed-mean cost at K and the seed-mean rise."""
    if not any(name in runs for name in BASELINES):
        return []
    lines = ["\n## The goal, seed by seed\n", "CE at K minus the fixed-depth baseline's at the same seed and number of "
             f"steps (the cost at K; goal ≤ {COST_GOAL:+}), the rise (goal ≤ {RISE_GOAL:+}), and on how many seeds "
             "both hold:\n"]
    means = {}
    for name, pts in points(runs).items():
        paired = list(pts)
        cost, rises = [pts[s][0] for s in paired], [pts[s][1] for s in paired]
        ok = sum(r <= RISE_GOAL and c <= COST_GOAL for r, c in zip(rises, cost))
        lines.append(f"- `{name}`: cost at K {study.mean_range(cost, '+.3f')}, rise {study.mean_range(rises, '+.3f')}; "
                     f"meets the goal on {ok} of {len(paired)} seeds")
        if paired:
            means[name] = sum(cost) / len(cost), sum(rises) / len(rises)
    if not means:
        return lines
    front = sorted((m, n) for n, m in means.items() if not any(o[0] <= m[0] and o[1] <= m[1] and o != m
                                                               for o in means.values()))
    first = {n: next(iter(runs[n].values()))[1] for n in means}  # a recipe's settings are its seeds'
    narrow = [f"`{n}` (K = {rep['config']['n_loops']}: at {', '.join(map(str, rise_depths(rep)))} loops only)"
              for n, rep in first.items() if len(rise_depths(rep)) < 3]
    lines.append("\nThe frontier (seed means; no other recipe has both a lower cost and a lower rise): "
                 + ", ".join(f"`{n}` (cost {c:+.3f}, rise {r:+.3f})" for (c, r), n in front) + "."
                 + (f" The rise reads fewer depths (those evaluated and ≥ 4K) for {', '.join(narrow)}." if narrow else ""))
    excess = {n: max(0.0, c - COST_GOAL) + max(0.0, r - RISE_GOAL) for n, (c, r) in means.items()}
    best = min(excess, key=excess.get)
    c, r = means[best]
    lines.append(f"Closest to the goal (by how far its seed-mean cost and rise pass {COST_GOAL:+} and {RISE_GOAL:+}, "
                 f"summed): `{best}`, cost {c:+.3f}, rise {r:+.3f}: {excess[best]:.3f} nats away.")
    return lines


LESSONS = (  # what one ingredient does: (what, recipe, the recipe without it)
    ("depth sampling", "mean4", "baseline"),
    ("Paper B's depth distribution, gradient through the last 4 loops", "deep", "mean4"),
    ("the raw readout", "raw-mean4", "mean4"),
    ("the norm penalty", "penalty-mean4", "mean4"),
    ("loop_norm", "loopnorm-mean4", "mean4"),
    ("STARS", "stars-mean4", "mean4"),
    ("Paper B's sandwich block", "sandwich-mean4", "mean4"),
    ("a damped loop, α 0.5", "damp0.5-mean4", "mean4"),
    ("input injection", "inject-loopnorm-mean4", "loopnorm-mean4"),
    ("Huginn's random start", "inject-loopnorm-noise1-mean4", "inject-loopnorm-mean4"),
    ("the DEQ-style target instead of depth sampling", "deq16-inject-loopnorm", "inject-loopnorm-mean4"),
    ("depth sampling given 4x the steps", "mean4-2400", "mean4"),
)


def lessons(runs):
    """Per ingredient, seed by seed: the change in cost at K and in rise when it is added to a recipe."""
    pts, mr = points(runs), study.mean_range
    lines = ["\n## What each ingredient does, seed by seed\n", "The recipe minus the same recipe without the "
             "ingredient, at the same seed (the same initial weights where the shapes agree, the same batches): change "
             "in cost at K, change in rise (negative is better).\n"]
    for what, name, ref in LESSONS:
        seeds = [s for s in pts.get(name, {}) if s in pts.get(ref, {})]
        if seeds:
            d = [(pts[name][s][0] - pts[ref][s][0], pts[name][s][1] - pts[ref][s][1]) for s in seeds]
            deeper = [k for k in (16, 32, 64) if all(k <= len(runs[n][s][1]["per_loop"]) for n in (name, ref)
                                                     for s in seeds)]  # the same depth, not the rise
            lower = [sum(ce_at(runs[name][s][1], k) < ce_at(runs[ref][s][1], k) for s in seeds) for k in deeper]
            lines.append(f"- {what} (`{name}` against `{ref}`): cost {mr([c for c, _ in d], '+.3f')}, rise "
                         f"{mr([r for _, r in d], '+.3f')}; lower cost on {sum(c < 0 for c, _ in d)} of {len(d)} "
                         f"seeds, lower rise on {sum(r < 0 for _, r in d)} of {len(d)}" + (
                             f"; lower CE at {', '.join(map(str, deeper))} loops on {', '.join(map(str, lower))} "
                             f"of {len(d)}" if deeper else ""))
    return lines if len(lines) > 2 else []


def page(runs, args):
    import matplotlib.pyplot as plt
    from report import training_loops
    mr = study.mean_range
    n = min(len(rep["per_loop"]) for seeds in runs.values() for _, rep in seeds.values())
    ks = [k for k in DEPTHS if k <= n]
    findings, effects, rhos = goal(runs), lessons(runs), rho_table(runs)
    short = ([line.strip() for line in findings if line.startswith(("\nThe frontier", "Closest"))]
             + [line[2:] for line in effects if line.startswith("- depth sampling (")] + [r.strip() for r in rhos[-1:]])
    lines = ["# Depth as a dial on text\n", study.provenance(runs, args)]
    lines += ["\n## In short\n", f"The goal: CE at 16, 32 and 64 loops within {RISE_GOAL:+} of CE at K, CE at K "
              f"within {COST_GOAL:+} of the fixed-depth baseline's. The page: the goal seed by seed, what each ingredient does, then the tables "
              "by depth.\n", *[f"- {line}" for line in short]] if short else []
    lines += ["\nA recipe's name is its parts: " + "; ".join(f"`{k}` {v}" for k, v in PARTS.items()) + ". Depth is "
             "sampled as in `mean4` unless the name has `baseline`, `deep` or `deq16`. A seed fixes the initial weights, "
             "the batches and the validation windows: every recipe of one seed trains on the same batches in the same "
             "order (`train.step_streams`) and is scored on the same windows (`report.evaluate_lm`).\n",
             "\nRecipes (`python train.py` options; each run adds `--seed S`):\n"]
    lines += [f"- `{name}`: `{ROWS[name]}`" for name in runs]
    missing = [name for name in ROWS if name not in runs]
    if missing and not args.quick:
        lines.append("\nRows of the script not run for this page (`--rows NAME` runs one): "
                     + ", ".join(f"`{n}`" for n in missing) + ".")
    lines += findings + effects
    lines.append("\n## CE (nats per byte) at each depth, and the worst rise past 4K: mean (min–max) over seeds\n")
    lines.append("| recipe | seeds | loops a step: all / with gradient | " + " | ".join(f"CE at {k}" for k in ks)
                 + " | rise: worst of 16/32/64 (those ≥ 4K) − CE_K |\n|---|---|---|" + "---|" * (len(ks) + 1))
    for name, seeds in runs.items():
        reps = [rep for _, rep in seeds.values()]
        lines.append(f"| {name} | {len(seeds)} | {training_loops(reps[0]['config'])} | "
                     + " | ".join(mr([r["per_loop"][k - 1]["ce"] for r in reps], ".3f") for k in ks)
                     + f" | {mr([rise(r) for r in reps], '+.3f')} |")
    lines.append("\n## ‖H_k‖ / relative step at each depth (seed mean)\n")
    lines.append("Relative step: ‖H_k − H_{k−1}‖/‖H_{k−1}‖ (`looplm.relative_step`).\n")
    lines.append("| recipe | " + " | ".join(f"at {k}" for k in ks) + " |\n|---|" + "---|" * len(ks))
    for name, seeds in runs.items():
        reps = [rep for _, rep in seeds.values()]
        m = lambda k, key: (lambda v: None if None in v else sum(v) / len(v))([r["per_loop"][k - 1][key] for r in reps])
        cell = lambda k: " / ".join(study.mean_range([m(k, key)], fmt) for key, fmt in
                                    (("norm_mean", ".3g"), ("relative_step", ".1e")))
        lines.append(f"| {name} | " + " | ".join(cell(k) for k in ks) + " |")
    lines += rhos
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = study.colours()
    for i, (name, pts) in enumerate(points(runs).items()):  # (cost, rise) per seed: the goal's own axes
        if pts:
            ax.scatter(*zip(*pts.values()), label=name, color=colours[i % len(colours)],
                       marker="*" if name in BASELINES else "o")
    if not ax.collections:  # no recipe has a fixed-depth baseline of its seed and steps: no cost to plot
        ax.text(0.5, 0.5, "no baseline run of the same seed and steps: no cost", ha="center", transform=ax.transAxes)
    ax.axhline(RISE_GOAL, color="gray", ls=":", lw=1)
    ax.axvline(COST_GOAL, color="gray", ls=":", lw=1)
    ax.set(xlabel="cost at K: CE at K − the fixed-depth baseline's, same seed and steps (nats/byte)",
           ylabel="rise: worst CE at 16/32/64 (≥ 4K) − CE at K", title="one point per recipe and seed; the goal: left of and below the dotted lines")
    ax.title.set_fontsize(10)
    if ax.collections:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    png = study.savefig(fig, args, "frontier")
    lines.insert(2, f"\n![the frontier: the cost at K against the worst rise past 4K]({png})\n")
    return "\n".join(lines) + "\n", [png]


if __name__ == "__main__":
    args = study.parse("depth", __doc__, "1,2", QUICK)
    runs = study.run_all(ROWS, args)
    study.write_page(args, *page(runs, args))
