"""
sample.py: sample from a trained looplm checkpoint at any depth, optionally with adaptive depth.

    python sample.py --out_dir out --start "The meaning of life" --n_loops 4
    python sample.py --out_dir out-addition --start "1234+5678="            # prints 1234+5678=6912
    python sample.py --out_dir out --exit max_prob --exit_threshold 0.9     # easy tokens exit early
    python sample.py --out_dir out --eval --exit entropy --exit_threshold 1.5
    python sample.py --out_dir out --calibrate --exit max_prob              # Paper A's 1.01x-PPL protocol

Depth is a compute dial: the shared stack runs any number of loops and every loop's state can
be read out (LoopLM.readout). Adaptive depth stops looping for a token as soon as its readout is
confident enough, so easy tokens cost one loop and hard ones loop on.
"""
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import checkpoint
import data
from configurator import RunError, UsageError, check, check_device, command, parse, setting

EXITS = ("max_prob", "margin", "entropy")


# ---- exit criteria: how confident is one loop's readout? -----------------------------------
def exit_score(logits, exit):
    """Per-token confidence statistic of the (untempered) readout distribution, shape logits[..., 0]:
    max_prob = p_top1, margin = p_top1 - p_top2, entropy = H(p) in nats (lower = more confident)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    if exit == "entropy":
        return -(logp.exp() * logp).sum(-1)
    top = logp.topk(2, dim=-1).values.exp()
    return top[..., 0] if exit == "max_prob" else top[..., 0] - top[..., 1]


def exit_ok(score, exit, threshold):
    """True where the token may stop looping: score >= threshold (entropy: <= threshold)."""
    return score <= threshold if exit == "entropy" else score >= threshold


def new_cache(model, n_loops):
    """One KV slot per (loop, layer); model.step(h, h0, cache[k]) appends this loop's keys/values."""
    return [[{} for _ in model.blocks] for _ in range(n_loops)]


@torch.no_grad()
def prefill(model, ctx, n_loops):
    """A fresh cache holding ctx (B, T) at positions 0..T-1, run at full depth n_loops."""
    cache = new_cache(model, n_loops)
    if ctx.size(1) > 0:
        h0 = h = model.embed(ctx, 0)
        for i, slot in enumerate(cache):
            h = model.step(h, h0, slot, first=i == 0)
    return cache


@torch.no_grad()
def decode_token(model, tok, pos, cache, n_loops, exit=None, threshold=None):
    """Run one new token per row, tok (B, 1) at absolute position pos, through up to n_loops
    loops, appending to cache. Returns (logits (B, V) read out at each row's exit loop,
    exit loop (B,)). Without `exit` every row runs all n_loops loops."""
    h0 = model.embed(tok, pos)
    h, B = h0, tok.size(0)
    done = torch.zeros(B, dtype=torch.bool, device=tok.device)
    loops = torch.full((B,), n_loops, device=tok.device)
    out = None
    for i in range(n_loops):  # loop k = i + 1
        # KV-copy rule. A row that exited at loop e never runs loops e+1..K, so the cache slots of
        # those loops would have no entry at its position, and later tokens running loop k > e
        # could not attend to it. We copy the token's own loop-e keys/values (layer by layer) into
        # every deeper slot: later tokens see an exited token as it was when it stopped. It costs
        # no compute and keeps every slot the same length (test_kv_copy_rule_* checks it).
        if done.all():  # nobody runs this loop: append the copies
            for slot, prev in zip(cache[i], cache[i - 1]):
                for kv in ("k", "v"):
                    new = prev[kv][:, :, -1:]
                    slot[kv] = torch.cat([slot[kv], new], 2) if kv in slot else new.clone()
            continue
        h_new = model.step(h, h0, cache[i], first=i == 0)
        if done.any():  # the batch ran this loop for every row: undo it for the exited rows
            h_new = torch.where(done[:, None, None], h, h_new)
            for slot, prev in zip(cache[i], cache[i - 1]):
                for kv in ("k", "v"):
                    slot[kv][done, :, -1] = prev[kv][done, :, -1]
        h = h_new
        if exit is None and i < n_loops - 1:
            continue  # fixed depth: only the last loop is read out
        out = exit_step(out, done, loops, model.readout(h[:, -1], i + 1, n_loops), i + 1, n_loops, exit, threshold)
    return out, loops


