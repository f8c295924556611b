"""
experiments/study.py: what every study script shares. A study is a plain list of rows, each a name and
its train.py options, run once per seed (nanochat's runs/speedrun.sh, with seeds and a page at the end):

    ROWS = {"baseline": "config/addition_cpu.py",
            "stars":    "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1"}
    args = study.parse("paper_b", __doc__, "1,2,3,4,5", QUICK)  # --seeds, --rows, --jobs, --quick, --device ...
    runs = study.run_all(ROWS, args)         # {row: {seed: (run.json, report.json)}}: runs, skips finished ones
    study.write_page(args, *page(runs, args))  # experiments/paper_b.md and its plots, with the provenance line

Each run lives in experiments/runs/<study>/<row>/s<seed>/ (train.py's ckpt.pt, log.jsonl, report.json, plots, and
run.json: the command, its wall time, the commit and the machine); .gitignore keeps all but the checkpoint and
plots (under experiments/runs/, but not <study>-quick), so once a study's records are committed --page_only remakes its
page on any clone (test_experiments checks each committed page against them). A finished run whose report holds the
settings its row's command resolves to now is not run again, whatever command made it (a row's command may
change without changing the run: an option a preset now sets), so an interrupted study resumes where it
stopped; an interrupted run continues from its checkpoint (--init_from resume) if its command is the same.
A finished run at other settings (a preset edited since) is run again, and left off the page.
The page's header gives each row's commit(s) and the command that made its runs (a table, where they are not one
commit and the rows' own commands) and says whether the code that trains and evaluates has changed since.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "experiments", "runs")  # each study's runs, beside its script and page
sys.path.insert(0, ROOT)
from data import atomic_write_text  # noqa: E402


def parse(study, doc, default_seeds, quick_args, jobs=2, threads=1):
    p = argparse.ArgumentParser(prog=f"experiments/{study}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default=default_seeds, help=f"comma-separated seeds (default {default_seeds})")
    p.add_argument("--jobs", type=int, default=jobs, help=f"runs at once (default {jobs})")
    p.add_argument("--threads", type=int, default=threads, help=f"CPU threads a run (0: torch's default; default {threads})")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: passed to every run (default cpu)")
    p.add_argument("--rows", default="", help="comma-separated row names: only these (default: every row)")
    p.add_argument("--runs", default="", help=f"folder of the runs (default experiments/runs/{study}, {study}-quick)")
    p.add_argument("--out", default="", help="folder of the page and its plots (default: beside this script; --quick: "
                                             "the runs folder)")
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
    args.runs = os.path.abspath(args.runs or os.path.join(RUNS, study + ("-quick" if args.quick else "")))
    args.out = os.path.abspath(args.out or (args.runs if args.quick else os.path.dirname(os.path.abspath(sys.argv[0]))))
    os.makedirs(args.out, exist_ok=True)
    os.chdir(ROOT)  # where train.py runs and its presets' paths start (--runs and --out are absolute by now)
    return args


def command(options, seed, out_dir, args):
    """The train.py command line of one run."""
    argv = shlex.split(options) + ["--seed", str(seed), "--device", args.device, "--out_dir", out_dir]
    if args.device == "cpu":
        argv += ["--num_threads", str(args.threads)]
    return argv + shlex.split(args.train_args) + (shlex.split(args.quick_args) if args.quick else [])


PLACES = ("--out_dir", "--data_dir", "--cache_dir")  # where a run and its data live, not what it is


def without_places(argv):
    """argv without PLACES, in either form (--data_dir DIR, --data_dir=DIR)."""
    return [v for i, v in enumerate(argv) if v not in PLACES and (i == 0 or argv[i - 1] not in PLACES)
            and not v.startswith(tuple(p + "=" for p in PLACES))]


def same_command(meta, argv):
    """Whether run.json's command is argv, wherever the runs and the data are (PLACES left out: a run made
    offline from --data_dir files is the run the hub's copy of the same text makes)."""
    return "argv" in meta and without_places(meta["argv"]) == without_places(argv)


