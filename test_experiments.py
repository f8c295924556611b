"""Tests of experiments/: the study scripts' machinery, and one study end to end with --quick (slow)."""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import HERE, TRAIN_ENV

sys.path.append(os.path.join(HERE, "experiments"))  # after the root: bench is the root bench.py
import study  # noqa: E402


def test_mean_range_is_the_mean_and_the_extremes_of_the_seeds():
    assert study.mean_range([0.99, 1.0, 0.97], ".1f", 100) == "98.7 (97.0–100.0)"
    assert study.mean_range([0.5], ".2f") == "0.50"
    assert study.mean_range([0.5, None]) == "n/a"  # a seed that lacks the value: no mean of the others


def test_paper_a_claims_count_the_seeds_each_claim_holds_on(tmp_path):
    import json
    import paper_a

    def run(norm, ppl1, ppl4, radial=1e-8, clamp=0.001, b=0.0, steps=range(10, 101, 10)):
        # the probe falls as s^-2 below s = 1 and as s^-1 (raw: s^-1/2) above: the slope is fitted above only
        probe = [0.1 / (norm * s ** ((0.5 if ppl1 > 10 else 1) if s >= 1 else 2)) for s in paper_a.SCALES]
        rows = [{"k": k, "ppl": ppl1 + (ppl4 - ppl1) * (k - 1) / 3, "norm_mean": norm, "radial_fraction": radial,
                 "ce": math.log(ppl1 + (ppl4 - ppl1) * (k - 1) / 3),
                 "clamp_delta_ce": clamp, "relative_step": 0.1 / norm ** 0.5, "update": 0.1 * norm ** 0.5 * (2 if ppl1 > 10 else 1),
                 "scale_probe": probe} for k in (1, 2, 3, 4)]
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()  # its training log: ‖H_K‖ = norm · (step/100)^b, so the drift exponent is b
        (out / "log.jsonl").write_text("".join(json.dumps({"iter": i, "norm_K": norm * (i / 100) ** b}) + "\n"
                                               for i in steps))
        return {"out_dir": str(out)}, {"per_loop": rows, "config": {"per_loop_ce": True, "n_loops": 4}}
    runs = {"norm-perloop": {1: run(900.0, 9.0, 9.0, b=0.5), 2: run(700.0, 9.0, 9.1, clamp=-0.05), 3: run(5.0, 9.0, 9.0)},
            "raw-perloop": {1: run(7.0, 11.0, 8.5, 2e-2, 0.1), 2: run(8.0, 11.0, 9.5, 3e-2, 0.1),
                            3: run(9.0, 11.0, 8.0, 1e-2, 0.1)}}
    lines = paper_a.claims(runs, ["<the Lemma 2 table>"])
    drift = next(line for line in lines if line.startswith("- Scale gap"))
    assert "larger on 2 of 3 seeds" in drift  # seed 3: norm 5 < raw 9
    fix = next(line for line in lines if line.startswith("- `raw-perloop`"))
    assert "gains more from its loops on 3 of 3 seeds" in fix and "on 2 of 3 (Paper A" in fix  # seed 2 ends above norm
    assert "seeds (Paper A: -0.20 against `norm`'s +0.01); lower PPL" in fix  # the paper's own ΔPPL 1→4 beside ours
    frozen = next(line for line in lines if line.startswith("- Lemma 2"))
    assert "smaller for `norm` on 2 of 3 seeds" in frozen  # the step is 0.1 / scale: seed 3's norm run is the small one
    across = next(line for line in lines if line.startswith("- Lemma 2 is for a fixed network"))
    # the update is 0.1·√norm (raw's twice that, so not relative step × ‖H_3‖): ratios √(900/7)/2, √(700/8)/2, √(5/9)/2
    # by seed; the state ratios 900/7, 700/8, 5/9
    assert "is 4 (0–6)x `raw`'s, for a 72 (1–129)x larger ‖H_3‖; larger on 2 of 3 seeds" in across
    probed = next(line for line in lines if line.startswith("- Lemma 2, probed"))
    assert "slope -1.00 to -0.50 over the 6 runs without `loop_norm`" in probed  # raw's probe falls as 1/sqrt(s)
    radial = next(line for line in lines if line.startswith("- Radial"))
    assert "1.0e-08 to 1.0e-08 for all 3 runs" in radial and "1.0e-02 to 3.0e-02 for the 3 `raw` runs" in radial
    grows = next(line for line in lines if line.startswith("- Growth over training, `norm-perloop`"))
    # seed 1 grows as √step: 900 at the end, 900·√0.1 = 284.6 at step 10; the others are flat
    assert "is 329.9 (5.0–700.0) at 10% of training and 535.0 (5.0–900.0) at the end" in grows
    assert "half +0.17 (" in grows and "+0.50), still growing (b > 0.1) on 1 of 3 seeds" in grows
    clamp = next(line for line in lines if line.startswith("- Scale clamp"))
    assert "ΔCE -0.0500 (`norm-perloop`) to +0.0010 (`norm-perloop`) over the 3 per-loop runs" in clamp
    assert "at most 2.3% of the run's CE at K" in clamp  # |-0.05| / ln 9.1: a share of the size, whatever the sign
    flat = next(line for line in lines if line.startswith("- Flat loops"))
    assert "(ΔPPL 1→4 > -0.1) in 3 of 3 runs (`norm-perloop`)" in flat  # raw-perloop's not counted: it reads the scale
    assert "(Paper A: ΔPPL 1→4 +0.01" in flat
    assert not any("penalty" in line for line in lines)  # a claim whose rows did not run is left out
    step = lambda n: next(i for i, line in enumerate(lines) if line.startswith(f"\n### ({n})"))
    assert (step(1) < lines.index(drift) < lines.index(grows) < step(2) < lines.index(radial) < step(3)  # under its step
            < lines.index(frozen) < lines.index(across) < lines.index(flat) < lines.index("<the Lemma 2 table>") < step(4)
            < lines.index(fix))
    # a run too short to fit a drift exponent (--quick: one logged step) leaves it n/a rather than failing the page
    short = paper_a.claims({"norm-terminal": {1: run(50.0, 9.0, 8.0, steps=[4])}}, [])
    heads = [line[5:8] for line in short if line.startswith("\n###")]
    assert heads == ["(1)", "(3)"]  # a step without claims (no `raw` run: no radial contrast; no fix) has no heading
    assert "drift exponent over the second half n/a, still growing (b > 0.1) on 0 of 1 seeds" in "".join(short)


