"""
bench.py: what a looped LM costs. K loops should cost K ordinary passes and nothing more.

    python bench.py                        # CPU: the 44M shape and config/cpu_tiny.py's shape (~10 min, 2 cores)
    python bench.py --quick --json         # smoke run, small shapes, under a minute
    python bench.py --device cuda --shape 44m --batch_size 64 [--compile]

Per shape, every figure comes from one process, one batch (B, T) and one model config (terminal CE
unless --per_loop_ce, which adds K - 1 readouts that the unrolled model does not have):
  loop_vs_unrolled   training tokens/s of LoopLM(n_layer=L, K loops) / LoopLM(n_layer=L*K, 1 loop): equal FLOPs
  mfu                training FLOP/s (train_flops) / peak: the best float32 torch.mm at the model's own
                     largest matmuls (matmul_peak) on CPU, the bf16 peak (--peak_flops) on a GPU
  stars_overhead     step time with the STARS Jacobian penalty (stars.py) / step time without, at K
  eval_tps_k1..      inference tokens/s of a forward at depth k (ideal: ∝ 1/k); gen_tps_*: KV-cached
                     generation at fixed depth K and with adaptive exit (sample.py)
  mem_mb_*           training-step peak memory at K = 4, 8, 16: plain, checkpoint (per loop), truncated
                     backprop (--grad_loops last loops): flat in K
Timings are medians of --reps steps after --warmup steps. Configurations that are compared run in
turn, step by step (a, b, c, a, b, c, ...), so a noisy shared machine slows them alike.
"""
import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

import stars
from looplm import LoopLM, LoopLMConfig

SHAPES = {  # model and batch; dropout 0 as in nanoGPT's bench.py. config/cpu_tiny.py is "tiny"
    "44m": dict(n_embd=512, n_head=8, n_layer=8, n_loop=4, vocab_size=20000, block_size=256, batch_size=4),
    "tiny": dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, vocab_size=256, block_size=128, batch_size=16),
    "quick": dict(n_embd=64, n_head=4, n_layer=2, n_loop=4, vocab_size=256, block_size=64, batch_size=8),
}
TARGETS = {"loop_vs_unrolled": (">=", 0.97), "stars_overhead": ("<=", 1.35), "mfu": (">=", {"44m": 0.8, "tiny": 0.6})}


