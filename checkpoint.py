"""
checkpoint.py: what a run leaves in its out_dir, and the rules that keep it. Checkpoints (written
atomically; every field checked on load), the out_dir (one process at a time, never a finished run
replaced without --overwrite) and the training log (log.jsonl). report.py measures; this file keeps.
"""
import fcntl
import json
import math
import os
import sys
from contextlib import suppress
from dataclasses import asdict, fields

import torch

from configurator import RunError, UsageError, check
from data import atomic_write, atomic_write_text, get_tokenizer
from looplm import ARCHITECTURE, LoopLM, LoopLMConfig


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path, obj):
    """Write to a temporary file, then rename: a crash mid-write never destroys the last checkpoint."""
    try:
        atomic_write(path, lambda tmp: torch.save(obj, tmp))
    except (OSError, RuntimeError) as e:  # disk full: torch.save raises RuntimeError, open() OSError
        raise RunError(f"cannot write checkpoint {path} ({getattr(e, 'strerror', None) or str(e).splitlines()[0]}); "
                       "the previous one, if any, is intact") from None


def load_checkpoint(path, device="cpu"):
    """Load ckpt.pt (a directory or a file) with weights_only=True: a checkpoint cannot run code."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}; train one first (or use --init_from scratch)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except PermissionError:
        raise RunError(f"checkpoint {path} is not readable (permission denied)") from None
    except Exception as e:
        why = ("it holds objects other than tensors and plain data, which weights_only=True refuses to unpickle"
               if "unsupported global" in str(e).lower() else f"truncated or corrupted? {type(e).__name__}")
        raise RunError(f"checkpoint {path} is unreadable ({why})") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args", "config", "tokenizer"} <= ckpt.keys():
        raise RunError(f"{path} is not a looplm checkpoint (written by train.py)")
    check_checkpoint(ckpt, path)
    return ckpt


def check_checkpoint(ckpt, path):
    """Every field that resume, --eval_only and sample.py read, checked once, on load: a checkpoint from
    another version or program, or edited by hand, is one line naming the field, never a traceback later
    nor a default filled in silently (a missing n_embd would build another shape)."""
    def bad(what):
        return RunError(f"checkpoint {path}: {what}; it was not written by this looplm (or was edited)")
    for k in ("model", "model_args", "config", "tokenizer") + (("optimizer",) if "optimizer" in ckpt else ()):
        if not isinstance(ckpt[k], dict):
            raise bad(f"{k} is a {type(ckpt[k]).__name__}, not a dict")
    for k, ok in (("iter_num", lambda v: type(v) is int and v >= 0),
                  ("best_val_loss", lambda v: type(v) in (int, float) and not math.isnan(v))):
        if k in ckpt and not ok(ckpt[k]):
            raise bad(f"{k} is {ckpt[k]!r}")
    tok, args, weights = ckpt["tokenizer"], ckpt["model_args"], ckpt["model"]
    if tok.get("kind") not in ("gpt2", "bytes", "regex", "addition"):
        raise bad(f"tokenizer.kind is {tok.get('kind')!r}, not gpt2, bytes, regex or addition")
    vocab = tok.get("vocab")
    if tok["kind"] == "regex" and not (isinstance(vocab, list) and all(isinstance(t, str) for t in vocab)):
        raise bad("tokenizer.vocab is not a list of strings")
    # the settings the weights' shapes (and the trained depth) come from; defaults fill only newer settings
    for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_loops"):
        if k not in args:
            raise bad(f"model_args lacks {k}")
    try:
        mcfg = LoopLMConfig.from_dict(args)
    except UsageError as e:  # a wrong type or value: "--n_embd expects int, got '32'"
        raise bad("model_args." + str(e).removeprefix("--")) from None
    with torch.device("meta"):  # the shapes that model_args make, none allocated
        want = LoopLM(mcfg).state_dict()
    for k in sorted(want.keys() | weights.keys()):
        if k not in weights or k not in want or not isinstance(weights[k], torch.Tensor):
            raise bad(f"model.{k} " + ("is missing" if k not in weights else "is not a weight of this model"
                                       if k not in want else "is not a tensor"))
        if weights[k].shape != want[k].shape:
            raise bad(f"model.{k} has shape {tuple(weights[k].shape)}, but model_args make {tuple(want[k].shape)}")
    if tok["kind"] != "gpt2" and get_tokenizer(tok).vocab_size > mcfg.vocab_size:
        raise bad(f"the tokenizer has {get_tokenizer(tok).vocab_size} tokens, more than model_args.vocab_size "
                  f"{mcfg.vocab_size}")
    if "optimizer" in ckpt and not isinstance(ckpt["optimizer"].get("state"), dict):
        raise bad("optimizer.state is not a dict")
    # the training settings that it has: each of its type and in its range, as train.py checks its own
    from train import TrainConfig  # (here, not at the top: train.py imports this module)
    names = {f.name for f in fields(TrainConfig)}
    saved = ckpt["config"]
    try:
        check(TrainConfig(**{k: v for k, v in saved.items() if k in names}))
    except UsageError as e:
        raise bad("config." + str(e).removeprefix("--")) from None
    if saved.get("task") == "addition" and "digits" not in saved:
        raise bad("config lacks digits (an addition run's)")


def make_ckpt(cfg, run, model, optimizer):
    """What ckpt.pt holds: weights, optimizer state, both configs, the step, the best loss, the tokenizer."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": asdict(model.config),
            "config": asdict(cfg), "iter_num": run.iter_num, "best_val_loss": run.best_val, "tokenizer": run.meta}


