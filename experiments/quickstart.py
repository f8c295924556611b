"""
The README's quick start as a study: its five training commands, one at a time with torch's default threads (as
a reader runs them), timed, then its two --compare plots and this page (quickstart.md). No download.

    python experiments/quickstart.py              # about 15 minutes on 2 idle CPU cores (quickstart.md)

Each row is the README's command; the study adds `--seed 1 --device cpu --num_threads 0` (the presets' own
values) and its own --out_dir. The addition rows are Paper B's study's baseline, sampling and stars at seed 1
(there with one thread: the thread count moves the last bits of a float sum, and training at sampled depths can
grow that into a gap at 64-100 loops as large as a seed's).
"""
import os

import study

ROWS = {
    "cpu-tiny": "config/cpu_tiny.py",                                         # the blind spot: norm readout
    "cpu-tiny-raw": "config/cpu_tiny.py --readout raw",                       # fix 1: raw readout
    "addition-cpu": "config/addition_cpu.py",                                 # Paper B: trained at 4 loops
    "addition-cpu-sampling": "config/addition_cpu.py --loop_sampling lognormal",
    "addition-cpu-stars": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1",
}
QUICK = "--max_iters 4 --eval_interval 4 --eval_iters 1 --eval_problems 40 --eval_loops 4 --sample_tokens 8"
HERE = os.path.dirname(os.path.abspath(__file__))


def page(runs, args):
    from report import compare_runs
    reps = [rep for seeds in runs.values() for _, rep in seeds.values()]
    n_test = next((r["config"]["eval_problems"] for r in reps if "addition" in r), 0)
    lines = ["# The quick start, timed\n", study.provenance(runs, args),
             "\nThe README's commands, one after another on the idle machine. PPL per byte at loop k of the 4-loop "
             "run (`report.json`)" + (f"; strict exact match (%) on {n_test:,} held-out problems at each depth" if n_test
                                      else "") + ". The addition rows are Paper B's study's seed 1 with torch's "
             "default threads (there: one thread), which moves the last bits of a float sum; training at sampled "
             "depths can grow that into a gap at any depth as large as one between seeds (compare paper_b.md's seed "
             "1): compare runs at equal threads.\n", "| command | seconds | result |\n|---|---|---|"]
    for name, seeds in runs.items():
        meta, rep = next(iter(seeds.values()))
        if "addition" in rep:
            acc = rep["addition"]["accuracy"]
            result = "exact match at " + ", ".join(f"{k}: {100 * v:.1f}" for k, v in acc.items() if int(k) in
                                                    (1, 2, 4, 8, 16, 32, 64, 100))
        else:
            rows = rep["per_loop"]
            result = (f"PPL loop 1 → 4: {rows[0]['ppl']:.3f} → {rows[3]['ppl']:.3f}; "
                      f"‖H_K‖ {rows[3]['norm_mean']:.1f}")
        lines.append(f"| `python train.py {ROWS[name]}` | {meta['wall_s']:.0f} | {result} |")
    total = sum(m["wall_s"] for seeds in runs.values() for m, _ in seeds.values())
    lines.append(f"\nAll {sum(map(len, runs.values()))} runs: {total / 60:.1f} minutes (the two `--compare` commands take "
                 "seconds). Each is one seed: which recipe is the better model is for the studies' seeds to say "
                 "(paper_a.md, paper_b.md).\n")
    for name, seeds in runs.items():
        out = open(os.path.join(next(iter(seeds.values()))[0]["out_dir"], "train.out")).read()
        if "sample: " in out:
            lines.append(f"- `{name}`'s end-of-run sample: \"{' '.join(out.rsplit('sample: ', 1)[1].split())[:80]}\"")
    # the plots: in assets/, the repository's images, for this page; beside the page otherwise
    figdir = os.path.join(study.ROOT, "assets") if args.out == HERE and not args.quick else args.out
    lines.append("")
    for group in ([n for n in runs if "addition" not in n], [n for n in runs if "addition" in n]):
        if len(group) > 1:
            for png in compare_runs([next(iter(runs[n].values()))[0]["out_dir"] for n in group], figdir):
                lines.append(f"![{os.path.basename(png)}]({os.path.relpath(png, args.out)})")
    return "\n".join(lines) + "\n", []


if __name__ == "__main__":
    args = study.parse("quickstart", __doc__, "1", QUICK, jobs=1, threads=0)
    runs = study.run_all(ROWS, args)
    study.write_page(args, *page(runs, args))
