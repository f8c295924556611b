"""Tests of report.py: the evaluation, report.json, plots, --compare. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import contextlib
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import checkpoint
import data
import report
import stars
import train
from conftest import TRAIN_TINY, copy_run, file_bytes, run_train

TRAIN_PER_LOOP_FIELDS = {"k", "ce", "ppl", "norm_mean", "norm_median", "norm_p99", "norm_max", "norm_std", "norm_min",
                         "radial_fraction", "relative_step", "spectral_radius", "spectral_radius_off_state", "scale_probe",
                         "clamp_delta_ce", "tokens_per_s", "update"}


@pytest.mark.slow
def test_report_has_every_field_and_eval_only_rewrites_it(trained_run, train_data_args, tmp_path):
    out = copy_run(trained_run, tmp_path / "run")
    rep = json.load(open(os.path.join(out, "report.json")))
    assert {"config", "params", "per_loop", "loop1_probe"} <= set(rep)
    assert rep["params"] == checkpoint.model_from_checkpoint(checkpoint.load_checkpoint(out)).num_params()
    assert rep["config"]["n_embd"] == 32 and rep["config"]["n_loops"] == 2
    assert [r["k"] for r in rep["per_loop"]] == [1, 2]  # K_eval defaults to n_loops
    for r in rep["per_loop"]:
        assert set(r) == TRAIN_PER_LOOP_FIELDS
        for name, v in r.items():
            if name in ("relative_step", "update", "scale_probe", "spectral_radius", "spectral_radius_off_state") and r["k"] == 1:
                assert v is None
            elif name == "scale_probe":
                assert len(v) == len(rep["scale_probe_scales"]) and all(math.isfinite(x) and x > 0 for x in v)
            else:
                assert isinstance(v, (int, float)) and math.isfinite(v), (name, v)
        assert abs(r["ppl"] - math.exp(r["ce"])) < 1e-6 * r["ppl"] and r["norm_min"] <= r["norm_median"] <= r["norm_p99"] <= r["norm_max"]
    for png in ("per_loop.png", "norm_hist.png", "training.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000
    ckpt = file_bytes(os.path.join(out, "ckpt.pt"))
    os.remove(os.path.join(out, "per_loop.png"))
    assert run_train(TRAIN_TINY + train_data_args + ["--out_dir", out, "--eval_only", "--init_from", "resume", "--eval_loops", 3]) == 0
    rep2 = json.load(open(os.path.join(out, "report.json")))
    assert [r["k"] for r in rep2["per_loop"]] == [1, 2, 3]  # re-evaluated, here to depth 3
    assert all(abs(x["ce"] - y["ce"]) < 1e-6 for x, y in zip(rep["per_loop"], rep2["per_loop"]))  # same weights
    assert os.path.isfile(os.path.join(out, "per_loop.png")) and file_bytes(os.path.join(out, "ckpt.pt")) == ckpt


@pytest.mark.slow
def test_addition_teacher_forced_exact_match_equals_greedy_decoding(tmp_path):
    out = str(tmp_path / "add")
    argv = ["--task", "addition", "--digits", 2, "--n_embd", 64, "--n_head", 4, "--n_layer", 1, "--n_loops", 1,
            "--mlp", "gelu", "--block_norm", "sandwich", "--inject", "--dropout", 0, "--init", "nanogpt", "--batch_size", 128,
            "--max_iters", 120, "--learning_rate", 5e-3, "--eval_interval", 120, "--log_interval", 60,
            "--eval_loops", 3, "--eval_problems", 50, "--out_dir", out, "--device", "cpu", "--num_threads", 1]
    assert run_train(argv) == 0
    ckpt = checkpoint.load_checkpoint(out)
    model = checkpoint.model_from_checkpoint(ckpt)
    cfg = train.TrainConfig(**ckpt["config"])
    result = report.addition_eval(model, cfg, 3, "cpu")
    acc, public = result["accuracy"], result["accuracy_public"]
    rho, rho_answer = result["spectral_radius"], result["spectral_radius_answer"]  # loop 2's map (loop 1's is another)
    assert rho.keys() == rho_answer.keys() == {"2"} and 0 < rho_answer["2"] <= rho["2"]
    x, _, codes = data.addition_heldout(2, 50)
    tok = data.get_tokenizer({"kind": "addition"})
    verdicts = []
    for k in (1, 2, 3):  # real greedy decoding, token by token, until §
        seq = x[:, :6]  # "ab+cd="
        with torch.no_grad():
            for _ in range(5):  # " " + up to 3 digits + "§"
                logits = model.readout(model.loop_states(seq, k)[-1][:, -1], k, k)
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        right, lenient = [], []
        for row, code in zip(seq[:, 6:].tolist(), codes.tolist()):
            a, b = divmod(code, 100)
            text, answer = tok.decode(row), str(a + b)[::-1]
            right.append(text[: text.index("§") + 1] == f" {answer}§" if "§" in text else False)
            # Paper B's protocol: as many tokens as " " + answer, then only their digits, as an integer
            got = "".join(c for c in text[:1 + len(answer)] if c.isdigit())
            lenient.append(got != "" and int(got[::-1]) == a + b)
        verdicts += right
        assert round(acc[str(k)] * 50) == sum(right), (k, acc[str(k)], sum(right))
        if str(k) in public:  # measured at depths 1, 2, 4, 8, ...
            assert round(public[str(k)] * 50) == sum(lenient) >= sum(right), (k, public[str(k)], sum(lenient))
    assert 0 < sum(verdicts) < len(verdicts)  # a mix of right and wrong answers: the comparison means something


@pytest.mark.slow
def test_compare_prints_table_and_drift_exponent(trained_run, tmp_path, capsys):
    # the drift fit recovers a known power law; --compare turns reports into a table row and plots
    rows = [{"iter": s, "norm_K": 3.0 * s ** 0.5} for s in range(10, 201, 10)]
    assert abs(report.drift_exponent(rows) - 0.5) < 1e-9
    assert abs(report.drift_exponent([{"iter": s, "norm_K": 7.0} for s in range(10, 201, 10)])) < 1e-9
    capsys.readouterr()
    assert run_train(["--compare", trained_run, "--out_dir", tmp_path]) == 0
    out = capsys.readouterr().out.splitlines()
    rep = json.load(open(os.path.join(trained_run, "report.json")))["per_loop"]
    row = [l for l in out if l.startswith("| " + os.path.basename(trained_run))][0].split("|")
    assert float(row[6]) == round(rep[0]["ppl"], 3)  # PPL at K=1
    assert len(row) == len(out[0].split("|")) and os.path.isfile(tmp_path / "compare_norms.png")
    # two runs with the same folder name in different parents: two rows, named by enough of their path
    a, b = copy_run(trained_run, tmp_path / "x" / "run"), copy_run(trained_run, tmp_path / "y" / "run")
    assert run_train(["--compare", f"{a},{b}", "--out_dir", tmp_path]) == 0
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| x/run") or l.startswith("| y/run")]
    assert len(rows) == 2
    # a run evaluated past its trained depth (--eval_loops): the ‖H_K‖ column is still loop K's, not the deepest row's
    deep = copy_run(trained_run, tmp_path / "deep" / "run")
    rep = json.load(open(os.path.join(deep, "report.json")))
    K = rep["config"]["n_loops"]
    rep["per_loop"].append(dict(rep["per_loop"][-1], k=len(rep["per_loop"]) + 1, norm_mean=1e9))
    json.dump(rep, open(os.path.join(deep, "report.json"), "w"))
    assert run_train(["--compare", str(deep), "--out_dir", tmp_path]) == 0
    row = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| run |") and "‖" not in l][0].split("|")
    assert float(row[2]) == round(rep["per_loop"][K - 1]["norm_mean"], 1)


@pytest.mark.slow
def test_early_exit_curve_reads_final_norm_raw_before_the_trained_depth():
    # Paper A's early-exit curve: loop k's logits from the run at the trained depth K, so final_norm's
    # readout at k < K is the raw one; "ce_run_at_k" is the model run at depth k (normalized at loop k)
    from conftest import tiny
    fn, raw = tiny(readout="final_norm", n_loops=3), tiny(readout="raw", n_loops=3)  # same seed: same weights
    raw.load_state_dict(fn.state_dict())
    val = np.random.default_rng(0).integers(0, 61, 4000).astype(np.uint16)
    cfg = train.TrainConfig(batch_size=4, eval_iters=2, seed=0)
    rows, _ = report.evaluate_lm(fn, val, cfg, 5, "cpu", contextlib.nullcontext())
    raw_rows, _ = report.evaluate_lm(raw, val, cfg, 5, "cpu", contextlib.nullcontext())
    norm = tiny(readout="norm", n_loops=3)
    norm.load_state_dict(fn.state_dict())
    norm_rows, _ = report.evaluate_lm(norm, val, cfg, 5, "cpu", contextlib.nullcontext())
    for k in (1, 2):  # before K: raw; run at depth k: normalized at its last loop
        assert abs(rows[k - 1]["ce"] - raw_rows[k - 1]["ce"]) < 1e-6
        assert abs(rows[k - 1]["ce_run_at_k"] - norm_rows[k - 1]["ce"]) < 1e-6
    for k in (3, 4, 5):  # at and past K, both curves are the model run at depth k
        assert abs(rows[k - 1]["ce"] - norm_rows[k - 1]["ce"]) < 1e-6 and rows[k - 1]["ce_run_at_k"] == rows[k - 1]["ce"]
    assert "ce_run_at_k" not in raw_rows[0]


def test_evaluation_measures_each_loops_update_and_the_loop_1_probe_on_its_first_batch():
    from conftest import tiny
    from data import get_batch
    from looplm import token_norms
    m = tiny(readout="final_norm", n_loops=3)
    val = np.random.default_rng(0).integers(0, 61, 4000).astype(np.uint16)
    cfg = train.TrainConfig(batch_size=4, eval_iters=1, seed=0, task="lm")
    rows, _ = report.evaluate_lm(m, val, cfg, 3, "cpu", contextlib.nullcontext(), final=False)
    x, _ = get_batch(val, 4, 32, torch.Generator().manual_seed(999))  # evaluate_lm's one batch
    states = m.loop_states(x, 3)
    for k in (2, 3):  # ‖H_k − H_{k−1}‖ per token, averaged
        assert abs(rows[k - 1]["update"] - token_norms(states[k - 1] - states[k - 2]).mean().item()) < 1e-5
    _, rep = report.evaluate(m, cfg, val, "cpu", contextlib.nullcontext(), final=True)
    assert rep["loop1_probe"]["ce1"] == rep["per_loop"][0]["ce"]  # loop 1's readout on the same (only) batch


def test_depth_table_measures_the_rise_at_four_times_the_trained_depth(capsys):
    # the depth study's --compare: CE at 1, 2, 4, 8, 16 and the worst CE − CE_K at 4K loops and deeper;
    # the costly diagnostics: ρ at 2, 4, 8, 16, ...; the scale probe at 2 <= k <= 8, at 16, ... and at the last
    # depth; tokens/s at 1, 2, 4, 8, 16, ..., at the trained depth and the last
    from conftest import tiny
    m = tiny(n_loops=4)
    val = np.random.default_rng(0).integers(0, 61, 4000).astype(np.uint16)
    rows, _ = report.evaluate_lm(m, val, train.TrainConfig(batch_size=2, eval_iters=1, seed=0), 17, "cpu",
                                 contextlib.nullcontext())
    assert [r["k"] for r in rows if r["spectral_radius"] is not None] == [2, 4, 8, 16]
    assert [r["k"] for r in rows if r["spectral_radius_off_state"] is not None] == [2, 4, 8, 16]
    assert [r["k"] for r in rows if r["tokens_per_s"]] == [1, 2, 4, 8, 16, 17]
    assert [r["k"] for r in rows if r["scale_probe"]] == [2, 3, 4, 5, 6, 7, 8, 16, 17]
    mid, _ = report.evaluate_lm(m, val, train.TrainConfig(batch_size=2, eval_iters=1, seed=0), 17, "cpu",
                                contextlib.nullcontext(), final=False)  # an intermediate one: CE, norms, radial, clamp
    assert all(r["spectral_radius"] is None and r["scale_probe"] is None and r["tokens_per_s"] is None for r in mid)
    assert [r["ce"] for r in mid] == [r["ce"] for r in rows] and mid[3]["radial_fraction"] == rows[3]["radial_fraction"]
    rep = {"config": {"n_loops": 4}, "per_loop": rows}
    fig, _ = report.depth_table({"a": rep, "b": {"config": {"n_loops": 2}, "per_loop": rows}})
    out = capsys.readouterr().out.splitlines()
    a, b = (next(l for l in out if l.startswith(f"| {n} | ")).split(" | ") for n in "ab")
    assert [float(c) for c in a[3:8]] == [round(rows[k - 1]["ce"], 3) for k in (1, 2, 4, 8, 16)]
    assert float(a[8].rstrip(" |")) == round(rows[15]["ce"] - rows[3]["ce"], 3)                        # K 4: at 16
    assert float(b[8].rstrip(" |")) == round(max(rows[k - 1]["ce"] for k in (8, 16)) - rows[1]["ce"], 3)  # K 2: 8, 16
    assert a[2] == "n/a"  # no training settings in this report: its compute is unknown
    fig.clf()
    # a run's compute in loops a step, replayed from its settings: fixed 4 / DEQ-style 16 with gradient through 4 /
    # log-normal with gradient through 2 after a curriculum of 3 steps at 4 loops (every loop with gradient)
    cfg = lambda **kw: {**vars(train.TrainConfig(max_iters=10, seed=3, **kw)), "n_loops": 4}
    assert report.training_loops(cfg()) == "4.0 / 4.0"
    assert report.training_loops({**cfg(grad_loops=4), "n_loops": 16}) == "16.0 / 4.0"
    gen = lambda it: torch.Generator().manual_seed(train.stream_seed(3, it, "depth"))
    ts = [stars.sample_loops(gen(it), mu=2.0, sigma=0.7, loop_max=32)[0] for it in range(3, 10)]
    want = f"{(12 + sum(ts)) / 10:.1f} / {(12 + sum(min(t, 2) for t in ts)) / 10:.1f}"
    assert report.training_loops(cfg(loop_sampling="lognormal", loop_max=32, grad_loops=2, loop_start=3)) == want
    assert report.training_loops(cfg(epochs=1.0)) == "n/a"


def test_addition_eval_scores_each_answer_position_at_the_trained_depth():
    # an oracle that reads the answer off the input (the next token), except the units digit, which it always
    # says is 0: every position right but that one, which is right only where the units digit is 0
    class Oracle:
        config = dataclasses.make_dataclass("C", [("n_loops", int, 2)])()

        def loop_states(self, x, n):
            return [x] * n

        def readout(self, x, k, K):
            nxt = torch.cat([x[:, 1:], x[:, -1:]], 1).clone()
            nxt[:, 2 * 4 + 2] = 0  # the column that predicts the units digit
            return torch.nn.functional.one_hot(nxt, 15).float()
    cfg = dataclasses.make_dataclass("T", [("digits", int, 4), ("eval_problems", int, 300)])()
    out = report.addition_eval(Oracle(), cfg, 3, "cpu", final=False)
    _, y, codes = data.addition_heldout(4, 300)
    zero = ((codes // 10_000 + codes % 10_000) % 10 == 0).float().mean().item()
    pos = out["answer_positions"]
    assert pos["space"] == 1.0 and abs(pos["digit0"] - zero) < 1e-6 and 0.02 < zero < 0.3
    assert all(pos[f"digit{j}"] == 1.0 for j in range(1, 5)) and pos["digit2_carry"] == [1.0, 1.0]
    assert out["accuracy"] == {"1": zero, "2": zero, "3": zero} and "accuracy_public" not in out


@pytest.mark.parametrize("variant", [{}, {"inject": True, "loop_norm": True}, {"loop_damping": 0.5}])
def test_loop_rho_is_the_spectral_radius_of_the_whole_loop_map(variant):
    # the exact Jacobian of the loop map of two sequences, (T·d)² each: causal attention makes it block
    # lower-triangular over positions, so its ρ is the largest of the diagonal blocks' (loop_rho's)
    from conftest import batch, tiny
    model, T, d = tiny(**variant), 6, 32
    x = batch(B=2, T=T)[0]
    with torch.no_grad():
        h0 = model.embed(x)
        h = model.loop_states(x, 3)[-1]
    rho, off = report.loop_rho(model, h0, h, off_state=True)  # every position's block, both sequences at once
    assert rho.shape == off.shape == (2, T)
    for b in range(2):
        J = torch.autograd.functional.jacobian(stars.looplm_step_fn(model, h0[b:b + 1]), h[b:b + 1])
        J = J.reshape(T, d, T, d).double()
        assert all(J[s, :, t].abs().max() == 0 for t in range(T) for s in range(t))  # causal: block lower-triangular
        whole = torch.linalg.eigvals(J.reshape(T * d, T * d)).abs().max().item()
        assert rho[b].max().item() == pytest.approx(whole, rel=1e-5) and whole > 0.5
        for t in range(T):  # each position: its diagonal block of the whole map, and that block off the state
            u = h[b, t].double() / h[b, t].double().norm()
            P = torch.eye(d, dtype=torch.float64) - torch.outer(u, u)
            assert rho[b, t].item() == pytest.approx(torch.linalg.eigvals(J[t, :, t]).abs().max().item(), rel=1e-5)
            assert off[b, t].item() == pytest.approx(torch.linalg.eigvals(P @ J[t, :, t] @ P).abs().max().item(),
                                                     rel=1e-5)
        if not variant:  # pre-norm: the state's own direction is (nearly) an eigenvector with eigenvalue near 1
            assert all(torch.allclose(J[t, :, t] @ h[b, t].double(), h[b, t].double(), rtol=0.05,
                                      atol=0.05 * h[b, t].norm().item()) for t in range(T))
