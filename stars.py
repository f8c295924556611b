"""
stars.py: Paper B's STARS in one screen. It works on any looped model's step function.
Paper B: "Stabilizing Recurrent Dynamics for Test-Time Scalable Latent Reasoning in Looped Language
Models" (Yang et al., ICML 2026, arXiv 2605.26733; code: github.com/njuyxw/STARS).

A looped model is a dynamical system h_{t+1} = Φ(h_t), where Φ is one pass of the shared
block. A fixed point of the loop is stable when the spectral radius of J = ∂Φ/∂h is below 1,
and then extra loops at test time refine the answer instead of making it diverge. STARS
aims at ρ(J) < 1 with a penalty in the training loss, which Paper B writes

    L = (1 − λ)·L_task + λ·‖Jv‖²        v ~ N(0, I) normalized, at the last loop's state

(The default mode, "vjp", computes ‖vᵀJ‖², as the public code does: the same in expectation; see
jsrr_penalty. This file writes ‖Jv‖ for either.)
Here ‖Jv‖ is one step of power iteration from a random direction, which the paper writes as
ρ(J) ≈ ‖Jv‖. What it measures is E‖Jv‖² = ‖J‖_F²/n, the mean squared singular value of J
(n = T·C per sample): pushing it down pulls the spectrum down on average, but it neither bounds
nor equals ρ, which can sit near 1 while ‖Jv‖ is small (report.loop_rho measures ρ itself).
It costs a pass through ONE loop step, not the whole loop (the default VJP: forward, backward and, for
the weights' gradient, a double backward through that step). The number of loops t is sampled per training
step (sample_loops), so the penalty meets the state at many depths.

To use it on another model you need a function step(h) -> next h whose parameters require
grad. Nothing else in the project is needed:

    pen, jv_norm = jsrr_penalty(step, h_last)
    loss = stars_objective(task_loss, pen, lambda_at(it, 0.1, 2000))

(stars.training_loss does this for LoopLM, its options in a stars.Penalty.)

Attention caveat: the fused SDPA kernels have no forward-mode AD and no double backward.
The step must use explicit softmax(QKᵀ/√d)V attention or the math backend. For LoopLM,
looplm_step_fn takes care of this.
"""
import math
from dataclasses import dataclass

import torch

MODES = ("jvp", "vjp")
KINDS = ("fixed", "lognormal", "poisson_lognormal")


def _unit_normal(h, generator, mask=None):
    """v ~ N(0, I) with the shape of h (zero outside mask), scaled so each sample (dim 0) has
    ‖v‖ = 1 over its other dims. (The public addition code normalizes once over the whole tensor.
    Per sample, every sequence's penalty has the same scale whatever the batch size.)"""
    device = generator.device if generator is not None else h.device
    v = torch.randn(h.shape, generator=generator, device=device, dtype=h.dtype).to(h.device, non_blocking=True)
    if mask is not None:
        v = v * mask
    return v / v.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *[1] * (h.dim() - 1))


