"""
report.py: what a run measures. The evaluation that fills report.json (per loop k: CE, ‖H_k‖, radial fraction, relative step,
spectral radius, Lemma 2's scale probe, clamp ΔCE, tokens/s; addition: exact match at every depth), the plots, and
`train.py --compare`, which tables and overlays several runs.

Two curves over depth, told apart. The early-exit curve (Paper A's public code) reads loop k's
logits from one run at the trained depth K, so final_norm's readout is raw at k < K: that is the
row's "ce". Beyond K, row k is the model run at depth k. For final_norm the curve of the model run
at depth k (normalized at its own last loop) is also given, as "ce_run_at_k".
"""
import json
import math
import os
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

import stars
from checkpoint import read_log
from configurator import RunError, UsageError
from data import ADDITION_CHARS, addition_heldout, atomic_write_text, get_batch
from looplm import SCALES, loop1_probe, norm_stats, radial_fraction, relative_step, scale_probe, token_norms


# ---------------------------------------------------------------- evaluation
def curve_depth(model, k):
    """The depth of the run whose loop k an evaluation row k reads out (model.readout(h, k, this)), which
    makes the early-exit curve: up to the trained depth K, loop k of the run at depth K (Paper A's protocol:
    one run, every loop a possible exit; final_norm is then raw before K); past K, the model run at depth k,
    its last loop. Only final_norm reads loop k differently in the two (ce_run_at_k gives the other)."""
    return max(k, model.config.n_loops)


def row_at_K(rows, K):
    """The evaluation row of loop K, the trained depth (rows past it: the model run deeper; a run evaluated
    short of K: its last row)."""
    return rows[min(K, len(rows)) - 1]


def evaluate(model, cfg, val_data, device, ctx, final=False):
    """Evaluate at loops 1..eval_loops: (validation loss that picks the best checkpoint, report dict).
    The loss is CE at the trained depth (LM), or 1 − exact match there (addition)."""
    model.eval()
    K, mcfg = model.config.n_loops, model.config
    K_eval = cfg.eval_loops or (32 if cfg.task == "addition" else K)
    report = {"config": {**vars(cfg), **vars(mcfg)}, "params": model.num_params()}
    if cfg.task == "addition":
        report["addition"] = addition_eval(model, cfg, K_eval, device, final)
        acc = report["addition"]["accuracy"]
        val_loss = 1.0 - acc[str(min(K, K_eval))]
        pub = report["addition"].get("accuracy_public", {})  # (at the end of the run only)
        print(f"exact match ({'strict | public' if pub else 'strict'}) " + " ".join(
            f"K{k}={100 * acc[str(k)]:.1f}" + (f"|{100 * pub[str(k)]:.0f}" if pub else "") + "%"
            for k in DEPTHS if str(k) in acc))
    else:
        rows, n_tok = evaluate_lm(model, val_data, cfg, K_eval, device, ctx, final)
        report["per_loop"], report["eval_tokens"] = rows, n_tok
        report["norm_convention"] = "per-token L2 norm ||H_k||_2 (RMS = L2/sqrt(n_embd))"
        report["scale_probe_scales"] = list(SCALES)
        last = row_at_K(rows, K)
        val_loss = float(last["ce"])
        print("val CE by loop " + " ".join(f"K{r['k']}={r['ce']:.4f}" for r in rows)
              + f" | ‖H_{last['k']}‖ mean {last['norm_mean']:.1f} p99 {last['norm_p99']:.1f} max {last['norm_max']:.1f}"
              f" | radial {last['radial_fraction']:.1e} | clamp ΔCE {na(last['clamp_delta_ce'], '+.4f')}")
        if final:
            x, _ = get_batch(val_data, 8, mcfg.block_size, torch.Generator().manual_seed(cfg.seed + 999))
            with torch.no_grad():
                n = token_norms(model.loop_states(x.to(device), last["k"])[-1]).cpu().numpy()  # loop K's
            counts, edges = np.histogram(n, bins=60)
            report["norm_hist"] = {"counts": counts.tolist(), "edges": edges.tolist()}
            x, y = get_batch(val_data, min(cfg.batch_size, 16), mcfg.block_size,  # evaluate_lm's first batch
                             torch.Generator().manual_seed(cfg.seed + 999))
            report["loop1_probe"] = loop1_probe(model, x.to(device), y.to(device))
    model.train()
    return val_loss, report