def settings_changed(argv, report):
    """The settings argv resolves to now that differ from those the run's report holds (a preset edited since
    it ran): {name: (then, now)}. A setting the report lacks (added since) counts if it is off its default; a
    report without settings counts as changed. Left out: PLACES, how the run was started (init_from, eval_only,
    overwrite, compare: a resumed run is the same run) and the derived vocab_size (and addition's block_size)."""
    import train
    from dataclasses import fields
    cfg, model_args, _ = train.settings(argv)
    now = {**vars(cfg), **model_args}
    defaults = {f.name: f.default for c in (train.TrainConfig, train.LoopLMConfig) for f in fields(c)}
    then = report.get("config")
    if not then:
        return {"config": (None, "the command's")}
    skip = {p[2:] for p in PLACES} | {"init_from", "eval_only", "overwrite", "compare", "vocab_size"} | (
        {"block_size"} if now["task"] == "addition" else set())
    as_json = lambda v: list(v) if isinstance(v, tuple) else v
    return {k: (then.get(k, defaults.get(k)), v) for k, v in now.items()
            if k not in skip and as_json(v) != as_json(then.get(k, defaults.get(k)))}


def read_json(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):  # missing, or torn by a kill mid-write
        return {}


def finished(meta, argv, out_dir):
    """Whether out_dir holds a finished run: its run.json says so, or, for a run of this command, its report is
    newer than its checkpoint (train.py writes the final report after the final save; the study was stopped
    before it could mark run.json)."""
    rep, ckpt = (os.path.join(out_dir, f) for f in ("report.json", "ckpt.pt"))
    return bool(meta.get("finished")) or (same_command(meta, argv) and os.path.exists(rep) and os.path.exists(ckpt)
                                           and os.path.getmtime(rep) >= os.path.getmtime(ckpt))


def by_row(meta):
    """Whether a finished run (from finished_runs) was made by its row's command as it reads now; else by another
    command that resolves to the same settings."""
    return "row_argv" not in meta or same_command(meta, meta["row_argv"])


