"""
train.py: train and evaluate looped LMs, on one GPU, on a CPU, or on several processes (torchrun).

    python train.py --readout raw --per_loop_ce                  # Paper A's 44M shape on WikiText-103, GPT-2 BPE
    python train.py config/wikitext103_44m.py                    # Paper A's own recipe (its tokens, per-loop CE)
    python train.py config/cpu_tiny.py                           # a real run on a 2-core CPU, no download
    python train.py config/addition_cpu.py --stars_lambda 0.1 --loop_sampling lognormal   # Paper B's addition
    python train.py --eval_only --init_from resume --out_dir out # re-evaluate a checkpoint
    python train.py --compare out-a,out-b --out_dir cmp          # table and overlaid plots of several runs
    torchrun --nproc_per_node 2 train.py config/cpu_tiny.py      # data parallel (NCCL on GPU, gloo on CPU)

Settings come from, in order: the defaults below (the model's are looplm.LoopLMConfig's: Paper A's
44M shape), config/*.py files of plain assignments, then --name value options. With --init_from
resume the checkpoint's settings are used, except those given on the command line.
"""
import datetime
import math
import os
import signal
import sys
import time
from contextlib import nullcontext, suppress
from types import SimpleNamespace
from dataclasses import dataclass, fields

# idle OpenMP threads spin 300,000 times (libgomp) before sleeping, starving other processes (`bench.py --busy`)
os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # read when torch loads OpenMP, so before `import torch`
import torch  # noqa: E402

import checkpoint
import data
import report
import stars
from configurator import RunError, UsageError, check, command, interrupt, parse, setting
from looplm import LoopLMConfig, token_norms


