"""Tests: each checks a numeric property. Run with `python -m pytest -q` (a few minutes on 2 CPU cores)."""
import math

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM, LoopLMConfig, fixed_point_residual, norm_stats, per_loop_ce, radial_fraction, rms, token_norms

torch.set_num_threads(1)  # tiny shapes: one thread is fastest, and immune to a busy machine


def tiny(**kw):
    args = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_embd=32, n_loop=4)
    args.update(kw)
    torch.manual_seed(0)
    return LoopLM(LoopLMConfig(**args)).eval()


def batch(B=3, T=16, V=61, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---------------------------------------------------------------- looplm.py: the model core
def test_one_loop_equals_plain_transformer():
    # K = 1 is an ordinary n_layer pre-norm GPT with the same weights, written out here independently
    m = tiny(n_loop=1, readout="norm")
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
    assert tiny(n_loop=1).num_params() == tiny(n_loop=12).num_params()
    for d, h, L, paper in [(512, 8, 8, 43_935_234), (768, 12, 12, 128_823_554)]:
        with torch.device("meta"):
            m = LoopLM(LoopLMConfig(vocab_size=20000, block_size=256, n_layer=L, n_head=h, n_embd=d))
        assert abs(m.num_params() - paper) / paper < 0.005, (m.num_params(), paper)


def test_runs_beyond_training_depth_and_state_count():
    m = tiny(n_loop=2)
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
    ces = per_loop_ce(m, idx, tgt)
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
    # Lemma 1: a scale-invariant readout has zero radial gradient. RMSNorm's eps is the only
    # leak, ~eps/(rms²+eps): with eps=0 the fraction is float round-off; with eps=1e-6 at init
    # (rms ~0.03) it stays under that bound; the raw readout sees the scale (fraction ~1e-1).
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


def test_diagnostics():
    s = norm_stats(torch.tensor([3.0, 4.0, 5.0, 100.0]))
    assert s["max"] == 100 and s["min"] == 3 and s["median"] == 4 and abs(s["mean"] - 28) < 1e-9
    h = torch.randn(2, 3, 8)
    assert torch.allclose(token_norms(h), h.norm(dim=-1).flatten())
    assert abs(fixed_point_residual(h, h * 1.1) - 0.1) < 1e-6 and fixed_point_residual(h, h) == 0


@pytest.mark.parametrize("field,value,msg", [
    ("readout", "rms", "readout='rms' is invalid; choose one of norm, raw, final_norm"),
    ("block_norm", "middle", "block_norm"), ("mlp", "relu", "mlp"), ("n_loop", 0, "n_loop"),
    ("norm_penalty", -1.0, "norm_penalty"), ("n_embd", 30, "divisible"), ("attn", "flash", "attn")])
def test_bad_config_raises_clear_error(field, value, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        LoopLMConfig(n_head=4, **{field: value})


# ---------------------------------------------------------------- stars.py (issue 3)
import stars


def _linear_step(eigs, seed=0, block=None):
    """h -> h @ Aᵀ with A = Q·diag(eigs)·Qᵀ (or Q·block·Qᵀ): a step whose Jacobian is A, known spectrum."""
    n = len(eigs) if block is None else block.size(0)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    A = Q @ (torch.diag(torch.tensor(eigs, dtype=torch.float64)) if block is None else block) @ Q.T
    return A, (lambda h: h @ A.T)


def test_stars_linear_step_known_spectrum():
    eigs = [-1.5] + torch.linspace(-1.0, 1.0, 15).tolist()  # dominant eigenvalue negative: ρ = |λ| = 1.5
    A, f = _linear_step(eigs)
    h = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert abs(stars.spectral_radius(f, h, generator=torch.Generator().manual_seed(2)) - 1.5) < 0.015
    # E‖Jv‖² = ‖A‖_F²/n for unit isotropic v: 4,000 draws in one batch
    H = torch.zeros(4000, 16, dtype=torch.float64)
    pen, rho = stars.jsrr_penalty(f, H, generator=torch.Generator().manual_seed(3))
    assert abs(pen.item() / (A.pow(2).sum().item() / 16) - 1) < 0.05
    assert rho.shape == (4000,) and torch.allclose(rho.pow(2).mean(), pen) and not rho.requires_grad
    # symmetric A: vᵀA = (Av)ᵀ, so the same v gives the same value in both modes
    pen2, rho2 = stars.jsrr_penalty(f, H, mode="vjp", generator=torch.Generator().manual_seed(3))
    assert torch.allclose(rho, rho2, rtol=1e-10) and torch.allclose(pen, pen2, rtol=1e-10)
    # a rotating (complex) dominant pair, |λ| = 1.2: the geometric-mean estimate still finds it
    c, s = math.cos(1.0), math.sin(1.0)
    R = 1.2 * torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    B, g = _linear_step(None, block=torch.block_diag(R, torch.diag(torch.linspace(-0.9, 0.9, 14, dtype=torch.float64))))
    assert abs(torch.linalg.eigvals(B).abs().max().item() - 1.2) < 1e-9
    assert abs(stars.spectral_radius(g, h, iters=40, generator=torch.Generator().manual_seed(2)) - 1.2) < 0.012


@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_stars_penalty_grad_reaches_every_block_parameter(mode):
    m = tiny(block_norm="sandwich", inject=True, attn="math")
    idx, _ = batch()
    h0 = m.embed(idx)
    h = m.loop_states(idx, 3)[-1]
    pen, rho = stars.jsrr_penalty(stars.looplm_step_fn(m, h0), h, mode=mode, generator=torch.Generator().manual_seed(0))
    pen.backward()
    assert pen.item() > 0 and rho.shape == (3,)
    for name, p in m.blocks.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert m.wte.weight.grad is None and m.wpe.weight.grad is None  # the input state and h0 are detached


def test_stars_penalty_alone_drives_rho_below_one():
    torch.manual_seed(0)
    m = LoopLM(LoopLMConfig(vocab_size=61, block_size=32, n_layer=1, n_head=4, n_embd=32, block_norm="sandwich"))
    with torch.no_grad():  # scale the block's matrices up: an unstable loop, ρ > 1
        for p in m.blocks.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    idx, _ = batch(B=4, T=16)

    def states():
        with torch.no_grad():
            return m.embed(idx), m.loop_states(idx, 4)[-1]

    def rho():
        h0, h = states()
        return stars.spectral_radius(stars.looplm_step_fn(m, h0), h, generator=torch.Generator().manual_seed(3))

    rho0 = rho()
    assert rho0 > 1.1
    opt = torch.optim.Adam(m.blocks.parameters(), lr=3e-3)
    for it in range(40):  # ρ ≈ 1.21 -> ≈ 0.06 in 30 Adam steps
        h0, h = states()
        pen, _ = stars.jsrr_penalty(stars.looplm_step_fn(m, h0), h, generator=stars.step_generator(0, it))
        opt.zero_grad()
        pen.backward()
        opt.step()
    assert rho() < 0.5, (rho0, rho())


def test_stars_sample_loops_deterministic_and_exact_mean():
    mu, sigma, t_max = 2.0, 0.7, 100
    draw = lambda seed, n, **kw: [stars.sample_loops(stars.step_generator(seed, i), **kw) for i in range(n)]
    assert draw(7, 50) == draw(7, 50) and draw(7, 50) != draw(8, 50)
    ts = draw(0, 10_000, mu=mu, sigma=sigma, t_max=t_max)
    assert min(ts) >= 1 and max(ts) <= t_max and all(isinstance(t, int) for t in ts)
    # exact mean of clip(round(LogNormal(μ, σ)), 1, t_max) from the lognormal CDF at the rounding boundaries
    cdf = lambda x: 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))
    edges = [0.0] + [k + 0.5 for k in range(1, t_max)] + [math.inf]  # t = k  <=>  edges[k-1] <= X < edges[k]
    F_ = [0.0] + [cdf(e) for e in edges[1:-1]] + [1.0]
    exact = sum(k * (F_[k] - F_[k - 1]) for k in range(1, t_max + 1))
    assert abs(sum(ts) / len(ts) / exact - 1) < 0.02, (sum(ts) / len(ts), exact)
    assert stars.sample_loops(None, kind="fixed", t_max=4) == 4
    # Huginn: (no_grad, grad) with grad = min(t, b), no_grad = max(t - b, 0), E[t] = mean_loops + 1
    splits = draw(1, 2000, kind="poisson_lognormal", sigma=0.5, mean_loops=32, backprop=8, t_max=1000)
    for ng, gr in splits:
        assert 1 <= gr <= 8 and ng >= 0 and (ng == 0 or gr == 8)
    assert abs(sum(ng + gr for ng, gr in splits) / len(splits) / 33 - 1) < 0.05
    assert max(sum(s) for s in draw(2, 500, kind="poisson_lognormal", mean_loops=32, t_max=40)) == 40