def exit_step(out, done, loops, logits, k, n_loops, exit, threshold):
    """Early-exit bookkeeping after loop k: rows still looping take loop k's logits, and those whose
    readout passes the criterion stop there (done and loops are updated in place). Returns out."""
    out = logits if out is None else torch.where(done[:, None], out, logits)
    if exit is not None and k < n_loops:
        stop = ~done & exit_ok(exit_score(logits, exit), exit, threshold)
        loops[stop] = k
        done |= stop
    return out


@torch.no_grad()
def uncached_logits(model, idx, n_loops, exit=None, threshold=None):
    """Reference path: recompute the whole context at every loop, read out the last position at
    its exit loop. Earlier tokens always get all n_loops loops here (no KV-copy rule): this is
    the "full-depth context" semantics of adaptive_eval, and equals the cached path at fixed depth."""
    states = model.loop_states(idx, n_loops)
    out, loops = None, torch.full((idx.size(0),), n_loops, device=idx.device)
    done = torch.zeros_like(loops, dtype=torch.bool)
    for k, h in enumerate(states, 1):
        if exit is not None or k == n_loops:
            out = exit_step(out, done, loops, model.readout(h[:, -1], k, n_loops), k, n_loops, exit, threshold)
    return out, loops


@torch.no_grad()
def generate(model, idx, max_new_tokens, n_loops, temperature=1.0, top_k=None, exit=None,
             threshold=None, use_cache=True, generator=None, stop_token=None, vocab=None):
    """Sample max_new_tokens after idx (B, T). temperature 0 means greedy. Returns (idx with the
    new tokens appended, stats: loops per new token (B, N), mean_loops, tokens_per_s).

    Prefill: the prompt (all but its last token) runs at full depth n_loops; early exit applies
    to every position whose readout produces a new token. Cropping: the learned absolute
    positions stop at block_size, and a sliding window shifts every token's position, which
    invalidates all cached keys. So once the context is full, each step re-prefills the last
    block_size - 1 tokens into a fresh cache (nanoGPT's idx[:, -block_size:], at the cost of an
    uncached step). vocab: the tokenizer's size; the rows of a vocabulary padded beyond it are never sampled."""
    bs, t0, all_loops = model.config.block_size, time.perf_counter(), []
    cache, pos = None, 0  # pos: absolute position of the next token fed, = tokens in the cache
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, loops = uncached_logits(model, idx[:, -bs:], n_loops, exit, threshold)
        else:
            if cache is None or pos == bs:  # start, or the window is full: (re-)prefill
                ctx = idx[:, -bs:-1]  # the window idx[:, -bs:] without its last token
                cache, pos = prefill(model, ctx, n_loops), ctx.size(1)
            logits, loops = decode_token(model, idx[:, -1:], pos, cache, n_loops, exit, threshold)
            pos += 1
        all_loops.append(loops)
        if vocab is not None and vocab < logits.size(-1):
            logits[:, vocab:] = -float("inf")
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], 1)
        if stop_token is not None and (nxt == stop_token).all():
            break
    loops = torch.stack(all_loops, 1) if all_loops else torch.zeros(idx.size(0), 0)
    if idx.is_cuda:
        torch.cuda.synchronize()  # CUDA runs asynchronously: wait before reading the clock
    dt = time.perf_counter() - t0
    return idx, {"loops": loops, "mean_loops": loops.float().mean().item() if all_loops else 0.0,
                 "tokens_per_s": loops.numel() / max(dt, 1e-9)}


# ---- measuring the policy on held-out data ----------------------------------------------------
@torch.no_grad()
def loop_table(model, x, y, n_loops, exit, batch_size=4):
    """Teacher-forced, every loop for every token, in parallel: per loop k the targets' NLL, whether
    the argmax is right, and the exit score, each (K, B, T); mask (B, T) marks targets (y != -1).
    Simplification (an "oracle-free early-exit readout"): here every token runs all K loops, so
    later tokens attend to the deep keys of tokens that 'exited' early, unlike cached generation,
    where the KV-copy rule gives them the exit loop's keys. decode_forced() measures the real thing."""
    cols = {"nll": [], "correct": [], "score": []}
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        rows = {c: [] for c in cols}
        for k, logits in model.readouts(model.loop_states(xb, n_loops)):
            logits = logits.float()
            rows["nll"].append(F.cross_entropy(logits.transpose(1, 2), yb, ignore_index=-1, reduction="none"))
            rows["correct"].append(logits.argmax(-1) == yb)
            rows["score"].append(exit_score(logits, exit or "max_prob"))
        for c in cols:
            cols[c].append(torch.stack(rows[c]))
    return {**{c: torch.cat(v, 1) for c, v in cols.items()}, "mask": y != -1}


