"""
Depth as a dial on text: which recipe keeps a looped LM no worse at 16, 32 and 64 loops than at its training
depth K, at no cost at K? Every recipe on two seeds; the page is a frontier: CE at K against the worst rise.

    python experiments/depth.py                                  # every row on seeds 1, 2: depth.md
    python experiments/depth.py --rows baseline,mean4 --seeds 3  # some rows, another seed
    python experiments/depth.py --train_args "--data_dir DIR"    # offline: a folder of WikiText-2's valid.txt, test.txt

config/depth_cpu.py: WikiText-2 bytes, d 128, 2 layers, K 4, 600 steps, evaluated at every depth 1..64.
The goal: CE at 16, 32 and 64 within 0.01 nats of CE at K, with CE at K within 0.02 of the fixed-depth baseline.
"""
import json
import os

import torch

import study
import stars  # (study puts the repository on the path)

P = "config/depth_cpu.py"
LONG = "--max_iters 2400 --eval_interval 2400"  # 4x the steps, evaluated once, at the end
ROWS = {
    "baseline": f"{P} --loop_sampling fixed",                                  # fixed 4 loops
    "mean4": P,                                                                # depth ~ LogNormal, mean 4 loops
    "deep": f"{P} --loop_mu 2 --grad_loops 4",                                 # Paper B's distribution, truncated
    "inject-deep": f"{P} --inject --loop_mu 2 --grad_loops 4",
    "raw-mean4": f"{P} --readout raw",
    "penalty-mean4": f"{P} --norm_penalty 0.01",
    "loopnorm-mean4": f"{P} --loop_norm",
    "sandwich-mean4": f"{P} --block_norm sandwich",
    "stars-mean4": f"{P} --stars_lambda 0.1 --stars_warmup 120 --stars_rows 4",
    "stars-deep32-mean4": f"{P} --stars_lambda 0.1 --stars_warmup 120 --stars_rows 4 --stars_deep 32",
    "inject-loopnorm-mean4": f"{P} --inject --loop_norm",
    "inject-loopnorm-stars-mean4": f"{P} --inject --loop_norm --stars_lambda 0.1 --stars_warmup 120 --stars_rows 4",
    "inject-loopnorm-noise1-mean4": f"{P} --inject --loop_norm --state_noise 1",     # Huginn's random start
    "inject-loopnorm-noise0.3-mean4": f"{P} --inject --loop_norm --state_noise 0.3",
    "inject-loopnorm-deep-from300": f"{P} --inject --loop_norm --loop_mu 2 --grad_loops 4 --loop_start 300",
    "deq16-inject-loopnorm": f"{P} --loop_sampling fixed --inject --loop_norm --n_loops 16 --grad_loops 4",  # DEQ-style
    # round 2: is the random start's cost at K a cost of 600 steps? (and the baseline at the same budget)
    "baseline-2400": f"{P} --loop_sampling fixed {LONG}",        # a recipe of 2400 steps is held against this
    "inject-loopnorm-noise1-2400": f"{P} --inject --loop_norm --state_noise 1 {LONG}",
    "sandwich-2400": f"{P} --block_norm sandwich {LONG}",         # Paper B's block, given the steps to learn
    "inject-loopnorm-noise1-stars": f"{P} --inject --loop_norm --state_noise 1 --stars_lambda 0.1 --stars_warmup 120 "
                                    "--stars_rows 4",                                        # the random start + STARS
    "inject-loopnorm-noise1-half": f"{P} --inject --loop_norm --state_noise 1 --state_noise_frac 0.5",  # half from zero
    "inject-loopnorm-noise1-stars-iters4": f"{P} --inject --loop_norm --state_noise 1 --stars_lambda 0.1 "
                                           "--stars_warmup 120 --stars_rows 4 --stars_iters 4",  # aimed at ρ itself
    "inject-loopnorm-noise1-anneal": f"{P} --inject --loop_norm --state_noise 1 --state_noise_anneal",  # 1 down to 0
    "deq16-exits4-inject-loopnorm": f"{P} --loop_sampling fixed --inject --loop_norm --n_loops 16 --grad_loops 4 "
                                    "--grad_first 4",                    # the DEQ-style target and trained early exits
    "damp0.5-mean4": f"{P} --loop_damping 0.5",                          # each loop half of F's step
    "damp0.25-mean4": f"{P} --loop_damping 0.25",
    "damp0.5-inject-loopnorm-noise1-mean4": f"{P} --loop_damping 0.5 --inject --loop_norm --state_noise 1",
    # the frontier at K given 4x the steps: depth sampling, damped or not
    "mean4-2400": f"{P} {LONG}",
    "damp0.5-mean4-2400": f"{P} --loop_damping 0.5 {LONG}",
}
PARTS = {  # a recipe's name is its parts, joined by "-": the page's key to the 29 names
    "baseline": "fixed 4 loops", "mean4": "depth sampled around 4 loops (the preset)",
    "deep": "Paper B's depth distribution, LogNormal(2, 0.7), capped at 32, gradient through the last 4 loops (Paper "
            "B: up to 100, through every loop)",
    "inject": "input injection: every loop after the first adds H_0", "loopnorm": "`--loop_norm`, RMSNorm between loops",
    "raw": "raw readout",
    "penalty": "the norm penalty", "sandwich": "the sandwich norm placement of Paper B's block", "stars": "the STARS penalty",
    "deep32": "the penalty at loop 32's state", "iters4": "4 power steps in the penalty, aimed at ρ",
    "noise1, noise0.3": "Huginn's random start: in training loop 1 sees H_0 + noise, 1 (0.3) times H_0's RMS",
    "half": "the noise on half the sequences",
    "anneal": "the noise annealed to 0", "from300": "sampling from step 300", "deq16": "DEQ-style: 16 fixed loops, "
    "gradient through the last 4", "exits4": "and loops 1-4 trained as exits", "damp0.5, damp0.25": "a damped loop "
    "after the first, h + α(F(h) − h)", "2400": "4x the steps (2,400)"}