def jsrr_penalty(step_fn, h, mode="vjp", generator=None, iters=1, mask=None):
    """Jacobian spectral radius regularizer at state h (batch first).

    mode "jvp": Jv by forward-mode AD (torch.func.jvp). One forward pass that carries a tangent.
    mode "vjp" (the default): vᵀJ by backward through the step with create_graph=True, as in the
        public STARS code. It gives the same value in expectation because E‖vᵀJ‖² = E‖Jv‖² = ‖J‖_F²/n.
    iters: power iterations (the public code's spectral_iters, 1 there): v <- Jv/‖Jv‖, each
        through a fresh step, and the last ‖Jv‖² is the penalty. As iters grows it tends to the
        dominant |λ|², i.e. the penalty aims at ρ rather than at the mean squared singular value.
    mask: (batch, T) booleans, the positions the penalty looks at (say, the supervised ones): v
        lives there and only Jv there is measured, so the penalty sees J restricted to those
        positions (J_MM: their diagonal blocks and the blocks between them, none of the others).
        Its eigenvalues are those of the masked diagonal blocks (J is block lower-triangular over
        positions, by causal attention), which power iteration (iters > 1) aims at.
    Returns (penalty, jv_norm):
        penalty = mean over the batch of ‖Jv‖². It is differentiable w.r.t. step_fn's parameters,
            but not w.r.t. h, which is detached as in the public code.
        jv_norm = ‖Jv‖ per sample, shape (batch,), detached, for logging (an RMS singular value
            with iters=1, not ρ: see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; choose one of {', '.join(MODES)}")
    h = h.detach().contiguous()  # torch.func.jvp rejects expanded (overlapping) inputs
    m = None if mask is None else mask.to(h.dtype).unsqueeze(-1)
    v = _unit_normal(h, generator, m)
    for i in range(iters):
        if mode == "jvp":
            # the parameters that step_fn closes over stay ordinary autograd leaves. torch.func.jvp
            # composes with autograd, so the tangent output jv still has a graph back to them.
            _, jv = torch.func.jvp(step_fn, (h,), (v,))
        else:
            with torch.enable_grad():
                hg = h.clone().requires_grad_(True)
                (jv,) = torch.autograd.grad(step_fn(hg), hg, v, create_graph=True)  # this is vᵀJ
        if m is not None:
            jv = jv * m
        sq = jv.flatten(1).pow(2).sum(1)  # ‖Jv‖² per sample
        if i + 1 < iters:  # not detached, as in the public code: the gradient flows through v too
            v = jv / sq.sqrt().clamp_min(1e-12).view(-1, *[1] * (h.dim() - 1))
    return sq.mean(), sq.detach().sqrt()


# ---- how many loops this step: Paper B's lognormal, or Huginn's Poisson-lognormal ----------
def sample_loops(generator, kind="lognormal", mu=2.0, sigma=0.7, loop_max=100, loop_mean=32, grad_loops=0):
    """Draw the depth of one training step: (n_loops, grad_loops), where grad_loops is None (the
    gradient flows through every loop, as in Paper B's code) or b (truncated backprop through the
    last b loops only, LoopLM.loop_states(grad_loops=b); Huginn uses 8). Deterministic given the generator.
    fixed:             loop_max, always the same depth: the baseline, or with grad_loops a DEQ-style target
                       (a deep state reached mostly without gradient, the gradient through its last loops;
                       deep equilibrium models, arXiv 1909.01377).
    lognormal:         t = clip(round(LogNormal(mu, sigma)), 1, loop_max). Paper B uses μ=2, σ=0.7,
                       loop_max=100 for addition and μ=1.7, σ=0.4, loop_max=16 for the Ouro fine-tune.
    poisson_lognormal: Huginn's sampler (arXiv 2502.05171). τ ~ N(log r̄ − σ²/2, σ), so E[e^τ] = r̄ = loop_mean,
                       t = min(Poisson(e^τ) + 1, loop_max).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid; choose one of {', '.join(KINDS)}")
    if kind == "fixed":
        return loop_max, (min(loop_max, grad_loops) if grad_loops else None)
    z = torch.randn((), generator=generator, dtype=torch.float64).item()
    if kind == "lognormal":
        t = min(max(round(math.exp(mu + sigma * z)), 1), loop_max)
    else:
        tau = math.log(loop_mean) - sigma**2 / 2 + sigma * z
        t = min(int(torch.poisson(torch.tensor(math.exp(tau), dtype=torch.float64), generator=generator)) + 1, loop_max)
    return t, (min(t, grad_loops) if grad_loops else None)


def training_depth(cfg, step, n_loops, generator):
    """(depth, grad_loops) of training step `step` under train.py's settings (cfg: a TrainConfig): n_loops with
    the gradient through every loop until cfg.loop_start (the curriculum), then cfg.loop_sampling. The generator
    is the step's depth stream (train.step_streams), so a resumed run draws the same depths."""
    if step < cfg.loop_start:
        return n_loops, None
    fixed = cfg.loop_sampling == "fixed"
    return sample_loops(generator, cfg.loop_sampling, cfg.loop_mu, cfg.loop_sigma, n_loops if fixed else cfg.loop_max,
                        cfg.loop_mean, cfg.grad_loops)