def exit_loops(score, exit, threshold):
    """(K, ...) scores -> 0-based exit loop per token: the first loop that passes, else the last."""
    ok = exit_ok(score, exit, threshold)
    ok[-1] = True
    return ok.int().argmax(0)  # argmax returns the first maximum


def summarize(table, exit_idx):
    """PPL, mean loops and exact match (all targets of a row right) when each token reads out at exit_idx."""
    pick = lambda t: t.gather(0, exit_idx[None]).squeeze(0)
    m = table["mask"]
    return {"ppl": math.exp(pick(table["nll"])[m].mean().item()), "loops": (exit_idx + 1)[m].float().mean().item(),
            "exact": (pick(table["correct"]) | ~m).all(-1).float().mean().item()}


def adaptive_eval(table, exit, threshold):
    """(fixed-K summary, adaptive summary) from one loop_table."""
    K = table["nll"].size(0)
    fixed = summarize(table, torch.full_like(table["mask"], K - 1, dtype=torch.long))
    return fixed, summarize(table, exit_loops(table["score"], exit, threshold))


def calibrate(table, exit, ratio=1.01, n_candidates=200):
    """Paper A's protocol: the threshold with the fewest mean loops whose PPL stays within ratio x
    the fixed-K PPL. A sweep over quantiles of the observed scores (no monotonicity assumed); the
    never-exit threshold (PPL = fixed PPL) is always a candidate, so there is always an answer."""
    fixed_ppl = adaptive_eval(table, exit, 0.0)[0]["ppl"]
    s = table["score"][:-1][:, table["mask"]].flatten().sort().values
    never = -math.inf if exit == "entropy" else math.inf
    cands = [never] + s[torch.linspace(0, len(s) - 1, min(n_candidates, len(s))).long()].tolist()
    best = None
    for thr in cands:
        r = summarize(table, exit_loops(table["score"], exit, thr))
        if r["ppl"] <= ratio * fixed_ppl and (best is None or r["loops"] < best[1]["loops"]):
            best = (thr, r)
    return best


@torch.no_grad()
def decode_forced(model, x, y, n_loops, exit=None, threshold=None):
    """Teacher-forced incremental decoding, exactly as generate() runs: batch 1, one token at a
    time through the KV cache with the KV-copy rule, the context before the first target
    prefilled at full depth. What adaptive depth really costs and computes."""
    nll, exact, loops, n, t0 = [], [], [], 0, time.perf_counter()
    for xr, yr in zip(x, y):
        exact.append(True)
        tgt = (yr != -1).nonzero().flatten()
        first, last = int(tgt[0]), int(tgt[-1])
        cache = prefill(model, xr[None, :first], n_loops)
        for t in range(first, last + 1):
            logits, e = decode_token(model, xr[None, t:t + 1], t, cache, n_loops, exit, threshold)
            n += 1
            if yr[t] != -1:
                nll.append(F.cross_entropy(logits.float(), yr[t:t + 1]).item())
                exact[-1] &= bool(logits.argmax(-1) == yr[t])
                loops.append(int(e))
    dt = time.perf_counter() - t0
    return {"ppl": math.exp(sum(nll) / len(nll)), "loops": sum(loops) / len(loops),
            "exact": sum(exact) / len(exact), "tokens_per_s": n / dt}


# ---- command line ---------------------------------------------------------------------------
def eval_data(ckpt, model, n, folder="."):
    """(x, y) held-out sequences: evenly spaced validation windows (LM) or addition problems. folder:
    the checkpoint's, where a token cache goes if the training run's is not in the current directory."""
    cfg = ckpt["config"]
    if cfg.get("task") == "addition":
        try:
            x, y, _ = data.addition_heldout(cfg["digits"], n or 400)
        except ValueError as e:
            raise UsageError(f"--eval_seqs {n or 400}: {e}") from None
        return x, y
    # the training run's token cache if it is here, else one beside the checkpoint (never a new one here),
    # tokenized by the checkpoint's tokenizer (a regex vocabulary refit on the text would not be the model's)
    cache = cfg.get("cache_dir", "data_cache")
    _, val, _ = data.prepare_data({**cfg, "cache_dir": cache if os.path.isabs(cache) or os.path.isdir(cache) else
                                   os.path.join(folder, cache)}, ckpt["tokenizer"])
    T = model.config.block_size
    if len(val) < T + 1:
        raise RunError(f"the validation split has {len(val)} tokens, fewer than block_size+1={T + 1}")
    starts = torch.linspace(0, len(val) - T - 1, n or 16).long().tolist()
    x = torch.stack([torch.from_numpy(val[i:i + T + 1].astype("int64")) for i in starts])
    return x[:, :-1], x[:, 1:]


