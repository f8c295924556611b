"""Tests of train.py: training, resume, checkpoints, bad input. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import report
import stars
import train
from conftest import HERE, TRAIN_ENV, TRAIN_TINY, copy_run, file_bytes, one_error_line, run_train, train_losses
from looplm import LoopLM, LoopLMConfig

pytestmark = pytest.mark.slow  # every test here trains, or runs train.py in a subprocess


TRAIN_RESUME_CASES = {
    "fixed": [],
    # sampled depth + STARS penalty from step 2 on: the depths and the penalty's random direction must replay
    "lognormal_stars": ["--loop_sampling", "lognormal", "--loop_mu", "0.7", "--loop_sigma", "0.6", "--loop_max", "4",
                        "--stars_lambda", "0.1", "--stars_warmup", "2"],
    "dropout": ["--dropout", "0.2"],  # the dropout masks must replay too
}

def test_train_stars_rows_puts_the_penalty_on_that_many_sequences(train_data_args, tmp_path, monkeypatch):
    seen, real = [], stars.jsrr_penalty
    monkeypatch.setattr(stars, "jsrr_penalty", lambda f, h, **kw: seen.append(h.size(0)) or real(f, h, **kw))
    stars_args = ["--stars_lambda", "0.1", "--stars_warmup", "1", "--max_iters", "3", "--eval_interval", "3"]
    for rows, want in (("0", 4), ("1", 1), ("9", 4)):  # 0 or more than the batch: every sequence
        seen.clear()
        assert run_train(TRAIN_TINY + train_data_args + stars_args + ["--stars_rows", rows, "--out_dir", tmp_path / rows]) == 0
        assert seen == [want, want], (rows, seen)  # steps 2 and 3: after the warm-up
        assert all("jv_norm" in r for r in train_losses(tmp_path / rows)[1:])

@pytest.mark.parametrize("case", TRAIN_RESUME_CASES)
def test_train_resume_replays_the_uninterrupted_run_exactly(case, train_data_args, trained_run, tmp_path):
    extra = TRAIN_RESUME_CASES[case]
    full = trained_run if case == "fixed" else str(tmp_path / "full")
    if case != "fixed":
        assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", full]) == 0
    half = str(tmp_path / "half")
    assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", half, "--max_iters", 3]) == 0
    assert report.load_checkpoint(half)["iter_num"] == 3
    with open(os.path.join(half, "log.jsonl"), "a") as f:  # rows of a run killed after the checkpoint, and a torn line
        f.write(json.dumps({"iter": 4, "loss": 9.9}) + "\n" + '{"iter": 5, "lo')
    assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", half, "--init_from", "resume", "--max_iters", 6]) == 0
    a, b = train_losses(full), train_losses(half)
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loops"] for r in a] == [r["loops"] for r in b]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6, (ra, rb)
    if case == "lognormal_stars":
        assert len({r["loops"] for r in a}) > 1  # depth really was sampled
        assert all("jv_norm" in r for r in a[2:]) and all(abs(ra["jv_norm"] - rb["jv_norm"]) <= 1e-6 for ra, rb in zip(a[2:], b[2:]))
    wa, wb = report.load_checkpoint(full)["model"], report.load_checkpoint(half)["model"]
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)

def test_train_resume_with_a_shorter_context_keeps_the_first_positions(trained_run, train_data_args, tmp_path):
    out = copy_run(trained_run, tmp_path / "run")
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--block_size", 16,
                                                      "--max_iters", 7, "--learning_rate", 0]) == 0
    old, new = report.load_checkpoint(trained_run), report.load_checkpoint(out)
    assert new["iter_num"] == 7 and new["model_args"]["block_size"] == 16
    assert torch.equal(new["model"]["wpe.weight"], old["model"]["wpe.weight"][:16])  # lr 0: cropped, not changed
    shapes = [tuple(s["exp_avg"].shape) for s in new["optimizer"]["state"].values()]
    assert (16, 32) in shapes  # the AdamW moments of the position embedding were cropped with it

def test_train_checkpoint_is_atomic_and_weights_only(trained_run, train_data_args, tmp_path, monkeypatch, capsys):
    out = copy_run(trained_run, tmp_path / "run")
    path = os.path.join(out, "ckpt.pt")
    good = file_bytes(path)
    # a save that dies half-way (disk full) leaves the previous checkpoint and no temporary file
    real_save = torch.save

    def dying_save(obj, f):
        open(f, "wb").write(good[0][:100])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", dying_save)
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 9]) == 1
    assert "No space left on device" in one_error_line(capsys) and file_bytes(path) == good
    assert sorted(os.listdir(out)) == sorted(os.listdir(trained_run))
    monkeypatch.setattr(torch, "save", real_save)
    # truncated, garbage, or a pickle that would run code: one line naming the file, exit 1, file untouched
    pwned = tmp_path / "pwned"

    class Evil:  # unpickling this would run a shell command
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))
    for bad in (good[0][: len(good[0]) // 2], b"not a checkpoint", None):
        if bad is None:
            torch.save({"model": Evil()}, path)
        else:
            open(path, "wb").write(bad)
        before = file_bytes(path)
        assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume"]) == 1
        msg = one_error_line(capsys)
        assert f"checkpoint {path} is unreadable" in msg and file_bytes(path) == before
        assert ("weights_only=True refuses" in msg) == (bad is None)
    assert not pwned.exists()

def test_train_non_finite_loss_stops_and_keeps_last_good_checkpoint(train_data_args, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    saved = []
    real_save, real_objective = report.save_checkpoint, LoopLM.objective

    def recording_save(path, obj):
        real_save(path, obj)
        saved.append(open(path, "rb").read())

    calls = []

    def objective(self, states, targets):
        logits, loss = real_objective(self, states, targets)
        calls.append(1)
        return logits, loss * float("nan") if len(calls) == 4 else loss  # step 4 blows up
    monkeypatch.setattr(report, "save_checkpoint", recording_save)
    monkeypatch.setattr(LoopLM, "objective", objective)
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--eval_interval", 2]) == 1
    msg = one_error_line(capsys)
    ckpt = os.path.join(out, "ckpt.pt")
    assert "non-finite loss" in msg and "at step 4" in msg and f"Last good checkpoint: {ckpt}" in msg
    assert len(saved) == 1 and open(ckpt, "rb").read() == saved[0] and report.load_checkpoint(ckpt)["iter_num"] == 2
    assert [r["iter"] for r in train_losses(out)] == [1, 2, 3]

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_train_signal_saves_a_checkpoint_and_exits_128_plus_signal(sig, train_data_args, tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *TRAIN_TINY, *train_data_args, "--out_dir", out,
           "--max_iters", "100000", "--eval_interval", "100000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TRAIN_ENV)
    try:
        for line in p.stdout:
            if line.startswith("step "):  # training is under way
                break
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    step = report.load_checkpoint(out)["iter_num"]
    assert step >= 1 and f"interrupted: saved step {step} to {os.path.join(out, 'ckpt.pt')}" in err

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

TRAIN_DDP_WRAPPER = """