BASELINES = ("baseline", "baseline-2400")  # the fixed-depth baselines, one a number of steps
QUICK = "--max_iters 4 --eval_interval 4 --eval_iters 1 --batch_size 4 --eval_loops 16 --dataset pydoc --stars_warmup 2"
DEPTHS = (1, 2, 4, 8, 16, 32, 64)
RHO_AT = (8, 32, 64)  # the loops where the page gives ρ from the map's blocks (block_rho)


def block_rho(model, h0, h, positions):
    """ρ of the loop map H -> step(H) at the state h (1, T, d) from the given positions' blocks (all T: ρ exactly),
    and ρ off the state's direction. Under causal attention ∂step(H)/∂H is block lower-triangular over positions,
    so its eigenvalues are those of the positions' own d x d blocks J_t = ∂step(H)_t/∂H_t, and ρ is the largest
    over all T of them (over fewer, a lower bound). A block is d JVPs (one per basis vector, as a batch of d copies
    of the sequence cut after t: nothing later matters), then its eigenvalues. A pre-norm branch reads N(H_t),
    blind to H_t's scale, so J_t·H_t ≈ H_t: an eigenvalue near 1 along the state itself, the scale the loop carries
    (and the norm readout ignores). P J_t P, P = I − ĥĥᵀ (ĥ = H_t/‖H_t‖), is the map of the other directions, the
    ones a readout sees. Power iteration (report.loop_map_rho) converges slowly here: the eigenvalues cluster near
    1. Returns (ρ of each position's block, ρ of P J_t P)."""
    d, rho, off = h.shape[-1], [], []
    for t in positions:
        hs, es = (z[:1, :t + 1].expand(d, -1, -1).contiguous() for z in (h, h0))
        basis = torch.zeros_like(hs)
        basis[range(d), t, range(d)] = 1.0
        with torch.enable_grad():
            _, cols = torch.func.jvp(stars.looplm_step_fn(model, es), (hs,), (basis,))
        J = cols.detach()[:, t].T.double()  # column j: J_t e_j
        u = h[0, t].double() / h[0, t].double().norm()
        P = torch.eye(d, dtype=J.dtype) - torch.outer(u, u)
        rho.append(torch.linalg.eigvals(J).abs().max().item())
        off.append(torch.linalg.eigvals(P @ J @ P).abs().max().item())
    return rho, off


STRIDE = 8  # block_rho at positions 0, 8, 16, ..., T-1
RHO_METHOD = f"blocks at {RHO_AT}, every {STRIDE} positions, and off the state"  # a change recomputes rho.json