def test_loop1_claims_say_whether_loop_1_opposes_or_outgrows_the_embedding():
    import paper_a
    probe = {"h0": 10.0, "ce0": 80.0, "ce1": 2.0, "ce1_no_h0": 9.0, "h0_reads_input": 1.0}
    rep = lambda readout, **p: {"config": {"readout": readout, "norm_penalty": 0.0, "init": "pytorch"},
                                "loop1_probe": dict(probe, **p)}
    runs = {"norm-perloop": {1: ({}, rep("norm", d1=400.0, cos=0.05))}, "raw-perloop": {1: ({}, rep("raw", d1=10.0, cos=-0.8))},
            "unprobed": {1: ({}, {"config": {"readout": "raw", "norm_penalty": 0.0, "init": "pytorch"}})}}
    lines = paper_a.loop1_claims(runs)
    assert "on 100.0% to 100.0% of positions in the 2 runs probed" in lines[0]
    assert "with Paper A's init on 100.0% to 100.0% in its 2 runs" in lines[0]  # the README quotes this init's range
    assert any(line.startswith("- The 1 runs with Paper A's init whose loss sees") and "cos(Δ_1, H_0) -0.800" in line
               and "1.0x to 1.0x" in line and "(`raw-perloop`) oppose it" in line for line in lines)  # its rows named
    assert any("cannot see it" in line and "(`norm-perloop`) outgrow it" in line and "40.0x to 40.0x" in line for line in lines)
    assert not any("nanoGPT's init" in line for line in lines)  # no such run


