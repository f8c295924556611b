"""
experiments/study.py: what every study script shares. A study is a plain list of rows, each a name and
its train.py options, run once per seed (nanochat's runs/speedrun.sh, with seeds and a page at the end):

    ROWS = {"baseline": "config/addition_cpu.py",
            "stars":    "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1"}
    args = study.parse("paper_b", __doc__, default_seeds="1,2,3,4,5")
    runs = study.run_all("paper_b", ROWS, args)   # {row: {seed: report.json}}, finished runs skipped
    study.write_page(args, "paper_b", text)       # experiments/paper_b.md, with the provenance header

Each run lives in runs/<study>/<row>/s<seed>/ (train.py's ckpt.pt, log.jsonl, report.json, plots, and
run.json: the command, its wall time, the commit and the machine). A run whose run.json holds the same
command and that has its report.json is finished: it is not run again, so an interrupted study resumes
where it stopped, and an interrupted run continues from its checkpoint (--init_from resume).
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(study, doc, default_seeds, quick_args):
    p = argparse.ArgumentParser(prog=f"experiments/{study}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default=default_seeds, help=f"comma-separated seeds (default {default_seeds})")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: one a core on a 2-core CPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads a run (default 1)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: passed to every run (default cpu)")
    p.add_argument("--rows", default="", help="comma-separated row names: only these (default: every row)")
    p.add_argument("--runs", default="", help=f"folder of the runs (default runs/{study}, runs/{study}-quick)")
    p.add_argument("--out", default="", help="folder of the page and its plots (default: beside this script)")
    p.add_argument("--train_args", default="", help="more train.py options for every run (say, --data_dir DIR offline)")
    p.add_argument("--quick", action="store_true", help="two rows, one seed, a few steps: checks the pipeline")
    p.add_argument("--dry_run", action="store_true", help="print the commands and exit")
    p.add_argument("--page_only", action="store_true", help="run nothing: the page from the runs that have finished")
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.quick:
        args.seeds = args.seeds[:1]
    args.quick_args = quick_args
    args.study = study
    args.runs = args.runs or os.path.join(ROOT, "runs", study + ("-quick" if args.quick else ""))
    args.out = args.out or os.path.dirname(os.path.abspath(sys.argv[0]))
    os.makedirs(args.out, exist_ok=True)
    return args


def command(options, seed, out_dir, args):
    """The train.py command line of one run."""
    argv = shlex.split(options) + ["--seed", str(seed), "--device", args.device, "--out_dir", out_dir]
    if args.device == "cpu":
        argv += ["--num_threads", str(args.threads)]
    return argv + shlex.split(args.train_args) + (shlex.split(args.quick_args) if args.quick else [])


def run_one(argv, out_dir):
    """train.py once, unless it already finished with this command; returns (run.json dict, report dict)."""
    meta_path, rep_path = os.path.join(out_dir, "run.json"), os.path.join(out_dir, "report.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if meta.get("argv") == argv and meta.get("finished") and os.path.exists(rep_path):
        return meta, json.load(open(rep_path))
    same = meta.get("argv") == argv and os.path.exists(os.path.join(out_dir, "ckpt.pt"))
    extra = ["--init_from", "resume"] if same else (["--overwrite"] if os.path.exists(out_dir) else [])
    os.makedirs(out_dir, exist_ok=True)
    meta = {"argv": argv, "out_dir": out_dir, "finished": False, "commit": commit(), "machine": machine()}
    json.dump(meta, open(meta_path, "w"), indent=1)
    t0 = time.time()
    with open(os.path.join(out_dir, "train.out"), "a") as log:
        code = subprocess.call([sys.executable, "train.py", *argv, *extra], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if code != 0:
        raise SystemExit(f"run failed (exit {code}): python train.py {shlex.join(argv)}; see {out_dir}/train.out")
    meta.update(finished=True, wall_s=round(time.time() - t0, 1) + meta.get("wall_s", 0),
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    json.dump(meta, open(meta_path, "w"), indent=1)
    return meta, json.load(open(rep_path))


def run_all(rows, args):
    """Every (row, seed), args.jobs at once: {row: {seed: (run.json, report.json)}}."""
    if args.rows:
        rows = {k: v for k, v in rows.items() if k in args.rows.split(",")}
    if args.quick:
        rows = dict(list(rows.items())[:2])
    jobs = [(name, seed, os.path.join(args.runs, name, f"s{seed}")) for name in rows for seed in args.seeds]
    argvs = {(name, seed): command(rows[name], seed, d, args) for name, seed, d in jobs}
    for name, seed, _ in jobs:
        print(f"python train.py {shlex.join(argvs[name, seed])}")
    if args.dry_run:
        raise SystemExit(0)
    if args.page_only:
        out = {}
        for name, seed, d in jobs:
            meta = json.load(open(os.path.join(d, "run.json"))) if os.path.exists(os.path.join(d, "run.json")) else {}
            if meta.get("argv") == argvs[name, seed] and meta.get("finished"):
                out.setdefault(name, {})[seed] = meta, json.load(open(os.path.join(d, "report.json")))
        return out
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {(name, seed): pool.submit(run_one, argvs[name, seed], d) for name, seed, d in jobs}
        out = {}
        for (name, seed), f in futures.items():
            out.setdefault(name, {})[seed] = f.result()
            print(f"done: {name} seed {seed} ({out[name][seed][0].get('wall_s', 0) / 60:.1f} min)", flush=True)
    return out


# ---------------------------------------------------------------- the page
def commit():
    """HEAD's short hash, with "+changes" when tracked files differ from it (the page says so)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/*.md", ":!assets")
    return head + ("+changes" if dirty else "")


def machine():
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def mean_range(values, fmt=".1f", scale=1.0):
    """"mean (min–max)" of the seeds' values, or the one value; "n/a" when a seed lacks it."""
    if not values or any(v is None for v in values):
        return "n/a"
    v = [scale * x for x in values]
    m = format(sum(v) / len(v), fmt)
    return m if len(v) == 1 else f"{m} ({format(min(v), fmt)}–{format(max(v), fmt)})"


def provenance(runs, args):
    """The page's header lines: commit(s), dates, machine(s), seeds, wall time a run."""
    metas = [m for seeds in runs.values() for m, _ in seeds.values()]
    walls = [m.get("wall_s", 0) / 60 for m in metas]
    dates = sorted(m.get("date", "?")[:10] for m in metas)
    cmd = shlex.join([f"experiments/{args.study}.py", *sys.argv[1:]])
    return (f"Generated by `python {cmd}` ({len(metas)} runs, seeds {', '.join(map(str, args.seeds))}"
            + (": the finished ones" if args.page_only else "") + "). "
            f"Code: commit {', '.join(sorted({m['commit'] for m in metas}))}. "
            f"Runs dated {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") +
            f" on {'; '.join(sorted({m['machine'] for m in metas}))}, {args.jobs} at once, "
            f"{args.threads if args.device == 'cpu' else 'n/a'} thread(s) each. "
            f"Wall time a run: {min(walls):.1f} to {max(walls):.1f} minutes.\n")


def write_page(args, text, figures=()):
    """experiments/<study>.md (or --out): the text, then a table of every run's wall time."""
    path = os.path.join(args.out, f"{args.study}{'-quick' if args.quick else ''}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}" + "".join(f", {os.path.join(args.out, p)}" for p in figures))
    return path


def savefig(fig, args, name):
    """A study's plot, beside its page; returns its file name (for the page's markdown link)."""
    name = f"{args.study}{'-quick' if args.quick else ''}_{name}.png"
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, name), dpi=90)
    return name