def run_one(argv, out_dir):
    """train.py once, unless out_dir holds a finished run at the settings argv resolves to, whatever command made
    it (assumed the same run: the settings include the thread count, not the machine); returns (run.json, report). A
    finished run at other settings, or an interrupted run of another command, is removed first; an interrupted
    run of this command continues from its checkpoint."""
    meta_path, rep_path, ckpt = (os.path.join(out_dir, f) for f in ("run.json", "report.json", "ckpt.pt"))
    meta = read_json(meta_path)
    same = same_command(meta, argv)
    if finished(meta, argv, out_dir):
        report = read_json(rep_path)
        changed = settings_changed(argv, report)
        if not changed:
            return {**meta, "finished": True}, report
        why = f"it ran at other settings ({fmt_changed(changed)})" if report else "its report is missing or unreadable"
        print(f"{out_dir}: {why}: running it again", flush=True)
        same = False
    if not same and os.path.exists(out_dir):
        shutil.rmtree(out_dir)  # its checkpoint must not be resumed under this command
    extra = ["--init_from", "resume"] if same and os.path.exists(ckpt) else []
    os.makedirs(out_dir, exist_ok=True)
    meta = {"argv": argv, "out_dir": out_dir, "finished": False, "commit": commit((*TRAINING_CODE, "config")),
            "machine": machine(), "wall_s": meta.get("wall_s", 0) if same else 0}
    atomic_write_text(meta_path, json.dumps(meta, indent=1))
    t0, code = time.time(), None
    try:
        with open(os.path.join(out_dir, "train.out"), "a") as log:
            code = subprocess.call([sys.executable, "train.py", *argv, *extra], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:  # an interrupted attempt's time counts too
        meta.update(wall_s=round(meta["wall_s"] + time.time() - t0, 1), date=datetime.datetime.now().isoformat(timespec="seconds"))
        meta["finished"] = code == 0
        atomic_write_text(meta_path, json.dumps(meta, indent=1))
    if code != 0:
        raise SystemExit(f"run failed (exit {code}): python train.py {shlex.join(argv)}; see {out_dir}/train.out")
    return meta, read_json(rep_path)


def finished_runs(rows, args):
    """Every finished run on disk of every row at its command's settings, whatever the seed: {row: {seed: (run, report)}}.
    The page is made of these, so a study run for more seeds of one row adds them to the page."""
    out = {}
    for name in rows:
        folder = os.path.join(args.runs, name)
        for d in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if not (d.startswith("s") and d[1:].isdigit()):
                continue
            seed, path = int(d[1:]), os.path.join(folder, d)
            meta = read_json(os.path.join(path, "run.json"))
            argv = command(rows[name], seed, path, args)
            if finished(meta, argv, path):
                rep = read_json(os.path.join(path, "report.json"))
                changed = settings_changed(argv, rep)
                if changed:
                    why = f"ran at other settings ({fmt_changed(changed)})" if rep else "has no readable report"
                    print(f"left off the page: {path} {why}; rerun the study")
                    continue
                meta.update(finished=True, out_dir=path)  # where the run is now (the runs folder may have moved since)
                meta["row_argv"] = argv  # the row's command now: the header tells a run another command made (by_row)
                out.setdefault(name, {})[seed] = meta, rep
    if not out:
        raise SystemExit(f"no finished run in {args.runs} for these rows: run the study first")
    return out


def fmt_changed(changed):
    return ", ".join(f"{k} {a!r} then, {b!r} now" for k, (a, b) in changed.items())


def run_all(rows, args):
    """Run every (row, seed) asked, args.jobs at once, then return finished_runs: the page's runs."""
    unknown = set(filter(None, args.rows.split(","))) - rows.keys()
    if unknown:
        raise SystemExit(f"--rows: no row named {', '.join(sorted(unknown))}; the rows are {', '.join(rows)}")
    chosen = {k: v for k, v in rows.items() if not args.rows or k in args.rows.split(",")}
    if args.quick:
        rows = chosen = dict(list(chosen.items())[:2])
    jobs = [(name, seed, os.path.join(args.runs, name, f"s{seed}")) for name in chosen for seed in args.seeds]
    argvs = {(name, seed): command(chosen[name], seed, d, args) for name, seed, d in jobs}
    for name, seed, _ in [] if args.page_only else jobs:  # what will run (a finished run is skipped)
        print(f"python train.py {shlex.join(argvs[name, seed])}")
    if args.dry_run:
        raise SystemExit(0)
    if not args.page_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {(name, seed): pool.submit(run_one, argvs[name, seed], d) for name, seed, d in jobs}
            try:
                for (name, seed), f in futures.items():
                    print(f"done: {name} seed {seed} ({f.result()[0]['wall_s'] / 60:.1f} min)", flush=True)
            except BaseException:  # Ctrl-C or a failed run: start nothing more
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    return finished_runs(rows, args)


# ---------------------------------------------------------------- the page
def commit(paths=(".", ":!experiments/*.md", ":!experiments/*.png", ":!assets", ":!runs")):
    """HEAD's short hash, with "+changes" when the tracked files in paths differ from it (the page says so): a page
    depends on all the code, a run (run_one) on the code that trains and evaluates and the presets only."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    return head + ("+changes" if dirty else "")


TRAINING_CODE = ("looplm.py", "stars.py", "train.py", "report.py", "data.py", "checkpoint.py", "configurator.py",
                 "sample.py")
# (the presets, config/, are checked run by run: settings_changed)


def code_since(commits):
    """What changed in TRAINING_CODE between the commits and the working tree, in words: "unchanged", "changed in
    a.py (f, g: string constants only; +3 −1 lines), b.py (...)" naming the top-level functions and classes whose code
    changed (": string constants only" where only those did: help text, messages, but also a key or a compared value),
    those whose docstrings alone changed ("docstrings of h") and the lines git counts, or "... in comments and
    docstrings only" where the syntax trees without docstrings are the same."""
    import ast
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)

    def bare(source, strings=True, docs=False):  # {top-level function or class: its syntax tree without docstrings
        try:                                        # (docs=True: with them; strings=False: every string constant
            tree = ast.parse(source)                # blanked)} (the rest: "module"), or None
        except (SyntaxError, TypeError):
            return None
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if not docs and isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
            if not strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
                node.value = ""
        parts = {n.name: ast.dump(n) for n in tree.body if hasattr(n, "name")}
        return {**parts, "module": "".join(ast.dump(n) for n in tree.body if not hasattr(n, "name"))}
    changed, cosmetic, docs = {}, set(), {}
    for c in commits:
        rev = c.split("+")[0]
        r = git("diff", "--name-only", rev, "--", *TRAINING_CODE)
        if r.returncode:
            return f"not compared (git cannot read commit {rev})"
        for f in r.stdout.split():
            old, path = git("show", f"{rev}:{f}"), os.path.join(ROOT, f)
            src = open(path).read() if os.path.exists(path) else None
            then, now = bare(old.stdout) if old.returncode == 0 else None, bare(src) if src is not None else None
            if then is not None and now is not None:  # the names whose docstrings alone changed
                full_then, full_now = bare(old.stdout, docs=True), bare(src, docs=True)
                docs.setdefault(f, set()).update(k for k in {**full_then, **full_now} if k != "module" and
                                                 full_then.get(k) != full_now.get(k) and then.get(k) == now.get(k))
            if then is not None and then == now:
                cosmetic.add(f)
            else:
                plain_then, plain_now = (bare(old.stdout, False), bare(src, False)) if then and now else ({}, {})
                names = changed.setdefault(f, {})  # {name: only its string constants changed}, over every commit
                for k in {**(then or {}), **(now or {})} if then is not None and now is not None else ():
                    if then.get(k) != now.get(k):
                        names[k] = names.get(k, True) and plain_then.get(k) == plain_now.get(k)
        if "+" in c:
            changed["(uncommitted changes)"] = {}
    cosmetic -= set(changed)
    words = lambda files: ", ".join(sorted(files))
    first = oldest(commits)  # the diff's lines, counted from the earliest run commit (binary files: "-", left out)
    numstat = lambda f: git("diff", "--numstat", first, "--", f).stdout.split()[:2]
    count = lambda f: (lambda n: f"+{n[0]} −{n[1]} lines" if len(n) == 2 and all(x.isdigit() for x in n) else "")(numstat(f))
    names = lambda f: ", ".join([k + (": string constants only" if only else "") for k, only in sorted(changed[f].items())]
                                + ([f"docstrings of {', '.join(sorted(docs[f] - set(changed[f])))}"]
                                   if docs.get(f, set()) - set(changed[f]) else []))
    where = ", ".join(f + f" ({'; '.join(x for x in (names(f), count(f)) if x)})" if f.endswith(".py") else f
                      for f in sorted(changed))
    return ((f"changed in {where}" if changed else "unchanged") +
            (f" ({words(cosmetic)}: comments and docstrings only)" if cosmetic else ""))