# ---------------------------------------------------------------- settings
@dataclass
class TrainConfig:
    """training (train.py)"""
    # I/O
    out_dir: str = setting("out", "where ckpt.pt, log.jsonl, report.json and the plots go")
    init_from: str = setting("scratch", "scratch, or resume from out_dir/ckpt.pt", choices=("scratch", "resume"))
    eval_only: bool = setting(False, "evaluate the checkpoint in out_dir and exit (with --init_from resume)")
    eval_interval: int = setting(500, "evaluate and checkpoint every N steps", lo=1, hi=10**12)
    log_interval: int = setting(10, "print and log a row every N steps", lo=1, hi=10**12)
    eval_iters: int = setting(20, "validation batches per evaluation (LM task)", lo=1, hi=100_000)
    always_save_checkpoint: bool = setting(True, "save at every evaluation, not only when the validation loss improves")
    overwrite: bool = setting(False, "from scratch, replace the run in out_dir, finished or interrupted, of any shape "
                                     "(otherwise refused)")
    compare: str = setting("", "comma-separated run folders: table their reports, overlay their plots in out_dir, exit")
    # data
    task: str = setting("lm", "lm: language modelling | addition: Paper B's N-digit addition", choices=("lm", "addition"))
    dataset: str = setting("wikitext103", "wikitext103, wikitext2: from the Hugging Face hub (wikitext2 from --data_dir "
                           "if given) | text: --data_files | pydoc: the Python docs, offline",
                           choices=("wikitext103", "wikitext2", "text", "pydoc"))
    data_dir: str = setting("", "a folder of WikiText-2 files (train.txt, valid.txt, test.txt): no download")
    data_files: str = setting("", "comma-separated text files for --dataset text (the last one is the validation "
                                  "split; a single file: its last 10%)")
    train_split: str = setting("train", "WikiText split to train on (the validation split is always evaluated; "
                                        "the CPU presets train on the small test split)", choices=("train", "test"))
    tokenizer: str = setting("gpt2", "gpt2: tiktoken BPE | bytes: 256 symbols | regex: Paper A's, vocab <= 20,000",
                             choices=("gpt2", "bytes", "regex"))
    cache_dir: str = setting("data_cache", "where tokenized datasets are cached as memmaps")
    digits: int = setting(4, "operand digits of the addition task", lo=2, hi=8)
    zero_digits_steps: int = setting(0, "addition, easy problems first: each non-leading operand digit is forced to 0 "
                                        "with a probability from 0.5 to 0 over N steps (data.addition_zeros)", lo=0, hi=10**12)
    window_stride: int = setting(0, "0: random windows (nanoGPT) | S: Paper A's epochs of windows starting every S "
                                    "tokens, shuffled (S = block_size/2: each token seen twice an epoch)", lo=0, hi=10**9)
    # optimization
    batch_size: int = setting(64, "sequences per micro-batch", lo=1, hi=65536)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", lo=1, hi=65536)
    max_iters: int = setting(5000, "optimizer steps (set by --epochs when > 0)", lo=1, hi=10**12)
    epochs: float = setting(0.0, "passes over the training data; sets max_iters when > 0. An epoch is every window "
                                 "once (--window_stride), else as many tokens as the split holds", lo=0.0, hi=1e6)
    learning_rate: float = setting(3e-4, "peak AdamW learning rate", lo=0.0, hi=10.0)
    lr_schedule: str = setting("constant", "constant (Paper A) | cosine: linear warm-up, then decay to min_lr",
                               choices=("constant", "cosine"))
    warmup_iters: int = setting(0, "linear warm-up steps", lo=0, hi=10**12)
    min_lr: float = setting(0.0, "final learning rate of the cosine schedule", lo=0.0, hi=10.0)
    weight_decay: float = setting(0.01, "AdamW weight decay (matrices and embeddings only)", lo=0.0, hi=10.0)
    beta1: float = setting(0.9, "AdamW beta1", lo=0.0, hi=0.9999)
    beta2: float = setting(0.999, "AdamW beta2", lo=0.0, hi=0.99999)
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0 = off)", lo=0.0, hi=1e6)
    # depth during training (Paper B)
    loop_sampling: str = setting("fixed", "fixed: n_loops | lognormal: clip(round(LogNormal(mu, sigma)), 1, loop_max) "
                                 "| poisson_lognormal: Huginn's, Poisson(e^τ) + 1 with E[e^τ] = loop_mean",
                                 choices=stars.KINDS)
    loop_mu: float = setting(2.0, "lognormal: mu", lo=-10.0, hi=10.0)
    loop_sigma: float = setting(0.7, "lognormal and poisson_lognormal: sigma", lo=0.0, hi=10.0)
    loop_max: int = setting(100, "the largest sampled number of loops", lo=1, hi=100_000)
    loop_mean: float = setting(4.0, "poisson_lognormal: r̄, the mean of e^τ (the depth's mean is r̄ + 1 before "
                                    "loop_max)", above=0.0, hi=100_000.0)
    loop_start: int = setting(0, "sample depths from this step on; before it train at n_loops (a curriculum: the shallow "
                                 "task first; Paper B: 0)", lo=0, hi=10**12)
    grad_loops: int = setting(0, "from --loop_start on, truncated backprop: gradient through the last N loops only (0: "
                                 "every loop, Paper B; Huginn: 8; fixed depth n_loops > N: a DEQ-style target)", lo=0, hi=100_000)
    stars_lambda: float = setting(0.0, "STARS: weight of the Jacobian penalty (Paper B: 0.1; 0 = off)", lo=0.0, hi=1.0)
    stars_warmup: int = setting(2000, "steps before the STARS penalty is switched on", lo=0, hi=10**12)
    stars_mode: str = setting("vjp", "vjp: as Paper B's code | jvp: forward-mode AD", choices=stars.MODES)
    stars_rows: int = setting(0, "the STARS penalty on the first N sequences of each micro-batch only (0 = all, as "
                                 "Paper B): an unbiased estimate of the same mean at a fraction of the cost", lo=0, hi=65536)
    stars_iters: int = setting(1, "power iterations inside the STARS penalty (Paper B's spectral_iters: 1)", lo=1, hi=100)
    stars_supervised: bool = setting(False, "the STARS penalty at supervised positions only (Paper B: every position)")
    checkpoint_loops: bool = setting(False, "activation checkpointing per loop (the step and, with per-loop CE, the "
                                            "readout): training memory flat in the depth")
    # evaluation
    eval_loops: int = setting(0, "evaluate loops 1..N (0: n_loops; addition: 32)", lo=0, hi=100_000)
    eval_problems: int = setting(1000, "held-out addition problems for exact match", lo=1, hi=1_000_000)
    sample_tokens: int = setting(0, "at the end, print a sample of this many tokens (temperature 0.8; LM task)", lo=0, hi=10**6)
    # system
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto: bfloat16 on CUDA, float32 on CPU", choices=("auto", "float32", "bfloat16"))
    compile: bool = setting(False, "torch.compile the loop step (the STARS penalty stays eager)")
    seed: int = setting(1337, "random seed: init, data order, dropout, sampled depths, STARS's direction "
                              "(train.step_streams), the validation windows", lo=0, hi=2**32 - 1)
    num_threads: int = setting(0, "CPU threads (0 = torch's default)", lo=0, hi=4096)