def test_depth_goal_pairs_each_seed_with_its_baseline_and_finds_the_frontier():
    import depth

    def run(ce4, ce64, steps=600):  # CE at 16 and 32 equal to CE at 4: the rise is CE at 64 - CE at 4
        ce = {k: ce4 if k < 64 else ce64 for k in range(1, 65)}
        return {}, {"config": {"n_loops": 4, "max_iters": steps}, "per_loop": [{"ce": ce[k]} for k in range(1, 65)]}
    runs = {"baseline": {1: run(2.0, 2.6), 2: run(2.1, 2.6)},
            "flat": {1: run(2.3, 2.305), 2: run(2.1, 2.105)},       # cost +0.3 / 0: meets the goal on seed 2 only
            "worse": {1: run(2.4, 2.5), 2: run(2.4, 2.5)}}          # beaten by flat on both
    lines = depth.goal(runs)
    assert "- `flat`: cost at K +0.150 (+0.000–+0.300), rise +0.005 (+0.005–+0.005); meets the goal on 1 of 2 seeds" in lines
    front = next(line for line in lines if line.lstrip().startswith("The frontier"))
    assert "`baseline` (cost +0.000, rise +0.550)" in front and "`flat`" in front and "worse" not in front
    assert lines[-1].endswith("`flat`, cost +0.150, rise +0.005: 0.130 nats away.")  # 0.15 - 0.02 over the cost bound
    runs = {"baseline": {1: run(2.0, 2.6), 2: run(2.1, 2.6)}, "mean4": {1: run(2.0, 2.2), 2: run(2.2, 2.3)}}
    lesson = depth.lessons(runs)[-1]  # per seed: cost 0 / +0.1, rise 0.6 → 0.2 / 0.5 → 0.1
    assert lesson == ("- depth sampling (`mean4` against `baseline`): cost +0.050 (+0.000–+0.100), rise -0.400 "
                      "(-0.400–-0.400); lower cost on 0 of 2 seeds, lower rise on 2 of 2; lower CE at 16, 32, 64 loops "
                      "on 0, 0, 2 of 2")  # CE at 16 and 32 equal or higher, at 64 lower on both
    short = lambda ce4, ce32: ({}, {"config": {"n_loops": 4, "max_iters": 600},  # evaluated to 32 loops only
                                    "per_loop": [{"ce": ce4 if k < 32 else ce32} for k in range(1, 33)]})
    runs = {"baseline": {1: short(2.0, 2.6), 3: short(2.0, 2.6)}, "mean4": {1: short(2.1, 2.2), 2: short(2.1, 2.2)}}
    assert depth.lessons(runs)[-1].endswith("lower CE at 16, 32 loops on 0, 1 of 1")  # seed 1, the one both have