def depth_report(model, ckpt, args, device):
    """--eval / --calibrate: fixed K vs adaptive depth, first in the fast teacher-forced table
    (Paper A's protocol, all loops computed), then through real incremental decoding."""
    K, addition = args.n_loops, ckpt["config"].get("task") == "addition"
    folder = args.out_dir if os.path.isdir(args.out_dir) else os.path.dirname(args.out_dir)
    x, y = (t.to(device) for t in eval_data(ckpt, model, args.eval_seqs, folder))
    exit, thr = args.exit or "max_prob", args.exit_threshold
    fmt = lambda r: (f"PPL {r['ppl']:8.3f}  loops {r['loops']:5.2f}/{K}"
                     + (f"  exact {100 * r['exact']:5.1f}%" if addition else ""))
    if args.calibrate:  # calibrate on the first half, report on the held-out second half
        half = len(x) // 2
        thr, r = calibrate(loop_table(model, x[:half], y[:half], K, exit), exit, args.ratio)
        print(f"calibrated on {half} sequences: --exit {exit} --exit_threshold {thr:.6g} ({fmt(r)})")
        x, y = x[half:], y[half:]
    fixed, adaptive = adaptive_eval(loop_table(model, x, y, K, exit), exit, thr)
    rows = ((f"fixed K={K}", None), (f"adaptive {exit}{'<=' if exit == 'entropy' else '>='}{thr:.4g}", exit))
    w = max(len(r[0]) for r in rows) + 2
    print(f"teacher-forced, all loops computed, each token read out at its exit loop ({len(x)} sequences):")
    print(f"  {rows[0][0]:<{w}}{fmt(fixed)}\n  {rows[1][0]:<{w}}{fmt(adaptive)}"
          f"   PPL x{adaptive['ppl'] / fixed['ppl']:.4f}")
    n = max(1, len(x) // 8)
    print(f"incremental decoding, batch 1, KV cache with the KV-copy rule (the first {n} of them):")
    decode_forced(model, x[:1], y[:1], K)  # warm-up, untimed
    same = adaptive_eval(loop_table(model, x[:n], y[:n], K, exit), exit, thr)
    for (label, e), t in zip(rows, same):
        r = decode_forced(model, x[:n], y[:n], K, e, thr)
        print(f"  {label:<{w}}{fmt(r)}  {r['tokens_per_s']:8.1f} tokens/s  (teacher-forced table: PPL {t['ppl']:.3f})")


def addition_prompt(start, digits):
    m = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*=?\s*", start)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    if not m or not all(lo <= int(v) <= hi for v in m.groups()):
        raise UsageError(f"this checkpoint adds two {digits}-digit numbers ({lo}..{hi}); got --start {start!r}, "
                       f"try --start \"{lo}+{hi}=\"")
    return int(m[1]), int(m[2])


@dataclass
class SampleConfig:
    """sampling (sample.py)"""
    out_dir: str = setting("out", "folder holding ckpt.pt (or the .pt file itself)")
    start: str = setting("\n", 'prompt text, or FILE:path to read it from a file; addition: "1234+5678=" (default: '
                               'a newline)')
    num_samples: int = setting(None, "samples to draw (default: 10; addition 1)", type=int, lo=1, hi=100_000)
    max_new_tokens: int = setting(500, "tokens generated per sample (addition stops at §)", lo=0, hi=1_000_000)
    temperature: float = setting(None, "softmax temperature; 0 = greedy (default: 0.8; addition 0)", type=float,
                                 lo=0.0, hi=100.0)
    top_k: int = setting(200, "sample among the top_k most likely tokens only", lo=1, hi=10**7)
    seed: int = setting(1337, "random seed of the sampler", lo=0, hi=2**32 - 1)
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    num_threads: int = setting(0, "CPU threads (0 = torch's default; 1 is fastest for batch-1 decoding on a busy "
                                  "machine)", lo=0, hi=4096)
    n_loops: int = setting(None, "K: loops of the shared stack, any K >= 1 (default: the checkpoint's n_loops)",
                           type=int, lo=1, hi=100_000)
    exit: str = setting(None, "adaptive depth: a token stops looping once its readout passes this criterion "
                              "(max_prob, margin = p1-p2: >= threshold; entropy in nats: <= threshold; default: off)",
                        type=str, choices=EXITS)
    exit_threshold: float = setting(None, "threshold of --exit (--calibrate finds one)", type=float, lo=0.0, hi=100.0)
    cache: bool = setting(True, "KV cache (--no_cache: recompute the whole context for every token, the slow "
                                "reference path)")
    eval: bool = setting(False, "measure fixed K vs adaptive depth on held-out data, then exit")
    calibrate: bool = setting(False, "find the --exit threshold keeping PPL within --ratio x fixed-K PPL, then "
                                     "--eval it")
    ratio: float = setting(1.01, "--calibrate: allowed PPL ratio to fixed K (Paper A's protocol)", lo=1.0, hi=100.0)
    eval_seqs: int = setting(None, "held-out sequences for --eval/--calibrate (default: 16 windows; addition 400 "
                                   "problems)", type=int, lo=2, hi=10_000)


def parse_args(argv):
    values, _ = parse(argv, (SampleConfig,), __doc__)
    args = SampleConfig(**values)
    check(args)
    if args.exit and args.exit_threshold is None and not args.calibrate:
        raise UsageError(f"--exit {args.exit} needs --exit_threshold (or --calibrate to find one)")
    if args.exit_threshold is not None and not args.exit:
        raise UsageError("--exit_threshold needs --exit max_prob|margin|entropy")
    if args.eval and not args.calibrate and not args.exit:
        raise UsageError("--eval compares fixed K with an exit policy: give --exit and --exit_threshold, "
                       "or use --calibrate")
    check_device(args.device)
    return args


def run(args):
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"--device {device}, but no CUDA GPU is available; use --device cpu")
    if device.startswith("cuda"):  # fp32 matmuls on TF32 units, as train.py; the GPU's memory counters follow it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.cuda.set_device(device)
    path = args.out_dir if args.out_dir.endswith(".pt") else os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}; train one (python train.py --out_dir DIR) or fix --out_dir")
    ckpt = checkpoint.load_checkpoint(path, device)
    model = checkpoint.model_from_checkpoint(ckpt, device)
    tok, cfg = data.get_tokenizer(ckpt["tokenizer"]), ckpt["config"]
    addition, bs = cfg.get("task") == "addition", model.config.block_size
    args.n_loops = args.n_loops or model.config.n_loops
    if args.eval or args.calibrate:
        depth_report(model, ckpt, args, device)
        return 0
    start = args.start
    if start.startswith("FILE:"):
        start = data.read_file(start[5:], "prompt file")
    if addition:
        a, b = addition_prompt(start, cfg["digits"])
        start = f"{a}+{b}="
    ids = tok.encode(start)
    if not ids:
        raise UsageError("--start is empty: give at least one token of prompt")
    if ckpt["tokenizer"]["kind"] == "regex" and 1 in ids:  # id 1 is <unk>: say which words the model cannot see
        known = set(ckpt["tokenizer"]["vocab"])
        lacking = list(dict.fromkeys(t for t in re.findall(data.REGEX, start) if t not in known))
        print(f"note: {len(lacking)} word(s) of the prompt are not in this checkpoint's vocabulary and become <unk>: "
              + ", ".join(map(repr, lacking[:5])) + (", ..." if len(lacking) > 5 else ""), file=sys.stderr)
    if len(ids) > bs:
        raise UsageError(f"the prompt is {len(ids)} tokens, longer than this checkpoint's block_size of {bs}; "
                       f"shorten --start to at most {bs} tokens")
    temperature = args.temperature if args.temperature is not None else (0.0 if addition else 0.8)
    max_new = min(args.max_new_tokens, bs - len(ids)) if addition else args.max_new_tokens
    torch.manual_seed(args.seed)
    gen = torch.Generator(device).manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(args.num_samples or (1 if addition else 10)):
        y, stats = generate(model, x, max_new, args.n_loops, temperature, args.top_k, args.exit,
                            args.exit_threshold, args.cache, gen, tok.encode("§")[0] if addition else None,
                            tok.vocab_size)
        out = tok.decode(y[0, len(ids):].tolist())
        if addition:  # the model writes " 2196§": the sum's digits, least significant first
            digits = out.split("§")[0].strip()
            ok = digits.isdigit() and int(digits[::-1]) == a + b
            print(f"{start}{digits[::-1]}" + ("" if ok else f"   (wrong: {a}+{b}={a + b})")
                  + f"   [model wrote {out!r}]")
        else:
            print(start + out)
        print(f"--------------- {stats['loops'].numel()} tokens, {stats['mean_loops']:.2f} loops/token "
              f"(K={args.n_loops}{', exit ' + args.exit if args.exit else ''}), {stats['tokens_per_s']:.1f} tokens/s")
    return 0


def main(argv=None):
    return command("sample.py", lambda: run(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