def settings(argv):
    """Defaults < config files < --options: (TrainConfig, model settings dict, names given)."""
    values, given = parse(argv, (TrainConfig, LoopLMConfig), __doc__)
    cfg = TrainConfig(**{f.name: values[f.name] for f in fields(TrainConfig)})
    model_args = {f.name: values[f.name] for f in fields(LoopLMConfig)}
    check(cfg)
    LoopLMConfig(**model_args)  # checks the model's settings
    if cfg.zero_digits_steps and cfg.task != "addition":
        raise UsageError(f"--zero_digits_steps {cfg.zero_digits_steps} is a curriculum of the addition task; "
                         "use it with --task addition")
    if cfg.stars_lambda and cfg.stars_warmup >= cfg.max_iters and not cfg.eval_only:
        raise UsageError(f"--stars_warmup {cfg.stars_warmup} is not below --max_iters {cfg.max_iters}: the STARS penalty "
                         "would never switch on; lower --stars_warmup")
    if cfg.eval_only and cfg.init_from != "resume":
        raise UsageError("--eval_only needs --init_from resume (and a checkpoint in --out_dir)")
    if cfg.device != "auto":
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise UsageError(f"--device {cfg.device!r} is invalid; use auto, cpu, cuda or cuda:N") from None
    return cfg, model_args, given


