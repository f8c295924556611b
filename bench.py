"""
bench.py: what a looped LM costs. K loops should cost K ordinary passes, and nothing more.

    python bench.py                       # CPU: the 44M shape and config/cpu_tiny.py's shape (minutes)
    python bench.py --quick --json        # smoke run: a small shape, seconds
    python bench.py --threads 1 --clock cpu   # on a shared machine: CPU seconds, blind to other processes
    python bench.py --busy                # the thread default beside another run: OpenMP's spin count (minutes)
    python bench.py --device cuda --shape 44m --batch_size 64 [--compile]

Per shape, every figure comes from one process, one batch (B, T) and one model config (terminal CE
unless --per_loop_ce, which adds K - 1 readouts that the unrolled model does not have):
  loop_vs_unrolled  training tokens/s of LoopLM(n_layer=L, K loops) / LoopLM(n_layer=L*K, 1 loop): equal FLOPs
  mfu               training FLOP/s (train_flops) / peak: the best torch.mm measured on this device
                    (matmul_peak: float32 on CPU, bfloat16 on CUDA), or --peak_flops
  stars_overhead    step time with the STARS Jacobian penalty at the last loop / step time without;
                    stars_overhead_rows: the penalty on the first --stars_rows sequences only (train.py --stars_rows)
  eval_tps_k*       inference tokens/s of a forward at depth k (ideal: proportional to 1/k); gen_tps_*:
                    KV-cached generation at fixed depth K and with adaptive exit (sample.py)
  mem_mb_*          training-step peak memory at K = 4, 8, 16: plain, checkpoint (per loop), truncated
                    backprop (gradient through the last --grad_loops loops only: flat in K)
  --profile adds    kernel_share: the part of a plain step's wall time spent in matmul and attention kernels
                    (torch.profiler, CPU), and mfu_bound: train_flops / that kernel time / peak, the mfu if
                    nothing else took time. It prints the top ops of the plain and the STARS step to stderr.
Timings are medians of --reps calls after --warmup calls. Configurations that are compared run in
turn, step by step (a, b, c, a, b, c, ...), so a noisy shared machine slows them alike.
"""
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import stars
from configurator import RunError, UsageError, check, check_device, command, parse, setting
from looplm import LoopLM, LoopLMConfig

SHAPES = {  # model and batch; dropout 0 as in nanoGPT's bench.py. "tiny" is config/cpu_tiny.py (bytes)
    "44m": dict(n_embd=512, n_head=8, n_layer=8, n_loops=4, vocab_size=20000, block_size=256, batch_size=4),
    "tiny": dict(n_embd=128, n_head=4, n_layer=2, n_loops=4, vocab_size=256, block_size=128, batch_size=16),
    "quick": dict(n_embd=64, n_head=4, n_layer=2, n_loops=4, vocab_size=256, block_size=64, batch_size=8),
}
TARGETS = {"loop_vs_unrolled": (">=", 0.97), "stars_overhead": ("<=", 1.35), "stars_overhead_rows": ("<=", 1.35),
           "mfu": (">=", {"44m": 0.8, "tiny": 0.6})}
CLOCK = time.perf_counter  # --clock cpu: time.process_time


