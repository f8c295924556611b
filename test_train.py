"""Tests of train.py: training, resume, checkpoints, bad input. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
import data
import report
import stars
import train
from conftest import HERE, TRAIN_ENV, TRAIN_TINY, copy_run, file_bytes, one_error_line, run_train, tiny, train_losses
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

def test_train_rows_of_one_seed_train_on_the_same_batches_whatever_their_sampler_or_penalty(train_data_args, tmp_path,
                                                                                             monkeypatch):
    # every random stream has its own generator (train.step_streams): drawing a depth or STARS's direction
    # shifts no batch, so rows of one seed are paired in data; another seed draws other batches
    seen, real = [], data.train_batch
    monkeypatch.setattr(data, "train_batch", lambda *a: seen.append(real(*a)) or seen[-1])
    runs = {"fixed": [], "stars": ["--loop_sampling", "lognormal", "--loop_mu", "0.7", "--loop_max", "4",
                                   "--stars_lambda", "0.1", "--stars_warmup", "1"], "seed 2": ["--seed", "2"]}
    batches = {}
    for name, extra in runs.items():
        seen.clear()
        argv = TRAIN_TINY + train_data_args + ["--gradient_accumulation_steps", "2", "--out_dir", tmp_path / name]
        assert run_train(argv + extra) == 0
        batches[name] = torch.stack([x for x, _ in seen])
    assert len(batches["fixed"]) == 12 and len({r["loops"] for r in train_losses(tmp_path / "stars")}) > 1
    assert torch.equal(batches["fixed"], batches["stars"]) and not torch.equal(batches["fixed"], batches["seed 2"])


def test_train_logs_jv_norm_as_the_mean_over_micro_batches(train_data_args, tmp_path, monkeypatch, capsys):
    means, real = [], stars.jsrr_penalty
    def recorded(f, h, **kw):
        pen, jv = real(f, h, **kw)
        means.append(jv.mean().item())
        return pen, jv
    monkeypatch.setattr(stars, "jsrr_penalty", recorded)
    argv = ["--stars_lambda", "0.1", "--stars_warmup", "0", "--max_iters", "2", "--eval_interval", "2",
            "--gradient_accumulation_steps", "2", "--out_dir", tmp_path / "run"]
    assert run_train(TRAIN_TINY + train_data_args + argv) == 0
    logged = [r["jv_norm"] for r in train_losses(tmp_path / "run")]
    want = [(means[2 * i] + means[2 * i + 1]) / 2 for i in range(2)]
    assert len(means) == 4 and means[0] != means[1] and logged == pytest.approx(want, rel=1e-6)
    assert f" | ‖vᵀJ‖ {logged[-1]:.3f}" in capsys.readouterr().out  # the default mode's quantity, named as such


def test_train_step_reads_the_device_only_at_log_steps(train_data_args, tmp_path, monkeypatch):
    # a GPU step must not wait for the host: no .item()/.tolist()/.cpu()/.numpy() in the training step
    # (train.py, stars.py, looplm.py), except at the log steps. The depth sampler's draw from its
    # CPU generator is host-side work, not a device read, and is left out.
    reads = []
    HOST = {"item", "tolist", "cpu", "numpy"}

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in HOST and frame.f_code.co_name != "sample_loops" \
                and os.path.basename(frame.f_code.co_filename) in ("train.py", "stars.py", "looplm.py"):
            reads.append((arg.__name__, frame.f_code.co_name))
    monkeypatch.setattr(train, "evaluate_and_save", lambda *a: None)
    argv = TRAIN_TINY + train_data_args + ["--out_dir", tmp_path / "run", "--max_iters", "8", "--log_interval", "4",
                                           "--stars_lambda", "0.1", "--stars_warmup", "0", "--loop_sampling", "lognormal",
                                           "--loop_max", "4", "--eval_interval", "100"]
    sys.setprofile(profile)
    try:
        assert run_train(argv) == 0
    finally:
        sys.setprofile(None)
    # steps 4 and 8: one read of the logged numbers, ‖Jv‖ among them
    assert sorted(reads) == [("tolist", "train"), ("tolist", "train")], reads


def test_train_pads_large_vocabularies_and_sampling_never_picks_a_pad_row():
    assert [data.padded_vocab(n) for n in (50_257, 50_304, 50_305)] == [50_304, 50_304, 50_368]
    from sample import generate
    m = tiny()  # 61 rows; pretend the tokenizer has 40 and push every logit towards the pad rows
    with torch.no_grad():
        m.wte.weight[40:] *= 50
    x = torch.zeros(4, 3, dtype=torch.long)
    free, _ = generate(m, x, 20, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    kept, _ = generate(m, x, 20, 2, temperature=1.0, generator=torch.Generator().manual_seed(0), vocab=40)
    assert (free[:, 3:] >= 40).any() and (kept[:, 3:] < 40).all()


def test_train_fresh_run_keeps_the_older_run_until_it_saves_and_refuses_another_shape(trained_run, train_data_args,
                                                                                     tmp_path, monkeypatch, capsys):
    out = copy_run(trained_run, tmp_path / "run")
    before = file_bytes(*(os.path.join(out, f) for f in ("ckpt.pt", "log.jsonl", "report.json")))
    # a run of another shape is refused, in one line, and touches nothing
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--n_embd", 64]) == 2
    assert "holds a run of another shape (n_embd 32)" in one_error_line(capsys)
    # so is a run of the same shape, naming what is there
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out]) == 2
    assert f"{out} holds a run at step 6 (best val loss " in one_error_line(capsys)
    # a run told to --overwrite that fails before its first save leaves the older run whole, log included
    real = LoopLM.objective
    monkeypatch.setattr(LoopLM, "objective", lambda self, *a: (None, real(self, *a)[1] * float("nan")))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--overwrite"]) == 1
    assert "non-finite" in one_error_line(capsys)
    assert file_bytes(*(os.path.join(out, f) for f in ("ckpt.pt", "log.jsonl", "report.json"))) == before
    assert sorted(os.listdir(out)) == sorted(os.listdir(trained_run))  # no log.jsonl.new left behind
    # an interrupted run (interrupted.pt, beside no ckpt.pt) is not replaced either
    other = copy_run(trained_run, tmp_path / "interrupted")
    os.replace(os.path.join(other, "ckpt.pt"), os.path.join(other, "interrupted.pt"))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", other, "--no_always_save_checkpoint"]) == 2
    assert f"{other} holds a run at step 6 (best val loss " in (msg := one_error_line(capsys)) and "in interrupted.pt" in msg
    monkeypatch.setattr(LoopLM, "objective", real)
    # with --overwrite the other shape replaces it; its log starts afresh once it saves
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--n_embd", 64, "--overwrite"]) == 0
    assert checkpoint.load_checkpoint(out)["model_args"]["n_embd"] == 64
    assert [r["iter"] for r in train_losses(out)] == [1, 2, 3, 4, 5, 6]


def test_train_stale_temporary_files_of_killed_saves_are_cleaned(trained_run, train_data_args, tmp_path):
    out = copy_run(trained_run, tmp_path / "run")
    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    for name in ("ckpt.pt", "report.json"):
        open(os.path.join(out, f"{name}.{socket.gethostname()}.{dead}.tmp"), "wb").write(b"half a file")
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 9]) == 0
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_train_ctrl_c_while_evaluating_stops_at_once_and_names_the_saved_checkpoint(sig, trained_run, train_data_args,
                                                                                   tmp_path, monkeypatch, capsys):
    out = copy_run(trained_run, tmp_path / "run")
    real, calls = report.evaluate, []

    def interrupted(*a, **k):  # the user presses Ctrl-C (or kill sends SIGTERM) during the second evaluation
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("Ctrl-C ignored")
        return real(*a, **k)
    monkeypatch.setattr(report, "evaluate", interrupted)
    argv = TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 12]
    assert run_train(argv) == 128 + sig
    msg = one_error_line(capsys)
    assert msg == f"train.py: interrupted; {os.path.join(out, 'ckpt.pt')} holds step 9", msg
    assert checkpoint.load_checkpoint(out)["iter_num"] == 9


def test_train_piped_into_a_closed_pipe_trains_to_the_end(train_data_args, tmp_path, monkeypatch):
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", Closed())
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", tmp_path / "run"]) == 0
    assert checkpoint.load_checkpoint(tmp_path / "run")["iter_num"] == 6


def test_train_resume_needs_a_full_checkpoint(trained_run, train_data_args, tmp_path, capsys):
    out = copy_run(trained_run, tmp_path / "run")
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    del ckpt["optimizer"]
    torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 9]) == 1
    assert "has no optimizer state: it can be evaluated (--eval_only) or sampled, not resumed" in one_error_line(capsys)
    ckpt = torch.load(os.path.join(trained_run, "ckpt.pt"), weights_only=True)  # AdamW moments of another shape
    ckpt["optimizer"]["state"][0]["exp_avg"] = ckpt["optimizer"]["state"][0]["exp_avg"][:, :8]
    torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 9]) == 1
    assert "ckpt.pt: its optimizer state does not fit the model (ValueError: a moment of shape" in one_error_line(capsys)


def test_train_addition_stream_ignores_evaluation_settings_and_curriculum_starts_deep_later(tmp_path):
    # the held-out set's size must not change which problems the run trains on; the depth
    # curriculum trains at n_loops until --loop_start, then samples
    args = ["--task", "addition", "--digits", 2, "--n_embd", 32, "--n_head", 4, "--n_layer", 1, "--n_loops", 2,
            "--batch_size", 16, "--max_iters", 6, "--log_interval", 1, "--eval_interval", 6, "--eval_loops", 2,
            "--loop_sampling", "lognormal", "--loop_mu", 1.5, "--loop_max", 8, "--loop_start", 3, "--device", "cpu"]
    for n in (20, 60):
        assert run_train(args + ["--eval_problems", n, "--out_dir", tmp_path / str(n)]) == 0
    a, b = train_losses(tmp_path / "20"), train_losses(tmp_path / "60")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 6
    assert [r["loops"] for r in a[:3]] == [2, 2, 2] and {r["loops"] for r in a[3:]} != {2}


@pytest.mark.parametrize("case", TRAIN_RESUME_CASES)
def test_train_resume_replays_the_uninterrupted_run_exactly(case, train_data_args, trained_run, tmp_path):
    extra = TRAIN_RESUME_CASES[case]
    full = trained_run if case == "fixed" else str(tmp_path / "full")
    if case != "fixed":
        assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", full]) == 0
    half = str(tmp_path / "half")
    assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", half, "--max_iters", 3]) == 0
    assert checkpoint.load_checkpoint(half)["iter_num"] == 3
    log = os.path.join(half, "log.jsonl")
    rows = [json.loads(line) for line in open(log)]
    open(log, "w").write("".join(json.dumps({**r, "marker": 1}) + "\n" for r in rows))  # (a restart would drop it)
    with open(log, "a") as f:  # rows of a run killed after the checkpoint, and a torn line
        f.write(json.dumps({"iter": 4, "loss": 9.9}) + "\n" + '{"iter": 5, "lo')
    assert run_train(TRAIN_TINY + train_data_args + extra + ["--out_dir", half, "--init_from", "resume", "--max_iters", 6]) == 0
    a, b = train_losses(full), train_losses(half)
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r.get("marker") for r in b] == [1, 1, 1, None, None, None]  # steps 1-3 kept: resumed, not restarted
    assert [r["loops"] for r in a] == [r["loops"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # exactly: the same floats on CPU
    if case == "lognormal_stars":
        assert len({r["loops"] for r in a}) > 1  # depth really was sampled
        assert all("jv_norm" in r for r in a[2:]) and [r["jv_norm"] for r in a[2:]] == [r["jv_norm"] for r in b[2:]]
    wa, wb = checkpoint.load_checkpoint(full)["model"], checkpoint.load_checkpoint(half)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

def test_train_resume_with_a_shorter_context_keeps_the_first_positions(trained_run, train_data_args, tmp_path):
    out = copy_run(trained_run, tmp_path / "run")
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--block_size", 16,
                                                      "--max_iters", 7, "--learning_rate", 0]) == 0
    old, new = checkpoint.load_checkpoint(trained_run), checkpoint.load_checkpoint(out)
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
    real_save, real_objective = checkpoint.save_checkpoint, LoopLM.objective

    def recording_save(path, obj):
        real_save(path, obj)
        saved.append(open(path, "rb").read())

    calls = []

    def objective(self, states, targets, checkpoint=False):
        logits, loss = real_objective(self, states, targets, checkpoint)
        calls.append(1)
        return logits, loss * float("nan") if len(calls) == 4 else loss  # step 4 blows up
    monkeypatch.setattr(checkpoint, "save_checkpoint", recording_save)
    monkeypatch.setattr(LoopLM, "objective", objective)
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--eval_interval", 2]) == 1
    msg = one_error_line(capsys)
    ckpt = os.path.join(out, "ckpt.pt")
    assert "non-finite loss" in msg and "at step 4" in msg and f"Last good checkpoint: {ckpt}" in msg
    assert len(saved) == 1 and open(ckpt, "rb").read() == saved[0] and checkpoint.load_checkpoint(ckpt)["iter_num"] == 2
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
    step = checkpoint.load_checkpoint(out)["iter_num"]
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

class Recorded(train.checkpoint.LoopLM):  # keep a handle on the model each rank trains
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        models.append(self)

train.checkpoint.LoopLM = Recorded  # checkpoint.build_model makes the model
depths, sample_loops = [], train.stars.sample_loops
train.stars.sample_loops = lambda *a: depths.append(sample_loops(*a)) or depths[-1]  # each rank's depths

rc = train.main(sys.argv[1:])

torch.save({{"model": models[-1].state_dict(), "depths": depths}},
           os.path.join(os.environ["RANK_DIR"], f"rank{{os.environ['RANK']}}.pt"))

sys.exit(rc)

"""