def load_run(out_dir):
    """A finished run's settings (a train.TrainConfig, older names mapped) and its model in eval mode."""
    import train
    from checkpoint import load_checkpoint, model_from_checkpoint
    from configurator import RENAMED
    ckpt = load_checkpoint(out_dir)
    saved = {RENAMED.get(k) or k: v for k, v in ckpt["config"].items()}  # checkpoints of older versions
    cfg = train.TrainConfig(**{k: v for k, v in saved.items() if k in train.TrainConfig.__dataclass_fields__})
    cfg.cache_dir = os.path.join(study.ROOT, cfg.cache_dir)  # as train.py, which runs in the repository
    return cfg, ckpt, model_from_checkpoint(ckpt)


def run_block_rho(out_dir):
    """block_rho at RHO_AT on the run's first validation sequence (report.evaluate_lm's first batch):
    {"rho": {loop: [ρ per position]}, "off": {loop: [ρ off the state per position]}}."""
    import data
    cfg, ckpt, model = load_run(out_dir)
    _, val, _ = data.load_task_data(cfg, dict(ckpt["model_args"]), ckpt)
    T = ckpt["model_args"]["block_size"]
    x, _ = data.get_batch(val, min(cfg.batch_size, 16), T, torch.Generator().manual_seed(cfg.seed + 999))
    with torch.no_grad():
        states, h0 = model.loop_states(x[:1], max(RHO_AT)), model.embed(x[:1])
    positions = sorted(set(range(0, T, STRIDE)) | {T - 1})
    out = {str(k): block_rho(model, h0, states[k - 2], positions) for k in RHO_AT}
    return {"rho": {k: v[0] for k, v in out.items()}, "off": {k: v[1] for k, v in out.items()}}


def block_rhos(runs, args, measure=None, method=None):
    """{"name/sSEED": {..., "commit": ...}} for the page's runs, from <runs>/rho.json; a run not in it (or trained
    again since, or measured by another method) gets measure(its folder) (default run_block_rho), unless
    --page_only or --verify (which compute nothing new: such a run's cells read n/a)."""
    measure, method = measure or run_block_rho, method or RHO_METHOD  # (looked up here: a test may swap them)
    path = os.path.join(args.runs, "rho.json")
    kept = study.read_json(path) if os.path.exists(path) else {}
    out = {}
    for name, seeds in runs.items():
        for seed, (meta, _) in seeds.items():
            key, stamp = f"{name}/s{seed}", [meta["commit"], meta["date"]]
            fresh = kept.get(key, {}).get("run") == stamp and kept[key].get("method") == method
            if not fresh and not (args.page_only or args.verify):
                print(f"ρ of {key}'s loop map from its blocks", flush=True)
                kept[key] = {"run": stamp, "method": method, "commit": study.commit(),
                             **measure(os.path.join(args.runs, key))}
                study.atomic_write_text(path, json.dumps(kept, indent=1))
                fresh = True
            if fresh:
                out[key] = {k: v for k, v in kept[key].items() if k not in ("run", "method")}
    return out