# ---- glue for LoopLM (looplm.py) -----------------------------------------------------------
def looplm_step_fn(model, h0):
    """LoopLM's loop map as a function of the state alone: H_k -> H_{k+1} (with loop_norm the
    inter-loop norm is part of the map: LoopLM.step carries the state in). h0 is the embedding, which the step adds when
    config.inject is on (None without it), and it is held fixed. The step always runs eagerly (the class's method,
    not a torch.compile'd model.step: compiled graphs have no double backward) with explicit
    attention, so jvp and double backward work even if the model's forward uses SDPA."""
    h0 = None if h0 is None else h0.detach()

    def step(h):
        with model.math_attention():
            return type(model).step(model, h, h0)
    return step


@dataclass
class Penalty:
    """The STARS penalty of one training step: its weight λ and how it is taken (train.py's --stars_* options).
    Beyond the public code, each off by default:
    rows > 0: on the first `rows` sequences only (the batch is random, so they are a random subset: an
        unbiased estimate of the same mean).
    iters: power iterations inside the penalty (jsrr_penalty; the public code's spectral_iters, 1).
    supervised: at the supervised positions only (targets != -1).
    generator: where the random direction v comes from (train.py: the step's own stream, so a resumed run replays it)."""
    lam: float
    mode: str = "vjp"
    rows: int = 0
    iters: int = 1
    supervised: bool = False
    generator: torch.Generator = None


def training_loss(model, x, y, n_loops, grad_loops=None, penalty=None, checkpoint=False):
    """The loss of one training step at depth n_loops, as train.py and bench.py take it: Paper A's
    objective over the loop states (LoopLM.objective), and with a penalty (a Penalty, λ > 0) Paper B's
    (1 − λ)·task + λ·‖Jv‖² at the last state. Returns (loss, the loop states, ‖Jv‖ per penalized
    sequence or None). grad_loops: the last loops with gradient (LoopLM.loop_states).

    To add another penalty on the loop map: (1) a function of step_fn in this file, like jsrr_penalty;
    (2) its weight, a train.TrainConfig field carried in a Penalty field; (3) in train.train, build the
    Penalty when that weight is > 0 too, and in train.step_streams the "v" generator; (4) its term below,
    before the early return (taken when λ ≤ 0), any randomness from its own generator, seeded by
    train.stream_seed(…, "v", …) XOR a constant (a new name in train.STREAMS would reseed every stream,
    so earlier runs would no longer replay); (5) a test on a known spectrum, like
    test_stars.test_stars_linear_step_known_spectrum."""
    states = model.loop_states(x, n_loops, grad_loops=grad_loops, checkpoint=checkpoint)
    _, loss = model.objective(states, y, checkpoint)
    if penalty is None or penalty.lam <= 0:
        return loss, states, None
    n = penalty.rows or x.size(0)
    # with inject, the map's h0 is the embedding again (with dropout on: a fresh mask, not the loop's)
    step = looplm_step_fn(model, model.embed(x[:n]) if model.config.inject else None)
    h = states[-1][:n].detach()
    mask = (y[:n] != -1) if penalty.supervised else None
    pen, jv_norm = jsrr_penalty(step, h, mode=penalty.mode, generator=penalty.generator, iters=penalty.iters, mask=mask)
    return stars_objective(loss, pen, penalty.lam), states, jv_norm


def lambda_at(step, lam, warmup):
    """λ is 0 during the first `warmup` training steps (2,000 in the public code), then lam.
    (While λ is 0 the trainer skips the penalty pass.)"""
    return 0.0 if step < warmup else lam


def stars_objective(task_loss, penalty, lam):
    """Paper B's objective: (1 − λ)·L_task + λ·L_JSRR (λ = 0.1)."""
    return (1 - lam) * task_loss + lam * penalty
