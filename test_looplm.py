"""Tests of looplm.py: the model, every variant, the diagnostics. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import math

import pytest
import torch
import torch.nn.functional as F

from configurator import UsageError
from conftest import batch, tiny
from looplm import (SCALES, LoopLM, LoopLMConfig, ce_by_loop, loop1_probe, norm_stats, radial_fraction, relative_step, rms,
                    scale_probe, token_norms)


def test_one_loop_equals_plain_transformer():
    # K = 1 is an ordinary n_layer pre-norm GPT with the same weights, written out here independently
    m = tiny(n_loops=1, readout="norm")
    idx, _ = batch()
    x = m.wte(idx) + m.wpe(torch.arange(idx.size(1)))
    for b in m.blocks:
        a = b.attn
        q, k, v = a.c_attn(b.ln_1(x)).split(32, dim=2)
        q, k, v = (t.view(3, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(torch.ones(16, 16).triu(1).bool(), -1e9)
        x = x + a.c_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(3, 16, 32))
        gate, up = b.mlp.c_fc(b.ln_2(x)).chunk(2, -1)
        x = x + b.mlp.c_proj(F.silu(gate) * up)
    ref = m.lm_head(m.ln_f(x))
    logits, _ = m(idx, idx, n_loops=1)
    assert torch.allclose(logits, ref, atol=1e-5)


def test_param_count_independent_of_loops_and_matches_paper():
    assert tiny(n_loops=1).num_params() == tiny(n_loops=12).num_params()
    for d, h, L, paper in [(512, 8, 8, 43_935_234), (768, 12, 12, 128_823_554)]:
        with torch.device("meta"):
            m = LoopLM(LoopLMConfig(vocab_size=20000, block_size=256, n_layer=L, n_head=h, n_embd=d))
        assert abs(m.num_params() - paper) / paper < 0.005, (m.num_params(), paper)
    # Paper B's addition model (its public code): sandwich block, LayerNorm and Linear biases, d_ff 1024,
    # 15 tokens, 512 positions: 2,104,832 in the block + 7,680 + 262,144 + 1,024 = 2,375,680, exactly
    with torch.device("meta"):
        m = LoopLM(LoopLMConfig(vocab_size=15, block_size=512, n_layer=1, n_head=8, n_embd=512, mlp="gelu",
                                mlp_hidden=1024, block_norm="sandwich", norm="layernorm", bias=True))
    assert m.num_params() == 2_375_680


def test_layernorm_bias_option_and_inject_from_the_second_loop():
    m = tiny(norm="layernorm", bias=True, init="normal", inject=True, block_norm="sandwich")
    norms = [n for n in m.modules() if isinstance(n, torch.nn.LayerNorm)]
    assert len(norms) == 4 * 2 + 1 and all(n.bias is not None for n in norms)  # 4 per sandwich block, ln_f
    linears = [n for n in m.modules() if isinstance(n, torch.nn.Linear) and n is not m.lm_head]
    assert linears and all(n.bias is not None and not n.bias.any() for n in linears)  # "normal" init: biases 0
    idx, _ = batch()
    h0 = m.embed(idx)
    stack = lambda h: m.blocks[1](m.blocks[0](h))
    H1, H2 = m.loop_states(idx, 2)
    assert torch.allclose(H1, stack(h0), atol=1e-6)          # loop 1: F(H_0), not F(2·H_0)
    assert torch.allclose(H2, stack(H1 + h0), atol=1e-6)     # later loops: F(H_k + H_0)


def test_state_noise_is_a_random_start_in_training_only():
    # Huginn's random start: loop 1 sees H_0 + noise of 0.5x its RMS (not normalized by loop_norm); eval: from zero
    with pytest.raises(UsageError, match="needs --inject"):
        tiny(state_noise=1.0)
    m, plain = tiny(inject=True, state_noise=0.5, loop_norm=True), tiny(inject=True, loop_norm=True)
    idx, _ = batch()
    h0, stack = m.embed(idx), lambda h: m.blocks[1](m.blocks[0](h))
    assert torch.equal(m.loop_states(idx, 3)[-1], plain.loop_states(idx, 3)[-1])   # eval: deterministic, from zero
    m.train()
    torch.manual_seed(5)
    H1 = m.loop_states(idx, 1)[0]
    torch.manual_seed(5)
    noise = 0.5 * torch.randn_like(h0) * h0.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(H1, stack(noise + h0), atol=1e-5) and not torch.allclose(H1, stack(h0), atol=1e-3)


def test_runs_beyond_training_depth_and_state_count():
    m = tiny(n_loops=2)
    idx, _ = batch()
    assert len(m.loop_states(idx, n_loops=9)) == 9
    logits, loss = m(idx, n_loops=9)
    assert logits.shape == (3, 1, 61) and loss is None and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="n_loops"):
        m.loop_states(idx, n_loops=0)


@pytest.mark.parametrize("readout", ["norm", "raw", "final_norm"])
def test_per_loop_loss_is_mean_of_per_loop_ces(readout):
    m = tiny(readout=readout, per_loop_ce=True)
    idx, tgt = batch()
    _, loss = m(idx, tgt)
    ces = ce_by_loop(m, idx, tgt)
    assert len(ces) == 4 and abs(loss.item() - sum(ces) / 4) < 1e-5
    m.config.per_loop_ce = False
    _, terminal = m(idx, tgt)
    assert abs(terminal.item() - ces[-1]) < 1e-5


def test_norm_penalty_adds_exactly_lambda_mean_square():
    idx, tgt = batch()
    base, pen = tiny(per_loop_ce=True), tiny(per_loop_ce=True, norm_penalty=0.01)
    states = base.loop_states(idx)
    expect = 0.01 * sum(h.pow(2).mean() for h in states).item() / 4
    assert expect > 0
    diff = pen(idx, tgt)[1].item() - base(idx, tgt)[1].item()
    assert abs(diff - expect) < 1e-7 + 1e-4 * expect


def test_radial_fraction_norm_blind_raw_visible():
    # Lemma 1: a scale-invariant readout has zero radial gradient. In exact arithmetic RMSNorm's eps
    # is the only leak, ~eps/(rms²+eps), which dominates at a small rms (here at init, ~0.03); at a
    # large rms float32 round-off (~1e-8) does (eps=0 leaves it alone); raw sees the scale (~1e-1).
    idx, tgt = batch()
    norm, raw = tiny(readout="norm"), tiny(readout="raw")
    h = norm.loop_states(idx)[-1]
    bound = (1e-6 / (rms(h).pow(2) + 1e-6)).max().item()
    assert radial_fraction(norm, h, tgt, 4, 4) < bound
    norm.ln_f.eps = 0.0
    assert radial_fraction(norm, h, tgt, 4, 4) < 1e-4
    assert radial_fraction(raw, raw.loop_states(idx)[-1], tgt, 4, 4) > 1e-3


def test_final_norm_is_raw_before_last_loop():
    fn, raw, nm = tiny(readout="final_norm"), tiny(readout="raw"), tiny(readout="norm")
    h = torch.randn(2, 5, 32) * 7
    for k in (1, 2, 3):
        assert torch.equal(fn.readout(h, k, 4), raw.readout(h, k, 4))
    assert torch.equal(fn.readout(h, 4, 4), nm.readout(h, 4, 4))
    assert not torch.allclose(fn.readout(h, 3, 4), fn.readout(h, 4, 4))


def test_clamp_keeps_loop1_rms():
    m = tiny()
    with torch.no_grad():  # make the state grow so the clamp has something to do
        for b in m.blocks:
            b.mlp.c_proj.weight.mul_(30)
    idx, _ = batch()
    free, clamped = m.loop_states(idx, 8), m.loop_states(idx, 8, clamp=True)
    assert rms(free[-1]).mean() > 2 * rms(free[0]).mean()
    for h in clamped[1:]:
        assert torch.allclose(rms(h), rms(clamped[0]), rtol=1e-5)
    assert torch.equal(free[0], clamped[0])


def test_loop_norm_bounds_state_over_32_loops():
    idx, _ = batch()
    for loop_norm in (False, True):
        m = tiny(loop_norm=loop_norm)
        with torch.no_grad():
            for b in m.blocks:
                b.mlp.c_proj.weight.mul_(30)
        r = [rms(h).mean().item() for h in m.loop_states(idx, 32)]
        if loop_norm:
            assert max(r) < 1.5  # RMSNorm output has RMS ~1 (gain 1 at init)
        else:
            assert r[-1] > 5 * r[0]  # without it the scale grows loop after loop


@pytest.mark.parametrize("block_norm", ["pre", "post", "sandwich"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_every_variant_trains_a_step(block_norm, mlp):
    m = tiny(block_norm=block_norm, mlp=mlp, per_loop_ce=True, inject=True, norm_penalty=0.01).train()
    idx, tgt = batch()
    opt = m.configure_optimizers(0.01, 1e-2)
    l0 = m(idx, tgt)[1]
    l0.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    opt.step()
    assert m(idx, tgt)[1].item() < l0.item()


def test_math_attention_matches_sdpa_and_cache():
    m = tiny()
    idx, _ = batch()
    ref = m.loop_states(idx)[-1]
    with m.math_attention():
        assert torch.allclose(m.loop_states(idx)[-1], ref, atol=1e-5)
    # prefill in two chunks through a per-(loop, layer) cache equals the full pass
    caches = [[{} for _ in m.blocks] for _ in range(4)]
    outs = []
    for lo, hi in ((0, 10), (10, 16)):
        h0 = m.embed(idx[:, lo:hi], pos0=lo)
        h = h0
        for k in range(4):
            h = m.step(h, h0, caches[k])
        outs.append(h)
    assert torch.allclose(torch.cat(outs, 1), ref, atol=1e-5)


def test_truncated_backprop_and_checkpoint_gradients():
    idx, tgt = batch()
    m = tiny(per_loop_ce=True).train()
    m(idx, tgt)[1].backward()
    full = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(idx, tgt, checkpoint=True)[1].backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(full, m.parameters()))
    m.zero_grad()
    m(idx, tgt, grad_loops=1)[1].backward()
    assert not all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(full, m.parameters()))


def test_truncated_backprop_gives_only_the_last_loops_gradient():
    idx, _ = batch()
    m = tiny().train()
    assert [h.requires_grad for h in m.loop_states(idx, 6, grad_loops=2)] == [False, False, False, False, True, True]


def test_damped_loop_moves_a_fraction_alpha_of_the_plain_step():
    idx, _ = batch()
    plain, damped = tiny(), tiny(loop_damping=0.25)
    damped.load_state_dict(plain.state_dict())
    h1, h2, _ = plain.loop_states(idx, 3)
    d1, d2, d3 = damped.loop_states(idx, 3)
    assert torch.equal(h1, d1)  # loop 1 takes H_0 as it is: not damped
    assert torch.allclose(d2, h1 + 0.25 * (h2 - h1), atol=1e-6)
    assert torch.allclose(d3, d2 + 0.25 * (plain.step(d2, plain.embed(idx)) - d2), atol=1e-6)


def test_diagnostics():
    s = norm_stats(torch.tensor([3.0, 4.0, 5.0, 100.0]))
    assert s["max"] == 100 and s["min"] == 3 and s["median"] == 4 and abs(s["mean"] - 28) < 1e-9
    h = torch.randn(2, 3, 8)
    assert torch.allclose(token_norms(h), h.norm(dim=-1).flatten())
    assert abs(relative_step(h, h * 1.1) - 0.1) < 1e-6 and relative_step(h, h) == 0


def test_scale_probe_shows_lemma_2_for_pre_norm_and_not_through_loop_norm():
    """Pre-norm: scaling loop k's input by 4 divides its relative step by 4 (Lemma 2's 1/s). With loop_norm the
    next loop reads RMSNorm(s·H), so at a large s the update is bounded and the relative step tends to 1."""
    idx, _ = batch()
    for kw in ({}, {"init": "pytorch"}, {"inject": True}):
        m = tiny(**kw)
        steps = scale_probe(m, m.loop_states(idx, 2)[0], m.embed(idx))
        big = [r for s, r in zip(SCALES, steps) if s >= 1]
        assert all(abs(b / a - 0.25) < 0.03 for a, b in zip(big, big[1:])), (kw, steps)
    m = tiny(loop_norm=True)
    h = m.loop_states(idx, 2)[0]
    steps = scale_probe(m, h / rms(h), m.embed(idx))  # from RMS 1/64 to 64
    assert abs(steps[-1] - 1) < 0.05 and steps[0] > 10, steps


def test_loop1_probe_measures_what_loop_1_does_with_the_embedding():
    idx, tgt = batch()
    m = tiny(init="pytorch", readout="raw")  # Paper A's init: an N(0, 1) embedding
    for block in m.blocks:  # no update: H_1 = H_0
        torch.nn.init.zeros_(block.attn.c_proj.weight), torch.nn.init.zeros_(block.mlp.c_proj.weight)
    p = loop1_probe(m, idx, tgt)
    assert p["d1"] == 0 and p["ce1"] == p["ce0"]  # loop 1 did nothing
    assert abs(p["ce1_no_h0"] - math.log(61)) < 1e-5  # Δ_1 = 0 reads out as uniform logits
    assert abs(p["h0"] - math.sqrt(2 * 32)) < 2  # token + position embeddings, each N(0, 1) in 32 dimensions
    assert p["h0_reads_input"] > 0.9  # the tied head reads the embedding back as its own token (chance: 1/61)
    m = tiny(init="pytorch", readout="final_norm")  # a working loop, read out at loop 1 of K = 4: raw
    p, h0 = loop1_probe(m, idx, tgt), m.embed(idx)
    d1 = m.loop_states(idx, 1)[0] - h0
    assert abs(p["cos"] - F.cosine_similarity(d1, h0, dim=-1).mean().item()) < 1e-6
    ce = lambda logits: F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).item()
    assert abs(p["ce1"] - ce(m.lm_head(h0 + d1))) < 1e-5  # final_norm before loop K: the raw readout
    assert abs(p["ce1"] - ce(m.lm_head(m.ln_f(h0 + d1)))) > 1e-3  # not the normalized one (loop 1 of 1 would be)


@pytest.mark.parametrize("field,value,msg", [
    ("readout", "rms", "--readout 'rms' is invalid; choose one of norm, raw, final_norm"),
    ("block_norm", "middle", "block_norm"), ("mlp", "relu", "mlp"), ("n_loops", 0, "--n_loops 0 is invalid; it must be >= 1"),
    ("norm_penalty", -1.0, "norm_penalty"), ("norm_penalty", float("nan"), "must be a finite number"),
    ("dropout", 1.0, "--dropout 1.0 is invalid"), ("n_embd", 30, "divisible"), ("init", "xavier", "init"),
    ("n_layer", 2.5, "--n_layer expects int")])
def test_bad_config_raises_clear_error(field, value, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        LoopLMConfig(n_head=4, **{field: value})


@pytest.mark.parametrize("init", ["pytorch", "normal", "nanogpt"])
def test_init_gives_the_statistics_of_its_source(init):
    # Paper A's code: torch's defaults (Embedding N(0, 1), the tied head too; Linear U(±1/sqrt(fan_in)),
    # std 1/sqrt(3·fan_in)); Paper B's code: every weight N(0, 0.02); nanoGPT: residual projections / sqrt(2·L·K)
    m = tiny(n_embd=128, vocab_size=512, block_size=64, n_loops=8, init=init)
    fc, proj = m.blocks[0].mlp.c_fc.weight, m.blocks[0].mlp.c_proj.weight
    assert m.lm_head.weight is m.wte.weight
    if init == "pytorch":
        assert abs(m.wte.weight.std().item() - 1) < 0.02 and abs(m.wpe.weight.std().item() - 1) < 0.03
        assert fc.abs().max() <= 1 / math.sqrt(128) and abs(fc.std().item() * math.sqrt(3 * 128) - 1) < 0.02
        assert abs(proj.std().item() * math.sqrt(3 * 512) - 1) < 0.02  # fan_in = hidden 4·d
    else:
        assert abs(m.wte.weight.std().item() / 0.02 - 1) < 0.02 and abs(fc.std().item() / 0.02 - 1) < 0.02
        want = 0.02 / math.sqrt(2 * 2 * 8) if init == "nanogpt" else 0.02
        assert abs(proj.std().item() / want - 1) < 0.03
    assert all(torch.equal(n.weight, torch.ones(128)) for n in m.modules() if type(n).__name__ == "RMSNorm")


def test_loop_norm_sits_on_the_recurrent_path_only():
    # as Paper A's code: H_k is read out, penalized and measured before the inter-loop norm; the next
    # loop's input is the normalized state. So the returned states keep their scale.
    m = tiny(loop_norm=True, init="pytorch")
    with torch.no_grad():
        m.ln_loop.weight.fill_(1.0)
        idx, _ = batch()
        states = m.loop_states(idx, 4)
        r = [rms(h).mean().item() for h in states]
        assert all(abs(v - 1) > 0.05 for v in r) and max(r) > 1.3, r  # not unit-RMS: the readout sees the scale
        for k in range(1, 4):
            nxt = m.carry(states[k - 1])
            assert torch.allclose(rms(nxt), torch.ones_like(rms(nxt)), atol=1e-4)  # the next loop's input is
            assert torch.allclose(m.step(states[k - 1], m.embed(idx)), states[k], atol=1e-5)  # step carries it in
            assert torch.allclose(m.step(nxt, m.embed(idx), first=True), states[k], atol=1e-5)
        assert torch.allclose(states[0], m.step(m.embed(idx), m.embed(idx), first=True), atol=1e-6)  # loop 1: H_0 as is


def test_checkpointed_per_loop_ce_holds_no_vocabulary_sized_activation():
    # what autograd keeps for backward, by shape: without checkpointing one (B, T, V) log-softmax per
    # loop, K of them; with it none, at any depth. Same loss and gradients.
    m = tiny(per_loop_ce=True)
    idx, tgt = batch()
    V = m.config.vocab_size

    def kept(K, checkpoint):
        big = []
        pack = lambda t: big.append(t.dim() > 0 and t.shape[-1] == V and t.numel() >= idx.numel() * V) or t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = m.objective(m.loop_states(idx, K), tgt, checkpoint)
        m.zero_grad()
        loss.backward()
        return sum(big), loss.item(), m.blocks[0].attn.c_attn.weight.grad.clone()

    for K in (2, 6):
        n, loss, grad = kept(K, False)
        n_ck, loss_ck, grad_ck = kept(K, True)
        assert n >= K and n_ck == 0
        assert abs(loss - loss_ck) < 1e-6 and torch.allclose(grad, grad_ck, atol=1e-6)