def rho_table(runs, rho):
    """ρ of the loop map at RHO_AT from its blocks (block_rho), off the state's direction, and the run's reading."""
    keys = [(n, s) for n in runs for s in runs[n]]
    if not any(f"{n}/s{s}" in rho for n, s in keys):
        return []
    get = lambda part, n, s, k: max(rho[f"{n}/s{s}"][part][str(k)]) if f"{n}/s{s}" in rho else None
    lines = [f"\n## ρ of the loop map at {', '.join(map(str, RHO_AT))} loops, from its blocks: mean (min–max) over seeds\n",
             "ρ(∂H_k/∂H_{k−1}) at loop k's input, on the first validation sequence (`block_rho`). Under causal "
             "attention it is the largest of the positions' own blocks' ρ over all T positions; the tables give the "
             f"largest over positions 0, {STRIDE}, …, T−1, each block's eigenvalues computed exactly: a lower bound. "
             "**All directions**: with pre-norm blocks the state's own direction has an eigenvalue near 1 (a branch "
             "reads N(H), blind to its scale): the scale the loop carries, which a norm readout does not see. **Off "
             "the state**: the block with that direction projected out, the directions a readout sees. A block below 1 "
             "draws nearby states together at its position; a maximum below 1 over the positions measured does not "
             "show that every position's does. Then the run's own reading (`report.loop_map_rho`: 10 power iterations, "
             "4 sequences), which converges slowly when the eigenvalues cluster near 1. Computed by this script from "
             "each run's checkpoint (`block_rhos`, kept in the runs' rho.json), at commit "
             f"{', '.join(sorted({str(r.get('commit')) for r in rho.values()}))}.\n"]
    head = " | ".join(f"at {k}" for k in RHO_AT)
    lines.append(f"| recipe | all directions: {head} | off the state: {head} | run's reading: {head} |\n|---|"
                 + "---|" * 3 * len(RHO_AT))
    for name, seeds in runs.items():
        cells = [study.mean_range([get(part, name, s, k) for s in seeds], ".3f") for part in ("rho", "off")
                 for k in RHO_AT]
        cells += [study.mean_range([rep["per_loop"][k - 1]["spectral_radius"] for _, rep in seeds.values()], ".3f")
                  for k in RHO_AT]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    K = RHO_AT[-1]
    have = [(n, s) for n, s in keys if f"{n}/s{s}" in rho]
    above = sum(get("rho", n, s, K) > 1 for n, s in have)
    off_below = [n for n in runs if all(f"{n}/s{s}" in rho and get("off", n, s, K) < 1 for s in runs[n])]
    named = f": {', '.join(f'`{n}`' for n in off_below)}" if 0 < len(off_below) < len(runs) else ""
    off_above = sum(get("off", n, s, K) > 1 for n, s in have)
    lines.append(f"\nAt {K} loops ρ > 1 in {above} of {len(have)} runs, and off the state's own direction (not the carried "
                 f"scale) in {off_above} of {len(have)}. Off the state the bound is below 1 on every seed for "
                 f"{len(off_below)} of {len(runs)} recipes{named}."
                 + (f" No ρ yet for {len(keys) - len(have)} runs (trained again since?)." if len(have) < len(keys) else ""))
    return lines


def rise(rep):
    """The worst CE at 16, 32 and 64 loops (those evaluated, ≥ 4K) minus CE at the trained depth K."""
    rows, K = rep["per_loop"], rep["config"]["n_loops"]
    deep = [rows[k - 1]["ce"] for k in (16, 32, 64) if k <= len(rows) and k >= 4 * K]
    return max(deep) - rows[K - 1]["ce"] if deep else None


def ce_K(rep):
    return rep["per_loop"][rep["config"]["n_loops"] - 1]["ce"]


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
             "steps (the cost at K; goal ≤ +0.02), the rise (goal ≤ +0.01), and on how many seeds both hold:\n"]
    means = {}
    for name, pts in points(runs).items():
        paired = list(pts)
        cost, rises = [pts[s][0] for s in paired], [pts[s][1] for s in paired]
        ok = sum(r <= 0.01 and c <= 0.02 for r, c in zip(rises, cost))
        lines.append(f"- `{name}`: cost at K {study.mean_range(cost, '+.3f')}, rise {study.mean_range(rises, '+.3f')}; "
                     f"meets the goal on {ok} of {len(paired)} seeds")
        if paired:
            means[name] = sum(cost) / len(cost), sum(rises) / len(rises)
    if not means:
        return lines
    front = sorted((m, n) for n, m in means.items() if not any(o[0] <= m[0] and o[1] <= m[1] and o != m
                                                               for o in means.values()))
    lines.append("\nThe frontier (seed means; no other recipe has both a lower cost and a lower rise): "
                 + ", ".join(f"`{n}` (cost {c:+.3f}, rise {r:+.3f})" for (c, r), n in front) + ".")
    excess = {n: max(0.0, c - 0.02) + max(0.0, r - 0.01) for n, (c, r) in means.items()}
    best = min(excess, key=excess.get)
    lines.append(f"Closest to the goal (cost above +0.02 plus rise above +0.01, seed means): `{best}`, "
                 f"{excess[best]:.3f} nats away.")
    return lines