def save_interrupted(cfg, run, model, optimizer):
    """Ctrl-C: the state goes to ckpt.pt when every evaluation saves anyway; otherwise ckpt.pt holds
    the best model, which an interrupted state must not replace, so it goes beside it. Returns the path."""
    path = run.ckpt_path if cfg.always_save_checkpoint else os.path.join(cfg.out_dir, "interrupted.pt")
    save_checkpoint(path, make_ckpt(cfg, run, model, optimizer))
    adopt_log(run, "log.jsonl" if path == run.ckpt_path else "interrupted.log.jsonl")
    hint = ("continue with --init_from resume" if path == run.ckpt_path else
            f"{run.ckpt_path} keeps the best model; to continue from this state, move it over ckpt.pt (and "
            "interrupted.log.jsonl, if there, over log.jsonl) and --init_from resume")
    print(f"interrupted: saved step {run.iter_num} to {path}; {hint}", file=sys.stderr)
    return path


def model_from_checkpoint(ckpt, device="cpu"):
    model = LoopLM(LoopLMConfig.from_dict(ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def build_model(cfg, mcfg, device, ckpt):
    """The model and its AdamW, from scratch (seeded) or from the checkpoint."""
    torch.manual_seed(cfg.seed)
    model = LoopLM(mcfg).to(device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.split(":")[0])
    if ckpt is not None:
        # a smaller --block_size keeps the first positions of the position embedding (and their AdamW moments)
        T = mcfg.block_size
        ckpt["model"]["wpe.weight"] = ckpt["model"]["wpe.weight"][:T]
        model.load_state_dict(ckpt["model"])
        if not cfg.eval_only:
            wpe = [id(p) for g in optimizer.param_groups for p in g["params"]].index(id(model.wpe.weight))
            try:
                for k, v in ckpt["optimizer"]["state"].get(wpe, {}).items():
                    if k in ("exp_avg", "exp_avg_sq"):
                        ckpt["optimizer"]["state"][wpe][k] = v[:T]
                optimizer.load_state_dict(ckpt["optimizer"])
                for p, state in optimizer.state.items():  # (load_state_dict checks the count, not the shapes)
                    if state["exp_avg"].shape != p.shape:
                        raise ValueError(f"a moment of shape {tuple(state['exp_avg'].shape)} for a weight of "
                                         f"{tuple(p.shape)}")
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                raise RunError(f"checkpoint {os.path.join(cfg.out_dir, 'ckpt.pt')}: its optimizer state does not fit "
                               f"the model ({type(e).__name__}: {e}); evaluate or sample it, or train from "
                               "scratch") from None
    return model, optimizer


# ---------------------------------------------------------------- the out_dir
def resume_settings(cfg, model_args, given, ckpt):
    """On --init_from resume: the checkpoint's settings (cfg: train.py's TrainConfig), overridden by those given
    on this command line; the settings that shape the weights cannot change."""
    saved = ckpt["config"]
    saved_model = LoopLMConfig.from_dict(ckpt["model_args"])
    names = {f.name for f in fields(cfg)}
    cfg = type(cfg)(**{**{k: v for k, v in saved.items() if k in names}, **{k: getattr(cfg, k) for k in given if k in names},
                         "init_from": "resume", "eval_only": cfg.eval_only, "out_dir": cfg.out_dir})
    for k in ARCHITECTURE:  # these shape (or define) the weights: they cannot change on resume
        if k in given and model_args[k] != getattr(saved_model, k):
            raise UsageError(f"--{k} {model_args[k]} differs from the checkpoint's {getattr(saved_model, k)}; "
                             "it cannot change on resume")
    if "block_size" in given and model_args["block_size"] > saved_model.block_size:
        raise UsageError(f"--block_size {model_args['block_size']} exceeds the checkpoint's "
                         f"{saved_model.block_size}: its position embeddings end there")
    return cfg, {**asdict(saved_model), **{k: model_args[k] for k in given if k in model_args}}


def writable_out_dir(out_dir, rank=0):
    """Create out_dir and check that it takes a file now, not after hours of training. Returns whether
    it made the folder (unlock_out_dir removes it again if the run leaves nothing in it)."""
    made = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test{rank}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise RunError(f"out_dir {out_dir} is not writable ({e.strerror}); pick another --out_dir") from None
    return made


def lock_out_dir(out_dir):
    """One process per out_dir: an exclusive flock on out_dir/.lock, held for the run's lifetime. The
    kernel releases it when the process ends, however it ends (kill -9 too), so there is never a stale
    lock to clean up. A second process gets one line naming the holder's pid. Returns the lock file."""
    path = os.path.join(out_dir, ".lock")
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RunError(f"{out_dir} is in use by another run (pid {holder}); wait for it to end, or pick another "
                           "--out_dir") from None
        except OSError as e:
            f.close()
            raise RunError(f"cannot lock {path} ({e.strerror}); put --out_dir on a local file system") from None
        with suppress(FileNotFoundError):  # the holder before us removes the file as it unlocks: lock the one there now
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        f.close()
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def unlock_out_dir(lock, made=False):
    """Release lock_out_dir's lock (its file goes first) and, if this run made out_dir (made) and left
    nothing in it (a run that failed early), remove the folder."""
    with suppress(FileNotFoundError):
        os.remove(lock.name)
    lock.close()
    if made:
        with suppress(OSError):  # (not empty: it stays)
            os.rmdir(os.path.dirname(lock.name))


def guard_out_dir(out_dir, task, model_args):
    """A run from scratch never replaces a run in out_dir, finished or interrupted (ckpt.pt or
    interrupted.pt), of any shape: refuse, naming what is there, unless the caller was told --overwrite."""
    for name in ("ckpt.pt", "interrupted.pt"):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        try:
            old = load_checkpoint(path)
            saved = asdict(LoopLMConfig.from_dict(old["model_args"]))
            diff = [f"{k} {saved[k]}" for k in ARCHITECTURE if saved[k] != model_args[k]]
            if old["config"].get("task", "lm") != task:
                diff.append(f"task {old['config'].get('task', 'lm')}")
            shape = f" of another shape ({', '.join(diff)})" if diff else ""
            best = old.get("best_val_loss", math.inf)
            what = f"a run{shape} at step {old.get('iter_num', 0)} (best val loss " + \
                   (f"{best:.4f})" if math.isfinite(best) else "not evaluated yet)")
        except RunError:
            what = "an unreadable checkpoint"
        raise UsageError(f"{out_dir} holds {what} in {name}; continue it with --init_from resume, pick another "
                         "--out_dir, or --overwrite to replace it")


def out_of_memory(e, batch_size, block_size, n_loops):
    """e as one line if it is an out-of-memory error (CUDA's or the CPU allocator's), else e itself."""
    if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e)):
        return e
    return RunError(f"out of memory at --batch_size {batch_size} --block_size {block_size} --n_loops {n_loops}: lower "
                    "one of them, or with sampled depths --loop_max or --grad_loops (--gradient_accumulation_steps keeps "
                    "the tokens per step; --checkpoint_loops keeps training memory flat in the depth)")


# ---------------------------------------------------------------- the log
def append_log(path, row):
    """One row of the training log (a line of JSON); a failed write is one line, not a traceback."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise RunError(f"cannot write the log {path} ({e.strerror})") from None


def trim_log(path, iter_num):
    """Keep the log's rows up to step iter_num: on resume, the checkpoint's step (later rows belong to a
    run that no longer exists). A torn last line is dropped too."""
    if os.path.exists(path):
        rows = [r for r in read_log(os.path.dirname(path), os.path.basename(path)) if r.get("iter", 0) <= iter_num]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_log(d, name="log.jsonl"):
    """log.jsonl's rows; a torn last line (a run killed mid-write) is skipped."""
    p = os.path.join(d, name)
    rows = []
    for line in open(p) if os.path.exists(p) else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def adopt_log(run, name="log.jsonl"):
    """A new run in a folder that holds an older run's log writes log.jsonl.new; it replaces the old
    log only once the new run has saved something, so a run that fails early loses nothing."""
    if run.log_path.endswith(".new"):
        path = os.path.join(os.path.dirname(run.log_path), name)
        os.replace(run.log_path, path)
        run.log_path = path