def test_train_two_process_gloo_ddp_keeps_ranks_identical(train_data_args, tmp_path):
    wrapper = tmp_path / "ddp_wrapper.py"
    wrapper.write_text(TRAIN_DDP_WRAPPER.format(here=HERE))
    out = str(tmp_path / "run")
    # a cold cache: both ranks tokenize at the same time. Sampled depths; Paper A's epochs of windows,
    # so that rank r's batch is micro-batch r of one process with 2 accumulation steps
    args = [*TRAIN_TINY, *train_data_args[:4], "--cache_dir", str(tmp_path / "cache"), "--learning_rate", "1e-2",
            "--window_stride", "16", "--loop_sampling", "lognormal", "--loop_mu", "0.7", "--loop_max", "4"]
    env = {**TRAIN_ENV, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "RANK_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(wrapper), *args, "--out_dir", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    (w0, d0), (w1, d1) = [torch.load(tmp_path / f"rank{r}.pt").values() for r in (0, 1)]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # gradients were averaged: the replicas never drifted
    assert d0 == d1 and len(d0) == 6 and len(set(d0)) > 1  # every step, both ranks ran the same (sampled) depth
    ckpt = checkpoint.load_checkpoint(out)
    assert all(torch.equal(w0[k], ckpt["model"][k]) for k in w0) and ckpt["iter_num"] == 6
    losses = [row["loss"] for row in train_losses(out)]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # training made progress
    # the average over 2 ranks is one process's gradient over both batches (2 accumulation steps)
    single = str(tmp_path / "single")
    assert run_train(args + ["--gradient_accumulation_steps", "2", "--out_dir", single]) == 0
    ws = checkpoint.load_checkpoint(single)["model"]
    assert all(torch.allclose(ws[k], w0[k], atol=1e-5) for k in w0)
    assert [r["loops"] for r in train_losses(single)] == [t for t, _ in d0]
    assert torch.allclose(torch.tensor(losses), torch.tensor([r["loss"] for r in train_losses(single)]), atol=1e-5)


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
    "STARS never on": (["--stars_lambda", "0.1"], 2, "--stars_warmup 2000 is not below --max_iters 6: the STARS penalty"),
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
    "damping out of range": (["--loop_damping", "0"], 2, "--loop_damping 0.0 is invalid"),
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
    # --overwrite lets a run from scratch into the folder, so that the case's own error is the one told: even
    # then, nothing there is lost
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", run, "--overwrite"] + [fill(a) for a in argv]) == code
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


@pytest.mark.parametrize("cli", ["train", "sample", "bench"])
def test_every_numeric_option_of_every_command_rejects_nan_inf_and_out_of_range(cli, capsys):
    # every numeric field, present and future, of train.py, sample.py and bench.py states its range once and is
    # checked by configurator.check: nan, inf, below, above, a non-number -> one line, exit 2
    import bench
    import sample
    main, classes = {"train": (train.main, (train.TrainConfig, LoopLMConfig)), "sample": (sample.main, (sample.SampleConfig,)),
                     "bench": (bench.cli, (bench.BenchConfig,))}[cli]
    checked = 0
    for f in [f for c in classes for f in dataclasses.fields(c)]:
        m = f.metadata
        if m.get("type") not in (int, float) or not m.get("help"):
            continue
        assert (m["lo"] is not None or m["above"] is not None) and m["hi"] is not None, f"--{f.name} states no range"
        bad = (["nan", "inf", "-inf"] if m["type"] is float else ["1.5"]) + ["many"]
        bad += [str(m["lo"] - 1)] if m["lo"] is not None else [str(m["above"])]
        bad += [str(m["hi"] * 10 + 1)]
        for v in bad:
            assert main([f"--{f.name}", v]) == 2, (f.name, v)
            assert f"--{f.name} " in one_error_line(capsys), (f.name, v)
            checked += 1
    assert checked > 20


def test_train_boolean_options_accept_explicit_values():
    cfg, model, _ = train.settings(["--per_loop_ce=false", "--inject", "--no_always_save_checkpoint", "--compile=true"])
    assert (model["per_loop_ce"], model["inject"], cfg.always_save_checkpoint, cfg.compile) == (False, True, False, True)
    with pytest.raises(train.UsageError, match="unknown option --no_n_embd"):
        train.settings(["--no_n_embd", "3"])


def test_train_help_piped_into_head_ends_quietly():
    r = subprocess.run(f"{sys.executable} {os.path.join(HERE, 'train.py')} --help | head -3", shell=True,
                       capture_output=True, text=True, timeout=60)
    assert len(r.stdout.splitlines()) == 3 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_train_one_process_per_out_dir_and_compare_and_sample_take_no_lock(trained_run, train_data_args, tmp_path, capsys):
    import sample
    out = copy_run(trained_run, tmp_path / "run")
    before = {f: file_bytes(os.path.join(out, f)) for f in os.listdir(out)}
    code = (f"import sys, time; sys.path.insert(0, {HERE!r}); import checkpoint; lock = checkpoint.lock_out_dir({out!r}); "
            "print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=TRAIN_ENV)
    try:
        assert holder.stdout.readline() == "locked\n"
        for argv in ([], ["--init_from", "resume", "--max_iters", 9], ["--init_from", "resume", "--eval_only"]):
            assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out] + argv) == 1
            assert f"{out} is in use by another run (pid {holder.pid}); wait for it to end" in one_error_line(capsys)
        assert run_train(["--compare", out, "--out_dir", tmp_path / "cmp"]) == 0  # these only read
        assert sample.main(["--out_dir", out, "--num_samples", "1", "--max_new_tokens", "2", "--device", "cpu"]) == 0
    finally:
        holder.kill()
        holder.wait()
    assert {f: file_bytes(os.path.join(out, f)) for f in os.listdir(out) if f != ".lock"} == before
    # the kernel released the killed holder's lock: there is no stale lock to clean up
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 7]) == 0
    assert checkpoint.load_checkpoint(out)["iter_num"] == 7 and ".lock" not in os.listdir(out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("phase", ["tokenizing", "eval_only", "sample"])
def test_train_a_signal_in_any_phase_is_one_line_and_128_plus_signal(phase, sig, trained_run, train_data_args, tmp_path,
                                                                     monkeypatch, capsys):
    def signalled(*a, **k):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("signal ignored")
    out = str(tmp_path / "run")
    if phase == "tokenizing":  # a cold cache and a new out_dir: neither is left behind, empty
        monkeypatch.setattr(data, "get_tokenizer", lambda meta: data.Tokenizer(signalled, None, 256))
        argv, held = ["--cache_dir", tmp_path / "cache"], "nothing was saved"
    elif phase == "eval_only":
        out = copy_run(trained_run, out)
        monkeypatch.setattr(report, "evaluate", signalled)
        argv, held = ["--init_from", "resume", "--eval_only"], f"{out}/ckpt.pt holds step 6"
    else:  # the sample printed at the end of a run
        import sample
        monkeypatch.setattr(sample, "generate", signalled)
        argv, held = ["--sample_tokens", "5"], f"{out}/ckpt.pt holds step 6"
    old = signal.signal(sig, signal.SIG_IGN)  # as a background job of a shell, which ignores SIGINT: still stops
    try:
        assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out] + argv) == 128 + sig
    finally:
        signal.signal(sig, old)
    assert one_error_line(capsys) == f"train.py: interrupted; {held}"
    if phase == "tokenizing":
        assert not os.path.exists(out) and os.listdir(tmp_path / "cache") == []