LESSONS = (  # what one ingredient does: (what, recipe, the recipe without it)
    ("depth sampling", "mean4", "baseline"),
    ("a damped loop, α 0.5", "damp0.5-mean4", "mean4"),
    ("a damped loop, α 0.25", "damp0.25-mean4", "mean4"),
    ("the norm penalty", "penalty-mean4", "mean4"),
    ("loop_norm", "loopnorm-mean4", "mean4"),
    ("STARS", "stars-mean4", "mean4"),
    ("STARS at the deep loops", "stars-deep32-mean4", "stars-mean4"),
    ("Paper B's sandwich block", "sandwich-mean4", "mean4"),
    ("Huginn's random start", "inject-loopnorm-noise1-mean4", "inject-loopnorm-mean4"),
    ("damping the random start", "damp0.5-inject-loopnorm-noise1-mean4", "inject-loopnorm-noise1-mean4"),
    ("the random start given 4x the steps", "inject-loopnorm-noise1-2400", "inject-loopnorm-noise1-mean4"),
    ("depth sampling given 4x the steps", "mean4-2400", "mean4"),
    ("the damped loop given 4x the steps", "damp0.5-mean4-2400", "damp0.5-mean4"),
    ("early exits on the DEQ-style target", "deq16-exits4-inject-loopnorm", "deq16-inject-loopnorm"),
)


def lessons(runs):
    """Per ingredient, seed by seed: the change in cost at K and in rise when it is added to a recipe."""
    pts, mr = points(runs), study.mean_range
    lines = ["\n## What each ingredient does, seed by seed\n", "The recipe minus the same recipe without the "
             "ingredient, at the same seed: change in cost at K, change in rise (negative is better). A seed fixes "
             "the initial weights; the batch is drawn after the depth from one generator (`train.step_streams`), so "
             "rows whose samplers draw differently (`baseline` against `mean4`) also see other batches.\n"]
    for what, name, ref in LESSONS:
        seeds = [s for s in pts.get(name, {}) if s in pts.get(ref, {})]
        if seeds:
            d = [(pts[name][s][0] - pts[ref][s][0], pts[name][s][1] - pts[ref][s][1]) for s in seeds]
            lines.append(f"- {what} (`{name}` against `{ref}`): cost {mr([c for c, _ in d], '+.3f')}, rise "
                         f"{mr([r for _, r in d], '+.3f')}; lower cost on {sum(c < 0 for c, _ in d)} of {len(d)} "
                         f"seeds, lower rise on {sum(r < 0 for _, r in d)} of {len(d)}")
    return lines if len(lines) > 2 else []


def page(runs, args, rho=None):
    import matplotlib.pyplot as plt
    from report import training_loops
    mr = study.mean_range
    n = min(len(rep["per_loop"]) for seeds in runs.values() for _, rep in seeds.values())
    ks = [k for k in DEPTHS if k <= n]
    findings, effects, rhos = goal(runs), lessons(runs), rho_table(runs, rho or {})
    short = ([line.strip() for line in findings if line.startswith(("\nThe frontier", "Closest"))]
             + [line[2:] for line in effects if line.startswith("- depth sampling (")] + [r.strip() for r in rhos[-1:]])
    lines = ["# Depth as a dial on text\n", study.provenance(runs, args)]
    lines += ["\n## In short\n", "The goal: CE at 16, 32 and 64 loops within +0.01 of CE at K, CE at K within +0.02 of "
              "the fixed-depth baseline's. The page: the goal seed by seed, what each ingredient does, then the tables "
              "by depth.\n", *[f"- {line}" for line in short]] if short else []
    lines += ["\nA recipe's name is its parts: " + "; ".join(f"`{k}` {v}" for k, v in PARTS.items()) + ". Depth is "
             "sampled as in `mean4` unless the name has `baseline`, `deep` (not `deep32`) or `deq16`.\n",
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
    for i, (name, seeds) in enumerate(runs.items()):
        pts = [(ce_K(rep), rise(rep)) for _, rep in seeds.values() if rise(rep) is not None]
        if pts:
            ax.scatter(*zip(*pts), label=name, color=plt.get_cmap("tab20")(i % 20),
                       marker="*" if name in BASELINES else "o")
    ax.axhline(0.01, color="gray", ls=":", lw=1)
    ax.set(xlabel="validation CE at the training depth K (nats/byte)", ylabel="worst CE at 16/32/64 − CE at K",
           title="the depth frontier: one point per recipe and seed (goal: bottom left)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    png = study.savefig(fig, args, "frontier")
    lines.insert(2, f"\n![the frontier: CE at K against the worst rise past 4K]({png})\n")
    return "\n".join(lines) + "\n", [png]


if __name__ == "__main__":
    args = study.parse("depth", __doc__, "1,2", QUICK)
    runs = study.run_all(ROWS, args)
    study.write_page(args, *page(runs, args, block_rhos(runs, args)))