def oldest(commits):
    """The earliest of the commits (by commit time; "+changes" dropped): what a diff of everything since starts from."""
    when = lambda c: subprocess.run(["git", "log", "-1", "--format=%ct", c.split("+")[0]], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip() or "0"
    return min((c.split("+")[0] for c in commits), key=lambda c: int(when(c)))


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
    """The page's header: its commit; the runs' commits (runs_table), dates, machine(s), seeds and wall times; whether
    the code that trains and evaluates changed since the runs."""
    metas = [m for seeds in runs.values() for m, _ in seeds.values()]
    walls = [m.get("wall_s", 0) / 60 for m in metas]
    dates = sorted(m.get("date", "?")[:10] for m in metas)
    cmd = shlex.join([f"experiments/{args.study}.py", *sys.argv[1:]])
    seeds = sorted({s for r in runs.values() for s in r})
    commits = sorted({m["commit"] for m in metas})
    threads = {0: "torch's default threads", 1: "1 thread each"}.get(args.threads, f"{args.threads} threads each")
    other = made_by_others(runs)
    # one run's own command, without where its run and data live (PLACES): one its row's command made, if any
    own = next((m["argv"] for m in metas if by_row(m)), None)
    argv = own or metas[0]["argv"]
    shown = without_places(argv)
    tail = shown[shown.index("--seed"):] if "--seed" in shown else []  # what follows a row's options (study.command)
    template = shlex.join(["--seed", "S", *tail[2:]])
    dropped = [p for p in PLACES if any(a == p or a.startswith(p + "=") for a in argv)]
    report = next(iter(next(iter(runs.values())).values()))[1]
    offline = ("; these runs read WikiText-2 from local files, the text the hub serves"
               if "--data_dir" in dropped and report.get("config", {}).get("task") == "lm" else "")
    where = os.path.relpath(args.runs, ROOT) if args.runs.startswith(ROOT + os.sep) else args.runs
    kept = "" if args.quick or os.path.dirname(args.runs) != RUNS else (", their records in git (report.json, run.json, the logs; not the checkpoints): "
                                            "`--page_only` remakes this page from them")
    took = (f"A run took {min(walls):.1f} to {max(walls):.1f} minutes; all runs {sum(walls) / 60:.1f} hours"
            + (f" (about {sum(walls) / 60 / args.jobs:.1f} at {args.jobs} at once)." if args.jobs > 1 else ".")
            if len(walls) > 1 else f"It took {walls[0]:.1f} minutes.")
    first = oldest(commits)
    since = code_since(commits)  # and the command that shows how (from the runs' first commit to this tree)
    now = commit()
    head = "" if now.endswith("+changes") else now
    table = len(commits) > 1 or other  # else one commit and the rows' own commands: said in a line
    at = "the commits in the table below" if len(commits) > 1 else f"commit {commits[0]} (HEAD when each started)"
    dated = dates[0] + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    but = (" (except the runs the table below names another command for" + ", this one among them" * (own is None)
           + ")") * other
    lines = [f"Generated by `python {cmd}` with the code at commit {now} (the page is committed after it).\n",
             f"- **Runs:** {len(metas)} finished, seeds {', '.join(map(str, seeds))} (in {where}/{kept}), at {at}, "
             f"dated {dated}; {'; '.join(sorted({m['machine'] for m in metas}))}; {args.jobs} at once, "
             f"{threads if args.device == 'cpu' else 'on ' + args.device}. {took}",
             f"- **A run's command,** from its run.json (every run's is `python train.py OPTIONS {template}`, OPTIONS "
             f"its row's under \"The recipes\"{but}; shown without where its run and data live, "
             f"{' and '.join(dropped) or 'nothing'}{offline}): `python train.py {shlex.join(shown)}`. "
             f"One row and seed again: `python experiments/{args.study}.py "
             f"--rows ROW --seeds S --runs DIR --out DIR` (its runs and page in DIR, this page untouched).",
             "- **Settings:** every run's recorded settings are those its row's command, presets included, resolves to "
             "here (`study.settings_changed`)" + ("; a run made by another command (the table names it) was made at the "
                                                  "same settings" if other else "") + ".",
             f"- **Code since the runs:** the Python that trains and evaluates ({', '.join(TRAINING_CODE)}) "
             f"{since}" + (f": `git diff {' '.join([first] + [head] * bool(head))} -- {' '.join(TRAINING_CODE)}` "
                               f"({first}: the oldest commit any run was made at)." if since.startswith("changed")
                           else ".")]
    if table:
        lines += runs_table(runs)
    return "\n".join(lines) + "\n"


def options(argv):
    """A train.py command's options, {"--name": [its values]}, without PLACES; its presets (the .py files, anywhere in
    the command, as configurator reads them) under "" """
    out, key = {}, ""
    for a in without_places(argv):
        if a.startswith("--"):
            key, _, v = a.partition("=")
            out[key] = [v] if "=" in a else []
        elif a.endswith(".py"):
            out.setdefault("", []).append(a)
        else:
            out.setdefault(key, []).append(a)
    return out


def made_by_others(runs):
    """Whether some finished run was made by another command than its row's (by_row)."""
    return not all(by_row(m) for row in runs.values() for m, _ in row.values())


def runs_table(runs):
    """The header's table, with the sentence that reads it: per row, the commit(s) its runs were made at and, where
    some run was made by another command than its row's, the command(s) that made them."""
    def made_by(meta):
        if by_row(meta):
            return "the row's"
        a = without_places(meta["argv"])
        cell = "`python train.py " + shlex.join(["S" if i and a[i - 1] == "--seed" else v for i, v in enumerate(a)]) + "`"
        then, now = options(meta["argv"]), options(meta["row_argv"])
        named = [f"`{shlex.join([k] + v)}`" for k, v in then.items() if k and k not in now]
        left = [f"`{shlex.join([k] + v)}`" for k, v in now.items() if k and k not in then]
        return cell + "".join([f": spells out {', '.join(named)}" * bool(named),
                               f"{'; it' if named else ': it'} leaves {', '.join(left)} unnamed" * bool(left),
                               " (with its commit's presets: the recorded settings)" * bool(named or left)])
    other = made_by_others(runs)
    lines = ["\n**Each row's runs:** the commit they were made at" + (", and the command that made them where it is "
             "not the row's under \"The recipes\" (seed as S; " if other else " (") + "by seed where the seeds differ). A run's "
             "commit is HEAD when it started, with \"+changes\" if the code that trains and evaluates, or a preset, differed "
             "from it (`study.commit`)." + (
                 " A run's report.json records the settings it ran with: the row's command resolves to them with "
                 "today's presets (`study.settings_changed`: every setting but where a run and its data live and how "
                 "it was started), the command that made it did with the presets of its commit; copied today, that "
                 "command could differ (an option it leaves unnamed now takes today's preset value)." if other else "") + "\n",
             "| row | commit | made by |" if other else "| row | commit |", "|---|---|---|" if other else "|---|---|"]
    for name, row in runs.items():
        cells = []
        for key in (lambda m: m["commit"], made_by)[:1 + other]:
            at = {}  # value -> its seeds
            for seed, (meta, _) in sorted(row.items()):
                at.setdefault(key(meta), []).append(seed)
            cells.append("; ".join(v if len(at) == 1 else f"{v} (seed{'s' * (len(s) > 1)} {', '.join(map(str, s))})"
                                   for v, s in at.items()))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def page_path(args):
    """experiments/<study>.md, or in --out; with --quick, <study>-quick.md."""
    return os.path.join(args.out, f"{args.study}{'-quick' if args.quick else ''}.md")


def write_page(args, text, figures=()):
    """The page's text, at page_path."""
    path = page_path(args)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}" + "".join(f", {os.path.join(args.out, p)}" for p in figures))
    return path


def colours():
    """20 colours for a study's plot, one per row: tab20's dark shades, then its light ones (so rows next to each
    other in the legend differ in hue; matplotlib's default cycle repeats after 10)."""
    import matplotlib.pyplot as plt
    return plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]


def savefig(fig, args, name):
    """A study's plot, beside its page; returns its file name (for the page's markdown link)."""
    name = f"{args.study}{'-quick' if args.quick else ''}_{name}.png"
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, name), dpi=90)
    return name