@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_stars_penalty_runs_on_sdpa_model(mode):
    # the fused SDPA path has no forward-mode AD / double backward; looplm_step_fn switches to math attention
    fast, ref = tiny(attn="sdpa"), tiny(attn="math")  # same seed, same weights
    idx, _ = batch()
    out = []
    for m in (fast, ref):
        with torch.no_grad():
            h0, h = m.embed(idx), m.loop_states(idx, 3)[-1]
        pen, _ = stars.jsrr_penalty(stars.looplm_step_fn(m, h0), h, mode=mode, generator=torch.Generator().manual_seed(0))
        pen.backward()
        out.append((pen.item(), m.blocks[0].attn.c_attn.weight.grad.clone()))
    assert abs(out[0][0] - out[1][0]) < 1e-5 * out[1][0] and torch.allclose(out[0][1], out[1][1], rtol=1e-4, atol=1e-7)
    assert out[0][1].abs().sum() > 0 and fast.blocks[0].attn.math is False  # SDPA restored for the normal forward


def test_stars_jvp_vjp_agree_in_expectation_on_looplm():
    # non-symmetric J: the same v gives different ‖Jv‖ and ‖vᵀJ‖, but both have mean ‖J‖_F²/n.
    # Weights scaled x8 so that J is far from the identity; the exact J (n = 8·32 = 256) by jacfwd.
    m = tiny(attn="math")
    with torch.no_grad():
        for p in m.blocks.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
        idx, _ = batch(B=1, T=8, seed=0)
        h0, h = m.embed(idx), m.loop_states(idx, 3)[-1]
        J = torch.func.jacfwd(stars.looplm_step_fn(m, h0))(h).reshape(256, 256).double()
    fro = J.pow(2).sum().item() / 256
    f = stars.looplm_step_fn(m, h0.expand(48, -1, -1))
    h = h.expand(48, -1, -1)  # 48 draws at the same state, one batch
    pj, rj = stars.jsrr_penalty(f, h, mode="jvp", generator=torch.Generator().manual_seed(0))
    pv, _ = stars.jsrr_penalty(f, h, mode="vjp", generator=torch.Generator().manual_seed(1))
    assert abs(pj.item() / fro - 1) < 0.03 and abs(pv.item() / fro - 1) < 0.03, (pj.item(), pv.item(), fro)
    assert abs(fro - 1) > 0.1  # not the identity's value
    _, rv_same = stars.jsrr_penalty(f, h, mode="vjp", generator=torch.Generator().manual_seed(0))
    assert ((rj - rv_same).abs() / rj).max() > 0.01  # J really is non-symmetric: the test is not trivial
    # power iteration on the real model vs the exact ρ(J) = max|eig(J)| (here |λ₂/λ₁| ≈ 0.90)
    rho = torch.linalg.eigvals(J).abs().max().item()
    est = stars.spectral_radius(f, h[:4], iters=50, generator=torch.Generator().manual_seed(0))
    assert abs(est / rho - 1) < 0.01, (est, rho)