DEPTHS = (1, 2, 4, 8, 16, 32, 64, 100)  # where ρ and the public protocol are measured


@torch.no_grad()
def addition_eval(model, cfg, n_loops, device, final=True):
    """Exact match at every depth 1..n_loops by two protocols, the loop map's ρ at a few depths, and what
    the model gets right digit by digit at its trained depth.
    strict (looplm's): the held-out problems, the space, every digit and § must all be right. Teacher
        forcing gives the same verdict as greedy decoding until §: the greedy answer is right iff the
        argmax is the true token at every answer position given the true prefix. So one pass to
        n_loops scores every depth.
    public (Paper B's random_test_formal.py): the first 100 problems, decoded greedily for exactly as
        many tokens as the true answer (space + digits), and only the digits compared, as an integer.
    ρ: of the loop map at loop k's input (k >= 2), exactly, at every position and at the answer positions.
    answer_positions: at the trained depth K, the share right at each answer position (space, digit 0 = the
        units, ..., then digit d or §), and for digits 1..d-1 split by the carry coming into them: a model
        on the loss plateau has the space and the last position right and every other digit at chance (10%).
    Intermediate evaluations (final=False) measure exact match and digits only: public and ρ, the costly
    ones (decoding 8 depths; the loop map's blocks), are measured at the end of the run."""
    x, y, codes = addition_heldout(cfg.digits, cfg.eval_problems)
    K, d = min(model.config.n_loops, n_loops), cfg.digits
    correct = torch.zeros(n_loops, len(x), dtype=torch.bool)
    right_K = torch.zeros(len(x), x.size(1), dtype=torch.bool)  # position by position, at depth K
    res_sum = torch.zeros(n_loops)
    for i in range(0, len(x), 250):
        xb, yb = x[i:i + 250].to(device), y[i:i + 250].to(device)
        mask = yb != -1
        states = model.loop_states(xb, n_loops)
        for k, h in enumerate(states, 1):
            pred = model.readout(h, k, curve_depth(model, k)).argmax(-1)
            correct[k - 1, i:i + 250] = ((pred == yb) | ~mask).all(-1).cpu()
            if k == K:
                right_K[i:i + 250] = (pred == yb).cpu()
            if k > 1:
                res_sum[k - 1] += relative_step(states[k - 2][mask], h[mask]) * len(xb)
    acc = {str(k): correct[k - 1].float().mean().item() for k in range(1, n_loops + 1)}
    resid = {str(k): res_sum[k - 1].item() / len(x) if k > 1 else None for k in range(1, n_loops + 1)}
    first = 2 * d + 1                                   # the target column of the space (the input's "=")
    a, b = codes // 10 ** d, codes % 10 ** d
    digits = {"space": right_K[:, first].float().mean().item()}
    for j in range(d + 1):                              # digit j of the reversed sum (digit d: its 5th, or §)
        digits[f"digit{j}"] = right_K[:, first + 1 + j].float().mean().item()
        if 0 < j < d:
            carry = (a % 10 ** j + b % 10 ** j) >= 10 ** j
            digits[f"digit{j}_carry"] = [right_K[~carry, first + 1 + j].float().mean().item(),
                                         right_K[carry, first + 1 + j].float().mean().item()]
    out = {"accuracy": acc, "relative_step": resid, "answer_positions": digits}
    if not final:
        return out
    depths = [k for k in DEPTHS if k <= n_loops]
    out["accuracy_public"] = {str(k): public_addition_accuracy(model, x[:100], y[:100], k, device) for k in depths}
    # ρ of the loop map at loop k's input, on 16 problems, every position's block: the mean over problems of ρ
    # (the largest block) and of the largest at the answer positions, those that decide the output
    xb, answer = x[:16].to(device), y[:16] != -1
    states, h0 = model.loop_states(xb, n_loops), model.embed(xb)
    rhos = {k: loop_rho(model, h0, states[k - 2])[0] for k in depths if k > 1}
    out["spectral_radius"] = {str(k): r.amax(1).mean().item() for k, r in rhos.items()}
    out["spectral_radius_answer"] = {str(k): r.where(answer, 0.0).amax(1).mean().item() for k, r in rhos.items()}
    return out


