"""Tests of bench.py: FLOP counts, the profile, every figure. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import json
import math

import pytest
import torch

import bench
from conftest import tiny


def test_bench_train_flops_by_hand():
    # d 32, 2 layers, SwiGLU hidden 128: per block c_attn 32·96 + attn c_proj 32·32 + c_fc 32·256
    # + mlp c_proj 128·32 + two RMSNorm gains 2·32 = 16,448; the tied head is 61·32 = 1,952
    m = tiny()
    per_token = 6 * (3 * 2 * 16_448 + 1_952) + 12 * (2 * 3) * 8 * 32  # K = 3 loops, T = 8, one readout
    assert bench.train_flops(m, 3, 2, 8) == per_token * 2 * 8 == 9_956_352
    m = tiny(per_loop_ce=True)  # every loop's readout is a V·d matmul too
    assert bench.train_flops(m, 3, 2, 8) == (6 * (3 * 2 * 16_448 + 3 * 1_952) + 12 * 6 * 8 * 32) * 16


@pytest.mark.slow
def test_bench_profile_tells_kernel_time_from_the_rest(capsys):
    a = torch.randn(384, 384)
    share = lambda step: bench.profile_steps([step], ["x"], flops=1.0, peak=1.0, device="cpu")["kernel_share"]
    assert share(lambda: [a @ a for _ in range(10)]) > 0.8      # all matmul
    assert share(lambda: [a.exp().sin() for _ in range(30)]) < 0.05  # no matmul
    assert "aten::sin" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_reports_every_figure():
    shape = dict(n_embd=32, n_head=4, n_layer=1, n_loops=4, vocab_size=61, block_size=32, batch_size=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread is faster, and robust on a busy machine
    try:
        res = bench.bench(bench.parse_args(["--warmup", "0", "--reps", "1"]), shape, "cpu")
    finally:
        torch.set_num_threads(threads)
    keys = {"loop_vs_unrolled", "mfu", "stars_overhead", "stars_overhead_rows", "train_tps_loop", "train_tps_unrolled",
            "peak_gflops", "gen_tps_fixed", "gen_tps_adaptive", "adaptive_mean_loops"}
    keys |= {f"eval_tps_k{k}" for k in range(1, 5)}
    keys |= {f"mem_mb_{m}_K{K}" for K in (4, 8, 16) for m in ("plain", "checkpoint", "truncated")}
    assert keys <= res.keys(), keys - res.keys()
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in res.values()), res
    assert 1 <= res["adaptive_mean_loops"] <= 4




@pytest.mark.slow
def test_bench_busy_times_each_spin_count_alone_and_beside_another_run(tmp_path):
    res = bench.busy_runs(bench.parse_args(["--busy", "--busy_iters", "1"]))
    spins = [f"default threads, GOMP_SPINCOUNT {s}" for s in bench.SPINS] + ["1 thread"]
    assert list(res) == [f"{w}, {s}" for w in ("alone", "beside a 1-thread run") for s in spins]
    assert all(0 < v < 120 for v in res.values()), res


def test_bench_options_are_checked_with_one_line(capsys):
    for argv, msg in ((["--shape", "huge"], "--shape 'huge' is unknown"), (["--reps", "0"], "--reps 0 is invalid"),
                      (["--mem_loops", "4,,8"], "--mem_loops '4,,8' is invalid"), (["--warmup", "nan"], "expects int"),
                      (["--peak_flops", "inf"], "must be a finite number"), (["--device", "xpu"], "not supported")):
        assert bench.cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("bench.py: error:") and msg in err and "\n" not in err, err


@pytest.mark.slow
def test_bench_gpu_check_runs_end_to_end_dry_on_cpu(tmp_path):
    # the one-command GPU check, on CPU at tiny shapes: every stage runs and lands in the summary
    out = tmp_path / "check.json"
    assert bench.cli(["--gpu_check", "--dry", "--check_out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert {"tests", "bench", "lm_44m", "addition", "torchrun"} <= summary.keys()
    assert all(summary[k]["rc"] == 0 and summary[k]["tokens_per_s"] > 0 for k in ("lm_44m", "addition", "torchrun"))
    assert 0 < summary["bench"]["mfu"] < 1 and summary["bench"]["loop_vs_unrolled"] > 0