def test_depth_page_shows_the_runs_and_names_the_rows_not_run(tmp_path):
    import argparse
    import depth

    def run(ce4, rho):
        rows = [{"ce": ce4 + 0.01 * (k > 4), "norm_mean": 10.0, "relative_step": 1e-3,
                 "spectral_radius": rho.get(k, (None, None))[0], "spectral_radius_off_state": rho.get(k, (None, None))[1]}
                for k in range(1, 65)]
        meta = {"commit": "abc1234", "machine": "test", "wall_s": 60.0, "date": "2026-12-03T00:00:00",
                "argv": ["config/depth_cpu.py", "--seed", "1"]}
        return meta, {"config": {"n_loops": 4, "max_iters": 600}, "per_loop": rows}
    runs = {"baseline": {1: run(2.0, {8: (1.3, 0.9), 32: (1.05, 0.95), 64: (0.88, 0.97)}),
                         2: run(2.2, {8: (1.1, 0.8), 32: (1.01, 0.9), 64: (1.02, 0.99)})}}
    args = argparse.Namespace(study="depth", out=str(tmp_path), runs=str(tmp_path), quick=False, jobs=2, threads=1,
                              device="cpu")
    text, pngs = depth.page(runs, args)
    assert "| 2.100 (2.000–2.200) |" in text and "| +0.010 (+0.010–+0.010) |" in text
    assert "`python train.py config/depth_cpu.py --seed 1`" in text  # the runs' own command, from run.json
    # ρ from the reports: all directions, then off the state's direction
    assert ("| baseline | 1.200 (1.100–1.300) | 1.030 (1.010–1.050) | 0.950 (0.880–1.020) | 0.850 (0.800–0.900) "
            "| 0.925 (0.900–0.950) | 0.980 (0.970–0.990) |") in text
    assert ("At 64 loops ρ > 1 in 1 of 2 runs, and off the state's own direction (not the carried scale) in 0 of 2. Off "
            "the state ρ is below 1 on every seed for 1 of 1 recipes.") in text
    not_run = next(line for line in text.splitlines() if line.startswith("Rows of the script not run"))
    assert "`mean4`" in not_run and "`baseline`" not in not_run and (tmp_path / pngs[0]).stat().st_size > 0