def tune_malloc():
    """glibc serves each large tensor (logits, activations) by mmap and unmaps it when it is freed, so
    every step page-faults it in again: on these VMs a third of a step at vocab 50k, a quarter at the
    quick shape. Keep freed memory in the heap for reuse instead (no mmap, no trimming). glibc only."""
    try:  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 2 GiB
        return bool(ctypes.CDLL("libc.so.6").mallopt(-4, 0) and ctypes.CDLL("libc.so.6").mallopt(-1, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def timed(fn, device):
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    sync()
    t0 = CLOCK()
    fn()
    sync()
    return CLOCK() - t0


def interleaved(fns, warmup, reps, device):
    """Median seconds per call of each fn, called in turn: a, b, c, a, b, c, ..."""
    for _ in range(warmup):
        for f in fns:
            f()
    times = [[timed(f, device) for f in fns] for _ in range(reps)]
    return [statistics.median(t) for t in zip(*times)]


def make_model(args, shape, device, **over):
    """A LoopLM of `shape` (a SHAPES entry) and its AdamW from LoopLM.configure_optimizers."""
    cfg = {k: v for k, v in shape.items() if k != "batch_size"}
    cfg.update(dict(per_loop_ce=args.per_loop_ce, dropout=0.0), **over)
    torch.manual_seed(0)
    model = LoopLM(LoopLMConfig(**cfg)).to(device).train()
    if args.compile:
        model.step = torch.compile(model.step)  # as train.py --compile
    return model, model.configure_optimizers(0.01, 3e-4, device_type=device.split(":")[0])


def train_step(model, opt, X, Y, K, ctx, lam=0.0, mode="vjp", rows=0, grad_loops=None, checkpoint=False):
    """One AdamW step with grad clip 1.0, with train.py's loss (stars.training_loss). lam > 0 adds the
    STARS penalty at the last loop's state (on the first `rows` sequences of the batch only, if rows > 0)."""
    with ctx:
        loss, _, _ = stars.training_loss(model, X, Y, K, grad_loops, stars.Penalty(lam, mode, rows), checkpoint)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_flops(model, K, B, T):
    """FLOPs of one training step, forward + backward, counted as PaLM and nanoGPT's estimate_mfu do:
        (6 * N_eff + 12 * (n_layer * K) * T * d) * B * T,   N_eff = K * N_block + R * V * d
    N_block: the shared stack's parameters, counted once per loop. V * d: the tied LM head, counted once
    per readout (R = K with per-loop CE, else 1). 12 * n_layer * K * T * d per token: attention scores
    and values, forward and backward, causal mask not discounted. Embedding lookups, norms, softmax
    and the optimizer are not counted."""
    cfg = model.config
    n_block = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_loop.")))
    n_eff = K * n_block + (K if cfg.per_loop_ce else 1) * cfg.vocab_size * cfg.n_embd
    return (6 * n_eff + 12 * cfg.n_layer * K * T * cfg.n_embd) * B * T


def matmul_peak(model, B, T, device, reps=5):
    """Best FLOP/s of torch.mm at the model's largest shapes, (B*T, d) x (d, MLP fc width) and
    (B*T, d) x (d, V), and on CUDA a large square one, 8192³, which reaches the device's peak: float32
    on CPU, bfloat16 on CUDA (what autocast runs the model's matmuls in). The best of reps
    calls after one warm-up call."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    d, best = model.config.n_embd, 0.0
    sizes = [(B * T, d, model.blocks[0].mlp.c_fc.out_features), (B * T, d, model.config.vocab_size)]
    for m, k, n in sizes + ([(8192, 8192, 8192)] if device.startswith("cuda") else []):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        torch.mm(a, b)
        t = min(timed(lambda: torch.mm(a, b), device) for _ in range(reps))
        best = max(best, 2 * m * k * n / t)
    return best


def profile_steps(steps, names, flops, peak, device):
    """--profile (CPU): torch.profiler over 3 calls of each step; prints the top ops by self time and
    returns the plain step's kernel_share and mfu_bound (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    res = {}
    for name, step in zip(names, steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = timed(lambda: [step() for _ in range(3)], device)
        ops = prof.key_averages()
        kern = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")
                   or "scaled_dot_product" in e.key) / 1e6  # seconds
        print(f"--- {name}: {wall / 3:.3f} s a step, matmul + attention kernels {kern / wall:.0%} of it", file=sys.stderr)
        print(ops.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=56), file=sys.stderr)
        if not res:  # the figures are the first (plain) step's
            res = dict(kernel_share=kern / wall, mfu_bound=3 * flops / kern / peak if kern else float("inf"))
    return res


@torch.no_grad()
def eval_throughput(model, X, K, ctx, args, device):
    """Tokens/s of a forward at depth k = 1..K (last-position readout, as report.depth_throughput), then
    of KV-cached generation (sample.generate, greedy; prefill of the prompt, the batch's first T/8 tokens,
    included) of n_new new tokens per row at fixed depth K and with adaptive exit (max_prob). The exit
    threshold is the median loop-1 max_prob on the prompt, so even a random model has tokens both sides."""
    model.eval()
    with ctx:
        meds = interleaved([lambda k=k: model(X, n_loops=k) for k in range(1, K + 1)], args.warmup, args.reps, device)
    res = {f"eval_tps_k{k}": X.numel() / t for k, t in enumerate(meds, 1)}
    try:
        from sample import exit_score, generate
    except ImportError:
        print("note: sample.py has no generate/exit_score: adaptive exit not measured", file=sys.stderr)
        return res
    n_new, prompt, loops = min(32, X.size(1) // 2), X[:, : max(1, X.size(1) // 8)], []
    if "step" in vars(model):  # --compile: decode eagerly, as sample.py does (the KV cache changes shape every token)
        del model.step
    with ctx:
        thr = exit_score(model.readout(model.loop_states(prompt, 1)[0], 1, K), "max_prob").median().item()
        fixed = lambda: generate(model, prompt, n_new, K, temperature=0)
        adaptive = lambda: loops.append(generate(model, prompt, n_new, K, 0, exit="max_prob", threshold=thr)[1])
        t_fixed, t_adapt = interleaved([fixed, adaptive], 1, max(1, args.reps // 2), device)
    model.train()
    return dict(res, gen_tps_fixed=X.size(0) * n_new / t_fixed, gen_tps_adaptive=X.size(0) * n_new / t_adapt,
                adaptive_mean_loops=statistics.mean(s["mean_loops"] for s in loops))


def memory_runs(args, shape, device, child=False):
    """Peak memory of one training step over what the model's weights already hold (activations,
    gradients, AdamW state, temporaries), in MiB, at K = --mem_loops: plain, checkpoint, truncated.
    Terminal CE here: a per-loop readout keeps every loop's logits, which no loop-side trick can drop.
    CUDA: torch.cuda.max_memory_allocated. CPU (Linux): a child process, where every allocation over
    1 MiB is mmapped and unmapped when freed (RSS follows live memory), trims the heap and resets the
    peak RSS (/proc/self/clear_refs) before each step, and reports VmHWM - VmRSS before the step."""
    if device == "cpu" and not child:
        cmd = [sys.executable, os.path.abspath(__file__), "--_memory", json.dumps(shape), "--grad_loops", str(args.grad_loops),
               "--mem_loops", args.mem_loops, "--threads", str(torch.get_num_threads())] + ["--compile"] * args.compile
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"memory child failed:\n{out.stderr}")
        return json.loads(out.stdout.splitlines()[-1])
    return {f"mem_mb_{m}_K{K}": memory_one(args, shape, device, K, m)
            for K in map(int, args.mem_loops.split(",")) for m in ("plain", "checkpoint", "truncated")}


def memory_one(args, shape, device, K, mode):
    model, opt = make_model(args, shape, device, per_loop_ce=False)
    X = torch.randint(0, model.config.vocab_size, (2, shape["batch_size"], model.config.block_size), device=device)
    ctx = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else nullcontext()
    step = lambda: train_step(model, opt, X[0], X[1], K, ctx, checkpoint=mode == "checkpoint",
                              grad_loops=args.grad_loops if mode == "truncated" else None)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    status = lambda key: int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return the previous run's freed heap to the OS
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS := current RSS
        f.write("5")
    step()
    return (status("VmHWM") - base) / 2**20


def bench(args, shape, device):
    """Every figure for one shape (a SHAPES entry): a flat dict of floats."""
    ctx = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else nullcontext()
    loop, loop_opt = make_model(args, shape, device)
    B, T, K, L = shape["batch_size"], loop.config.block_size, loop.config.n_loops, loop.config.n_layer
    unrolled, unrolled_opt = make_model(args, shape, device, n_layer=L * K, n_loops=1)
    X, Y = torch.randint(0, loop.config.vocab_size, (2, B, T), device=device)
    peak = args.peak_flops or matmul_peak(loop, B, T, device)
    steps = [lambda: train_step(loop, loop_opt, X, Y, K, ctx),
             lambda: train_step(unrolled, unrolled_opt, X, Y, 1, ctx),
             lambda: train_step(loop, loop_opt, X, Y, K, ctx, lam=0.1, mode=args.stars_mode),
             lambda: train_step(loop, loop_opt, X, Y, K, ctx, lam=0.1, mode=args.stars_mode,
                                rows=args.stars_rows or max(1, B // 4))]
    t_loop, t_unrolled, t_stars, t_rows = interleaved(steps, args.warmup, args.reps, device)
    del unrolled, unrolled_opt
    if not args.peak_flops:  # measured again after the steps (a warm machine); the best counts
        peak = max(peak, matmul_peak(loop, B, T, device))
    flops = train_flops(loop, K, B, T)
    res = dict(loop_vs_unrolled=t_unrolled / t_loop, mfu=flops / t_loop / peak, stars_overhead=t_stars / t_loop,
               stars_overhead_rows=t_rows / t_loop,
               train_tps_loop=B * T / t_loop, train_tps_unrolled=B * T / t_unrolled, step_s=t_loop,
               stars_step_s=t_stars, train_gflops=flops / t_loop / 1e9, peak_gflops=peak / 1e9)
    if args.profile:
        res.update(profile_steps([steps[0], steps[2]], ["plain step", "STARS step"], flops, peak, device))
    res.update(eval_throughput(loop, X, K, ctx, args, device))
    if args.memory:
        res.update(memory_runs(args, shape, device))
    return res


def gpu_check(args):
    """python bench.py --gpu_check: everything a first GPU session should measure, in one command
    (under 10 minutes on one H100/H200), with one JSON summary (--check_out) and a table:
      tests      the test suite (python -m pytest -q), on the GPU machine
      bench      the 44M shape, bf16 autocast + torch.compile, per-loop CE: mfu against the measured
                 bf16 peak, loop_vs_unrolled, stars_overhead, memory
      lm_44m     200 steps of config/wikitext103_44m.py with bf16 + compile (offline: the Python docs,
                 Paper A's regex tokenizer), tokens/s and loss from its log
      addition   200 steps of config/addition.py with STARS from step 0 and Paper B's depth sampling
      torchrun   the same 44M run on 2 processes, if the machine has 2 GPUs
    --dry: the same code path on CPU at tiny shapes and a few steps (what the test suite runs)."""
    import shutil
    import tempfile
    dry, dev = args.dry, ("cpu" if args.dry else "cuda")
    if not dry and not torch.cuda.is_available():
        raise RunError("--gpu_check needs a CUDA GPU; use --gpu_check --dry to run its code path on CPU")
    here, tmp = os.path.dirname(os.path.abspath(__file__)), tempfile.mkdtemp(prefix="looplm_check_")
    summary = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "torch": torch.__version__,
               "gpus": torch.cuda.device_count()}

    def run(name, cmd, timeout):
        """A stage in its own process group: a hung stage (say NCCL start-up) is killed whole, rc 124."""
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=here, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, rc = p.communicate(timeout=timeout)[0], p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, rc = p.communicate()[0] + f"\ntimed out after {timeout} s", 124
        lines = [x for x in out.strip().splitlines() if x.strip("*= ")]  # (torchrun's banners: rows of = and *)
        errors = [x for x in lines if "Error" in x or "error:" in x]
        summary[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                         "tail": lines[-3:] + (errors[-1:] if rc and errors and errors[-1] not in lines[-3:] else [])}
        print(f"{name:<10} rc {rc}  {summary[name]['seconds']:7.1f} s  {summary[name]['tail'][-1:]}", flush=True)
        return rc == 0

    def train_run(name, preset, extra, nproc=1):
        out = os.path.join(tmp, name)
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                      "--standalone", "--nproc_per_node", str(nproc)]  # a free port
        ok = run(name, launch + ["train.py", preset, "--device", dev, "--out_dir", out] + extra, 300)
        if not ok and nproc > 1 and summary[name]["rc"] != 124:  # a start-up can fail once (rendezvous, ports): once
            # more, on record (not after a hang: that is a 300 s timeout already)
            first = summary[name]
            ok = run(name, launch + ["train.py", preset, "--device", dev, "--out_dir", out, "--overwrite"] + extra, 300)
            summary[name]["first_try"] = first
        if ok:
            rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"loss"' in line]
            summary[name].update(final_loss=rows[-1]["loss"], tokens_per_s=statistics.median(
                r["tokens_per_s"] for r in rows[len(rows) // 2:] if r["tokens_per_s"]))
    steps = ["--epochs", "0", "--max_iters", "6" if dry else "200", "--log_interval", "2" if dry else "20"]
    tiny = ["--n_layer", "1", "--n_embd", "32", "--n_head", "4", "--batch_size", "4"] if dry else []
    run("tests", [sys.executable, "-m", "pytest", "-q", "-x"] + (["test_bench.py", "-m", "not slow"] if dry else []), 420)
    shape = dict(SHAPES["quick" if dry else "44m"], batch_size=args.batch_size or (4 if dry else 64))
    b_args = parse_args(["--device", dev, "--per_loop_ce"] + (["--warmup", "1", "--reps", "2", "--no_memory"] if dry
                                                              else ["--compile", "--reps", "10"]))
    t0 = time.perf_counter()
    try:
        summary["bench"] = dict(bench(b_args, shape, dev), rc=0, seconds=round(time.perf_counter() - t0, 1))
        print(f"bench      mfu {summary['bench']['mfu']:.3f}  loop/unrolled {summary['bench']['loop_vs_unrolled']:.3f}  "
              f"stars {summary['bench']['stars_overhead']:.2f}x", flush=True)
    except Exception as e:  # compile failure, out of memory: recorded, and the other stages still run
        summary["bench"] = {"rc": 1, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"bench      failed: {summary['bench']['error']}", flush=True)
    lm = ["--dataset", "pydoc", "--tokenizer", "bytes" if dry else "regex", "--eval_interval", "1000", "--eval_iters", "2",
          "--cache_dir", os.path.join(tmp, "cache")] + ([] if dry else ["--compile"])
    train_run("lm_44m", "config/wikitext103_44m.py", lm + steps + tiny + (["--block_size", "32"] if dry else []))
    train_run("addition", "config/addition.py", ["--stars_lambda", "0.1", "--stars_warmup", "0", "--loop_sampling",
              "lognormal", "--eval_interval", "1000", "--eval_loops", "4" if dry else "16", "--eval_problems", "100"]
              + steps + tiny + (["--loop_max", "4"] if dry else []))
    if dry or torch.cuda.device_count() >= 2:
        train_run("torchrun", "config/wikitext103_44m.py", lm + steps + tiny + (["--block_size", "32"] if dry else []), nproc=2)
    with open(args.check_out, "w") as f:  # (train_run and run record failures rather than raise)
        json.dump(summary, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.check_out}")
    return 0 if all(v.get("rc", 0) == 0 for v in summary.values() if isinstance(v, dict)) else 1


PRESETS = {  # --presets: each CPU preset's short run, ~100 steps and its final evaluation, at the preset's shapes
    "cpu_tiny": "config/cpu_tiny.py",
    "ablation_cpu": "config/ablation_cpu.py",
    "depth_cpu": "config/depth_cpu.py",
    "addition_cpu": "config/addition_cpu.py",
    "addition_cpu_stars": "config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1 --loop_start 0 "
                          "--stars_warmup 0",
}
PHASES = {  # where a run's time goes: cumulative seconds in these functions (cProfile)
    "data": "data.load_task_data", "train steps": "train.train", "evaluation": "report.evaluate",
    "report and plots": "report.write_report", "sample": "sample.generate",
    "checkpoints": ("checkpoint.save_checkpoint", "report.save_checkpoint")}  # (report.py's before checkpoint.py)
EVAL_PARTS = {  # inside the evaluation; what is left of it is CE, norms, relative step, strict exact match
    "eval: radial fraction": "looplm.radial_fraction",
    "eval: ρ": ("report.loop_rho", "report.loop_map_rho"),  # (loop_map_rho: an older commit's, for --against)
    "eval: tokens/s": "report.depth_throughput", "eval: public addition protocol": "report.public_addition_accuracy",
    "eval: scale probe": "looplm.scale_probe"}


def preset_runs(args):
    """--presets: each preset's short run (python train.py PRESET --max_iters N) under cProfile, one thread, one
    after the other; per preset its wall time, steps/s and the share of each phase (PHASES). Nested phases are
    taken out of their parent (the evaluation out of the training loop, its parts out of it), so the shares
    add up to 1."""
    import pstats
    import tempfile
    out = {}
    for name in filter(None, args.presets.split(",")):
        if name not in PRESETS:
            raise UsageError(f"--presets {name!r} is unknown; choose among {', '.join(PRESETS)}")
        with tempfile.TemporaryDirectory() as tmp:
            argv = [*PRESETS[name].split(), "--max_iters", str(args.preset_iters), "--eval_interval", str(args.preset_iters),
                    "--num_threads", "1", "--out_dir", tmp, "--cache_dir", os.path.join(tmp, "cache")]
            if args.data_dir and "addition" not in name:
                argv += ["--data_dir", args.data_dir]
            prof = os.path.join(tmp, "prof.out")
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "cProfile", "-o", prof, "train.py", *argv], capture_output=True,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               cwd=args.presets_repo or os.path.dirname(os.path.abspath(__file__)))
            wall = time.perf_counter() - t0
            if r.returncode:
                raise RunError(f"--presets {name}: train.py failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            cum = {}
            for (file, _, func), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():
                key = f"{os.path.splitext(os.path.basename(file))[0]}.{func}"
                cum[key] = max(cum.get(key, 0.0), ct)
        total = lambda fns: sum(cum.get(fn, 0.0) for fn in ((fns,) if isinstance(fns, str) else fns))
        sec = {phase: total(fns) for phase, fns in PHASES.items()}
        sec["train steps"] -= cum.get("train.evaluate_and_save", 0.0)  # the evaluations and saves it makes
        sec["start-up"] = wall - sum(sec.values())                    # process start, imports, the model
        parts = {part: total(fns) for part, fns in EVAL_PARTS.items()}
        sec["eval: CE, norms, relative step, exact match"] = sec.pop("evaluation") - sum(parts.values())
        sec.update(parts)
        steps = sec["train steps"]
        out[name] = {"wall_s": wall, "steps_per_s": args.preset_iters / steps if steps > 0 else float("nan"),
                     **{k: v / wall for k, v in sec.items()}}
    return out


SPINS = ("300000", "3000", "0")  # GOMP_SPINCOUNT: libgomp's default, train.py's, none


def busy_runs(args):
    """--busy: does a run collapse on a shared machine? Wall seconds of N steps of config/cpu_tiny.py (train.py, its
    final evaluation cut to one batch at loop 1) with torch's default threads at each OpenMP spin count (SPINS) and on one thread, alone and then
    beside another run of it on one thread. OpenMP's threads spin while they wait for work; with the cores taken,
    the spinning takes them from the other run."""
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")}

    def train(tmp, name, threads, spins, steps):
        argv = ["config/cpu_tiny.py", "--max_iters", str(steps), "--eval_interval", "1000000", "--sample_tokens", "0",
                "--eval_iters", "1", "--eval_loops", "1",  # (the one evaluation, at the end: loop 1 of one batch)
                "--num_threads", str(threads), "--out_dir", os.path.join(tmp, name), "--cache_dir", os.path.join(tmp, "c")]
        return subprocess.Popen([sys.executable, "train.py", *argv], cwd=here, env={**env, "GOMP_SPINCOUNT": spins},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wall(tmp, name, threads, spins):
        t0, p = time.perf_counter(), train(tmp, name, threads, spins, args.busy_iters)
        if p.wait():
            raise RunError(f"--busy: train.py failed: {(p.stderr.read().strip().splitlines() or ['?'])[-1]}")
        return time.perf_counter() - t0
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        wall(tmp, "warm", 1, SPINS[1])  # the token cache, once
        for where in ("alone", "beside a 1-thread run"):
            other = train(tmp, "other", 1, SPINS[1], 10**6) if where != "alone" else None
            time.sleep(5 if other else 0)  # (its start-up)
            for spins in SPINS:
                out[f"{where}, default threads, GOMP_SPINCOUNT {spins}"] = wall(tmp, f"d{spins}{bool(other)}", 0, spins)
            out[f"{where}, 1 thread"] = wall(tmp, f"one{bool(other)}", 1, SPINS[1])
            if other:
                other.kill()
                other.wait()
    return out


@dataclass
class BenchConfig:
    """benchmark (bench.py)"""
    shape: str = setting("", f"comma-separated, of {', '.join(SHAPES)} (default: 44m,tiny on CPU, 44m on CUDA, quick "
                             "with --quick)")
    quick: bool = setting(False, "smoke run: the quick shape, 1 thread, 1 warm-up call, 3 timed")
    device: str = setting("cpu", "cpu | cuda | cuda:N")
    batch_size: int = setting(0, "override the shape's batch size (0: the shape's)", lo=0, hi=1_000_000)
    warmup: int = setting(2, "untimed calls per configuration", lo=0, hi=1000)
    reps: int = setting(5, "timed calls per configuration (the median is reported)", lo=1, hi=1000)
    peak_flops: float = setting(0.0, "peak FLOP/s for mfu (0: measured, the best torch.mm at the model's shapes and a "
                                     "large square one; float32 on CPU, bfloat16 on CUDA)", lo=0.0, hi=1e18)
    per_loop_ce: bool = setting(False, "train on mean_k CE_k as config/*.py do (default: CE_K, so that the looped "
                                       "and the unrolled model have equal FLOPs)")
    stars_mode: str = setting("vjp", "how the STARS penalty gets Jv (vjp: train.py's default)", choices=stars.MODES)
    stars_rows: int = setting(0, "stars_overhead_rows: the penalty on the first N sequences only (0: a quarter of "
                                 "the batch)", lo=0, hi=65536)
    grad_loops: int = setting(2, "loops with gradient in the truncated-backprop run", lo=1, hi=100_000)
    mem_loops: str = setting("4,8,16", "loop counts K of the memory runs (comma-separated)")
    memory: bool = setting(True, "the memory runs (--no_memory: skip them)")
    compile: bool = setting(False, "torch.compile model.step, as train.py --compile")
    profile: bool = setting(False, "CPU: where a step's time goes (kernel_share, mfu_bound, and the top ops on stderr)")
    tune_malloc: bool = setting(True, "keep freed memory in glibc's heap (--no_tune_malloc: glibc's defaults; see "
                                      "tune_malloc)")
    threads: int = setting(0, "torch threads on CPU (0: torch's choice)", lo=0, hi=4096)
    clock: str = setting("wall", "wall: seconds | cpu: CPU seconds of this process, blind to other processes on a "
                                 "shared machine (needs --threads 1)", choices=("wall", "cpu"))
    json: bool = setting(False, "print one JSON object instead of the table")
    gpu_check: bool = setting(False, "the one-command GPU check (gpu_check below); with --dry, the same on CPU at "
                                     "tiny shapes")
    dry: bool = setting(False, "--gpu_check on CPU, tiny shapes, a few steps: the code path without a GPU")
    check_out: str = setting("gpu_check.json", "where --gpu_check writes its summary")
    presets: str = setting("", f"comma-separated, of {', '.join(PRESETS)}: each preset's short run under cProfile, "
                               "one thread: wall time, steps/s, and the share of each phase (preset_runs)")
    preset_iters: int = setting(100, "--presets: training steps of each short run", lo=1, hi=100_000)
    data_dir: str = setting("", "--presets: a folder of WikiText-2 files for the presets that train on it (else the hub)")
    presets_repo: str = setting("", "--presets: run the train.py of this checkout (an older commit, say) instead of this one's")
    busy: bool = setting(False, "N steps of config/cpu_tiny.py alone and beside another run, at each OpenMP spin count "
                                "(busy_runs): does the thread default collapse on a shared machine?")
    busy_iters: int = setting(50, "--busy: training steps of each run", lo=1, hi=100_000)
    _memory: str = setting("", None)  # internal: the CPU memory child


def parse_args(argv=None):
    values, _ = parse(sys.argv[1:] if argv is None else argv, (BenchConfig,), __doc__)
    args = BenchConfig(**values)
    check(args)
    for name in filter(None, args.shape.split(",")):
        if name not in SHAPES:
            raise UsageError(f"--shape {name!r} is unknown; choose among {', '.join(SHAPES)}")
    if not re.fullmatch(r"\d+(,\d+)*", args.mem_loops) or 0 in map(int, args.mem_loops.split(",")):
        raise UsageError(f"--mem_loops {args.mem_loops!r} is invalid; give loop counts >= 1, e.g. 4,8,16")
    check_device(args.device, auto=False)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"--device {args.device} but CUDA is not available; use --device cpu")
    return args


def main(argv=None):
    global CLOCK
    args = parse_args(argv)
    if args.quick:  # one thread: seconds even on a busy shared machine, where OpenMP threads wait on each other
        args.warmup, args.reps, args.threads = 1, 3, args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu_check:
        return gpu_check(args)
    if args.presets:
        res = preset_runs(args)
        if args.json:
            return print(json.dumps(res, indent=1))
        names = list(res)
        print("| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for key in res[names[0]]:
            fmt = (lambda v: f"{v:.0f}") if key == "wall_s" else (lambda v: f"{v:.2f}") if key == "steps_per_s" \
                else (lambda v: f"{100 * v:.1f}%")
            print(f"| {key} | " + " | ".join(fmt(res[n][key]) for n in names) + " |")
        return 0
    if args.busy:
        res = busy_runs(args)
        return print(json.dumps(res, indent=1) if args.json else "\n".join(f"{k:<56} {v:6.1f} s" for k, v in res.items()))
    if args._memory:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: allocations over 1 MiB get their own map
        shape = json.loads(args._memory)
        memory_one(args, shape, "cpu", 1, "plain")  # a first step pays the one-time allocations
        return print(json.dumps(memory_runs(args, shape, "cpu", child=True)))
    if args.profile and args.device != "cpu":
        raise UsageError("--profile measures CPU time per op: use it on CPU (on a GPU, see torch.profiler's CUDA activity)")
    if args.clock == "cpu":
        if torch.get_num_threads() != 1 or args.device != "cpu":
            raise UsageError("--clock cpu adds up the CPU time of all threads: use it with --threads 1 on CPU")
        CLOCK = time.process_time
    cuda = args.device.startswith("cuda")
    names = (args.shape or ("quick" if args.quick else "44m" if cuda else "44m,tiny")).split(",")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tuned = not cuda and args.tune_malloc and tune_malloc()
    load0 = os.getloadavg()[0]
    results = {s: bench(args, dict(SHAPES[s], batch_size=args.batch_size or SHAPES[s]["batch_size"]), args.device)
               for s in names}
    meta = dict(device=args.device, threads=torch.get_num_threads(), clock=args.clock, compile=args.compile,
                malloc_tuned=tuned, loadavg_start=load0, loadavg_end=os.getloadavg()[0], torch=torch.__version__)
    if args.json:
        return print(json.dumps({"meta": meta, **results}, indent=1))
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    for s in names:
        c = SHAPES[s]
        print(f"{s}: d {c['n_embd']}, {c['n_head']} heads, {c['n_layer']} layers, K {c['n_loops']}, vocab {c['vocab_size']}, "
              f"batch {args.batch_size or c['batch_size']} x seq {c['block_size']}, {'per-loop' if args.per_loop_ce else 'terminal'} CE")
    print(f"{'':<24}" + "".join(f"{s:>12}" for s in names) + "   target")
    for key in results[names[0]]:
        vals = [results[s].get(key, float("nan")) for s in names]
        row = f"{key:<24}" + "".join(f"{v:>12.3f}" if abs(v) < 100 else f"{v:>12.0f}" for v in vals)
        if key in TARGETS and not (key == "mfu" and cuda):
            op, target = TARGETS[key]
            for s, v in zip(names, vals):
                t = target.get(s) if isinstance(target, dict) else target
                if t is not None:
                    row += f"   {s}: {op} {t} {'ok' if (v >= t if op == '>=' else v <= t) else 'SHORT'}"
        print(row)


def cli(argv=None):
    return command("bench.py", lambda: main(argv))


if __name__ == "__main__":
    sys.exit(cli())