import os, sys

import torch

sys.path.insert(0, {here!r})

import train

models = []

class Recorded(train.LoopLM):  # keep a handle on the model each rank trains
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        models.append(self)

train.LoopLM = Recorded

rc = train.main(sys.argv[1:])

torch.save(models[-1].state_dict(), os.path.join(os.environ["RANK_DIR"], f"rank{{os.environ['RANK']}}.pt"))

sys.exit(rc)

"""

def test_train_two_process_gloo_ddp_keeps_ranks_identical(train_data_args, tmp_path):
    wrapper = tmp_path / "ddp_wrapper.py"
    wrapper.write_text(TRAIN_DDP_WRAPPER.format(here=HERE))
    out = str(tmp_path / "run")
    # a cold cache: both ranks tokenize at the same time
    args = [*TRAIN_TINY, *train_data_args[:4], "--cache_dir", str(tmp_path / "cache"), "--learning_rate", "1e-2"]
    env = {**TRAIN_ENV, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "RANK_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(wrapper), *args, "--out_dir", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # gradients were averaged: the replicas never drifted
    ckpt = report.load_checkpoint(out)
    assert all(torch.equal(w0[k], ckpt["model"][k]) for k in w0) and ckpt["iter_num"] == 6
    losses = [row["loss"] for row in train_losses(out)]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # training made progress
    # rank 1 trained on its own batches: the result differs from one process doing the same steps
    single = str(tmp_path / "single")
    assert run_train(args + ["--out_dir", single]) == 0
    ws = report.load_checkpoint(single)["model"]
    assert not torch.allclose(ws["wte.weight"], w0["wte.weight"])


# bad input -> (exit code, a piece of the one-line message). Every case runs with --out_dir {dir}, a copy of
# trained_run (ckpt.pt, log.jsonl, report.json, plots), unless it names another; {file}: a regular file,
# {empty}: a blank text file, {short}: 96 bytes of text, {empty_dir}: an empty folder.
TRAIN_BAD_INPUTS = {
    "unknown option": (["--bogus", "1"], 2, "unknown option --bogus"),
    "wrong type": (["--n_embd", "wide"], 2, "--n_embd expects int, got 'wide'"),
    "missing value": (["--n_embd"], 2, "--n_embd needs a value"),
    "invalid readout": (["--readout", "cosine"], 2, "--readout 'cosine' is invalid; choose one of norm, raw, final_norm"),
    "invalid block_norm": (["--block_norm", "mid"], 2, "--block_norm 'mid' is invalid; choose one of pre, post, sandwich"),
    "invalid loop_sampling": (["--loop_sampling", "uniform"], 2, "--loop_sampling 'uniform' is invalid"),
    "n_loops < 1": (["--n_loops", "0"], 2, "--n_loops 0 is invalid; it must be >= 1"),
    "old name": (["--n_loop", "2"], 2, "--n_loop was renamed: use --n_loops"),
    "negative stars_lambda": (["--stars_lambda", "-1"], 2, "--stars_lambda -1.0 is invalid; it must be >= 0.0 and <= 1.0"),
    "nan learning rate": (["--learning_rate", "nan"], 2, "--learning_rate nan is invalid; it must be a finite number"),
    "beta1 out of range": (["--beta1", "1.5"], 2, "--beta1 1.5 is invalid; it must be >= 0.0 and <= 0.9999"),
    "max_iters below the checkpoint": (["--init_from", "resume", "--max_iters", "3"], 2,
                                       "nothing to train: the run is at step 6 and --max_iters is 3"),
    "unsupported device": (["--device", "meta"], 2, "--device meta is not supported"),
    "width not divisible by heads": (["--n_embd", "30"], 2, "--n_embd 30 is not divisible by --n_head 4"),
    "resume, another task": (["--init_from", "resume", "--task", "addition"], 2, "is not the checkpoint's"),
    "negative norm_penalty": (["--norm_penalty", "-1"], 2, "--norm_penalty -1.0 is invalid; it must be >= 0.0"),
    "eval_only from scratch": (["--eval_only"], 2, "--eval_only needs --init_from resume"),
    "resume, no checkpoint": (["--init_from", "resume", "--out_dir", "{empty_dir}"], 1, "no checkpoint at"),
    "resume, larger block_size": (["--init_from", "resume", "--block_size", "64"], 2,
                                  "--block_size 64 exceeds the checkpoint's 32"),
    "resume, other width": (["--init_from", "resume", "--n_embd", "64"], 2,
                            "--n_embd 64 differs from the checkpoint's 32; it cannot change on resume"),
    "resume, other tokenizer": (["--init_from", "resume", "--tokenizer", "regex"], 2, "is not the checkpoint's"),
    "missing data file": (["--data_files", "{dir}/nope.txt"], 1, "data file {dir}/nope.txt not found"),
    "empty data file": (["--data_files", "{empty}"], 1, "data file {empty} is empty"),
    "too little data": (["--data_files", "{short}"], 1, "fewer than block_size+1=33"),
    "out_dir not writable": (["--out_dir", "{file}/sub"], 1, "out_dir {file}/sub is not writable (Not a directory)"),
    "cache_dir not writable": (["--cache_dir", "{file}/sub"], 1, "cannot write the token cache in {file}/sub"),
    "digits out of range": (["--task", "addition", "--digits", "9"], 2, "--digits 9 is invalid; it must be >= 2 and <= 8"),
    "config file missing": (["config/nope.py"], 2, "config file config/nope.py not found"),
    "bad device": (["--device", "gpu0"], 2, "--device 'gpu0' is invalid"),
}

if not torch.cuda.is_available():
    TRAIN_BAD_INPUTS["no CUDA"] = (["--device", "cuda"], 1, "--device cuda but CUDA is not available")

@pytest.mark.parametrize("case", TRAIN_BAD_INPUTS)
def test_train_bad_input_one_line_nonzero_exit_nothing_overwritten(case, trained_run, train_data_args, tmp_path, capsys):
    argv, code, msg = TRAIN_BAD_INPUTS[case]
    run = copy_run(trained_run, tmp_path / "run")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "short.txt").write_text("too short for a 32-token window\n" * 3)
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "empty_dir").mkdir()
    names = {"dir": run, "empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt", "file": tmp_path / "file",
             "empty_dir": tmp_path / "empty_dir"}
    fill = lambda s: s.format(**{k: str(v) for k, v in names.items()})
    before = {f: file_bytes(os.path.join(run, f)) for f in os.listdir(run)}
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", run] + [fill(a) for a in argv]) == code
    err = one_error_line(capsys)
    assert err.startswith("train.py: error: ") and fill(msg) in err, err
    assert {f: file_bytes(os.path.join(run, f)) for f in os.listdir(run)} == before

def test_train_gpt2_tokenizer_unavailable_offline_fails_fast(train_data_args, tmp_path, monkeypatch, capsys):
    tiktoken = pytest.importorskip("tiktoken")
    import tiktoken.load
    import tiktoken.registry
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget an encoding another test loaded

    def no_network(path):  # the test never downloads; on a machine without network this is what happens
        raise ConnectionError(f"cannot reach {path}")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    t0 = time.perf_counter()
    argv = TRAIN_TINY + train_data_args[:4] + ["--cache_dir", tmp_path / "cache", "--out_dir", tmp_path / "run", "--tokenizer", "gpt2"]
    assert run_train(argv) == 1
    assert time.perf_counter() - t0 < 10
    err = one_error_line(capsys)
    assert "GPT-2 tokenizer unavailable (ConnectionError)" in err and "TIKTOKEN_CACHE_DIR" in err

def test_train_wikitext103_offline_fails_fast_with_one_line(tmp_path):
    pytest.importorskip("datasets")
    env = {**TRAIN_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *TRAIN_TINY, "--dataset", "wikitext103",
                        "--cache_dir", str(tmp_path / "cache"), "--out_dir", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t0 < 60
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot load WikiText-103 from the Hugging Face hub" in r.stderr and "--dataset pydoc" in r.stderr

def test_train_help_lists_every_option_with_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = {l.split()[0][2:]: l for l in out.splitlines() if l.strip().startswith("--")}
    fields = dataclasses.fields(train.TrainConfig) + dataclasses.fields(LoopLMConfig)
    assert set(lines) == {f.name for f in fields}
    for f in fields:  # the help comes from the field itself: its text, its valid values, its default
        assert f.metadata["help"] in lines[f.name] and lines[f.name].rstrip().endswith(f"[{f.default!r}]"), f.name
        for c in f.metadata["choices"] or ():
            assert str(c) in lines[f.name]
    assert "[256]" in lines["block_size"] and "['gpt2']" in lines["tokenizer"] and "(>= 0.0 and <= 0.9999)" in lines["beta1"]


def test_train_every_numeric_option_rejects_nan_inf_and_out_of_range(capsys):
    # every numeric field, present and future, is checked by configurator.check: one line, exit 2
    for f in dataclasses.fields(train.TrainConfig) + dataclasses.fields(LoopLMConfig):
        m = f.metadata
        if type(f.default) not in (int, float) or f.name == "vocab_size":
            continue
        bad = ["nan", "inf", "-inf"] if type(f.default) is float else []
        bad += [str(m["lo"] - 1)] if m["lo"] is not None else []
        bad += [str(m["hi"] * 10 + 1)] if m["hi"] is not None else []
        for v in bad:
            assert train.main([f"--{f.name}", v]) == 2, (f.name, v)
            assert f"--{f.name} " in one_error_line(capsys), (f.name, v)


def test_train_boolean_options_accept_explicit_values():
    cfg, model, _ = train.settings(["--per_loop_ce=false", "--inject", "--no_always_save_checkpoint", "--compile=true"])
    assert (model["per_loop_ce"], model["inject"], cfg.always_save_checkpoint, cfg.compile) == (False, True, False, True)
    with pytest.raises(train.UsageError, match="unknown option --no_n_embd"):
        train.settings(["--no_n_embd", "3"])


def test_train_help_piped_into_head_ends_quietly():
    r = subprocess.run(f"{sys.executable} {os.path.join(HERE, 'train.py')} --help | head -3", shell=True,
                       capture_output=True, text=True, timeout=60)
    assert len(r.stdout.splitlines()) == 3 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