def run_quick(study_name, tmp_path):
    """experiments/<study>.py --quick into tmp_path (its runs in tmp_path/runs): (its command, its page's text)."""
    cmd = [sys.executable, f"experiments/{study_name}.py", "--quick", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]
    r = subprocess.run(cmd, cwd=HERE, env=TRAIN_ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return cmd, (tmp_path / f"{study_name}-quick.md").read_text()


@pytest.mark.slow
def test_paper_a_quick_reports_loop_1_for_each_run(tmp_path):
    _, page = run_quick("paper_a", tmp_path)
    table = page.split("## What loop 1 does with the embedding")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| norm-terminal |") or line.startswith("| raw-terminal |")]
    assert len(rows) == 2 and "n/a" not in "".join(rows)  # each run's report.json holds its loop-1 probe
    assert "of positions in the 2 runs probed" in page


@pytest.mark.slow
def test_paper_b_quick_writes_its_page_from_the_reports_and_skips_finished_runs(tmp_path):
    cmd, page = run_quick("paper_b", tmp_path)
    assert (tmp_path / "paper_b-quick_accuracy.png").stat().st_size > 0
    metas = {}
    for row in ("baseline", "sampling"):
        rep = json.load(open(tmp_path / "runs" / row / "s1" / "report.json"))
        acc = rep["addition"]["accuracy"]
        cells = " | ".join(f"{100 * acc[str(k)]:.1f}" for k in (1, 2, 4))
        assert f"| {row} | 1 | {cells} |" in page  # the table is the runs' report.json, digit for digit
        meta = metas[row] = json.load(open(tmp_path / "runs" / row / "s1" / "run.json"))
        assert meta["finished"] and meta["wall_s"] > 0 and "--seed" in meta["argv"]
    # made by another command that resolves to the same settings (here: it names the preset's own n_loops)
    equivalent = {**metas["baseline"], "argv": metas["baseline"]["argv"][:1] + ["--n_loops", "4"] + metas["baseline"]["argv"][1:]}
    (tmp_path / "runs" / "baseline" / "s1" / "run.json").write_text(json.dumps(equivalent))
    again = subprocess.run(cmd, cwd=HERE, env=TRAIN_ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "done: baseline seed 1 (" in again.stdout
    assert equivalent == json.load(open(tmp_path / "runs" / "baseline" / "s1" / "run.json"))  # not run again
    assert "| `baseline` | " in (tmp_path / "paper_b-quick.md").read_text()  # the header's table names that command
    cell = (tmp_path / "paper_b-quick.md").read_text().split("| `baseline` | ")[1].split("\n")[0]
    assert " | `python train.py config/addition_cpu.py --n_loops 4 --seed S --device cpu" in cell
    assert cell.endswith(": spells out `--n_loops 4` (with its commit's presets: the recorded settings) |")  # and says how it differs
    # a preset edited since a run finished (here: its report says another learning rate): run again, not reused
    rep_path = tmp_path / "runs" / "baseline" / "s1" / "report.json"
    rep = json.load(open(rep_path))
    rep["config"]["learning_rate"] = 0.5
    rep_path.write_text(json.dumps(rep))
    elsewhere = [sys.executable, os.path.join(HERE, "experiments/paper_b.py")] + cmd[2:]  # started from another folder
    third = subprocess.run(elsewhere, cwd=tmp_path, env=TRAIN_ENV, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and "it ran at other settings (learning_rate 0.5 then, 0.001 now)" in third.stdout
    assert json.load(open(rep_path))["config"]["learning_rate"] == 0.001


def test_paper_b_finds_where_each_recipe_splits_from_the_baseline_and_the_logged_penalty(tmp_path):
    import paper_b

    def run(name, seed, losses, jv=None):
        out = tmp_path / name / str(seed)
        out.mkdir(parents=True)
        out.joinpath("log.jsonl").write_text("".join(json.dumps({"iter": 10 * (i + 1), "loss": v, **(
            {"jv_norm": jv[i]} if jv else {})}) + "\n" for i, v in enumerate(losses)))
        return {"out_dir": str(out)}, {}
    base = [3.0, 2.0, 1.0, 0.5]
    runs = {"baseline": {1: run("baseline", 1, base), 2: run("baseline", 2, base)},
            "stars": {1: run("stars", 1, [3.0, 2.0, 0.9, 0.4], jv=[0.1, 0.2, 0.3, 0.8]),
                      2: run("stars", 2, [3.0, 2.0, 1.0, 0.4], jv=[0.1, 0.2, 0.3, 0.6])}}
    line, = paper_b.shared_start(runs)
    assert "`stars` at step 30–40 (2 of 2 seeds)" in line  # seed 1 splits at its third log, seed 2 at its fourth
    assert paper_b.logged_jv(runs["stars"][1][0]) == pytest.approx(0.8)  # the last 10% of steps: step 40 only
    assert paper_b.logged_jv(runs["baseline"][1][0]) is None


def test_code_since_tells_code_from_strings_comments_and_docstrings(tmp_path, monkeypatch):
    head = study.commit().split("+")[0]
    assert "(uncommitted changes)" in study.code_since([head + "+changes"])  # a run made from a changed tree
    assert study.code_since(["0000000"]) == "not compared (git cannot read commit 0000000)"
    monkeypatch.setattr(study, "ROOT", str(tmp_path))  # a repository of one training file, changed three ways
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    src = 'def f(x):\n    """Old."""\n    return x  # old\n'
    (tmp_path / "looplm.py").write_text(src)
    git("add", "looplm.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    c = git("rev-parse", "--short", "HEAD")
    assert study.code_since([c]) == "unchanged"
    (tmp_path / "looplm.py").write_text(src.replace("Old.", "New.").replace("# old", "# new"))
    assert study.code_since([c]) == "unchanged (looplm.py: comments and docstrings only)"
    (tmp_path / "looplm.py").write_text(src.replace("return x", "return -x"))
    assert study.code_since([c]) == "changed in looplm.py (f; +1 −1 lines)"  # the function whose code changed is named
    (tmp_path / "looplm.py").write_text(src + "g = f\n")
    assert study.code_since([c]) == "changed in looplm.py (module; +1 −0 lines)"
    (tmp_path / "looplm.py").write_text(src.replace("return x", "return x + 'a'"))
    assert study.code_since([c]) == "changed in looplm.py (f; +1 −1 lines)"  # a string that was not there: code
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    first, c = c, git("rev-parse", "--short", "HEAD")
    (tmp_path / "looplm.py").write_text(src.replace("return x", "return x + 'b'"))
    assert study.code_since([c]) == "changed in looplm.py (f: string constants only; +1 −1 lines)"  # help text, a message
    assert study.code_since([first, c]) == "changed in looplm.py (f; +1 −1 lines)"  # code since the first commit


def test_options_reads_values_flags_and_presets_anywhere_in_a_command():
    argv = ["--stars_supervised", "config/y.py", "--n_loops", "4", "config/x.py", "--learning_rate=-1e-3", "--tag=",
            "--out_dir", "/r/b/s1", "--data_dir=/d"]
    assert study.options(argv) == {"--stars_supervised": [], "": ["config/y.py", "config/x.py"], "--n_loops": ["4"],
                                   "--learning_rate": ["-1e-3"], "--tag": [""]}


def test_the_header_table_names_each_rows_commits_and_the_command_that_made_its_runs():
    own = lambda c: ({"commit": c}, {})
    other = ({"commit": "c3", "argv": ["config/x.py", "--k", "0", "--seed", "2", "--out_dir", "/r/b/s2"],
              "row_argv": ["config/x.py", "--seed", "2", "--j=4", "--out_dir", "/r/b/s2"]}, {})
    runs = {"a": {1: own("c1"), 2: own("c1")}, "b": {1: own("c1"), 2: other}, "c": {1: own("c2"), 3: own("c1"), 2: own("c2")}}
    assert study.runs_table(runs)[0].startswith("\n**Each row's runs:** the commit they were made at, and the command")
    assert study.runs_table(runs)[3:] == [
        "| `a` | c1 | the row's |",
        "| `b` | c1 (seed 1); c3 (seed 2) | the row's (seed 1); `python train.py config/x.py --k 0 --seed S`: spells out "
        "`--k 0`; it leaves `--j 4` unnamed (with its commit's presets: the recorded settings) (seed 2) |",
        "| `c` | c2 (seeds 1, 2); c1 (seed 3) | the row's |"]
    del runs["b"]  # every run made by its row's command: no "made by" column
    assert study.runs_table(runs) == ["\n**Each row's runs:** the commit they were made at (by seed where the seeds differ). A "
                                      "run's commit is HEAD when it started, with \"+changes\" if the code that trains and "
                                      "evaluates, or a preset, differed from it (`study.commit`).\n",
                                      "| row | commit |", "|---|---|", "| `a` | c1 |", "| `c` | c2 (seeds 1, 2); c1 (seed 3) |"]


def test_a_run_whose_command_now_resolves_to_other_settings_is_told_apart():
    argv = ["config/addition_cpu.py", "--seed", "1", "--device", "cpu", "--out_dir", "x", "--num_threads", "1"]
    import train
    cfg, model_args, _ = train.settings(argv)
    report = {"config": {**vars(cfg), **model_args, "block_size": 17, "vocab_size": 16, "out_dir": "elsewhere"}}
    assert study.settings_changed(argv, report) == {}  # derived settings and out_dir do not count
    report["config"]["data_dir"] = "/elsewhere"  # nor where the data was read from
    assert study.settings_changed(argv, report) == {}
    assert study.same_command({"argv": argv + ["--data_dir", "/x"]}, argv) and study.same_command({"argv": argv}, argv + ["--data_dir=/y"])
    for how in ({"init_from": "resume"}, {"eval_only": True}):  # a resumed or re-evaluated run is the same run
        assert study.settings_changed(argv, {"config": {**report["config"], **how}}) == {}
    del report["config"]["stars_rows"]  # a setting added since the run: the same run while it is at its default
    assert study.settings_changed(argv, report) == {}
    assert study.settings_changed(argv, {}) == {"config": (None, "the command's")}
    assert not study.same_command({"argv": argv + ["--dropout", "0.1"]}, argv)
    report["config"]["zero_digits_steps"] = 0
    assert study.settings_changed(argv, report) == {"zero_digits_steps": (0, 400)}


@pytest.mark.slow
def test_quickstart_quick_times_the_readme_commands_and_writes_their_page(tmp_path):
    _, page = run_quick("quickstart", tmp_path)
    rep = json.load(open(tmp_path / "runs" / "cpu-tiny-raw" / "s1" / "report.json"))
    wall = json.load(open(tmp_path / "runs" / "cpu-tiny-raw" / "s1" / "run.json"))["wall_s"]
    assert (f"| `python train.py config/cpu_tiny.py --readout raw` | {wall:.0f} | PPL loop 1 → 4: "
            f"{rep['per_loop'][0]['ppl']:.3f} → {rep['per_loop'][3]['ppl']:.3f}") in page  # its time and numbers
    assert (tmp_path / "compare_norms.png").stat().st_size > 0


def test_quickstart_rows_are_the_readme_commands():
    import quickstart
    readme = open(os.path.join(HERE, "README.md")).read().split("```")[1]  # the quick start's commands
    commands = [line.split("#")[0].split(" --out_dir")[0].strip() for line in readme.splitlines()
                if line.startswith("python train.py config/")]
    assert commands == [f"python train.py {options}" for options in quickstart.ROWS.values()]


STUDIES = sorted(f[:-3] for f in os.listdir(os.path.join(HERE, "experiments"))  # every script with ROWS is a study
                 if f.endswith(".py") and "\nROWS = " in open(os.path.join(HERE, "experiments", f)).read())


@pytest.mark.slow
@pytest.mark.parametrize("name", STUDIES)
def test_a_committed_page_is_what_its_script_makes_from_the_run_records_in_git(name, tmp_path):
    # the README's "To check a number": --page_only remakes the page from experiments/runs/NAME/, at this commit's code, the same
    # but for the line that names the command and commit, and the plots' links (beside the page, or ../assets/)
    if not os.path.exists(os.path.join(HERE, "experiments", f"{name}.md")):
        pytest.skip(f"experiments/{name}.md: no page yet")
    tracked = subprocess.run(["git", "ls-files", f"experiments/runs/{name}"], cwd=HERE, capture_output=True, text=True).stdout
    assert "report.json" in tracked, f"experiments/{name}.md stands without its run records: commit experiments/runs/{name}/"
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=HERE, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":  # the header compares the code with the runs' commits
        pytest.skip("a shallow clone: the runs' commits are not in it")
    r = subprocess.run([sys.executable, f"experiments/{name}.py", "--page_only", "--out", str(tmp_path)], cwd=HERE,
                       env=TRAIN_ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = lambda text: [line for line in text.splitlines() if not line.startswith(("Generated by", "!["))]
    committed = open(os.path.join(HERE, "experiments", f"{name}.md")).read()
    assert lines((tmp_path / f"{name}.md").read_text()) == lines(committed), \
        f"experiments/{name}.md is not what its records give now: python experiments/{name}.py --page_only"


def test_the_readme_is_a_guide_of_at_most_20_kb_and_its_links_resolve():
    import re
    readme = open(os.path.join(HERE, "README.md"), "rb").read()
    assert len(readme) <= 20 * 1024, f"README.md is {len(readme)} bytes: the detail belongs on a study page"
    for link in re.findall(r"\]\(([^)#]+)\)", readme.decode()):
        assert os.path.exists(os.path.join(HERE, link)), f"README links {link}, which does not exist"


def test_every_number_in_the_readme_results_is_on_the_page_it_links():
    # the README's results are the pages' numbers, copied: each decimal in a study's summary (and in the quick
    # start's line) stands, sign and digits, on a page that summary links (the studies' pages are generated)
    import re
    number = r"(?<![\w.])[+-]?\d+\.\d+(?:e[+-]\d+)?(?!\d)"  # "−" is read as "-": a sign is checked too
    on = lambda n, text: re.search(r"(?<![\d.])" + re.escape(n) + r"(?![\d])", text)  # "9.8" is not in "99.8"
    read = lambda *pages: "".join(open(os.path.join(HERE, "experiments", p + ".md")).read() for p in pages).replace("−", "-")
    readme = open(os.path.join(HERE, "README.md")).read().replace("−", "-")
    start = readme.index("\n## Quick start")
    sections = [readme[start:readme.index("\n## Tests")]] + readme.split("\n## Results")[1].split("\n### ")
    checked = 0
    for part in sections:
        pages = sorted(set(re.findall(r"\(experiments/(\w+)\.md\)", part))) or ["quickstart", "paper_a", "paper_b", "depth"]
        text = read(*pages)
        for n in re.findall(number, part):
            assert on(n, text), f"README's {n} is on none of {pages}"
            checked += 1
    assert checked > 40
    # and every number in the guide's theory but a paper's own (*Paper:* to the next *Here* or the line's end) stands
    # on a study page: what the runs found, and the settings the pages name
    theory = readme[readme.index("\n## The two papers"):readme.index("\n## Where each idea")]
    ours = re.sub(r"\*Paper[^*]*\*.*?(?=\*Here|\n)", "", theory)
    numbers = re.findall(number, ours)
    text = read("paper_a", "paper_b", "depth")
    assert len(numbers) > 30 and not [n for n in numbers if not on(n, text)]


def test_run_one_resumes_only_its_own_command_and_reruns_other_settings(tmp_path, monkeypatch):
    calls = []  # train.py's argv for each run started; the run itself is not trained here
    monkeypatch.setattr(study.subprocess, "call", lambda cmd, **kw: calls.append(cmd[2:]) or 0)
    argv = ["config/addition_cpu.py", "--seed", "1", "--device", "cpu", "--out_dir", str(tmp_path)]

    def leave(meta, report=None):  # a run folder as a killed (or finished) run leaves it
        (tmp_path / "run.json").write_text(json.dumps(meta))
        (tmp_path / "ckpt.pt").write_text("")
        if report is not None:
            (tmp_path / "report.json").write_text(json.dumps(report))
    leave({"argv": argv, "finished": False, "wall_s": 5})  # interrupted, this command: resumed
    study.run_one(argv, str(tmp_path))
    assert calls[-1][-2:] == ["--init_from", "resume"] and json.load(open(tmp_path / "run.json"))["wall_s"] >= 5
    leave({"argv": argv + ["--n_loops", "4"], "finished": False})  # interrupted, another command: started over
    study.run_one(argv, str(tmp_path))
    assert "--init_from" not in calls[-1] and not (tmp_path / "ckpt.pt").exists()
    import train
    cfg, model_args, _ = train.settings(argv)
    report = {"config": {**vars(cfg), **model_args}}
    leave({"argv": argv + ["--n_loops", "4"], "finished": True}, report)  # finished, same settings: reused
    n = len(calls)
    assert study.run_one(argv, str(tmp_path))[1] == report and len(calls) == n
    leave({"argv": argv, "finished": True}, {"config": {**report["config"], "learning_rate": 0.5}})  # other settings
    study.run_one(argv, str(tmp_path))
    assert len(calls) == n + 1 and "--init_from" not in calls[-1]
    # run.json unmarked but the report newer than the checkpoint (the study stopped after train.py finished):
    for other, started in ((argv, False), (argv + ["--n_loops", "4"], True)):  # this command's: finished; another's: not
        leave({"argv": other, "finished": False}, report)
        os.utime(tmp_path / "ckpt.pt", (0, 0))
        n = len(calls)
        study.run_one(argv, str(tmp_path))
        assert len(calls) == n + started and (not started or "--init_from" not in calls[-1])