# ---------------------------------------------------------------- the model and its data
def setup_device(cfg):
    """(device, autocast context, rank, world size). torchrun sets WORLD_SIZE and RANK."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 256:
        raise UsageError(f"{world} processes: at most 256 (each has its own random streams, train.stream_seed)")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if "cuda" in device and not torch.cuda.is_available():
        raise RunError(f"--device {device} but CUDA is not available; use --device cpu (or auto)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"--device {device} is not supported; use auto, cpu, cuda or cuda:N")
    if world > 1:
        # rank 0 evaluates and saves while the others wait in a collective: a long timeout
        torch.distributed.init_process_group("nccl" if "cuda" in device else "gloo", timeout=datetime.timedelta(hours=2))
        if "cuda" in device:
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if "cuda" in device else "float32")
    if "cuda" in device:
        torch.cuda.set_device(device)  # cuda:N without torchrun too: synchronize and memory counters follow it
        # fp32 matmuls (evaluation, diagnostics) on TF32 units, unless float32 was asked for explicitly
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.dtype != "float32"
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    ctx = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    return device, dtype, ctx, rank, world


def lr_at(cfg, it, max_iters):
    """Constant (after an optional linear warm-up), or cosine from learning_rate down to min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    frac = min(1.0, (it - cfg.warmup_iters) / max(1, max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.learning_rate - cfg.min_lr)


# ---------------------------------------------------------------- the training loop
STREAMS = ("depth", "batch", "v", "dropout")


def stream_seed(seed, it, stream, rank=0):
    """The seed of one random stream of step `it`. Within a seed, a different number for each step below 2^22,
    stream and rank (< 256) in its low 32 bits, the only ones torch's CPU generator keeps. A new name in STREAMS
    changes len(STREAMS) and with it every stream's seed, so recorded runs would no longer replay (seed a new
    generator from an existing stream's seed XOR a constant instead)."""
    return (((seed * 1_000_003 + it) * 256 + rank) * len(STREAMS) + STREAMS.index(stream)) % 2**64


def step_streams(cfg, it, rank, device):
    """Step `it`'s random streams, each from its own generator seeded by (seed, step, stream, rank) alone. So a
    resumed run draws what the uninterrupted one drew (exactly on CPU), and no stream shifts another: rows of one
    seed train on the same batches whatever their depth sampler or penalty. The depth is the same on every rank (it
    is drawn as rank 0's); the batch and STARS's direction v are each rank's own, v on the device (None without
    STARS). Dropout and the random start's noise use torch's global generator, seeded here with the "dropout"
    stream. Returns the (depth, batch, v) generators."""
    torch.manual_seed(stream_seed(cfg.seed, it, "dropout", rank))
    gen = lambda stream, r, dev="cpu": torch.Generator(dev).manual_seed(stream_seed(cfg.seed, it, stream, r))
    return gen("depth", 0), gen("batch", rank), gen("v", rank, device) if cfg.stars_lambda else None


def train(cfg, run, model, optimizer):
    """Train from run.iter_num to run.max_iters. Returns the exit code."""
    # Ctrl-C / SIGTERM while training: finish the step, save, exit 130 / 143 (torchrun signals every rank).
    # While evaluating, the signal interrupts at once (main() says what is saved)
    stop = {}

    def on_signal(sig, _):
        if stop.get("evaluating"):
            interrupt(sig)  # KeyboardInterrupt or Terminated: exit 130 or 143
        stop.setdefault("sig", sig)
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    model.train()
    t0, t_start, it0 = time.perf_counter(), time.perf_counter(), run.iter_num
    guard = NonFiniteGuard(run.device)
    try:
        while run.iter_num < run.max_iters:
            it = run.iter_num
            lr = lr_at(cfg, it, run.max_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            g_depth, g_batch, g_penalty = step_streams(cfg, it, run.rank, run.device)
            n_loops, grad_loops = stars.training_depth(cfg, it, model.config.n_loops, g_depth)
            lam = stars.lambda_at(it, cfg.stars_lambda, cfg.stars_warmup)
            penalty = stars.Penalty(lam, cfg.stars_mode, cfg.stars_rows, cfg.stars_iters, cfg.stars_supervised,
                                    g_penalty) if lam > 0 else None
            logged = torch.zeros(4, device=run.device)  # loss, mean ‖H_K‖, signalled, ‖vᵀJ‖: read at log steps
            for micro in range(cfg.gradient_accumulation_steps):
                x, y = data.train_batch(cfg, run, g_batch, micro)
                with run.ctx:
                    loss, states, jv = stars.training_loss(model, x, y, n_loops, grad_loops, penalty, cfg.checkpoint_loops)
                (loss / cfg.gradient_accumulation_steps).backward()
                logged[:2] += torch.stack([loss.detach().float(), token_norms(states[-1].detach()).mean()]) \
                    / cfg.gradient_accumulation_steps
                if jv is not None:  # the penalty's ‖Jv‖ (vjp: ‖vᵀJ‖), averaged over sequences, micro-batches (and ranks)
                    logged[3] += jv.detach().float().mean() / cfg.gradient_accumulation_steps
            logged[2] = float("sig" in stop)
            if run.world > 1:  # average the gradients and the logged numbers over ranks
                all_reduce_mean(list(model.parameters()), logged)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))  # 0: measure
            guard.check(optimizer, logged[0], grad_norm, it)
            logged = torch.cat([logged, grad_norm.reshape(1).float()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.iter_num += 1
            log_now = run.iter_num % cfg.log_interval == 0 or run.iter_num == run.max_iters
            eval_now = run.iter_num % cfg.eval_interval == 0 or run.iter_num == run.max_iters
            if log_now or eval_now:  # the only host syncs of the loop: here, at the log and eval intervals
                loss_f, norm_K, signalled, jv_f, grad_f, bad_step = torch.cat([logged, guard.first.reshape(1).float()]).tolist()
                if bad_step:
                    raise guard.error(bad_step, f"; at step {run.iter_num}: loss {loss_f:.4g}, gradient norm {grad_f:.4g}")
            if run.master and log_now:
                dt = time.perf_counter() - t0
                tps = run.tokens_per_iter * cfg.log_interval / dt if run.iter_num % cfg.log_interval == 0 else 0
                eta = (time.perf_counter() - t_start) / (run.iter_num - it0) * (run.max_iters - run.iter_num)
                checkpoint.append_log(run.log_path, {"iter": run.iter_num, "loss": loss_f, "lr": lr, "loops": n_loops,
                                                 "norm_K": norm_K, "tokens_per_s": tps,
                                                 **({"jv_norm": jv_f} if penalty is not None else {})})
                jv_text = "" if penalty is None else f" | {'‖vᵀJ‖' if penalty.mode == 'vjp' else '‖Jv‖'} {jv_f:.3f}"
                print(f"step {run.iter_num}/{run.max_iters} loss {loss_f:.4f} | {tps:,.0f} tok/s | ETA {eta / 60:.1f} min"
                      f" | ‖H_K‖ {norm_K:.1f} | loops {n_loops}{jv_text}", flush=True)
                t0 = time.perf_counter()
            # one process stops at once; ranks together, at a log or eval step (all read the averaged flag there)
            stopping = "sig" in stop if run.world == 1 else (log_now or eval_now) and signalled > 0
            if eval_now:
                ok = False
                try:
                    if run.master:
                        evaluate_and_save(cfg, run, model, optimizer, stop)
                    ok = True
                finally:  # the other ranks learn whether rank 0's evaluation and save went through
                    if run.world > 1:
                        rank0_ok(run, ok)
                t0 = time.perf_counter()  # evaluation time is not training throughput
            if stopping:
                if guard.first.item():  # (skipped updates: the weights are clean, but say so rather than save)
                    raise guard.error(guard.first.item())
                if run.master:
                    SAVED["path"], SAVED["step"] = checkpoint.save_interrupted(cfg, run, model, optimizer), run.iter_num
                return 128 + stop.get("sig", signal.SIGTERM)  # (a rank stopped by another rank's signal: 143)
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    return 0


class NonFiniteGuard:
    """A step whose loss or gradient norm is inf or NaN must not reach the weights, and the loop must not wait
    on the device every step to find out. check() sets optimizer.found_inf, the hook GradScaler uses: fused AdamW
    (required; configure_optimizers always builds it) reads it on the device and, where it is 1, leaves the
    weights, the moments and the step count as they were. The first such step stays on the device (first:
    0 if none); the loop reads it with its logged numbers at the next log or eval step, and stops with error()."""

    def __init__(self, device):
        self.first = torch.zeros((), dtype=torch.long, device=device)

    def check(self, optimizer, loss, grad_norm, it):
        bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss))
        optimizer.found_inf = bad.float()
        self.first = torch.where(bad & (self.first == 0), it + 1, self.first)

    @staticmethod
    def error(step, detail=""):
        return RunError(f"non-finite loss or gradient at step {step:.0f} (the update was skipped{detail}); stopping. "
                        f"Last good checkpoint: {SAVED.get('path', 'none saved yet')} (left untouched). Lower "
                        "--learning_rate or check the data")


