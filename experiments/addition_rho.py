"""
Paper B's ρ on addition, exactly. paper_b.md reads "ρ ≈ 1 under STARS: a smaller step, not a contraction" from
40 power iterations (report.loop_map_rho), which converge slowly when the eigenvalues cluster near 1 (see
depth.md). Here the eigenvalues themselves, from the loop map's blocks.

    python experiments/addition_rho.py            # three of paper_b.py's rows on seeds 1, 2, then addition_rho.md

The rows are paper_b.py's commands (run again here: on another machine the digits need not match paper_b.md's
runs of the same seed exactly; compare the two pages). A problem is short
(15 tokens), so depth.block_rho takes every position's d × d block: ρ of the loop map on that problem exactly,
not a lower bound; and at the answer positions alone, the ρ that paper_b.md's reading estimates.
"""
import study
import torch

import paper_b
from depth import block_rho, block_rhos, load_run

ROWS = {name: paper_b.ROWS[name] for name in ("sampling", "stars", "stars_fixed")}
QUICK = paper_b.QUICK
AT = (4, 32, 64)  # ρ(∂H_k/∂H_{k−1}) at loop k's input
PROBLEMS = 8  # the first held-out problems
METHOD = f"every position's block, loops {AT}, the first {PROBLEMS} held-out problems"


def run_rho(out_dir):
    """Per loop in AT, per problem: ρ over every position, over the answer positions, and off the state's
    direction at the answer positions. {"rho": {loop: {"all": [...], "answer": [...], "off": [...]}}}."""
    import data
    cfg, _, model = load_run(out_dir)
    x, y, _ = data.addition_heldout(cfg.digits, cfg.eval_problems)
    out = {str(k): {"all": [], "answer": [], "off": []} for k in AT}
    for i in range(PROBLEMS):
        answer = (y[i] != -1).nonzero().flatten().tolist()  # the positions that decide the output
        with torch.no_grad():
            states, h0 = model.loop_states(x[i:i + 1], max(AT)), model.embed(x[i:i + 1])
        for k in AT:
            rho, off = block_rho(model, h0, states[k - 2], range(x.size(1)))
            out[str(k)]["all"].append(max(rho))
            out[str(k)]["answer"].append(max(rho[t] for t in answer))
            out[str(k)]["off"].append(max(off[t] for t in answer))
    return {"rho": out}


def page(runs, args, rho):
    mr = lambda v: study.mean_range(v, ".3f")
    reading = lambda rep, k: rep["addition"].get("spectral_radius_answer", {}).get(str(k))
    lines = ["# Paper B's ρ on addition, from the loop map's blocks\n", study.provenance(runs, args),
             "Recipes: " + "; ".join(f"`{n}`: `{o}`" for n, o in ROWS.items()) + " (paper_b.py's rows).\n",
             f"ρ(∂H_k/∂H_{{k−1}}) at loop k's input on each of the first {PROBLEMS} held-out problems: the mean "
             "(min–max) over problems. **Every position**: the largest ρ of all the positions' blocks, the loop map's "
             "ρ on that problem, exactly (`depth.block_rho`; causal attention makes the map block lower-triangular). "
             "**Answer positions**: the largest over those alone, the ρ paper_b.md's reading aims at. **Off the "
             "state**: at the answer positions, each block with the state's own direction projected out. **The "
             "run's reading**: its report.json's 40 power iterations at the answer positions, a mean over 64 "
             f"problems (paper_b.md's ρ). Computed from each run's checkpoint, at commit "
             f"{', '.join(sorted({str(r.get('commit')) for r in rho.values()}))}.\n"]
    for k in AT:
        lines += [f"\n## At {k} loops\n", "| recipe | seed | every position | answer positions | off the state | "
                  "the run's reading |", "|---|---|---|---|---|---|"]
        for name, seeds in runs.items():
            for seed, (_, rep) in sorted(seeds.items()):
                r = rho.get(f"{name}/s{seed}", {}).get("rho", {}).get(str(k))
                cells = [mr(r[part]) for part in ("all", "answer", "off")] if r else ["n/a"] * 3
                lines.append(f"| {name} | {seed} | " + " | ".join(cells) +
                             f" | {mr([reading(rep, k)]) if reading(rep, k) is not None else 'n/a'} |")
    have = [(n, s) for n in runs for s in runs[n] if f"{n}/s{s}" in rho]
    k = max(AT)
    below = lambda n, s, part: all(v < 1 for v in rho[f"{n}/s{s}"]["rho"][str(k)][part])
    lines.append(f"\n## In short, at {k} loops\n")
    for name in runs:
        seeds = [s for n, s in have if n == name]
        if seeds:
            lines.append(f"- `{name}`: ρ < 1 on every problem, every position, on {sum(below(name, s, 'all') for s in seeds)} "
                         f"of {len(seeds)} seeds; at the answer positions on {sum(below(name, s, 'answer') for s in seeds)} "
                         f"of {len(seeds)}; the run's reading < 1 on "
                         f"{sum(reading(runs[name][s][1], k) is not None and reading(runs[name][s][1], k) < 1 for s in seeds)}"
                         f" of {len(seeds)}.")
    return "\n".join(lines) + "\n", []


if __name__ == "__main__":
    args = study.parse("addition_rho", __doc__, "1,2", QUICK)
    runs = study.run_all(ROWS, args)
    study.write_page(args, *page(runs, args, block_rhos(runs, args, run_rho, METHOD)))
