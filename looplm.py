"""
looplm.py: a looped (weight-tied) transformer language model, with every variant of both papers
as a config value, and the diagnostics that show what the loop does to its state.

One shared stack of n_layer blocks F is applied n_loops (K) times:

    H_0 = tok_emb + pos_emb
    H_k = F(H_{k-1})                   k = 1..K     (LoopLM.step, LoopLM.loop_states)
    logits_k = readout(H_k)                         (LoopLM.readout)

K is an argument of every call, so the same weights run at depth 1, 4 or 100.

Paper A: "Dense Supervision Is Not Enough: The Readout Blind Spot in Looped Language Models"
(Sharma & Vu, arXiv 2606.24898). With a scale-invariant readout (W_E·RMSNorm(H)), cross-entropy
cannot see the state's scale, and the residual loop grows it. Its ideas live in four places:
  - the readout (norm | raw | final_norm) ................ LoopLM.readout
  - terminal vs per-loop CE, the norm penalty ............. LoopLM.objective
  - normalization between loops (loop_norm) ............... LoopLM.carry
  - the scale clamp diagnostic ............................ LoopLM.loop_states(clamp=True)
Paper B: "Stabilizing Recurrent Dynamics for Test-Time Scalable Latent Reasoning in Looped
Language Models", STARS (Yang et al., ICML 2026, arXiv 2605.26733). Its block normalization
placement (pre | post | sandwich) is in Block; its Jacobian penalty and loop sampling in stars.py.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import UsageError, check, setting


@dataclass
class LoopLMConfig:
    """model (looplm.LoopLMConfig)"""
    vocab_size: int = setting(50257, "vocabulary size; set by the tokenizer (GPT-2 BPE: 50,257)", lo=1, hi=10**7)
    block_size: int = setting(256, "context length (learned absolute positions end there)", lo=1, hi=10**6)
    n_layer: int = setting(8, "depth of the shared stack F", lo=1, hi=1000)
    n_head: int = setting(8, "attention heads", lo=1, hi=4096)
    n_embd: int = setting(512, "model width d", lo=1, hi=65536)
    n_loops: int = setting(4, "K: loops of the shared stack at training time (and the default at evaluation)", lo=1, hi=100_000)
    dropout: float = setting(0.1, "dropout on the embeddings, the attention probabilities and the MLP output", lo=0.0, hi=0.99)
    readout: str = setting("norm", "norm: W_E·RMSNorm(H), scale-invariant | raw: W_E·H | final_norm: raw, norm at loop K",
                           choices=("norm", "raw", "final_norm"))
    per_loop_ce: bool = setting(False, "train every loop's readout: mean_k CE_k (else CE_K only)")
    norm_penalty: float = setting(0.0, "Paper A's fix: loss += λ·mean_k mean(H_k²) (the paper: 0.01)", lo=0.0, hi=1e6)
    loop_norm: bool = setting(False, "RMSNorm the state on the recurrent path between loops (Ouro-style, "
                              "arXiv 2510.25741; Paper A names it, its reported runs do not use it)")
    loop_damping: float = setting(1.0, "α of a damped loop, H_k = H_{k-1} + α·(F(H_{k-1}) − H_{k-1}) for k ≥ 2 (1: the plain "
                                  "loop)", above=0.0, hi=1.0)
    block_norm: str = setting("pre", "pre: x+f(N(x)) | post: N(x+f(x)) | sandwich: N'(x+f(N(x))), Paper B's",
                              choices=("pre", "post", "sandwich"))
    mlp: str = setting("swiglu", "SwiGLU (Paper A) or GELU (Paper B's addition model)", choices=("swiglu", "gelu"))
    mlp_hidden: int = setting(0, "MLP hidden width; 0 means 4·n_embd", lo=0, hi=10**6)
    inject: bool = setting(False, "add the input embedding H_0 to the state at every loop after the first (so loop 1 "
                           "sees 0 + H_0: the state starts from zero)")
    state_noise: float = setting(0.0, "with inject, in training: loop 1 sees H_0 + Gaussian noise of this RMS relative to "
                                 "H_0's (Huginn's random start, arXiv 2502.05171; evaluation and sampling start from "
                                 "zero)", lo=0.0, hi=100.0)
    norm: str = setting("rmsnorm", "every norm: rmsnorm (Paper A) | layernorm, with a bias (Paper B's code)",
                        choices=("rmsnorm", "layernorm"))
    bias: bool = setting(False, "biases in the Linear layers (Paper B's code has them)")
    init: str = setting("pytorch", "pytorch: torch's module defaults, Paper A's code | normal: every weight N(0, 0.02), "
                        "Paper B's code | nanogpt: N(0, 0.02), residual projections / sqrt(2·n_layer·K)",
                        choices=("pytorch", "normal", "nanogpt"))

    def __post_init__(self):
        check(self)
        if self.state_noise and not self.inject:
            raise UsageError(f"--state_noise {self.state_noise} needs --inject: without it the input would never "
                             "reach a state that starts from noise")
        if self.n_embd % self.n_head:
            raise UsageError(f"--n_embd {self.n_embd} is not divisible by --n_head {self.n_head}; "
                             "pick n_embd a multiple of n_head")

    @classmethod
    def from_dict(cls, d):
        """Build from a dict (a checkpoint's model_args), ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# the settings that shape or define what the weights compute: a resumed run cannot change them (another model)
ARCHITECTURE = ("n_layer", "n_head", "n_embd", "mlp", "mlp_hidden", "block_norm", "loop_norm", "loop_damping", "inject", "norm",
                "bias")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g, one fused kernel (forward-mode AD and double backward work)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def Norm(cfg):
    """The model's norm: RMSNorm, or LayerNorm with a bias as in Paper B's code (every norm of the model)."""
    return RMSNorm(cfg.n_embd) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True  # scaled init, see LoopLM._init_weights
        self.dropout = cfg.dropout  # on the attention probabilities; none after c_proj, as in both papers' code
        self.math = False  # explicit attention: set by LoopLM.math_attention (STARS needs it)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:  # cache: a dict for this (loop, layer) slot, see sample.py
            if "k" in cache:
                past = cache["k"].size(2)
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        # query i (at absolute position past+i) sees keys 0..past+i (SDPA's is_causal covers past == 0)
        need = T > 1 and (self.math or past > 0)
        mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past) if need else None
        p = self.dropout if self.training else 0.0
        if self.math:  # explicit softmax(QKᵀ/√d)V: supports torch.func.jvp and double backward
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            if mask is not None:
                att = att.masked_fill(~mask, float("-inf"))
            y = F.dropout(F.softmax(att, dim=-1), p, self.training) @ v
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_hidden or 4 * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        # SwiGLU: silu(x W_gate) * (x W_up), fused into one matmul of width 2·hidden
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """One transformer block with Paper B's three normalization placements:
    pre      x = x + f(N(x))          internal: keeps the residual path, lets the scale grow
    post     x = N(x + f(x))          external: bounds the state
    sandwich x = N'(x + f(N(x)))      STARS's addition block
    """

    def __init__(self, cfg):
        super().__init__()
        self.placement = cfg.block_norm
        self.attn, self.mlp = CausalSelfAttention(cfg), MLP(cfg)
        self.ln_1, self.ln_2 = Norm(cfg), Norm(cfg)
        if self.placement == "sandwich":
            self.ln_1_post, self.ln_2_post = Norm(cfg), Norm(cfg)

    def forward(self, x, cache=None):
        if self.placement == "pre":
            x = x + self.attn(self.ln_1(x), cache)
            return x + self.mlp(self.ln_2(x))
        if self.placement == "post":
            x = self.ln_1(x + self.attn(x, cache))
            return self.ln_2(x + self.mlp(x))
        x = self.ln_1_post(x + self.attn(self.ln_1(x), cache))
        return self.ln_2_post(x + self.mlp(self.ln_2(x)))


class LoopLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))  # the shared stack F
        self.ln_f = Norm(config)   # the readout norm (used by readout "norm" and "final_norm")
        if config.loop_norm:
            self.ln_loop = Norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embedding and LM head
        if config.init != "pytorch":
            self.apply(self._init_weights)

    def _init_weights(self, module):
        """The init sets the size of Paper A's scale gap at small scale (experiments/paper_a.md).
        pytorch: nothing to do, the modules keep torch's defaults, as in Paper A's public code:
            embeddings N(0, 1) (the tied head too), Linear layers Kaiming-uniform, U(±1/sqrt(fan_in)).
        normal:  every weight N(0, 0.02), biases 0, as in Paper B's public addition code.
        nanogpt: N(0, 0.02), residual projections' std divided by sqrt(2·n_layer·K), K loops of n_layer blocks."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if self.config.init == "nanogpt" and getattr(module, "residual", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer * self.config.n_loops)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=False):
        """Parameters, shared weights counted once: independent of n_loops."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields the tied weight once
        return n - (self.wpe.weight.numel() if non_embedding else 0)

    # ---- the loop -----------------------------------------------------------------------
    def embed(self, idx, pos0=0):
        """H_0: token + position embedding for tokens at positions pos0.."""
        T = idx.size(1)
        if pos0 + T > self.config.block_size:
            raise ValueError(f"sequence of length {pos0 + T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(pos0, pos0 + T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def step(self, h, h0=None, cache=None, first=False):
        """One loop, H_k from H_{k-1}: the map whose Jacobian STARS regularizes. The state is
        carried into the loop (LoopLM.carry; the first loop takes H_0 as it is), h0 (the embedding)
        is added when config.inject is on, then the shared stack F runs. cache is a list of
        per-layer dicts for this loop (KV cache, see sample.py). With loop_damping α < 1 the loop moves
        only a fraction α of the way from H_{k-1} (as it came, before carry's norm) to F's output."""
        prev = h
        if not first:  # the first loop takes H_0 as it is (no 2·H_0 when injecting)
            h = self.carry(h)
            if self.config.inject:
                h = h + h0
        for i, block in enumerate(self.blocks):
            h = block(h, None if cache is None else cache[i])
        if not first and self.config.loop_damping != 1.0:
            h = prev + self.config.loop_damping * (h - prev)
        return h

    def carry(self, h):
        """What the recurrent path carries from loop k into loop k+1: H_k itself, or with loop_norm
        RMSNorm_loop(H_k), so that no scale is carried into the next loop (Paper A's fix 3, its third route). As in Paper
        A's public code, the H_k that is read out, penalized and measured is the one before this
        norm (normalizing it again at the readout would be a double normalization)."""
        return self.ln_loop(h) if self.config.loop_norm else h

    def loop_states(self, idx, n_loops=None, clamp=False, grad_loops=None, checkpoint=False):
        """[H_1, ..., H_K], exactly what the readout sees.

        clamp: Paper A's scale clamp (a diagnostic for trained models): after every loop
            k >= 2 each token's state is rescaled to its loop-1 RMS, before it is decoded
            and before it is fed to the next loop.
        grad_loops: truncated backprop (Huginn): only the last grad_loops loops get gradient.
        checkpoint: activation checkpointing per loop (memory ~ one loop instead of K)."""
        K = self.config.n_loops if n_loops is None else n_loops
        if K < 1:
            raise ValueError(f"n_loops={K} is invalid; it must be >= 1")
        h0 = self.embed(idx)
        h, states = h0, []
        if self.config.state_noise > 0 and self.training:  # Huginn's random start: loop 1 sees noise + H_0
            h = h0 + torch.randn_like(h0) * rms(h0.detach()) * self.config.state_noise
        for k in range(1, K + 1):
            no_grad = grad_loops is not None and k <= K - grad_loops
            with torch.set_grad_enabled(torch.is_grad_enabled() and not no_grad):
                if checkpoint and torch.is_grad_enabled():
                    h = torch.utils.checkpoint.checkpoint(self.step, h, h0, None, k == 1, use_reentrant=False)
                else:
                    h = self.step(h, h0, first=k == 1)
            if clamp:
                if k == 1:
                    rms1 = rms(h)
                else:
                    h = h * (rms1 / rms(h))
            states.append(h)
        return states

    def readout(self, h, k, n_loops):
        """Loop k's logits when the model runs n_loops loops. Paper A's central choice:
        norm is scale-invariant (CE cannot see ‖H‖), raw is not, final_norm normalizes only
        the last loop (k == n_loops)."""
        r = self.config.readout
        if r == "norm" or (r == "final_norm" and k == n_loops):
            h = self.ln_f(h)
        return self.lm_head(h)

    def readouts(self, states, n_loops=None):
        """Every loop's logits, [(k, logits_k)], when the model runs n_loops loops (default:
        len(states)): per-loop training, ce_by_loop, sample.loop_table."""
        K = len(states) if n_loops is None else n_loops
        return [(k, self.readout(h, k, K)) for k, h in enumerate(states, 1)]

    def forward(self, idx, targets=None, n_loops=None, grad_loops=None, checkpoint=False):
        """nanoGPT-compatible: (logits, loss). With targets, loss is the training objective
        and logits are the last loop's (all positions); without, only the last position's."""
        K = self.config.n_loops if n_loops is None else n_loops
        states = self.loop_states(idx, K, grad_loops=grad_loops, checkpoint=checkpoint)
        if targets is None:
            return self.readout(states[-1][:, [-1], :], K, K), None
        return self.objective(states, targets)

    def objective(self, states, targets, checkpoint=False):
        """Paper A's training objective from the loop states [H_1..H_K]: (last logits, loss).
        Where the loss is placed is the paper's second switch: CE_K alone (terminal), or the mean
        of every loop's CE (per_loop_ce), which asks each loop's readout to be a usable exit.
        checkpoint: each loop's readout and CE are recomputed in backward instead of kept, so per-loop
        CE never holds K (batch, T, vocab) activations at once (then the logits returned are None)."""
        cfg, K = self.config, len(states)
        ce = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        if cfg.per_loop_ce and checkpoint and torch.is_grad_enabled():
            ce_k = lambda h, k: ce(self.readout(h, k, K))
            logits = None
            loss = sum(torch.utils.checkpoint.checkpoint(ce_k, h, k, use_reentrant=False)
                       for k, h in enumerate(states, 1)) / K
        elif cfg.per_loop_ce:                               # dense supervision: mean_k CE_k
            outs = self.readouts(states)
            logits, loss = outs[-1][1], sum(ce(lg) for _, lg in outs) / K
        else:                                               # terminal: CE_K only
            logits = self.readout(states[-1], K, K)
            loss = ce(logits)
        if cfg.norm_penalty > 0:  # Paper A's fix: make the scale visible to the loss
            loss = loss + cfg.norm_penalty * sum(h.pow(2).mean() for h in states) / K
        return logits, loss

    @contextmanager
    def math_attention(self):
        """Temporarily route attention through the explicit math path (for torch.func.jvp
        and double backward, which the fused SDPA kernels do not support)."""
        mods = [m for m in self.modules() if isinstance(m, CausalSelfAttention)]
        old = [m.math for m in mods]
        for m in mods:
            m.math = True
        try:
            yield self
        finally:
            for m, o in zip(mods, old):
                m.math = o

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.999), device_type="cpu"):
        """AdamW; weight decay only on matrices and embeddings (tensors of 2+ dims)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        # fused AdamW: one kernel for all parameters (CPU: ~4x foreach); train.NonFiniteGuard needs it (found_inf)
        fused = device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None,
                                 foreach=None if fused else True)


# ---- diagnostics (report.py's evaluation calls these) -------------------------------------
def rms(h):
    """Per-token RMS = ‖h‖₂/√d, shape (..., 1). The clamp and Lemma-2 use this convention."""
    return h.pow(2).mean(-1, keepdim=True).sqrt()


def token_norms(h):
    """Per-token L2 norms ‖h‖₂ (the convention of Paper A's logged ‖H_K‖), flattened."""
    return h.float().norm(dim=-1).flatten()


def norm_stats(norms):
    """mean, median, p99, max, std, min of a 1-D tensor of per-token norms (heavy-tailed)."""
    n = norms.double()
    return {"mean": n.mean().item(), "median": n.median().item(), "p99": torch.quantile(n, 0.99).item(),
            "max": n.max().item(), "std": n.std().item() if n.numel() > 1 else 0.0, "min": n.min().item()}


@torch.no_grad()
def ce_by_loop(model, idx, targets, n_loops=None, clamp=False):
    """[CE_1, ..., CE_K] (floats): every loop's readout in one run of n_loops loops, readout(h, k, n_loops)."""
    states = model.loop_states(idx, n_loops or model.config.n_loops, clamp=clamp)
    return [F.cross_entropy(lg.flatten(0, 1).float(), targets.flatten(), ignore_index=-1).item()
            for _, lg in model.readouts(states)]


def radial_fraction(model, h, targets, k, n_loops):
    """Paper A's Lemma 1, measured: |<∇_H CE_k, H>| / (‖∇_H CE_k‖·‖H‖) per token, averaged.
    The gradient is CE_k's through loop k's own readout (h detached: later loops' losses are left out).
    ~0 for a scale-invariant readout: that loss cannot see (or correct) the state's scale."""
    h = h.detach().float().requires_grad_(True)
    with torch.enable_grad():
        logits = model.readout(h, k, n_loops).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
        (g,) = torch.autograd.grad(loss, h)
    g, hd = g.double(), h.detach().double()
    frac = (g * hd).sum(-1).abs() / (g.norm(dim=-1) * hd.norm(dim=-1)).clamp_min(1e-300)
    keep = (targets != -1) & (g.norm(dim=-1) > 0)
    return frac[keep].mean().item()


def relative_step(h_prev, h):
    """‖H_k − H_{k−1}‖ / ‖H_{k−1}‖ per token, averaged: → 0 when the loop settles on a fixed point."""
    return ((h - h_prev).float().norm(dim=-1) / h_prev.float().norm(dim=-1).clamp_min(1e-12)).mean().item()


@torch.no_grad()
def loop1_probe(model, idx, targets):
    """Where the state's scale is made: what loop 1 does with the embedding H_0 (per token, averaged). ‖H_0‖,
    ‖Δ_1‖ = ‖H_1 − H_0‖, cos(Δ_1, H_0); CE_1 (nats), CE_1 of Δ_1 alone (H_0 taken out of H_1); CE of H_0's own
    readout, and how often it predicts the input token. The tied head reads the embedding back as the input
    token, so a next-token model must overwrite H_0: by opposing it, or by outgrowing it (a large ‖H_1‖)."""
    K = model.config.n_loops
    ce = lambda h: F.cross_entropy(model.readout(h, 1, K).float().flatten(0, 1), targets.flatten()).item()
    h0 = model.embed(idx)
    d1 = model.loop_states(idx, 1)[0] - h0
    return {"h0": token_norms(h0).mean().item(), "d1": token_norms(d1).mean().item(),
            "cos": F.cosine_similarity(d1, h0, dim=-1).mean().item(), "ce0": ce(h0), "ce1": ce(h0 + d1),
            "ce1_no_h0": ce(d1), "h0_reads_input": (model.readout(h0, 1, K).argmax(-1) == idx).float().mean().item()}


SCALES = (1 / 64, 1 / 16, 1 / 4, 1, 4, 16, 64)


@torch.no_grad()
def scale_probe(model, h_prev, h0, scales=SCALES):
    """Paper A's Lemma 2, probed: one loop's relative step from its input H = H_{k-1} rescaled by s,
    relative_step(s·H, step(s·H)), for each s. Pre-norm branches read only H's direction (the first branch,
    layer 1's attention, exactly: N(s·H) = N(H); every later one reads N(s·H + O(1)) → N(H) as s grows), so the
    update step(s·H) − s·H barely changes with s and the relative step falls as 1/s (log-log slope −1): the
    larger the state, the less a loop can turn it (with inject, once s·H outweighs H_0). With loop_norm the next
    loop reads RMSNorm(s·H), whatever s."""
    return [relative_step(s * h_prev, model.step(s * h_prev, h0)) for s in scales]