def tune_malloc():
    """glibc serves every large tensor (a logits tensor, an AdamW temporary) by mmap and unmaps it when
    it is freed, so the next step page-faults it in again: on these VMs that cost up to half of a step.
    Keep freed memory in the heap for reuse instead (no mmap, no trimming). Linux/glibc only."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0) and libc.mallopt(-1, 2**31 - 1))  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_model(args, shape, device, **over):
    """A LoopLM of `shape` (a SHAPES entry, batch_size ignored) and its AdamW (looplm's configure_optimizers)."""
    cfg = {k: v for k, v in shape.items() if k != "batch_size"}
    cfg.update(per_loop_ce=args.per_loop_ce, dropout=0.0)
    cfg.update(over)
    torch.manual_seed(0)
    model = LoopLM(LoopLMConfig(**cfg)).to(device).train()
    if args.compile:
        model.step = torch.compile(model.step)  # as train.py --compile
    return model, model.configure_optimizers(0.01, 3e-4, device_type=device.split(":")[0])


def train_step(model, opt, X, Y, K, ctx, lam=0.0, mode="jvp", grad_loops=None, checkpoint=False):
    """One AdamW step (grad clip 1.0), as train.py takes it; lam > 0 adds the STARS penalty at the last loop."""
    with ctx:
        states = model.loop_states(X, K, grad_loops=grad_loops, checkpoint=checkpoint)
        _, loss = model.objective(states, Y)
        if lam:
            with model.math_attention():
                pen, _ = stars.jsrr_penalty(stars.looplm_step_fn(model, model.embed(X).detach()), states[-1], mode=mode)
            loss = stars.stars_objective(loss, pen, lam)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_flops(model, K, B, T):
    """FLOPs of one training step, forward + backward, counted as in PaLM / nanoGPT's estimate_mfu:
        6 · N_eff per token, N_eff = K · N_block + R · V · d
    N_block: the shared stack's parameters, counted once per loop; V · d: the tied LM head, counted once
    per readout (R = K with per-loop CE, else 1). Plus attention, 12 · (n_layer · K) · T · d per token
    (QKᵀ and AV, forward and backward, causal mask not discounted). Embedding lookups, norms, softmax and
    the optimizer are not counted. Total = (6 · N_eff + 12 · n_layer · K · T · d) · B · T."""
    cfg = model.config
    n_block = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_loop.")))
    n_eff = K * n_block + (K if cfg.per_loop_ce else 1) * cfg.vocab_size * cfg.n_embd
    return (6 * n_eff + 12 * cfg.n_layer * K * T * cfg.n_embd) * B * T


def matmul_peak(model, B, T, device, reps=5):
    """Best float32 FLOP/s of torch.mm at the model's two largest weights, (d, MLP fc width) and (d, V),
    in the three orientations a training step runs them: X·W (forward), G·Wᵀ (grad of X), Xᵀ·G (grad of W)."""
    d, M, best = model.config.n_embd, B * T, 0.0
    for n in (model.blocks[0].mlp.c_fc.out_features, model.config.vocab_size):
        x, w, g = (torch.randn(*s, device=device) for s in ((M, d), (d, n), (M, n)))
        for a, b in ((x, w), (g, w.t()), (x.t(), g)):
            for i in range(reps + 1):  # the first call is a warm-up
                dt = timed(lambda: torch.mm(a, b), device)
                best = max(best, 2 * a.size(0) * a.size(1) * b.size(1) / dt if i else 0.0)
    return best


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def timed(fn, device):
    sync(device)
    t0 = CLOCK()
    fn()
    sync(device)
    return CLOCK() - t0


def interleaved(fns, warmup, reps, device):
    """Median seconds per call of each fn, called in turn: a, b, c, a, b, c, ..."""
    for _ in range(warmup):
        for f in fns:
            f()
    times = [[timed(f, device) for f in fns] for _ in range(reps)]
    return [statistics.median(t) for t in zip(*times)]


@torch.no_grad()
def eval_throughput(model, X, K, ctx, args, device):
    """Tokens/s of a full forward at depth k = 1..K (last-position readout, as train.py's depth_throughput),
    then of KV-cached generation at fixed depth K and with adaptive exit (sample.generate, exit max_prob).
    The exit threshold is the median max_prob of the loop-1 readout on the batch, so that on a random model
    about half of the tokens are confident enough at loop 1. Generation: n_new tokens after the first T - n_new."""
    model.eval()
    res = {}
    meds = interleaved([lambda k=k: model(X, n_loops=k) for k in range(1, K + 1)], args.warmup, args.reps, device)
    for k, t in enumerate(meds, 1):
        res[f"eval_tps_k{k}"] = X.numel() / t
    try:
        from sample import exit_score, generate
    except ImportError:
        print("note: sample.py has no generate/exit_score: adaptive exit not measured", file=sys.stderr)
        return res
    n_new = min(32, X.size(1) // 2)
    prompt = X[:, : X.size(1) - n_new]
    with ctx:
        thr = exit_score(model.readout(model.loop_states(prompt, 1)[0], 1, K), "max_prob").median().item()
    loops = []
    fixed = lambda: generate(model, prompt, n_new, K, temperature=0)
    adaptive = lambda: loops.append(generate(model, prompt, n_new, K, temperature=0, exit="max_prob", threshold=thr)[1])
    with ctx:
        t_fixed, t_adapt = interleaved([fixed, adaptive], 1, max(1, args.reps // 2), device)
    model.train()
    res.update(gen_tps_fixed=prompt.size(0) * n_new / t_fixed, gen_tps_adaptive=prompt.size(0) * n_new / t_adapt,
               adaptive_mean_loops=statistics.mean(s["mean_loops"] for s in loops))
    return res


def memory_runs(args, shape, device, child=False):
    """Peak memory of one training step over what the model's weights already hold (so: activations,
    gradients, AdamW state, temporaries), in MiB, at K = --mem_loops: plain / checkpoint / truncated backprop.
    Terminal CE here: a per-loop readout keeps every loop's logits, which no loop-side trick can drop.
    CUDA: torch.cuda.max_memory_allocated. CPU (Linux): a child process, where every tensor over 1 MiB is
    mmapped and unmapped when freed, so RSS follows live memory, trims the heap and resets the peak RSS
    (/proc/self/clear_refs) before each step, and reports VmHWM - VmRSS before the step."""
    if device == "cpu" and not child:
        cmd = [sys.executable, os.path.abspath(__file__), "--_memory", json.dumps(shape), "--grad_loops",
               str(args.grad_loops), "--mem_loops", args.mem_loops] + ["--compile"] * args.compile
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    return {f"mem_mb_{m}_K{K}": memory_one(args, shape, device, K, m)
            for K in map(int, args.mem_loops.split(",")) for m in ("plain", "checkpoint", "truncated")}


def memory_one(args, shape, device, K, mode):
    model, opt = make_model(args, shape, device, per_loop_ce=False)
    B, T = shape["batch_size"], model.config.block_size
    X = torch.randint(0, model.config.vocab_size, (2, B, T), device=device)
    ctx = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else nullcontext()
    kw = dict(checkpoint=mode == "checkpoint", grad_loops=args.grad_loops if mode == "truncated" else None)
    if device == "cpu":
        status = lambda key: int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the previous run's freed heap back to the OS
        base = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        train_step(model, opt, X[0], X[1], K, ctx, **kw)
        return (status("VmHWM") - base) / 2**20
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, opt, X[0], X[1], K, ctx, **kw)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(args, shape, device):
    """Every figure for one shape (a SHAPES entry): a flat dict of floats."""
    B = shape["batch_size"]
    ctx = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else nullcontext()
    loop, loop_opt = make_model(args, shape, device)
    cfg = loop.config
    K, T = cfg.n_loop, cfg.block_size
    unrolled, unrolled_opt = make_model(args, shape, device, n_layer=cfg.n_layer * K, n_loop=1)
    X, Y = torch.randint(0, cfg.vocab_size, (2, B, T), device=device)
    peak = args.peak_flops or (989e12 if device.startswith("cuda") else matmul_peak(loop, B, T, device))
    steps = [lambda: train_step(loop, loop_opt, X, Y, K, ctx),
             lambda: train_step(unrolled, unrolled_opt, X, Y, 1, ctx),
             lambda: train_step(loop, loop_opt, X, Y, K, ctx, lam=0.1, mode=args.stars_mode)]
    t_loop, t_unrolled, t_stars = interleaved(steps, args.warmup, args.reps, device)
    del unrolled, unrolled_opt
    if not args.peak_flops and not device.startswith("cuda"):  # re-measure after the steps, keep the best
        peak = max(peak, matmul_peak(loop, B, T, device))
    flops = train_flops(loop, K, B, T)
    res = dict(loop_vs_unrolled=t_unrolled / t_loop, mfu=flops / t_loop / peak, stars_overhead=t_stars / t_loop,
               train_tps_loop=B * T / t_loop, train_tps_unrolled=B * T / t_unrolled, step_s=t_loop,
               stars_step_s=t_stars, train_gflops=flops / t_loop / 1e9, peak_gflops=peak / 1e9)
    res.update(eval_throughput(loop, X, K, ctx, args, device))
    if not args.no_memory:
        res.update(memory_runs(args, shape, device))
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help=f"comma-separated, from {', '.join(SHAPES)} "
                   "(default: 44m,tiny on CPU, 44m on CUDA, quick with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: the quick shape, 1 warm-up step, 3 timed")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--batch_size", type=int, default=0, help="override the shape's batch size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--reps", type=int, default=5, help="timed steps per configuration (the median is reported)")
    p.add_argument("--peak_flops", type=float, default=0.0, help="peak FLOP/s for mfu (default: measured on CPU, 989e12 on CUDA)")
    p.add_argument("--stars_mode", default="jvp", choices=stars.MODES, help="how the STARS penalty gets Jv")
    p.add_argument("--grad_loops", type=int, default=2, help="loops that get gradient in the truncated-backprop memory run")
    p.add_argument("--per_loop_ce", action="store_true", help="train on mean_k CE_k, as config/*.py do (default: "
                   "CE_K, so that the looped and the unrolled model have equal FLOPs)")
    p.add_argument("--compile", action="store_true", help="torch.compile model.step (as train.py --compile)")
    p.add_argument("--mem_loops", default="4,8,16", help="loop counts K of the memory runs")
    p.add_argument("--no_memory", action="store_true", help="skip the memory runs")
    p.add_argument("--no_tune_malloc", action="store_true", help="keep glibc's default malloc (see tune_malloc)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (default: torch's choice)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="wall: seconds; cpu: CPU seconds of this "
                   "process, blind to other processes on a shared machine (needs --threads 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--_memory", default=None, help=argparse.SUPPRESS)  # internal: the CPU memory child
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1 or args.device != "cpu":
            sys.exit("--clock cpu counts the CPU time of all threads: use it with --threads 1 on CPU")
        global CLOCK
        CLOCK = time.process_time
    if args._memory:  # every tensor over 1 MiB gets its own mapping, returned to the OS when freed
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        shape = json.loads(args._memory)
        memory_one(args, shape, "cpu", 1, "plain")  # a first step also pays one-time allocations
        print(json.dumps(memory_runs(args, shape, "cpu", child=True)))
        return
    if args.quick:
        args.warmup, args.reps = 1, 3
    shapes = (args.shape or ("quick" if args.quick else "44m" if args.device.startswith("cuda") else "44m,tiny")).split(",")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tuned = args.device == "cpu" and not args.no_tune_malloc and tune_malloc()
    load0 = os.getloadavg()
    results = {s: bench(args, dict(SHAPES[s], batch_size=args.batch_size or SHAPES[s]["batch_size"]), args.device)
               for s in shapes}
    meta = dict(device=args.device, threads=torch.get_num_threads(), clock=args.clock, torch=torch.__version__, malloc_tuned=tuned,
                loadavg_start=load0[0], loadavg_end=os.getloadavg()[0], warmup=args.warmup, reps=args.reps)
    if args.json:
        print(json.dumps({"meta": meta, **results}, indent=1))
        return
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print(f"{'shape':<26}" + "".join(f"{s:>14}" for s in shapes) + "   target")
    for s in shapes:
        cfg = SHAPES[s]
        print(f"  {s}: d {cfg['n_embd']}, {cfg['n_head']} heads, {cfg['n_layer']} layers, K {cfg['n_loop']}, "
              f"vocab {cfg['vocab_size']}, batch {args.batch_size or cfg['batch_size']} x seq {cfg['block_size']}")
    for key in results[shapes[0]]:
        row, target = f"{key:<26}", ""
        for s in shapes:
            v = results[s].get(key, float("nan"))
            row += f"{v:>14.3f}" if abs(v) < 100 else f"{v:>14.0f}"
            if key in TARGETS:
                op, t = TARGETS[key]
                t = t.get(s) if isinstance(t, dict) else t
                if t is not None and not (key == "mfu" and args.device.startswith("cuda")):
                    ok = v >= t if op == ">=" else v <= t
                    target += f" {s}:{op}{t} {'ok' if ok else 'SHORT'}"
        print(row + target)


if __name__ == "__main__":
    main()