def test_stars_objective_lambda_and_bad_arguments():
    assert stars.stars_lambda(1999, 0.1, 2000) == 0.0 and stars.stars_lambda(2000, 0.1, 2000) == 0.1
    assert abs(stars.stars_objective(torch.tensor(2.0), torch.tensor(4.0), 0.1).item() - 2.2) < 1e-6
    with pytest.raises(ValueError, match="choose one of jvp, vjp"):
        stars.jsrr_penalty(lambda h: h, torch.zeros(2, 3), mode="fwd")
    with pytest.raises(ValueError, match="choose one of fixed, lognormal, poisson_lognormal"):
        stars.sample_loops(None, kind="normal")

# ---------------------------------------------------------------- train.py (issues 4, 5, 8)

# ---------------------------------------------------------------- sample.py (issue 6)
@pytest.fixture
def one_thread():
    # token-by-token decoding is many tiny ops: two threads on two shared cores spin-wait and run
    # 50x slower than one, so these tests run single-threaded
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    import sample
    m = _sample_model()
    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(2))
    run = lambda K, seed, cache: sample.generate(m, prompt, 40, K, temperature=1.0, top_k=30, use_cache=cache,
                                                 generator=torch.Generator().manual_seed(seed))
    for K in (1, 3, 4, 7):  # 7: beyond n_loop; 5 + 40 tokens > block_size 32: the crop path runs too
        cached, stats = run(K, 3, True)
        assert cached.shape == (1, 45) and stats["mean_loops"] == K and stats["loops"].shape == (1, 40)
        assert torch.equal(cached, run(K, 3, False)[0]), K
        assert torch.equal(cached, run(K, 3, True)[0])
    assert not torch.equal(run(4, 3, True)[0], run(4, 4, True)[0])  # the seed matters


