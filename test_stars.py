"""Tests of stars.py: the Jacobian penalty, loop sampling. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import math

import pytest
import torch

import report
import stars
from conftest import batch, tiny
from looplm import LoopLM, LoopLMConfig




def _linear_step(eigs, seed=0, block=None):
    """h -> h @ Aᵀ with A = Q·diag(eigs)·Qᵀ (or Q·block·Qᵀ): a step whose Jacobian is A, known spectrum."""
    n = len(eigs) if block is None else block.size(0)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    A = Q @ (torch.diag(torch.tensor(eigs, dtype=torch.float64)) if block is None else block) @ Q.T
    return A, (lambda h: h @ A.T)


def test_stars_linear_step_known_spectrum():
    eigs = [-1.5] + torch.linspace(-1.0, 1.0, 15).tolist()  # dominant eigenvalue negative: ρ = |λ| = 1.5
    A, f = _linear_step(eigs)
    # E‖Jv‖² = ‖A‖_F²/n for unit isotropic v: 4,000 draws in one batch
    H = torch.zeros(4000, 16, dtype=torch.float64)
    pen, jv_norm = stars.jsrr_penalty(f, H, mode="jvp", generator=torch.Generator().manual_seed(3))
    assert abs(pen.item() / (A.pow(2).sum().item() / 16) - 1) < 0.05
    assert jv_norm.shape == (4000,) and torch.allclose(jv_norm.pow(2).mean(), pen) and not jv_norm.requires_grad
    # symmetric A: vᵀA = (Av)ᵀ, so the same v gives the same value in both modes
    pen2, jv_norm2 = stars.jsrr_penalty(f, H, mode="vjp", generator=torch.Generator().manual_seed(3))
    assert torch.allclose(jv_norm, jv_norm2, rtol=1e-10) and torch.allclose(pen, pen2, rtol=1e-10)
    assert pen.item() < 1.5 ** 2 / 2  # the mean squared singular value, far below ρ² = 2.25


def test_stars_penalty_with_a_mask_sees_only_those_positions():
    # a causal map over 3 positions of width 4: J is block lower-triangular. Position 0 (say, padding) has ρ 1.5;
    # positions 1 and 2 (the answer) a rotating complex pair of modulus 0.9 and a real 0.7.
    g = torch.Generator().manual_seed(0)
    c, s = math.cos(0.7), math.sin(0.7)
    blocks = [torch.diag(torch.tensor([1.5, 0.2, 0.1, -0.3], dtype=torch.float64)),
              torch.block_diag(0.9 * torch.tensor([[c, -s], [s, c]], dtype=torch.float64),
                               torch.diag(torch.tensor([0.5, -0.4], dtype=torch.float64))),
              torch.diag(torch.tensor([0.7, -0.6, 0.3, 0.0], dtype=torch.float64))]
    J = torch.zeros(12, 12, dtype=torch.float64)
    for i in range(3):
        for j in range(i + 1):
            J[4 * i:4 * i + 4, 4 * j:4 * j + 4] = blocks[i] if i == j else 0.8 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    assert abs(torch.linalg.eigvals(J).abs().max().item() - 1.5) < 1e-9
    f = lambda h: (h.flatten(1) @ J.T).view_as(h)
    h = torch.zeros(5, 3, 4, dtype=torch.float64)
    mask = torch.tensor([False, True, True]).expand(5, 3)
    # the penalty with that mask: v and Jv live at the masked positions only
    pen, _ = stars.jsrr_penalty(f, h, generator=g, mask=mask)
    Jm = J[4:, 4:]
    exact = Jm.pow(2).sum().item() / 8  # E‖P J P v‖² for unit isotropic v on the 8 masked coordinates
    many = stars.jsrr_penalty(f, torch.zeros(4000, 3, 4, dtype=torch.float64), generator=g,
                              mask=torch.tensor([False, True, True]).expand(4000, 3))[0].item()
    assert abs(many / exact - 1) < 0.05 and pen.item() > 0


@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_stars_penalty_power_iterations_aim_at_the_dominant_eigenvalue(mode):
    # symmetric A with eigenvalues 0.95 and the rest spread in [-0.5, 0.5]: one iteration gives the mean
    # squared eigenvalue, more iterations tend to the dominant one squared
    eigs = [0.95] + torch.linspace(-0.5, 0.5, 15).tolist()
    A, f = _linear_step(eigs)
    H = torch.zeros(500, 16, dtype=torch.float64)
    one = stars.jsrr_penalty(f, H, mode=mode, generator=torch.Generator().manual_seed(1))[0].item()
    many = stars.jsrr_penalty(f, H, mode=mode, generator=torch.Generator().manual_seed(1), iters=30)[0].item()
    assert abs(one - sum(e * e for e in eigs) / 16) < 0.02
    assert abs(many - 0.95 ** 2) < 0.01, many


@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_stars_penalty_grad_reaches_every_block_parameter(mode):
    m = tiny(block_norm="sandwich", inject=True)
    idx, _ = batch()
    h0 = m.embed(idx)
    h = m.loop_states(idx, 3)[-1]
    pen, jv_norm = stars.jsrr_penalty(stars.looplm_step_fn(m, h0), h, mode=mode, generator=torch.Generator().manual_seed(0))
    pen.backward()
    assert pen.item() > 0 and jv_norm.shape == (3,)
    for name, p in m.blocks.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert m.wte.weight.grad is None and m.wpe.weight.grad is None  # the input state and h0 are detached


def test_stars_penalty_alone_drives_rho_below_one():
    torch.manual_seed(0)
    m = LoopLM(LoopLMConfig(vocab_size=61, block_size=32, n_layer=1, n_head=4, n_embd=32, block_norm="sandwich",
                            dropout=0.0, init="nanogpt")).eval()  # (dropout 0: no difference to training)
    with torch.no_grad():  # scale the block's matrices up: an unstable loop, ρ > 1
        for p in m.blocks.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    idx, _ = batch(B=4, T=16)

    def states():
        with torch.no_grad():
            return m.embed(idx), m.loop_states(idx, 4)[-1]

    def rho():  # exactly, from every position's block (report.loop_rho), the largest over the batch
        h0, h = states()
        return report.loop_rho(m, h0, h)[0].max().item()

    rho0 = rho()
    assert rho0 > 1.1
    opt = torch.optim.Adam(m.blocks.parameters(), lr=3e-3)
    for it in range(40):  # the public code's VJP penalty drives ρ from above 1.1 to below 0.5
        h0, h = states()
        pen, _ = stars.jsrr_penalty(stars.looplm_step_fn(m, h0), h, generator=torch.Generator().manual_seed(it))
        opt.zero_grad()
        pen.backward()
        opt.step()
    assert rho() < 0.5, (rho0, rho())


def test_stars_sample_loops_deterministic_and_exact_mean():
    mu, sigma, loop_max = 2.0, 0.7, 100
    draw = lambda seed, n, **kw: [stars.sample_loops(torch.Generator().manual_seed(seed * 100_003 + i), **kw)
                                  for i in range(n)]
    assert draw(7, 50) == draw(7, 50) and draw(7, 50) != draw(8, 50)
    ts = [t for t, b in draw(0, 10_000, mu=mu, sigma=sigma, loop_max=loop_max)]
    assert min(ts) >= 1 and max(ts) <= loop_max and all(isinstance(t, int) for t in ts)
    # exact mean of clip(round(LogNormal(μ, σ)), 1, loop_max) from the lognormal CDF at the rounding boundaries
    cdf = lambda x: 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))
    edges = [0.0] + [k + 0.5 for k in range(1, loop_max)] + [math.inf]  # t = k  <=>  edges[k-1] <= X < edges[k]
    F_ = [0.0] + [cdf(e) for e in edges[1:-1]] + [1.0]
    exact = sum(k * (F_[k] - F_[k - 1]) for k in range(1, loop_max + 1))
    assert abs(sum(ts) / len(ts) / exact - 1) < 0.02, (sum(ts) / len(ts), exact)
    assert stars.sample_loops(None, kind="fixed", loop_max=4) == (4, None)
    assert stars.sample_loops(None, kind="fixed", loop_max=16, grad_loops=4) == (16, 4)  # DEQ-style target
    assert all(b is None for _, b in draw(0, 10, mu=mu, sigma=sigma))
    # Paper B's lognormal with truncated backprop: the same depths, gradient through the last b = min(t, 4)
    assert [t for t, _ in draw(0, 200, mu=mu, sigma=sigma, grad_loops=4)] == ts[:200]
    assert all(b == min(t, 4) for t, b in draw(0, 200, mu=mu, sigma=sigma, grad_loops=4))
    # Huginn: (t, b) with gradient through the last b = min(t, grad_loops) loops, E[t] = loop_mean + 1
    splits = draw(1, 2000, kind="poisson_lognormal", sigma=0.5, loop_mean=32, grad_loops=8, loop_max=1000)
    for t, b in splits:
        assert 1 <= b <= 8 and t >= b and (t == b or b == 8)
    assert abs(sum(t for t, _ in splits) / len(splits) / 33 - 1) < 0.05
    assert max(t for t, _ in draw(2, 500, kind="poisson_lognormal", loop_mean=32, loop_max=40)) == 40


@pytest.mark.parametrize("mode", ["jvp", "vjp"])
def test_stars_penalty_runs_on_sdpa_model(mode):
    # the fused SDPA path has no forward-mode AD / double backward; looplm_step_fn switches to math attention
    fast, ref = tiny(), tiny()  # same seed, same weights; ref runs with explicit attention throughout
    for mod in ref.modules():
        if hasattr(mod, "math"):
            mod.math = True
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
    m = tiny()
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


def test_stars_objective_lambda_and_bad_arguments():
    assert stars.lambda_at(1999, 0.1, 2000) == 0.0 and stars.lambda_at(2000, 0.1, 2000) == 0.1
    assert abs(stars.stars_objective(torch.tensor(2.0), torch.tensor(4.0), 0.1).item() - 2.2) < 1e-6
    with pytest.raises(ValueError, match="choose one of jvp, vjp"):
        stars.jsrr_penalty(lambda h: h, torch.zeros(2, 3), mode="fwd")
    with pytest.raises(ValueError, match="choose one of fixed, lognormal, poisson_lognormal"):
        stars.sample_loops(None, kind="normal")


def test_stars_training_loss_options_put_the_penalty_where_asked(monkeypatch):
    # at the last state, detached; supervised: the mask of the targets; iters: passed through
    m = tiny(block_norm="sandwich")
    idx, tgt = batch()
    tgt[:, :5] = -1
    seen, real = {}, stars.jsrr_penalty
    monkeypatch.setattr(stars, "jsrr_penalty", lambda f, h, **kw: seen.update(h=h, **kw) or real(f, h, **kw))
    pen = stars.Penalty(0.1, supervised=True, iters=2, generator=torch.Generator().manual_seed(0))
    loss, states, jv = stars.training_loss(m, idx, tgt, 3, penalty=pen)
    assert torch.equal(seen["h"], states[-1].detach()) and not seen["h"].requires_grad
    assert torch.equal(seen["mask"], tgt != -1) and seen["iters"] == 2 and len(states) == 3
    loss.backward()
    assert all(p.grad is not None for p in m.blocks.parameters())
    stars.training_loss(m, idx, tgt, 3, penalty=stars.Penalty(0.1, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(seen["h"], states[-1].detach()) and seen["mask"] is None and seen["iters"] == 1
