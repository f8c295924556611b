"""Tests of sample.py: generation at any depth, early exit, the KV cache. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import contextlib
import io
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import sample
import train
from conftest import tiny
from looplm import ce_by_loop


def _sample_model(readout="norm", scale=False):
    """tiny() whose loops matter: larger embeddings and residual branches, so per-token
    confidence changes from loop to loop and a threshold splits the tokens over exit loops 1..4."""
    m = tiny(readout=readout)
    if scale:
        with torch.no_grad():
            m.wte.weight.mul_(4)
            for b in m.blocks:
                b.mlp.c_proj.weight.mul_(10)
                b.attn.c_proj.weight.mul_(10)
    return m


def test_sample_seed_and_cache_match_uncached_at_fixed_depth(one_thread):
    m = _sample_model()
    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(2))
    run = lambda K, seed, cache: sample.generate(m, prompt, 40, K, temperature=1.0, top_k=30, use_cache=cache,
                                                 generator=torch.Generator().manual_seed(seed))
    for K in (1, 3, 4, 7):  # 7: beyond n_loops; 5 + 40 tokens > block_size 32: the crop path runs too
        cached, stats = run(K, 3, True)
        assert cached.shape == (1, 45) and stats["mean_loops"] == K and stats["loops"].shape == (1, 40)
        assert torch.equal(cached, run(K, 3, False)[0]), K
        assert torch.equal(cached, run(K, 3, True)[0])
    assert not torch.equal(run(4, 3, True)[0], run(4, 4, True)[0])  # the seed matters


def test_sample_exit_thresholds_always_and_never_met(one_thread):
    m = _sample_model(scale=True)
    prompt = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(2))
    gen = lambda K, **kw: sample.generate(m, prompt, 12, K, generator=torch.Generator().manual_seed(0), **kw)
    one, four = gen(1)[0], gen(4)[0]
    assert not torch.equal(one, four)
    for exit, always, never in (("max_prob", 0.0, 1.01), ("margin", 0.0, 1.01), ("entropy", 1e9, -1.0)):
        y, s = gen(4, exit=exit, threshold=always)
        # exit at loop 1 everywhere = the depth-1 model (the norm readout is the same at every k)
        assert s["mean_loops"] == 1.0 and torch.equal(y, one), exit
        y, s = gen(4, exit=exit, threshold=never)
        assert s["mean_loops"] == 4.0 and torch.equal(y, four), exit


def _kv_rule_reference(m, seq, n_prefill, K, thr):
    """Uncached reference of the KV-copy rule, written from the weights (pre-norm SwiGLU blocks):
    every position t >= n_prefill recomputes the whole prefix; token s's keys/values in loop k are
    its own loop-min(k, e_s) ones, and its state stops at its exit loop e_s. Returns (logits, exits)."""
    C, H = m.config.n_embd, m.config.n_head
    exits, logits_out = [K] * n_prefill, []
    for t in range(n_prefill, seq.size(1)):
        T, ex = t + 1, torch.tensor(exits + [K])  # the last token runs every loop; it decides below
        x = m.wte(seq[:, :T]) + m.wpe(torch.arange(T))
        kv, per_loop = [], []
        for i in range(K):
            h, frozen = x, ex <= i  # tokens whose exit loop came before loop i+1
            kv.append([])
            for l, b in enumerate(m.blocks):
                q, k, v = b.attn.c_attn(b.ln_1(h)).split(C, dim=2)
                q, k, v = (z.view(1, T, H, C // H).transpose(1, 2).clone() for z in (q, k, v))
                for s in frozen.nonzero().flatten().tolist():
                    e = int(ex[s]) - 1
                    k[:, :, s], v[:, :, s] = kv[e][l][0][:, :, s], kv[e][l][1][:, :, s]
                kv[i].append((k, v))
                att = (q @ k.transpose(-2, -1) / math.sqrt(C // H)).masked_fill(torch.ones(T, T).triu(1).bool(), -1e9)
                h = h + b.attn.c_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, C))
                gate, up = b.mlp.c_fc(b.ln_2(h)).chunk(2, -1)
                h = h + b.mlp.c_proj(F.silu(gate) * up)
            x = torch.where(frozen[None, :, None], x, h)
            per_loop.append(m.readout(x[0, -1], i + 1, K))
        e = next((k for k in range(1, K) if per_loop[k - 1].softmax(-1).max() >= thr), K)
        exits.append(e)
        logits_out.append(per_loop[e - 1])
    return torch.stack(logits_out), exits[n_prefill:]


@torch.no_grad()
def test_kv_copy_rule_matches_explicit_reference_and_fills_deeper_slots(one_thread):
    m, K, P = _sample_model(readout="raw", scale=True), 4, 4
    seq = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(5))
    # a threshold halfway between two neighbouring scores near the median: tokens split over loops
    s = sample.exit_score(torch.stack([m.readout(h, k, K) for k, h in enumerate(m.loop_states(seq[:1], K), 1)])[:3], "max_prob")
    s = s.flatten().sort().values
    thr = (s[len(s) // 2] + s[len(s) // 2 + 1]).item() / 2
    cache = sample.prefill(m, seq[:1, :P], K)
    got = [sample.decode_token(m, seq[:1, t:t + 1], t, cache, K, "max_prob", thr) for t in range(P, 24)]
    logits, exits = torch.cat([g[0] for g in got]), [int(g[1]) for g in got]
    ref_logits, ref_exits = _kv_rule_reference(m, seq[:1], P, K, thr)
    assert len(set(exits)) >= 3, exits  # early (1), middle (2 or 3) and full-depth exits all occur
    assert exits == ref_exits
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # the deeper slots hold exactly the exit loop's keys/values, layer by layer; shallower ones differ
    for t, e in zip(range(P, 24), exits):
        for l in range(len(m.blocks)):
            for i in range(K):
                same = torch.equal(cache[i][l]["k"][:, :, t], cache[e - 1][l]["k"][:, :, t]) and \
                    torch.equal(cache[i][l]["v"][:, :, t], cache[e - 1][l]["v"][:, :, t])
                assert same == (i >= e - 1), (t, e, l, i)
    # a batch whose rows exit at different loops gives each row its own result (the masked copies)
    both, solo, mixed = sample.prefill(m, seq[:, :P], K), sample.prefill(m, seq[1:, :P], K), 0
    for t, (lg, e) in zip(range(P, 24), got):
        lg2, e2 = sample.decode_token(m, seq[:, t:t + 1], t, both, K, "max_prob", thr)
        lg1, e1 = sample.decode_token(m, seq[1:, t:t + 1], t, solo, K, "max_prob", thr)
        assert e2.tolist() == [int(e), int(e1)] and torch.allclose(lg2, torch.cat([lg, lg1]), atol=1e-5)
        mixed += int(e) != int(e1)
    assert mixed > 0
    assert all(torch.allclose(both[i][l][kv][1:], solo[i][l][kv], atol=1e-5)
               for i in range(K) for l in range(len(m.blocks)) for kv in ("k", "v"))


@torch.no_grad()
def test_adaptive_eval_and_calibrate(one_thread):
    m = _sample_model(readout="raw", scale=True)
    x = torch.randint(0, 61, (6, 32), generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 61, (6, 32), generator=torch.Generator().manual_seed(8))
    table = sample.loop_table(m, x, y, 4, "max_prob")
    fixed, never = sample.adaptive_eval(table, "max_prob", 1.01)
    ce4 = ce_by_loop(m, x, y, 4)[-1]
    assert abs(math.log(fixed["ppl"]) - ce4) < 1e-5 and never == fixed and fixed["loops"] == 4
    assert sample.adaptive_eval(table, "max_prob", 0.0)[1]["loops"] == 1
    thr, r = sample.calibrate(table, "max_prob", ratio=1.01)
    assert r["ppl"] <= 1.01 * fixed["ppl"] and r["loops"] < 4  # calibration found a cheaper policy
    assert sample.calibrate(table, "max_prob", ratio=1.0)[1]["ppl"] <= fixed["ppl"]
    # incremental decoding through the cache at fixed depth = the parallel teacher-forced pass
    dec = sample.decode_forced(m, x[:2], y[:2], 4)
    assert abs(math.log(dec["ppl"]) - ce_by_loop(m, x[:2], y[:2], 4)[-1]) < 1e-4 and dec["loops"] == 4
    assert sample.decode_forced(m, x[:2], y[:2], 4, "max_prob", thr)["loops"] < 4


@pytest.mark.slow
def test_sample_cli(tmp_path, one_thread):
    m = tiny(vocab_size=256)
    ckpt = {"model": m.state_dict(), "model_args": asdict(m.config), "iter_num": 0, "tokenizer": {"kind": "bytes"},
            "config": {"task": "lm", "dataset": "pydoc", "tokenizer": "bytes", "seed": 1}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--exit_threshold" in r.stdout and "[1.01]" in r.stdout
    r = subprocess.run([sys.executable, script, "--out_dir", str(tmp_path), "--start", "x" * 33],
                       capture_output=True, text=True)  # block_size is 32
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "block_size of 32" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert sample.main(["--out_dir", str(tmp_path / "missing")]) == 1
    assert sample.main(["--out_dir", str(tmp_path), "--exit", "margin"]) == 2  # no threshold
    # unreadable prompts and unsupported devices: one line each, naming the real cause
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    for argv, code, msg in ((["--start", f"FILE:{tmp_path / 'latin.txt'}"], 1, "is not UTF-8 text (byte 0xe9 at offset 3)"),
                            (["--start", f"FILE:{tmp_path}"], 1, "is a folder"),
                            (["--device", "mps"], 2, "--device mps is not supported"),
                            (["--eval_seqs", "3000000", "--calibrate"], 2, "--eval_seqs 3000000 is invalid")):
        r = subprocess.run([sys.executable, script, "--out_dir", str(tmp_path), *argv], capture_output=True, text=True)
        assert r.returncode == code and r.stderr.count("\n") == 1 and msg in r.stderr, (argv, r.stderr)
    with contextlib.redirect_stdout(io.StringIO()) as f:
        assert sample.main(["--out_dir", str(tmp_path), "--start", "ab", "--num_samples", "2", "--max_new_tokens", "8",
                            "--exit", "max_prob", "--exit_threshold", "0", "--device", "cpu"]) == 0
    lines = [l for l in f.getvalue().splitlines() if l.startswith("---------------")]
    assert len(lines) == 2 and all("8 tokens, 1.00 loops/token" in l for l in lines), f.getvalue()


@pytest.mark.slow
def test_sample_answers_addition_after_training(tmp_path, one_thread, capsys):
    # train.py on 2-digit addition (~500 steps, ~30 s on 2 cores), then sample.py prints sums in
    # reading order (the model writes the digits least significant first)
    d, here = str(tmp_path / "add"), os.path.dirname(os.path.abspath(__file__))
    assert train.main([os.path.join(here, "config/addition_cpu.py"), "--digits", "2", "--n_embd", "64",
                       "--mlp_hidden", "256", "--n_loops", "2", "--batch_size", "128", "--learning_rate", "3e-3",
                       "--min_lr", "3e-4", "--max_iters", "500", "--warmup_iters", "20", "--eval_loops", "2",
                       "--eval_problems", "80", "--eval_interval", "500", "--log_interval", "500",
                       "--num_threads", "1", "--out_dir", d]) == 0
    right = 0
    for a, b in ((12, 34), (99, 99), (57, 68), (10, 10), (45, 55), (23, 89), (70, 31), (66, 66), (18, 27), (91, 19)):
        capsys.readouterr()
        assert sample.main(["--out_dir", d, "--start", f"{a}+{b}=", "--device", "cpu"]) == 0
        line = capsys.readouterr().out.splitlines()[0]
        raw = re.search(r"model wrote '(.*)'", line)[1]
        assert line.startswith(f"{a}+{b}={raw.split('§')[0].strip()[::-1]}"), line  # display = raw reversed
        right += line.startswith(f"{a}+{b}={a + b} ")
    assert right >= 8, right
    # batch-1 cached greedy decoding agrees exactly with the teacher-forced parallel verdict
    ckpt = checkpoint.load_checkpoint(d)
    model = checkpoint.model_from_checkpoint(ckpt)
    x, y = sample.eval_data(ckpt, model, 80)
    fixed = sample.adaptive_eval(sample.loop_table(model, x, y, 2, "max_prob"), "max_prob", 2.0)[0]
    assert abs(sample.decode_forced(model, x, y, 2)["exact"] - fixed["exact"]) < 1e-6 and fixed["exact"] >= 0.8


@pytest.mark.parametrize("variant", [dict(loop_norm=True, init="pytorch"), dict(inject=True, block_norm="sandwich")])
def test_cached_generation_carries_the_state_as_loop_states_does(variant, one_thread):
    # the KV-cached path runs LoopLM.step loop by loop: the inter-loop norm and the injection must match
    m = tiny(**variant)
    x = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    cached, _ = sample.generate(m, x, 12, 4, temperature=0)
    assert torch.equal(cached, sample.generate(m, x, 12, 4, temperature=0, use_cache=False)[0])


def test_sample_uses_the_checkpoints_regex_vocabulary_and_names_unknown_prompt_words(tmp_path, one_thread, capsys):
    # --eval tokenizes the held-out text with the checkpoint's vocabulary, whatever the text's order or its new words
    # (a refit would give other ids, or ids past the model's rows); a prompt word it lacks is named, not silently <unk>
    import data
    lines = [f"w{i} w{i + 1} ." for i in range(100)] * 2
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines))
    meta = data.fit_regex_tokenizer("\n".join(lines))
    m = tiny(vocab_size=len(meta["vocab"]))
    ckpt = {"model": m.state_dict(), "model_args": asdict(m.config), "iter_num": 0, "tokenizer": meta,
            "config": {"task": "lm", "dataset": "text", "data_files": str(path), "tokenizer": "regex",
                       "cache_dir": str(tmp_path / "cache")}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    path.write_text("\n".join(lines[::-1] + ["brand new words ."] * 20))
    x, y = sample.eval_data(checkpoint.load_checkpoint(tmp_path), m, 4, str(tmp_path))
    text = path.read_text()
    val = data.get_tokenizer(meta).encode(text[int(0.9 * len(text)):])
    assert x[0].tolist() == val[:32] and y[0].tolist() == val[1:33]
    assert sample.main(["--out_dir", str(tmp_path), "--start", "w1 zzz w2 qq", "--num_samples", "1",
                        "--max_new_tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "note: 2 word(s) of the prompt are not in this checkpoint's vocabulary and become <unk>: 'zzz', 'qq'" in err