def test_sample_exit_thresholds_always_and_never_met(one_thread):
    import sample
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
    import sample
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
    import sample
    m = _sample_model(readout="raw", scale=True)
    x = torch.randint(0, 61, (6, 32), generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 61, (6, 32), generator=torch.Generator().manual_seed(8))
    table = sample.loop_table(m, x, y, 4, "max_prob")
    fixed, never = sample.adaptive_eval(table, "max_prob", 1.01)
    ce4 = per_loop_ce(m, x, y, 4)[-1]
    assert abs(math.log(fixed["ppl"]) - ce4) < 1e-5 and never == fixed and fixed["loops"] == 4
    assert sample.adaptive_eval(table, "max_prob", 0.0)[1]["loops"] == 1
    thr, r = sample.calibrate(table, "max_prob", ratio=1.01)
    assert r["ppl"] <= 1.01 * fixed["ppl"] and r["loops"] < 4  # calibration found a cheaper policy
    assert sample.calibrate(table, "max_prob", ratio=1.0)[1]["ppl"] <= fixed["ppl"]
    # incremental decoding through the cache at fixed depth = the parallel teacher-forced pass
    dec = sample.decode_forced(m, x[:2], y[:2], 4)
    assert abs(math.log(dec["ppl"]) - per_loop_ce(m, x[:2], y[:2], 4)[-1]) < 1e-4 and dec["loops"] == 4
    assert sample.decode_forced(m, x[:2], y[:2], 4, "max_prob", thr)["loops"] < 4


def test_sample_cli(tmp_path, one_thread):
    import subprocess
    import sys
    from dataclasses import asdict
    import sample
    m = tiny(vocab_size=256)
    ckpt = {"model": m.state_dict(), "model_args": asdict(m.config), "iter_num": 0, "tokenizer": {"kind": "bytes"},
            "config": {"task": "lm", "dataset": "pydoc", "tokenizer": "bytes", "seed": 1}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    r = subprocess.run([sys.executable, "sample.py", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--exit_threshold" in r.stdout and "[1.01]" in r.stdout
    r = subprocess.run([sys.executable, "sample.py", "--out_dir", str(tmp_path), "--start", "x" * 33],
                       capture_output=True, text=True)  # block_size is 32
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "block_size of 32" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert sample.main(["--out_dir", str(tmp_path / "missing")]) == 1
    assert sample.main(["--out_dir", str(tmp_path), "--exit", "margin"]) == 2  # no threshold
    out = tmp_path / "out.txt"
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()) as f:
        assert sample.main(["--out_dir", str(tmp_path), "--start", "ab", "--num_samples", "2", "--max_new_tokens", "8",
                            "--exit", "max_prob", "--exit_threshold", "0", "--device", "cpu"]) == 0
    lines = [l for l in f.getvalue().splitlines() if l.startswith("---------------")]
    assert len(lines) == 2 and all("8 tokens, 1.00 loops/token" in l for l in lines), f.getvalue()

# ---------------------------------------------------------------- bench.py (issue 9)