def test_train_out_of_memory_is_one_line_naming_what_to_lower(train_data_args, tmp_path, monkeypatch, capsys):
    for e in (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 281474976710656 bytes. Error code 12 (Cannot allocate memory)"),
              torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 GiB")):
        def oom(*a, **k):
            raise e
        monkeypatch.setattr(stars, "training_loss", oom)
        assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", tmp_path / "run"]) == 1
        assert "out of memory at --batch_size 4 --block_size 32 --n_loops 2: lower one of them" in one_error_line(capsys)
        assert not os.path.exists(tmp_path / "run")  # a failed run leaves no empty out_dir behind


def test_train_resume_and_eval_only_tokenize_with_the_checkpoints_vocabulary(train_text_file, tmp_path):
    # the text changed after training (reordered, new words): a refit would give other ids, or ids past the model's rows
    text = tmp_path / "t.txt"
    text.write_text(open(train_text_file).read())
    args = TRAIN_TINY + ["--tokenizer", "regex", "--dataset", "text", "--data_files", text, "--cache_dir", tmp_path / "c"]
    out = tmp_path / "run"
    assert run_train(args + ["--out_dir", out]) == 0
    vocab = checkpoint.load_checkpoint(out)["tokenizer"]["vocab"]
    text.write_text("\n".join(text.read_text().splitlines()[::-1]) + "\nbrand new words\n" * 50)
    assert data.fit_regex_tokenizer(text.read_text())["vocab"] != vocab
    assert run_train(args + ["--out_dir", out, "--init_from", "resume", "--eval_only"]) == 0
    assert run_train(args + ["--out_dir", out, "--init_from", "resume", "--max_iters", 8]) == 0
    assert checkpoint.load_checkpoint(out)["tokenizer"]["vocab"] == vocab


def test_non_finite_guard_leaves_weights_moments_and_step_count_as_they_were():
    from conftest import batch
    model = tiny().train()
    opt = model.configure_optimizers(0.1, 1e-2)
    guard, (x, y) = train.NonFiniteGuard("cpu"), batch()

    def step(it, scale):
        loss, _, _ = stars.training_loss(model, x, y, 4)
        (loss * scale).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        guard.check(opt, loss * scale, grad_norm, it)
        opt.step()
        opt.zero_grad(set_to_none=True)

    snapshot = lambda: [t.clone() for p in model.parameters() for t in (p, *opt.state[p].values())]
    step(0, 1.0)
    before = snapshot()
    step(1, float("nan"))  # a NaN loss and gradient: the update is skipped, step count included
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot())) and guard.first.item() == 2
    step(2, 1.0)  # the next good step updates again; the first bad step stays recorded
    assert not torch.equal(before[0], next(model.parameters())) and guard.first.item() == 2
