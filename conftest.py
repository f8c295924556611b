"""Shared fixtures and helpers of the test files (one per module, nanochat-style).

    python -m pytest -q                  # everything (a few minutes on 2 cores)
    python -m pytest -q -m "not slow"    # the fast tests, seconds: model, STARS, data, sampling
"""
import json
import os
import shutil

import pytest
import torch

import train
from looplm import LoopLM, LoopLMConfig

torch.set_num_threads(1)  # tiny shapes: one thread is fastest, and immune to a busy machine
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_TINY = ("--tokenizer bytes --n_embd 32 --n_head 4 --n_layer 1 --n_loops 2 --block_size 32 --batch_size 4 "
              "--max_iters 6 --eval_interval 3 --eval_iters 2 --log_interval 1 --dropout 0 --init nanogpt "
              "--device cpu --num_threads 1").split()
TRAIN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: trains, or runs a command in a subprocess (deselect with -m 'not slow')")
    # torch's own forward-mode AD (torch.func.jvp) still loads a decomposition through torch.jit.script
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def tiny(**kw):
    """A small LoopLM in eval mode, seeded: vocab 61, context 32, 2 layers x 4 loops, d 32."""
    args = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_embd=32, n_loops=4, dropout=0.0, init="nanogpt")
    args.update(kw)
    torch.manual_seed(0)
    return LoopLM(LoopLMConfig(**args)).eval()


def batch(B=3, T=16, V=61, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def run_train(argv):
    """train.main in-process; restores the thread count that --num_threads changes."""
    n = torch.get_num_threads()
    try:
        return train.main([str(a) for a in argv])
    finally:
        torch.set_num_threads(n)


def train_losses(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    return [r for r in rows if "loss" in r]


def file_bytes(*paths):
    return [open(p, "rb").read() for p in paths]


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.fixture(scope="session")
def train_text_file(tmp_path_factory):
    """~40 KB of real English (CPython's pydoc topics): no download, tokenized in a blink."""
    import pydoc_data.topics as t
    path = tmp_path_factory.mktemp("data") / "docs.txt"
    path.write_text("\n".join(t.topics[k] for k in sorted(t.topics))[:40_000], encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def train_data_args(train_text_file, tmp_path_factory):
    return ["--dataset", "text", "--data_files", train_text_file, "--cache_dir", str(tmp_path_factory.mktemp("cache"))]


@pytest.fixture(scope="session")
def trained_run(train_data_args, tmp_path_factory):
    """One 6-step run (fixed depth 2), shared by the tests that need a checkpoint: never modify it, copy it."""
    out = str(tmp_path_factory.mktemp("trained_run"))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out]) == 0
    return out


@pytest.fixture
def one_thread():
    # token-by-token decoding is many tiny ops: two threads on two shared cores spin-wait and run
    # 50x slower than one, so these tests run single-threaded
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