@torch.no_grad()
def public_addition_accuracy(model, x, y, n_loops, device):
    """Paper B's protocol at depth n_loops: greedy, the answer length given, digits compared as an int."""
    answer = y != -1
    start = int(answer.float().argmax(1).min()) + 1     # the prompt ends with "=" (all prompts have one length)
    n_gen = answer.sum(1) - 1                           # space + digits: the true answer without §
    seq = x[:, :start].to(device)
    for _ in range(int(n_gen.max())):                   # every row decodes the longest length, then is cut
        h = model.loop_states(seq, n_loops)[-1]
        seq = torch.cat([seq, model.readout(h[:, -1:], n_loops, n_loops).argmax(-1)], 1)
    digits = lambda ids: "".join(ADDITION_CHARS[i] for i in ids if i < 10)  # ids 0..9 are the digits
    ok = 0
    for row, t, n in zip(seq[:, start:].tolist(), y.tolist(), n_gen.tolist()):
        got, want = digits(row[:n]), digits(t[start - 1:start - 1 + n])  # (reversed sums: compare as read)
        ok += got != "" and int(got[::-1]) == int(want[::-1])
    return ok / len(x)


@torch.no_grad()
def loop_rho(model, h0, h, off_state=False):
    """ρ of the loop map H -> step(H) (loop k >= 2) at the states h (B, T, d), exactly, from its diagonal blocks.
    Causal attention makes J = ∂step(H)/∂H block lower-triangular over positions (position t reads positions
    <= t), so J's eigenvalues are those of the positions' own d x d blocks J_t = ∂step(H)_t/∂H_t, and ρ(J) is the
    largest ρ(J_t). J_t is d JVPs at position t alone, one per basis vector (vmap): the keys and values of the
    earlier positions are held fixed (a KV cache, as sample.py decodes: a change at t does not reach them). Its
    eigenvalues are then computed exactly (power iteration would converge slowly here: the eigenvalues of a
    residual map cluster near 1).
    off_state: also ρ of P J_t P, P = I − ûûᵀ, û = H_t/‖H_t‖. A pre-norm branch reads N(H_t), blind to H_t's
    scale, so J_t H_t ≈ H_t: an eigenvalue near 1 along the state itself, the scale the loop carries (and a norm
    readout ignores); projected out, what is left acts on the directions a readout sees.
    Returns (ρ(J_t), ρ(P J_t P) or None), each (B, T), float64 on the CPU: ρ(J) is the largest over a row."""
    assert not model.training, "loop_rho needs the model in eval mode: dropout would change the map"
    B, T, d = h.shape
    step = lambda x, e, cache: type(model).step(model, x, e, cache)  # eager (not a compiled model.step)
    basis = torch.eye(d, device=h.device, dtype=h.dtype).view(d, 1, 1, d).expand(d, B, 1, d)
    rho, off = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64) if off_state else None
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # (on a GPU: TF32's 1e-3 would blur a ρ near 1)
    try:
        with model.math_attention():  # (forward-mode AD needs the explicit attention)
            kv = [{} for _ in model.blocks]
            step(h, h0, kv)  # every position's keys and values at every layer
            for t in range(T):
                x, e = h[:, t:t + 1], h0[:, t:t + 1]
                # a fresh cache of the positions before t for each call: attention appends t's keys to it
                past = lambda: [{"k": c["k"][:, :, :t], "v": c["v"][:, :, :t]} if t else {} for c in kv]
                column = lambda v: torch.func.jvp(lambda z: step(z, e, past()), (x,), (v,))[1]  # J_t v, (B, 1, d)
                J = torch.func.vmap(column)(basis)[:, :, 0].permute(1, 2, 0).double().cpu()  # J[b][:, j] = J_t e_j
                rho[:, t] = torch.linalg.eigvals(J).abs().amax(-1)
                if off_state:
                    u = h[:, t].double().cpu()
                    u = u / u.norm(dim=-1, keepdim=True)
                    P = torch.eye(d, dtype=torch.float64) - u[:, :, None] * u[:, None, :]
                    off[:, t] = torch.linalg.eigvals(P @ J @ P).abs().amax(-1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return rho, off


@torch.no_grad()
def evaluate_lm(model, val, cfg, K_eval, device, ctx, final=True):
    """Per loop k = 1..K_eval: CE/PPL, ‖H_k‖ stats (L2, per token), radial gradient fraction,
    relative step and update ‖H_k − H_{k−1}‖ (per token, averaged), ρ of the loop map (loop_rho, all directions and off the state), Lemma 2's scale probe (loop k's
    relative step from s·H_{k-1}, s in looplm.SCALES), clamp ΔCE, tokens/s at depth k (ρ at DEPTHS from 2 on, the
    probe at 2 <= k <= 8, at DEPTHS and at K_eval, tokens/s at DEPTHS, K and K_eval, the clamp at k <= max(8, K);
    None elsewhere). An intermediate evaluation (final=False: its report is not written) leaves out ρ, the probe and tokens/s.
    Row k's "ce" is the early-exit curve: loop k's readout in the run at the trained depth K
    (readout(h, k, K), Paper A's protocol), and beyond K the model run at depth k. For final_norm,
    "ce_run_at_k" adds the model run at depth k (normalized at loop k). Same batches for every k."""
    B, T = min(cfg.batch_size, 16), model.config.block_size
    g = torch.Generator().manual_seed(cfg.seed + 999)  # fixed validation batches
    batches = [get_batch(val, B, T, g) for _ in range(cfg.eval_iters)]
    ce, ce_run, ce_clamp, res, upd = (np.zeros(K_eval) for _ in range(5))
    K_train, final_norm = model.config.n_loops, model.config.readout == "final_norm"
    K_clamp = min(K_eval, max(8, K_train))  # the clamp (a second pass) at the trained depths, not at all 64
    norms = [[] for _ in range(K_eval)]
    first = None  # the first batch's states, kept for the radial fraction and ρ below
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with ctx:
            states = model.loop_states(x, K_eval)
            first = first or states
            clamped = model.loop_states(x, K_clamp, clamp=True)
            for k in range(1, K_eval + 1):
                lk = lambda s, K: F.cross_entropy(model.readout(s[k - 1], k, K).float().flatten(0, 1), y.flatten())
                ce[k - 1] += lk(states, curve_depth(model, k)).item() / len(batches)
                if final_norm and k < K_train:  # the only case where the run at depth k reads out differently
                    ce_run[k - 1] += lk(states, k).item() / len(batches)
                if k <= K_clamp:
                    ce_clamp[k - 1] += lk(clamped, curve_depth(model, k)).item() / len(batches)
                norms[k - 1].append(token_norms(states[k - 1]).cpu())
                if k > 1:
                    res[k - 1] += relative_step(states[k - 2], states[k - 1]) / len(batches)
                    upd[k - 1] += token_norms(states[k - 1] - states[k - 2]).mean().item() / len(batches)
    x, y = batches[0][0].to(device), batches[0][1].to(device)
    # the first batch's states again for the radial fraction and ρ below: in fp32 (recomputed only under autocast)
    states = first if isinstance(ctx, nullcontext) else model.loop_states(x, K_eval)
    h0 = model.embed(x[:4])
    rows = []
    probed = lambda k: final and k > 1 and (k <= 8 or k in DEPTHS or k == K_eval)  # the scale probe at these
    for k in range(1, K_eval + 1):
        s = norm_stats(torch.cat(norms[k - 1]))
        # ρ(∂H_k/∂H_{k-1}) at DEPTHS, exactly, on the first sequence (all directions, and off the state's)
        rho = [r.max().item() for r in loop_rho(model, h0[:1], states[k - 2][:1], off_state=True)] \
            if final and k > 1 and k in DEPTHS else (None, None)
        rows.append({"k": k, "ce": ce[k - 1], "ppl": math.exp(ce[k - 1]),
                     **({"ce_run_at_k": ce_run[k - 1] if k < K_train else ce[k - 1]} if final_norm else {}),
                     **{f"norm_{n}": s[n] for n in ("mean", "median", "p99", "max", "std", "min")},
                     "radial_fraction": radial_fraction(model, states[k - 1], y, k, curve_depth(model, k)),
                     "relative_step": res[k - 1] if k > 1 else None, "update": upd[k - 1] if k > 1 else None,
                     "spectral_radius": rho[0], "spectral_radius_off_state": rho[1],
                     "scale_probe": scale_probe(model, states[k - 2][:4], h0) if probed(k) else None,
                     "clamp_delta_ce": ce_clamp[k - 1] - ce[k - 1] if k <= K_clamp else None,
                     "tokens_per_s": depth_throughput(model, x, k, device, ctx)
                     if final and (k in DEPTHS or k in (K_train, K_eval)) else None})
    return rows, sum(len(n) for n in norms[0])


def depth_throughput(model, x, k, device, ctx):
    """Inference tokens/s of a full forward at depth k: the best of 3 timings to depth 8, one beyond (where a
    forward lasts long enough for one timing, and three would cost the evaluation more than its CE pass)."""
    best = float("inf")
    for _ in range(3 if k <= 8 else 1):
        sync(device)
        t0 = time.perf_counter()
        with ctx:
            model(x, n_loops=k)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() / best


def sync(device):
    if "cuda" in str(device):
        torch.cuda.synchronize()


def plot_report(out_dir, report, log_rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report.get("per_loop")
    if rows:
        ks = [r["k"] for r in rows]
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        ax[0].semilogy(ks, [r["norm_mean"] for r in rows], "o-", label="mean")
        ax[0].semilogy(ks, [r["norm_p99"] for r in rows], "s--", label="p99")
        ax[0].set(xlabel="loop k", ylabel="per-token ‖H_k‖₂", title="state norm vs loop")
        ax[0].legend()
        ax[1].plot(ks, [r["ppl"] for r in rows], "o-")
        ax[1].set(xlabel="loop k", ylabel="validation PPL", title="PPL vs loop")
        rows = [r for r in rows if r["tokens_per_s"]]
        ax[2].plot([r["tokens_per_s"] for r in rows], [r["ppl"] for r in rows], "o-")
        for r in rows:
            ax[2].annotate(f"K={r['k']}", (r["tokens_per_s"], r["ppl"]))
        ax[2].set(xlabel="tokens/s", ylabel="PPL", title="quality-compute frontier")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "per_loop.png"), dpi=90)
        plt.close(fig)
    if report.get("norm_hist"):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        h = report["norm_hist"]
        ax.stairs(h["counts"], h["edges"])
        ax.set(xlabel="per-token ‖H_K‖₂", ylabel="tokens", title="token norms at the last loop", yscale="log")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "norm_hist.png"), dpi=90)
        plt.close(fig)
    if "addition" in report:
        acc = report["addition"]["accuracy"]
        fig, ax = plt.subplots(figsize=(5, 3.4))
        ax.plot([int(k) for k in acc], [100 * v for v in acc.values()], "o-")
        ax.set(xlabel="loops at inference", ylabel="exact match (%)", xscale="log", title="addition, held out")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "addition.png"), dpi=90)
        plt.close(fig)
    train_rows = [r for r in log_rows if "loss" in r]
    if train_rows:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
        ax[0].plot([r["iter"] for r in train_rows], [r["loss"] for r in train_rows])
        ax[0].set(xlabel="step", ylabel="train loss")
        ax[1].semilogy([r["iter"] for r in train_rows], [r["norm_K"] for r in train_rows])
        ax[1].set(xlabel="step", ylabel="mean ‖H_K‖₂ (train batch)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "training.png"), dpi=90)
        plt.close(fig)


def read_report(d):
    p = os.path.join(d, "report.json")
    try:
        return json.load(open(p))
    except FileNotFoundError:
        raise RunError(f"{p} not found; train or --eval_only that run first") from None
    except (OSError, ValueError) as e:
        raise RunError(f"{p} is unreadable ({type(e).__name__}); rerun that run's evaluation with --eval_only") from None


def run_names(dirs):
    """Short names for runs: the folder name, or more of the path where two runs share it."""
    parts = [os.path.normpath(d).split(os.sep) for d in dirs]
    for n in range(1, max(map(len, parts)) + 1):
        names = [os.path.join(*p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    raise UsageError("--compare names the same run twice")


def write_report(out_dir, report):
    try:
        atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(report, indent=1))
    except OSError as e:
        raise RunError(f"cannot write {out_dir}/report.json ({e.strerror}); the checkpoint is intact: "
                       "rerun the evaluation with --eval_only --init_from resume") from None
    plot_report(out_dir, report, read_log(out_dir))
    print(f"wrote {out_dir}/report.json and plots")


def drift_exponent(log_rows):
    """Fit ‖H_K‖ ∝ step^b over the second half of training (least squares in log-log): b ≈ 0
    means the norm has saturated, b > 0 that it is still growing (b = 1: linearly)."""
    rows = [r for r in log_rows if "norm_K" in r]
    half = [r for r in rows if rows and r["iter"] >= rows[-1]["iter"] / 2]
    if len(half) < 3:
        return None
    return float(np.polyfit(np.log([r["iter"] for r in half]), np.log([r["norm_K"] for r in half]), 1)[0])


def na(v, f):
    """v formatted as f, or "n/a" for a value a report does not have (None)."""
    return "n/a" if v is None else format(v, f)


def compare_runs(dirs, out):
    """--compare: overlay several runs' plots in out/ and print a markdown table, a row per run.
    Addition runs: exact match vs loops. LM runs: PPL vs K and ‖H_K‖ vs training step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {name: (read_report(d), read_log(d)) for name, d in zip(run_names(dirs), dirs)}
    add = all("addition" in rep for rep, _ in runs.values())
    if not add and any("addition" in rep for rep, _ in runs.values()):
        raise UsageError("--compare takes either addition runs or language-model runs, not a mix")
    figs = [("compare_accuracy.png",)] if add else [("compare_ppl.png",), ("compare_norms.png",)]
    axes = []
    for _ in figs:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        axes.append((fig, ax))
    if add:
        ks = [k for k in DEPTHS if all(str(k) in rep["addition"]["accuracy"] for rep, _ in runs.values())]
        print("| run | " + " | ".join(f"K={k}" for k in ks) + " | ρ answer K=32 / 64 | ρ all K=32 / 64 | relative step K=32 / 64 |\n|"
              + "---|" * (len(ks) + 4))
        for name, (rep, _) in runs.items():
            a = rep["addition"]
            axes[0][1].plot([int(k) for k in a["accuracy"]], [100 * v for v in a["accuracy"].values()], label=name)
            pub = a.get("accuracy_public", {})  # strict | public (Paper B's protocol), in % at each depth
            cell = lambda k: f"{100 * a['accuracy'][str(k)]:.1f}" + (f" \\| {100 * pub[str(k)]:.0f}" if str(k) in pub else "")
            pair = lambda d: " / ".join(na(d.get(k), ".3f" if d is not a["relative_step"] else ".1e") for k in ("32", "64"))
            print(f"| {name} | " + " | ".join(cell(k) for k in ks) + f" | {pair(a.get('spectral_radius_answer', {}))} | "
                  f"{pair(a.get('spectral_radius', {}))} | {pair(a['relative_step'])} |")
        axes[0][1].set(xlabel="loops at inference", ylabel="exact match (%)", xscale="log")
    else:
        print("| run | ‖H_K‖ mean | p99 | max | radial fraction | PPL K=1 | K=2 | K=3 | K=4 | ΔPPL 1→4 | clamp ΔCE | "
              "drift exponent b |\n|" + "---|" * 12)
        for name, (rep, log) in runs.items():
            rows, b = rep["per_loop"], drift_exponent(log)
            last = row_at_K(rows, rep["config"]["n_loops"])
            axes[0][1].plot([r["k"] for r in rows], [r["ppl"] for r in rows], "o-", label=name)
            train_rows = [r for r in log if "norm_K" in r]
            axes[1][1].semilogy([r["iter"] for r in train_rows], [r["norm_K"] for r in train_rows], label=name)
            print(f"| {name} | {last['norm_mean']:.1f} | {last['norm_p99']:.1f} | {last['norm_max']:.1f} | "
                  f"{last['radial_fraction']:.1e} | " + " | ".join(f"{r['ppl']:.3f}" for r in rows[:4])
                  + " | n/a" * (4 - min(4, len(rows))) +
                  f" | {rows[min(3, len(rows) - 1)]['ppl'] - rows[0]['ppl']:+.3f} | {na(last['clamp_delta_ce'], '+.4f')} | "
                  + ("n/a" if b is None else f"{b:+.2f}") + " |")
        axes[0][1].set(xlabel="loops at inference (K)", ylabel="validation PPL")
        axes[1][1].set(xlabel="training step", ylabel="mean per-token ‖H_K‖₂ (train batch)")
        if min(len(rep["per_loop"]) for rep, _ in runs.values()) > 8:
            figs.append(("compare_depth.png",))
            axes.append(depth_table({name: rep for name, (rep, _) in runs.items()}))
    for (name,), (fig, ax) in zip(figs, axes):
        ax.legend(fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1)} if name == "compare_depth.png" else {}))
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=90)
        plt.close(fig)
    return [os.path.join(out, name) for (name,) in figs]


def depth_table(reports):
    """--compare of runs evaluated deeper than 8 loops (the depth study): validation CE at each depth of
    DEPTHS and its worst rise over CE at the trained depth K in those columns ≥ 4K (the goal: none), then
    ‖H_k‖ mean / relative step / ρ at each depth; a plot of CE against loops (log x): (fig, ax)."""
    import matplotlib.pyplot as plt
    n = min(len(rep["per_loop"]) for rep in reports.values())
    ks = [k for k in DEPTHS if k <= n]
    print("\n| run | K | loops a step: all / with gradient | " + " | ".join(f"CE K={k}" for k in ks)
          + " | CE − CE_K, worst column ≥ 4K |\n|" + "---|" * (len(ks) + 4))
    for name, rep in reports.items():  # the goal: no worse when run 4x (and more) deeper than trained
        rows, K = rep["per_loop"], rep["config"]["n_loops"]
        rise = max((rows[k - 1]["ce"] for k in ks if k >= 4 * K), default=None) if K <= n else None
        print(f"| {name} | {K} | {training_loops(rep['config'])} | " + " | ".join(f"{rows[k - 1]['ce']:.3f}" for k in ks)
              + f" | {na(None if rise is None else rise - rows[K - 1]['ce'], '+.3f')} |")
    print("\n| run | " + " | ".join(f"‖H‖ / relative step / ρ at K={k}" for k in ks) + " |\n|" + "---|" * (len(ks) + 1))
    for name, rep in reports.items():
        cell = lambda r: (f"{r['norm_mean']:.3g} / {na(r['relative_step'], '.1e')} / "
                          f"{na(r['spectral_radius'], '.2f')}")
        print(f"| {name} | " + " | ".join(cell(rep["per_loop"][k - 1]) for k in ks) + " |")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (name, rep) in enumerate(reports.items()):  # 10 colours x 2 line styles
        ax.plot([r["k"] for r in rep["per_loop"][:n]], [r["ce"] for r in rep["per_loop"][:n]], label=name,
                color=plt.get_cmap("tab10")(i % 10), ls="-" if i < 10 else "--")
    best = min(r["ce"] for rep in reports.values() for r in rep["per_loop"][:n])
    unit = "byte" if all(rep["config"].get("tokenizer") == "bytes" for rep in reports.values()) else "token"
    ax.set(xlabel="loops at inference", ylabel=f"validation CE (nats/{unit})", xscale="log", ylim=(best - 0.05, best + 1.0))
    return fig, ax  # (the y axis stops 1 nat above the best CE: a collapsing run leaves the plot)


def training_loops(config):
    """A run's compute in loops: mean loops a training step runs / runs with gradient, over its steps' depths
    (stars.training_depth, replayed from the run's settings; the STARS penalty's passes not counted), as
    "6.2 / 3.9"; "n/a" without them or for a run whose length --epochs set."""
    from train import stream_seed  # (train.py imports this module)
    try:
        cfg = SimpleNamespace(**config)
        if cfg.epochs:
            return "n/a"
        gen = lambda it: torch.Generator().manual_seed(stream_seed(cfg.seed, it, "depth"))
        depths = [stars.training_depth(cfg, it, cfg.n_loops, gen(it)) for it in range(cfg.max_iters)]
    except (AttributeError, TypeError, ValueError):
        return "n/a"
    return f"{np.mean([t for t, _ in depths]):.1f} / {np.mean([b or t for t, b in depths]):.1f}"
