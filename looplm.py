"""
looplm.py: a looped (weight-tied) transformer language model, every variant of
Paper A ("the readout blind spot") as a config value, and its diagnostics.

One shared stack of n_layer blocks F is applied K times:

    H_0 = tok_emb + pos_emb
    H_k = F(H_{k-1})                   k = 1..K     (see LoopLM.step)
    logits_k = readout(H_k)                         (see LoopLM.readout)

K is an argument of every call, so the same weights run at depth 1, 4 or 100.
The paper's ideas live in exactly four places:
  - the readout (norm | raw | final_norm) ......... LoopLM.readout
  - terminal vs per-loop CE, the norm penalty ...... LoopLM.forward
  - normalization between loops (loop_norm) ........ LoopLM.step
  - the scale clamp diagnostic ..................... LoopLM.loop_states
Paper B's block normalization placement (pre | post | sandwich) is in Block;
its Jacobian penalty and loop sampling live in stars.py.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

CHOICES = {
    "readout": ("norm", "raw", "final_norm"),
    "block_norm": ("pre", "post", "sandwich"),
    "mlp": ("swiglu", "gelu"),
}


@dataclass
class LoopLMConfig:
    vocab_size: int = 50257   # GPT-2 BPE by default; 20,000 with Paper A's regex tokenizer
    block_size: int = 256     # maximum sequence length
    n_layer: int = 2          # depth of the shared stack (applied n_loop times)
    n_head: int = 4
    n_embd: int = 128
    n_loop: int = 4           # K at training time; forward() accepts any n_loops >= 1
    dropout: float = 0.0
    readout: str = "norm"     # norm: W_E·RMSNorm(H) | raw: W_E·H | final_norm: raw, norm at the last loop
    per_loop_ce: bool = False  # loss = mean_k CE_k (dense supervision) instead of CE_K
    norm_penalty: float = 0.0  # Paper A: loss += λ·mean_k mean(H_k²); the paper uses 0.01
    loop_norm: bool = False    # RMSNorm the state between loops (takes scale out of the recurrence)
    block_norm: str = "pre"    # pre: x+f(N(x)) | post: N(x+f(x)) | sandwich: N(x+f(N(x))) (STARS)
    mlp: str = "swiglu"        # swiglu (Paper A) or gelu (Paper B's addition model)
    mlp_hidden: int = 0        # MLP hidden width; 0 means 4·n_embd
    inject: bool = False       # add the input embedding H_0 to the state at every loop
    attn: str = "sdpa"         # sdpa (fast kernels) or math (explicit; forward-mode AD, double backward)

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; choose one of {', '.join(allowed)}")
        if self.attn not in ("sdpa", "math"):
            raise ValueError(f"attn={self.attn!r} is invalid; choose one of sdpa, math")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_loop"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; it must be an integer >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_embd a multiple of n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is invalid; it must be in [0, 1)")
        if self.norm_penalty < 0:
            raise ValueError(f"norm_penalty={self.norm_penalty} is invalid; it must be >= 0 (Paper A uses 0.01)")
        if self.mlp_hidden < 0:
            raise ValueError(f"mlp_hidden={self.mlp_hidden} is invalid; it must be >= 0 (0 means 4*n_embd)")

    @classmethod
    def from_dict(cls, d):
        """Build from a dict (a checkpoint's, say), ignoring keys this version does not know."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g. Written out (not F.rms_norm) so forward-mode AD works."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj.residual = True  # scaled init, see LoopLM._init_weights
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.math = cfg.attn == "math"

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
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_hidden or 4 * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        # SwiGLU: silu(x W_gate) * (x W_up), fused into one matmul of width 2·hidden
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
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
        self.ln_1, self.ln_2 = RMSNorm(cfg.n_embd), RMSNorm(cfg.n_embd)
        if self.placement == "sandwich":
            self.ln_1_post, self.ln_2_post = RMSNorm(cfg.n_embd), RMSNorm(cfg.n_embd)

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
        self.ln_f = RMSNorm(config.n_embd)   # the readout norm (used by readout "norm" and "final_norm")
        if config.loop_norm:
            self.ln_loop = RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embedding and LM head
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # nanoGPT init; residual projections shrink with the number of *effective* layers, n_layer·n_loop
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if getattr(module, "residual", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer * self.config.n_loop)
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self, non_embedding=False):
        """Parameters, shared weights counted once: independent of n_loop."""
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

    def step(self, h, h0=None, cache=None):
        """One loop: H_k = F(H_{k-1}), the map whose Jacobian STARS regularizes.
        h0 (the embedding) is added first when config.inject is on; cache is a list of
        per-layer dicts for this loop (KV cache, see sample.py)."""
        if self.config.inject:
            h = h + h0
        for i, block in enumerate(self.blocks):
            h = block(h, None if cache is None else cache[i])
        if self.config.loop_norm:  # Ouro-style: no scale is carried into the next loop
            h = self.ln_loop(h)
        return h

    def loop_states(self, idx, n_loops=None, clamp=False, grad_loops=None, checkpoint=False):
        """[H_1, ..., H_K], exactly what the readout sees.

        clamp: Paper A's scale clamp (a diagnostic for trained models): after every loop
            k >= 2 each token's state is rescaled to its loop-1 RMS, before it is decoded
            and before it is fed to the next loop.
        grad_loops: truncated backprop (Huginn): only the last grad_loops loops get gradient.
        checkpoint: activation checkpointing per loop (memory ~ one loop instead of K)."""
        K = self.config.n_loop if n_loops is None else n_loops
        if K < 1:
            raise ValueError(f"n_loops={K} is invalid; it must be >= 1")
        h0 = self.embed(idx)
        h, states = h0, []
        for k in range(1, K + 1):
            no_grad = grad_loops is not None and k <= K - grad_loops
            with torch.set_grad_enabled(torch.is_grad_enabled() and not no_grad):
                if checkpoint and torch.is_grad_enabled():
                    h = torch.utils.checkpoint.checkpoint(self.step, h, h0, use_reentrant=False)
                else:
                    h = self.step(h, h0)
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

    def forward(self, idx, targets=None, n_loops=None, grad_loops=None, checkpoint=False):
        """nanoGPT-compatible: (logits, loss). With targets, loss is the training objective
        and logits are the last loop's (all positions); without, only the last position's."""
        K = self.config.n_loop if n_loops is None else n_loops
        states = self.loop_states(idx, K, grad_loops=grad_loops, checkpoint=checkpoint)
        if targets is None:
            return self.readout(states[-1][:, [-1], :], K, K), None
        return self.objective(states, targets)

    def objective(self, states, targets):
        """Paper A's training objective from the loop states [H_1..H_K]: (last logits, loss)."""
        cfg, K = self.config, len(states)
        ce = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        logits = self.readout(states[-1], K, K)
        loss = ce(logits)                                   # terminal: CE_K only
        if cfg.per_loop_ce:                                 # dense supervision: mean_k CE_k
            loss = (sum(ce(self.readout(h, k, K)) for k, h in enumerate(states[:-1], 1)) + loss) / K
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
        fused = device_type in ("cuda", "cpu")  # fused AdamW: one kernel for all parameters (CPU: ~4x foreach)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None,
                                 foreach=None if fused else True)