def all_reduce_mean(params, logged):
    """Average the gradients and the logged numbers over ranks in ONE collective over a flat buffer (DDP's bucket).
    Not DDP itself: its hooks fire during backward, and the STARS penalty's double backward is not supported there."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads] + [logged])
    torch.distributed.all_reduce(flat)
    flat /= torch.distributed.get_world_size()
    i = 0
    for p, g in zip(params, grads):
        p.grad = flat[i:i + g.numel()].view_as(g)
        i += g.numel()
    logged.copy_(flat[i:])


def rank0_ok(run, ok):
    """Rank 0 evaluates and saves while the others wait here; if it failed, they stop too."""
    flag = torch.tensor([float(ok)], device=run.device)
    torch.distributed.broadcast(flag, src=0)
    if not run.master and not flag.item():
        raise RunError("rank 0 stopped during evaluation or saving (its message says why)")


# ---------------------------------------------------------------- checkpoints, log, report
def evaluate_and_save(cfg, run, model, optimizer, stop):
    """Evaluate (a Ctrl-C interrupts it at once); save ckpt.pt if always_save_checkpoint or the validation
    loss improved (a Ctrl-C waits for the save); at the end, write report.json and the plots."""
    final = run.iter_num == run.max_iters
    print(f"step {run.iter_num}: ", end="")
    stop["evaluating"] = True
    val_loss, rep = report.evaluate(model, cfg, run.val_data, run.device, run.ctx, final)
    stop["evaluating"] = False
    checkpoint.append_log(run.log_path, {"iter": run.iter_num, "val_loss": val_loss})
    improved, run.best_val = val_loss <= run.best_val, min(run.best_val, val_loss)
    if cfg.always_save_checkpoint or improved:
        checkpoint.save_checkpoint(run.ckpt_path, checkpoint.make_ckpt(cfg, run, model, optimizer))
        SAVED["path"], SAVED["step"] = run.ckpt_path, run.iter_num
        checkpoint.adopt_log(run)
    if final:
        report.write_report(cfg.out_dir, {**rep, "iter": run.iter_num})


SAVED = {}  # the last checkpoint this process wrote or resumed from: what a Ctrl-C message points at
LOCK = {}  # the out_dir's lock while a command runs (checkpoint.lock_out_dir) and whether the run made the folder


def start(cfg, model_args, given):
    if cfg.compare:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print("wrote " + ", ".join(report.compare_runs([d for d in cfg.compare.split(",") if d], cfg.out_dir)))
        return 0
    device, dtype, ctx, rank, world = setup_device(cfg)
    made = checkpoint.writable_out_dir(cfg.out_dir, rank)
    if rank == 0:  # one process per out_dir, till main() ends (--compare and sample.py only read: no lock)
        LOCK["out_dir"] = checkpoint.lock_out_dir(cfg.out_dir), made
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = checkpoint.load_checkpoint(ckpt_path) if cfg.init_from == "resume" else None
    if ckpt is not None:
        if not cfg.eval_only and "optimizer" not in ckpt:
            raise RunError(f"{ckpt_path} has no optimizer state: it can be evaluated (--eval_only) or sampled, not "
                           "resumed; train from scratch in another --out_dir")
        cfg, model_args = checkpoint.resume_settings(cfg, model_args, given, ckpt)
    if cfg.init_from == "scratch" and not cfg.overwrite:
        checkpoint.guard_out_dir(cfg.out_dir, cfg.task, model_args)
    train_data, val_data, meta = data.load_task_data(cfg, model_args, ckpt)
    vocab = data.get_tokenizer(meta).vocab_size  # GPT-2's padded; Paper A's regex vocabulary stays exact
    vocab = model_args["vocab_size"] if ckpt else data.padded_vocab(vocab) if meta["kind"] == "gpt2" else vocab
    mcfg = LoopLMConfig(**{**model_args, "vocab_size": vocab})
    model, optimizer = checkpoint.build_model(cfg, mcfg, device, ckpt)
    tokens_per_iter = cfg.batch_size * mcfg.block_size * cfg.gradient_accumulation_steps * world
    max_iters = cfg.max_iters
    if cfg.epochs > 0 and train_data is not None:  # an epoch: every window once, or as many tokens as the split
        per_epoch = (data.n_windows(len(train_data), mcfg.block_size, cfg.window_stride) * mcfg.block_size
                     if cfg.window_stride else len(train_data))
        max_iters = math.ceil(cfg.epochs * per_epoch / tokens_per_iter)
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if ckpt is None and os.path.exists(log_path):  # an older run's log stays until this run saves (adopt_log)
        log_path += ".new"
    run = SimpleNamespace(  # the state of a run that the loop, the checkpoints and the log share
        device=device, ctx=ctx, rank=rank, world=world, master=rank == 0, train_data=train_data, val_data=val_data,
        meta=meta, block_size=mcfg.block_size, ckpt_path=ckpt_path, log_path=log_path, tokens_per_iter=tokens_per_iter,
        max_iters=max_iters, iter_num=(ckpt or {}).get("iter_num", 0), best_val=(ckpt or {}).get("best_val_loss", math.inf))
    if ckpt is not None:
        SAVED["path"], SAVED["step"] = ckpt_path, run.iter_num
    if run.master:
        print(f"{model.num_params():,} parameters (shared stack counted once) | {mcfg.n_layer} layers x "
              f"{mcfg.n_loops} loops | readout={mcfg.readout} per_loop_ce={mcfg.per_loop_ce} init={mcfg.init} | "
              f"{tokens_per_iter:,} tokens/step | {max_iters} steps | device {device} {dtype}")
    try:
        if cfg.eval_only:
            if run.master:
                _, rep = report.evaluate(model, cfg, val_data, device, ctx, final=True)
                report.write_report(cfg.out_dir, {**rep, "iter": run.iter_num})
            return 0
        if run.iter_num >= max_iters:
            raise UsageError(f"nothing to train: the run is at step {run.iter_num} and --max_iters is {max_iters}; "
                             "raise --max_iters" + (" (or --epochs)" if cfg.epochs else ""))
        if run.master:  # resume: the log up to the checkpoint; from scratch: a new log
            checkpoint.trim_log(run.log_path, run.iter_num)
        if cfg.compile:  # stars.looplm_step_fn keeps the STARS penalty and the evaluation's ρ on the eager step
            model.step = torch.compile(model.step)
        code = train(cfg, run, model, optimizer)
        if world > 1:  # every rank waits for the master's last evaluation and save before the group is torn down
            torch.distributed.barrier()
    except RuntimeError as e:  # out of memory (CUDA's OutOfMemoryError is one): one line saying what to lower
        oom = checkpoint.out_of_memory(e, cfg.batch_size, mcfg.block_size, mcfg.n_loops)
        if oom is e:
            raise
        raise oom from None
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
        if run.master and run.log_path.endswith(".new"):  # saved nothing: the older run stays whole
            with suppress(FileNotFoundError):
                os.remove(run.log_path)
    if code == 0 and cfg.sample_tokens and run.master and cfg.task == "lm":
        from sample import generate
        tok = data.get_tokenizer(meta)
        model.eval()
        vars(model).pop("step", None)  # decode eagerly: the KV cache changes shape every token (no recompiles)
        x = torch.tensor([tok.encode("The ")], device=device)  # prose, not the tables a newline often opens
        y, _ = generate(model, x, cfg.sample_tokens, mcfg.n_loops, temperature=0.8, top_k=None, vocab=tok.vocab_size)
        print("sample:", tok.decode(y[0].tolist()))
    return code


def main(argv=None):
    # Ctrl-C or SIGTERM outside the training steps (tokenizing, evaluating, sampling): say what is saved
    SAVED.clear()
    try:
        return command("train.py", lambda: start(*settings(sys.argv[1:] if argv is None else argv)),
                       lambda: "interrupted; " + (f"{SAVED['path']} holds step {SAVED['step']}" if SAVED else
                                                  "nothing was saved"))
    finally:
        if LOCK:
            checkpoint.unlock_out_dir(*LOCK.pop("out_dir"))


if __name__ == "__main__":
    sys.exit(main())