# ---- diagnostics (Paper A §3; train.py's evaluation calls these) -------------------------
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
def per_loop_ce(model, idx, targets, n_loops=None, clamp=False):
    """[CE_1, ..., CE_K] (floats) of every loop's readout."""
    K = model.config.n_loop if n_loops is None else n_loops
    states = model.loop_states(idx, K, clamp=clamp)
    return [F.cross_entropy(model.readout(h, k, K).flatten(0, 1).float(), targets.flatten(),
                            ignore_index=-1).item() for k, h in enumerate(states, 1)]


def radial_fraction(model, h, targets, k, n_loops):
    """Paper A's Lemma 1, measured: |<∇_H CE_k, H>| / (‖∇_H CE_k‖·‖H‖) per token, averaged.
    ~0 for a scale-invariant readout: the loss cannot see (or correct) the state's scale."""
    h = h.detach().float().requires_grad_(True)
    with torch.enable_grad():
        logits = model.readout(h, k, n_loops).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
        (g,) = torch.autograd.grad(loss, h)
    g, hd = g.double(), h.detach().double()
    frac = (g * hd).sum(-1).abs() / (g.norm(dim=-1) * hd.norm(dim=-1)).clamp_min(1e-300)
    keep = (targets != -1) & (g.norm(dim=-1) > 0)
    return frac[keep].mean().item()


def fixed_point_residual(h_prev, h):
    """‖H_k − H_{k−1}‖ / ‖H_{k−1}‖ per token, averaged: → 0 when the loop settles on a fixed point."""
    return ((h - h_prev).float().norm(dim=-1) / h_prev.float().norm(dim=-1).clamp_min(1e-12)).mean().item()
