"""
train.py: train and evaluate looped LMs, on one GPU, on a CPU, or on several processes (torchrun).

    python train.py --readout raw --per_loop_ce                  # Paper A's 44M shape on WikiText-103
    python train.py config/cpu_tiny.py                           # a real run on a 2-core CPU, ~4 minutes
    python train.py config/addition_cpu.py --stars 0.1 --loop_sampling lognormal   # Paper B's addition
    python train.py --eval_only --init_from resume --out_dir out # re-evaluate a checkpoint
    torchrun --nproc_per_node 2 train.py config/cpu_tiny.py      # data parallel (NCCL on GPU, gloo on CPU)

Settings come from, in order: the defaults below, an optional config/*.py file (plain
assignments), then --name value options. `python train.py --help` lists them all.
"""
import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from collections import Counter, namedtuple
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

import stars
from looplm import CHOICES as MODEL_CHOICES
from looplm import LoopLM, LoopLMConfig, fixed_point_residual, norm_stats, per_loop_ce, radial_fraction, token_norms


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    init_from: str = "scratch"
    eval_only: bool = False
    eval_interval: int = 500
    log_interval: int = 10
    eval_iters: int = 20
    always_save_checkpoint: bool = True
    # data
    task: str = "lm"
    dataset: str = "wikitext103"
    data_dir: str = ""
    data_files: str = ""
    tokenizer: str = "gpt2"
    cache_dir: str = "data_cache"
    digits: int = 4
    # optimization
    batch_size: int = 64
    gradient_accumulation_steps: int = 1
    max_iters: int = 5000
    epochs: float = 0.0
    learning_rate: float = 3e-4
    lr_schedule: str = "constant"
    warmup_iters: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    # depth during training (Paper B)
    loop_sampling: str = "fixed"
    loop_mu: float = 2.0
    loop_sigma: float = 0.7
    loop_max: int = 100
    loop_mean: float = 4.0
    backprop_depth: int = 4
    stars: float = 0.0
    stars_warmup: int = 2000
    stars_mode: str = "vjp"
    stars_rows: int = 0
    checkpoint_loops: bool = False
    # evaluation
    eval_loops: int = 0
    eval_problems: int = 1000
    sample_tokens: int = 0
    compare: str = ""
    # system
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    seed: int = 1337
    num_threads: int = 0


HELP = {  # one line per option, shown by --help
    "out_dir": "where ckpt.pt, log.jsonl, report.json and plots go",
    "init_from": "scratch | resume (continue from out_dir/ckpt.pt)",
    "eval_only": "evaluate the checkpoint in out_dir and exit (with --init_from resume)",
    "eval_interval": "evaluate and checkpoint every N steps",
    "log_interval": "print and log a row every N steps",
    "eval_iters": "validation batches per evaluation (LM task)",
    "always_save_checkpoint": "save at every eval, not only when val loss improves",
    "task": "lm (language modelling) | addition (Paper B's N-digit addition)",
    "dataset": "wikitext103 (Hugging Face) | wikitext2 (--data_dir) | text (--data_files) | pydoc (built in, offline)",
    "data_dir": "folder of WikiText-2 files (train/valid/test .txt or wiki.*.tokens)",
    "data_files": "comma-separated text files for --dataset text (one file: its last 10% is the validation split)",
    "tokenizer": "gpt2 (tiktoken BPE) | bytes (256 symbols) | regex (Paper A's, vocab <= 20,000)",
    "cache_dir": "where tokenized datasets are cached as memmaps",
    "digits": "operand digits for the addition task (2..8)",
    "batch_size": "sequences per micro-batch",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "max_iters": "optimizer steps (ignored when --epochs > 0)",
    "epochs": "passes over the training tokens; sets max_iters when > 0",
    "learning_rate": "peak AdamW learning rate",
    "lr_schedule": "constant | cosine (with warmup_iters linear warm-up, decay to min_lr)",
    "warmup_iters": "linear warm-up steps",
    "min_lr": "final learning rate of the cosine schedule",
    "weight_decay": "AdamW weight decay (matrices and embeddings only)",
    "beta1": "AdamW beta1", "beta2": "AdamW beta2",
    "grad_clip": "clip the gradient norm to this (0 = off)",
    "loop_sampling": "fixed (n_loop) | lognormal (clip(round(LogNormal(mu,sigma)),1,loop_max)) | poisson_lognormal (Huginn)",
    "loop_mu": "lognormal: mu", "loop_sigma": "lognormal and poisson_lognormal: sigma",
    "loop_max": "largest sampled number of loops",
    "loop_mean": "poisson_lognormal: mean number of loops",
    "backprop_depth": "poisson_lognormal: gradient flows through the last b loops only",
    "stars": "STARS: weight lambda of the Jacobian spectral-radius penalty (Paper B: 0.1; 0 = off)",
    "stars_warmup": "steps before the STARS penalty is switched on",
    "stars_mode": "vjp (public STARS code) | jvp (forward-mode AD)",
    "stars_rows": "STARS penalty on the first N sequences of each micro-batch only (0 = all, as Paper B): "
                  "an unbiased estimate of the same mean at a fraction of the cost",
    "checkpoint_loops": "activation checkpointing per loop (training memory flat in K; each loop is recomputed in backward)",
    "eval_loops": "evaluate loops 1..N (0 = n_loop; addition: default 32)",
    "eval_problems": "held-out addition problems for exact match",
    "sample_tokens": "print a greedy sample of this many tokens at the end (LM task)",
    "compare": "comma-separated run dirs: print a table of their reports, overlay their plots in out_dir, exit",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16",
    "compile": "torch.compile the loop step (CUDA, or CPU with a C++ compiler; the STARS penalty stays eager)",
    "seed": "random seed (data order, init, dropout, loop depths)",
    "num_threads": "CPU threads (0 = torch's default)",
    "vocab_size": "set by the tokenizer; ignored on the command line",
    "block_size": "context length", "n_layer": "depth of the shared stack", "n_head": "attention heads",
    "n_embd": "model width", "n_loop": "K: loops at training time (and default at eval)",
    "dropout": "dropout", "readout": "norm (W_E RMSNorm(H)) | raw (W_E H) | final_norm (raw, norm at loop K)",
    "per_loop_ce": "train every loop's readout: mean_k CE_k (else CE_K only)",
    "norm_penalty": "Paper A: loss += lambda * mean_k mean(H_k^2) (paper: 0.01)",
    "loop_norm": "RMSNorm the state between loops", "block_norm": "pre | post | sandwich (Paper B)",
    "mlp": "swiglu | gelu", "mlp_hidden": "MLP width (0 = 4*n_embd)",
    "inject": "add the input embedding to the state at every loop", "attn": "sdpa | math",
}
CHOICES = {"init_from": ("scratch", "resume"), "task": ("lm", "addition"), "tokenizer": ("gpt2", "bytes", "regex"),
           "dataset": ("wikitext103", "wikitext2", "text", "pydoc"), "lr_schedule": ("constant", "cosine"),
           "loop_sampling": ("fixed", "lognormal", "poisson_lognormal"), "stars_mode": ("vjp", "jvp"),
           "dtype": ("auto", "float32", "bfloat16")}
# defaults for the model: Paper A's 44M shape (a config file or options override them)
MODEL_DEFAULTS = dict(block_size=256, n_layer=8, n_head=8, n_embd=512, n_loop=4, dropout=0.1)
# model settings that shape the weights: a resumed run cannot change them
ARCHITECTURE = ("n_layer", "n_head", "n_embd", "mlp", "mlp_hidden", "block_norm", "loop_norm")


class UsageError(Exception):
    """Bad settings: one line, exit 2."""


class RunError(Exception):
    """A run cannot go on (missing file, offline, bad checkpoint): one line, exit 1."""


# ------------------------------------------------------------------ settings
def parse_args(argv):
    """Defaults < config file < --options. Returns (TrainConfig, model settings dict)."""
    spec = {f.name: f for f in fields(TrainConfig)} | {f.name: f for f in fields(LoopLMConfig)}
    values = {f.name: f.default for f in fields(TrainConfig)} | {f.name: f.default for f in fields(LoopLMConfig)}
    values |= MODEL_DEFAULTS
    given, i = set(), 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print_help(values)
            raise SystemExit(0)
        if not a.startswith("--"):  # a config file of plain assignments
            if not os.path.isfile(a):
                raise UsageError(f"config file {a} not found; presets are in config/")
            scope = {}
            try:
                exec(open(a).read(), {}, scope)
            except Exception as e:  # a typo in a preset: say where, not a traceback
                raise UsageError(f"config file {a} failed: {type(e).__name__}: {e}") from None
            for k, v in scope.items():
                if k.startswith("_"):
                    continue
                if k not in spec:
                    raise UsageError(f"{a}: unknown setting {k!r}; see python train.py --help")
                values[k] = coerce(k, v, spec[k])
            i += 1
            continue
        name, eq, inline = a[2:].partition("=")
        is_bool = lambda k: k in spec and spec[k].type in (bool, "bool")
        key = name[3:] if name.startswith("no_") and is_bool(name[3:]) else name
        if key not in spec:
            raise UsageError(f"unknown option --{name}; see python train.py --help")
        if is_bool(key):  # --name, --no_name, or --name=true/false
            value = coerce(key, inline, spec[key]) if eq else True
            values[key] = value if key == name else not value
            i += 1
        else:
            if not eq and i + 1 >= len(argv):
                raise UsageError(f"--{name} needs a value")
            raw = inline if eq else argv[i + 1]
            values[key] = coerce(key, raw, spec[key])
            i += 1 if eq else 2
        given.add(key)
    for k, allowed in {**CHOICES, **MODEL_CHOICES, "attn": ("sdpa", "math")}.items():
        if values[k] not in allowed:
            raise UsageError(f"--{k} {values[k]!r} is invalid; choose one of {', '.join(allowed)}")
    for k in ("stars", "norm_penalty", "learning_rate", "min_lr", "weight_decay", "grad_clip", "epochs", "loop_sigma",
              "max_iters", "warmup_iters", "stars_warmup", "stars_rows", "eval_loops", "sample_tokens", "num_threads"):
        if values[k] < 0:
            raise UsageError(f"--{k} {values[k]} is invalid; it must be >= 0")
    for k in ("batch_size", "gradient_accumulation_steps", "eval_iters", "log_interval", "eval_interval", "loop_max",
              "backprop_depth", "eval_problems"):
        if values[k] < 1:
            raise UsageError(f"--{k} {values[k]} is invalid; it must be >= 1")
    if values["loop_mean"] <= 0:
        raise UsageError(f"--loop_mean {values['loop_mean']} is invalid; it must be > 0")
    if values["task"] == "addition" and not 2 <= values["digits"] <= 8:
        raise UsageError(f"--digits {values['digits']} is out of range; addition supports 2 to 8 digits")
    if values["eval_only"] and values["init_from"] != "resume":
        raise UsageError("--eval_only needs --init_from resume (and a checkpoint in --out_dir)")
    if values["device"] != "auto":
        try:
            torch.device(values["device"])
        except RuntimeError:
            raise UsageError(f"--device {values['device']!r} is invalid; use auto, cpu, cuda or cuda:N") from None
    cfg = TrainConfig(**{k: values[k] for k in (f.name for f in fields(TrainConfig))})
    model = {k: values[k] for k in (f.name for f in fields(LoopLMConfig))}
    try:
        LoopLMConfig(**model)
    except ValueError as e:  # looplm says "n_loop=0 is invalid...": name the option the user typed
        raise UsageError("--" + re.sub(r"^(\w+)=", r"\1 ", str(e))) from None
    return cfg, model, given


def coerce(name, v, f):
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(f.type, f.type)
    if isinstance(v, str) and typ is not str:
        try:
            return {"true": True, "false": False}[v.lower()] if typ is bool else typ(v)
        except (ValueError, KeyError):
            raise UsageError(f"--{name} expects {typ.__name__}, got {v!r}") from None
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise UsageError(f"{name} expects {typ.__name__}, got {v!r}")
    return v


def print_help(values):
    print(__doc__.strip() + "\n\noptions (booleans: --name, --no_name or --name=true|false; with --init_from resume,"
          "\nthe checkpoint's settings are used except those given on the command line):")
    for group, cls in (("training", TrainConfig), ("model (looplm.LoopLMConfig)", LoopLMConfig)):
        print(f"\n  {group}:")
        for f in fields(cls):
            print(f"    --{f.name:<28} {HELP.get(f.name, ''):<76} [{values[f.name]!r}]")


# ------------------------------------------------------------------ tokenizers
Tokenizer = namedtuple("Tokenizer", "encode decode vocab_size")
REGEX = r"\s+|[A-Za-z0-9_]+|[^\w\s]|\w"  # Paper A's pattern; the last '|\w' keeps non-ASCII letters
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
ADDITION_CHARS = "0123456789+= §"  # plus a pad token (id 14)


def get_tokenizer(meta):
    """A Tokenizer from its metadata dict (stored with the data cache and every checkpoint)."""
    kind = meta["kind"]
    if kind == "gpt2":
        try:
            import tiktoken
            enc = tiktoken.get_encoding("r50k_base")  # GPT-2's BPE
        except Exception as e:
            raise RunError(f"GPT-2 tokenizer unavailable ({type(e).__name__}): offline? set TIKTOKEN_CACHE_DIR "
                           "to a tiktoken cache (e.g. ../shared/tiktoken) or use --tokenizer bytes or regex") from None
        return Tokenizer(enc.encode_ordinary, enc.decode, enc.n_vocab)
    if kind == "bytes":
        return Tokenizer(lambda s: list(s.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", "replace"), 256)
    if kind == "regex":
        itos = meta["vocab"]
        stoi = {t: i for i, t in enumerate(itos)}
        return Tokenizer(lambda s: [stoi.get(t, 1) for t in re.findall(REGEX, s)],
                         lambda ids: "".join(itos[i] if i >= len(SPECIALS) else "" for i in ids), len(itos))
    if kind == "addition":
        stoi = {c: i for i, c in enumerate(ADDITION_CHARS)}
        return Tokenizer(lambda s: [stoi[c] for c in s],
                         lambda ids: "".join(ADDITION_CHARS[i] for i in ids if i < len(ADDITION_CHARS)),
                         len(ADDITION_CHARS) + 1)
    raise RunError(f"unknown tokenizer kind {kind!r} in checkpoint metadata")


def fit_regex_tokenizer(text, vocab_size=20000, min_freq=2):
    """Paper A's tokenizer: 4 specials + the most frequent regex tokens seen >= min_freq times."""
    counts = Counter(re.findall(REGEX, text))
    common = [t for t, c in counts.most_common(vocab_size - len(SPECIALS)) if c >= min_freq]
    return {"kind": "regex", "vocab": SPECIALS + common}


# ------------------------------------------------------------------ language-model data
def read_texts(cfg):
    """(train_text, val_text) for the chosen dataset."""
    if cfg.dataset == "pydoc":  # ships with every CPython: the quick start needs no download
        import pydoc_data.topics as t
        docs = [t.topics[k] for k in sorted(t.topics)]
        cut = int(0.9 * len(docs))
        return "\n".join(docs[:cut]), "\n".join(docs[cut:])
    if cfg.dataset == "wikitext2":
        def find(*names):
            for n in names:
                p = os.path.join(cfg.data_dir, n)
                if os.path.isfile(p):
                    return p
        train = find("train.txt", "wiki.train.tokens")
        valid = find("valid.txt", "wiki.valid.tokens")
        test = find("test.txt", "wiki.test.tokens")
        if not cfg.data_dir or not os.path.isdir(cfg.data_dir):
            raise RunError(f"--data_dir {cfg.data_dir!r} is not a folder; point it at WikiText-2 "
                           "(e.g. ../shared/data/wikitext-2)")
        if valid is None or (train or test) is None:
            raise RunError(f"{cfg.data_dir} needs valid.txt and train.txt or test.txt (WikiText-2 splits)")
        return read_file(train or test), read_file(valid)  # no train split: train on test, evaluate on valid
    if cfg.dataset == "text":
        paths = [p for p in cfg.data_files.split(",") if p]
        if not paths:
            raise RunError("--dataset text needs --data_files A.txt[,B.txt]")
        texts = [read_file(p) for p in paths]
        if len(texts) > 1:
            return "\n".join(texts[:-1]), texts[-1]  # the last file is the validation split
        cut = int(0.9 * len(texts[0]))
        return texts[0][:cut], texts[0][cut:]
    if not os.environ.get("HF_HUB_OFFLINE") and not reachable("huggingface.co"):
        # no network: use only the local Hugging Face cache, and fail in a second instead of retrying for half a minute
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:  # wikitext103 from the Hugging Face hub
        import datasets
        ds = datasets.load_dataset("Salesforce/wikitext", "wikitext-103-raw-v1")
        return "".join(ds["train"]["text"]), "".join(ds["validation"]["text"])
    except Exception as e:
        raise RunError(f"cannot load WikiText-103 from the Hugging Face hub ({type(e).__name__}); offline? use "
                       "--dataset wikitext2 --data_dir ../shared/data/wikitext-2, --dataset text --data_files FILE, "
                       "or --dataset pydoc") from None


def reachable(host, port=443, timeout=3.0):
    """Can we open a TCP connection to host within timeout seconds? (A cheap test for "offline".)"""
    import socket
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_file(path):
    if not os.path.isfile(path):
        raise RunError(f"data file {path} not found")
    text = open(path, encoding="utf-8", errors="replace").read()
    if not text.strip():
        raise RunError(f"data file {path} is empty")
    return text


def prepare_data(cfg):
    """Tokenize once into uint16/uint32 memmaps under cache_dir; later runs reuse them.
    Returns (train_tokens, val_tokens, tokenizer_meta)."""
    cfg = cfg if isinstance(cfg, TrainConfig) else TrainConfig(**{k: v for k, v in cfg.items() if k in TrainConfig.__dataclass_fields__})
    src = {"wikitext2": cfg.data_dir, "text": cfg.data_files}.get(cfg.dataset, "")
    stamp = [(os.path.abspath(p), os.path.getsize(p), int(os.path.getmtime(p)))
             for p in src.split(",") if p and os.path.isfile(p)] if cfg.dataset == "text" else src
    # a stable digest (not hash(), which changes with every Python process): the cache outlives the run
    digest = hashlib.sha1(json.dumps(stamp).encode()).hexdigest()[:8] if src else ""
    key = re.sub(r"\W", "_", f"{cfg.dataset}-{cfg.tokenizer}-{digest}")
    if cfg.dataset == "wikitext2" and os.path.isdir(cfg.data_dir):
        key += "-" + str(sum(os.path.getsize(os.path.join(cfg.data_dir, f)) for f in os.listdir(cfg.data_dir)))
    folder = os.path.join(cfg.cache_dir, key)
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        train_text, val_text = read_texts(cfg)
        meta = fit_regex_tokenizer(train_text) if cfg.tokenizer == "regex" else {"kind": cfg.tokenizer}
        tok = get_tokenizer(meta)
        dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
        from tqdm import tqdm
        try:
            os.makedirs(folder, exist_ok=True)
            for split, text in (("train", train_text), ("val", val_text)):
                lines = text.splitlines(keepends=True)
                chunks = ["".join(lines[i:i + 2000]) for i in range(0, len(lines), 2000)]
                ids = [i for c in tqdm(chunks, desc=f"tokenizing {split}", disable=None) for i in tok.encode(c)]
                if not ids:
                    raise RunError(f"the {split} split of --dataset {cfg.dataset} has no tokens; use more text")
                # write under a name of this process, then rename: torchrun ranks may tokenize at the same time
                tmp = os.path.join(folder, f"{split}.{os.getpid()}.tmp")
                arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=(len(ids),))
                arr[:] = ids
                arr.flush()
                del arr
                os.replace(tmp, os.path.join(folder, f"{split}.bin"))
            meta["dtype"] = np.dtype(dtype).name
            atomic_write_text(meta_path, json.dumps(meta))  # written last: its presence means the cache is complete
        except OSError as e:
            raise RunError(f"cannot write the token cache in {folder} ({e.strerror}); pick another --cache_dir") from None
    meta = json.load(open(meta_path))
    load = lambda s: np.memmap(os.path.join(folder, f"{s}.bin"), dtype=meta["dtype"], mode="r")
    return load("train"), load("val"), meta


def get_batch(data, batch_size, block_size, generator):
    """Random windows (nanoGPT); the generator is seeded from (seed, step, rank), so a resumed
    run draws exactly the batches the uninterrupted run would have drawn."""
    if len(data) <= block_size + 1:
        raise RunError(f"split has {len(data)} tokens, fewer than block_size+1={block_size + 1}; lower --block_size")
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
    return x, y


# ------------------------------------------------------------------ addition data (Paper B)
def addition_block_size(digits):
    return 2 * digits + 3 + digits + 2   # "a+b= " + reversed sum (<= digits+1 digits) + "§"


def addition_batch(n, digits, generator, exclude=None):
    """n problems "1750+4733= 3846§" (sum reversed, least significant digit first), right-padded.
    Targets cover the space, the answer digits and § only. exclude: codes a*10^d+b held out."""
    lo, hi = 10 ** (digits - 1), 10 ** digits
    a = torch.randint(lo, hi, (n,), generator=generator)
    b = torch.randint(lo, hi, (n,), generator=generator)
    if exclude is not None:  # redraw the (rare) collisions with the held-out set
        bad = torch.from_numpy(np.isin((a * hi + b).numpy(), exclude))
        while bad.any():
            a[bad] = torch.randint(lo, hi, (int(bad.sum()),), generator=generator)
            bad = torch.from_numpy(np.isin((a * hi + b).numpy(), exclude))
    T = addition_block_size(digits)
    pad = len(ADDITION_CHARS)
    x = torch.full((n, T), pad)
    y = torch.full((n, T), -1)
    for i, (p, q) in enumerate(zip(a.tolist(), b.tolist())):
        s = [ADDITION_CHARS.index(c) for c in f"{p}+{q}= {str(p + q)[::-1]}§"]
        x[i, :len(s)] = torch.tensor(s)
        start = 2 * digits + 1  # position of "=": from here on, predict " ", the digits and "§"
        y[i, start:len(s) - 1] = torch.tensor(s[start + 1:])
    return x, y, a * hi + b


def addition_heldout(digits, n, seed):
    return addition_batch(n, digits, torch.Generator().manual_seed(10_000 + seed))


@torch.no_grad()
def addition_eval(model, cfg, max_loops, device):
    """Greedy exact match per loop count. Teacher forcing gives the same verdict as greedy
    decoding until '§': the greedy answer is right iff the argmax is the true token at every
    answer position given the true prefix. So one pass to max_loops scores every depth."""
    x, y, _ = addition_heldout(cfg.digits, cfg.eval_problems, cfg.seed)
    acc, resid = {}, {}
    correct = torch.zeros(max_loops, len(x), dtype=torch.bool)
    res_sum = torch.zeros(max_loops)
    for i in range(0, len(x), 250):
        xb, yb = x[i:i + 250].to(device), y[i:i + 250].to(device)
        mask = yb != -1
        states = model.loop_states(xb, max_loops)
        for k, h in enumerate(states, 1):
            pred = model.readout(h, k, k).argmax(-1)
            correct[k - 1, i:i + 250] = ((pred == yb) | ~mask).all(-1).cpu()
            if k > 1:
                res_sum[k - 1] += fixed_point_residual(states[k - 2][mask], h[mask]) * len(xb)
    for k in range(1, max_loops + 1):
        acc[str(k)] = correct[k - 1].float().mean().item()
        resid[str(k)] = res_sum[k - 1].item() / len(x) if k > 1 else None
    # spectral radius of the loop map at a few depths, on 64 problems (power iteration)
    rho = {}
    xb = x[:64].to(device)
    states = model.loop_states(xb, max_loops)
    with torch.enable_grad(), model.math_attention():
        h0 = model.embed(xb).detach()
        for k in sorted({1, 2, 4, 8, 16, 32, 64, 100, max_loops}):
            if k <= max_loops:
                rho[str(k)] = stars.spectral_radius(stars.looplm_step_fn(model, h0), h0 if k == 1 else states[k - 2], iters=10)
    return {"accuracy": acc, "residual": resid, "rho": rho}


# ------------------------------------------------------------------ checkpoints
def atomic_write_text(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_checkpoint(path, obj):
    """Write to a temporary file, then rename: a crash mid-write never destroys the last checkpoint."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except OSError as e:  # disk full, say: drop the partial file, keep the previous checkpoint
        if os.path.exists(tmp):
            os.remove(tmp)
        raise RunError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous one, if any, is intact") from None


def load_checkpoint(path, device="cpu"):
    """Load ckpt.pt (a directory or a file) with weights_only=True: a checkpoint cannot run code."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}; train one first (or use --init_from scratch)")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        why = ("it holds objects other than tensors and plain data, which weights_only=True refuses to unpickle"
               if "unsupported global" in str(e).lower() else f"truncated or corrupted? {type(e).__name__}")
        raise RunError(f"checkpoint {path} is unreadable ({why})") from None


def model_from_checkpoint(ckpt, device="cpu"):
    model = LoopLM(LoopLMConfig.from_dict(ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


# ------------------------------------------------------------------ evaluation (SPEC §3)
@torch.no_grad()
def evaluate_lm(model, val, cfg, K_eval, device, ctx):
    """Per loop k = 1..K_eval: CE/PPL, ‖H_k‖ stats (L2, per token), radial gradient fraction,
    fixed-point residual, spectral radius of the loop map, clamp ΔCE, tokens/s at depth k.
    Row k is the model run with k loops (readout(h, k, k): for final_norm, loop k is the
    normalized one). Same batches for every k."""
    B, T = min(cfg.batch_size, 16), model.config.block_size
    g = torch.Generator().manual_seed(cfg.seed + 999)  # fixed validation batches
    batches = [get_batch(val, B, T, g) for _ in range(cfg.eval_iters)]
    ce, ce_clamp, res = np.zeros(K_eval), np.zeros(K_eval), np.zeros(K_eval)
    norms = [[] for _ in range(K_eval)]
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with ctx:
            states = model.loop_states(x, K_eval)
            clamped = model.loop_states(x, K_eval, clamp=True)
            for k in range(1, K_eval + 1):
                lk = lambda s: F.cross_entropy(model.readout(s[k - 1], k, k).float().flatten(0, 1), y.flatten())
                ce[k - 1] += lk(states).item() / len(batches)
                ce_clamp[k - 1] += lk(clamped).item() / len(batches)
                norms[k - 1].append(token_norms(states[k - 1]).cpu())
                if k > 1:
                    res[k - 1] += fixed_point_residual(states[k - 2], states[k - 1]) / len(batches)
    x, y = batches[0][0].to(device), batches[0][1].to(device)
    states = model.loop_states(x, K_eval)
    h0 = model.embed(x[:4])
    step = stars.looplm_step_fn(model, h0)  # ρ(∂H_k/∂H_{k-1}): the loop map at its input, 4 sequences
    rows = []
    for k in range(1, K_eval + 1):
        s = norm_stats(torch.cat(norms[k - 1]))
        rows.append({"k": k, "ce": ce[k - 1], "ppl": math.exp(ce[k - 1]),
                     **{f"norm_{n}": s[n] for n in ("mean", "median", "p99", "max", "std", "min")},
                     "radial_fraction": radial_fraction(model, states[k - 1], y, k, k),
                     "fixed_point_residual": res[k - 1] if k > 1 else None,
                     "spectral_radius": stars.spectral_radius(step, (h0 if k == 1 else states[k - 2][:4]), iters=10),
                     "clamp_delta_ce": ce_clamp[k - 1] - ce[k - 1],
                     "tokens_per_s": depth_throughput(model, x, k, device, ctx)})
    return rows, sum(len(n) for n in norms[0])


def depth_throughput(model, x, k, device, ctx, reps=3):
    """Inference tokens/s of a full forward at depth k (best of reps)."""
    best = float("inf")
    for _ in range(reps):
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


def read_log(d):
    p = os.path.join(d, "log.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []


def drift_exponent(log_rows):
    """Fit ‖H_K‖ ∝ step^b over the second half of training (least squares in log-log): b ≈ 0
    means the norm has saturated, b > 0 that it is still growing (b = 1: linearly)."""
    rows = [r for r in log_rows if "norm_K" in r]
    half = [r for r in rows if rows and r["iter"] >= rows[-1]["iter"] / 2]
    if len(half) < 3:
        return None
    return float(np.polyfit(np.log([r["iter"] for r in half]), np.log([r["norm_K"] for r in half]), 1)[0])


def compare_runs(dirs, out):
    """--compare: overlay several runs' plots in out/ and print a markdown table, a row per run.
    Addition runs: exact match vs loops. LM runs: PPL vs K and ‖H_K‖ vs training step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {os.path.basename(d.rstrip("/")): (json.load(open(os.path.join(d, "report.json"))), read_log(d)) for d in dirs}
    add = all("addition" in rep for rep, _ in runs.values())
    if not add and any("addition" in rep for rep, _ in runs.values()):
        raise UsageError("--compare takes either addition runs or language-model runs, not a mix")
    figs = [("compare_accuracy.png",)] if add else [("compare_ppl.png",), ("compare_norms.png",)]
    axes = []
    for _ in figs:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        axes.append((fig, ax))
    if add:
        ks = (1, 2, 4, 8, 16, 32)
        print("| run | " + " | ".join(f"K={k}" for k in ks) + " | residual at K=32 | ρ at K=32 |\n|" + "---|" * (len(ks) + 3))
        for name, (rep, _) in runs.items():
            a = rep["addition"]
            axes[0][1].plot([int(k) for k in a["accuracy"]], [100 * v for v in a["accuracy"].values()], label=name)
            fmt = lambda v, f: "n/a" if v is None else format(v, f)
            print(f"| {name} | " + " | ".join(fmt(100 * a["accuracy"][str(k)], ".1f") + "%" if str(k) in a["accuracy"] else "n/a"
                                         for k in ks) + f" | {fmt(a['residual'].get('32'), '.2e')} | {fmt(a['rho'].get('32'), '.3f')} |")
        axes[0][1].set(xlabel="loops at inference", ylabel="exact match (%)", xscale="log")
    else:
        print("| run | ‖H_K‖ mean | p99 | max | radial fraction | PPL K=1 | K=2 | K=3 | K=4 | ΔPPL 1→4 | clamp ΔCE | "
              "drift exponent b |\n|" + "---|" * 12)
        for name, (rep, log) in runs.items():
            rows, b = rep["per_loop"], drift_exponent(log)
            last = rows[-1]
            axes[0][1].plot([r["k"] for r in rows], [r["ppl"] for r in rows], "o-", label=name)
            train_rows = [r for r in log if "norm_K" in r]
            axes[1][1].semilogy([r["iter"] for r in train_rows], [r["norm_K"] for r in train_rows], label=name)
            print(f"| {name} | {last['norm_mean']:.1f} | {last['norm_p99']:.1f} | {last['norm_max']:.1f} | "
                  f"{last['radial_fraction']:.1e} | " + " | ".join(f"{r['ppl']:.3f}" for r in rows[:4])
                  + " | n/a" * (4 - min(4, len(rows))) +
                  f" | {rows[min(3, len(rows) - 1)]['ppl'] - rows[0]['ppl']:+.3f} | {last['clamp_delta_ce']:+.4f} | "
                  + ("n/a" if b is None else f"{b:+.2f}") + " |")
        axes[0][1].set(xlabel="loops at inference (K)", ylabel="validation PPL")
        axes[1][1].set(xlabel="training step", ylabel="mean per-token ‖H_K‖₂ (train batch)")
    for (name,), (fig, ax) in zip(figs, axes):
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=90)
        plt.close(fig)
    return [os.path.join(out, name) for (name,) in figs]


# ------------------------------------------------------------------ training
def main(argv=None):
    try:
        return run(*parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before training started (while tokenizing, say): nothing to save
        print("train.py: interrupted before training started; nothing saved", file=sys.stderr)
        return 130


def run(cfg, model_args, given):
    if cfg.compare:
        os.makedirs(cfg.out_dir, exist_ok=True)
        dirs = [d for d in cfg.compare.split(",") if d]
        for d in dirs:
            if not os.path.isfile(os.path.join(d, "report.json")):
                raise RunError(f"{d}/report.json not found; train or --eval_only that run first")
        print("wrote " + ", ".join(compare_runs(dirs, cfg.out_dir)))
        return 0
    # -- distributed (torchrun sets these): every rank trains on its own batches, gradients averaged
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if "cuda" in device and not torch.cuda.is_available():
        raise RunError(f"--device {device} but CUDA is not available; use --device cpu (or auto)")
    if ddp:
        torch.distributed.init_process_group("nccl" if "cuda" in device else "gloo")
        if "cuda" in device:
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(device)
    master = rank == 0
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if "cuda" in device else "float32")
    ctx = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write_test{rank}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise RunError(f"out_dir {cfg.out_dir} is not writable ({e.strerror}); pick another --out_dir") from None

    # -- resume: settings the user gave on this command line override the checkpoint's
    ckpt = None
    if cfg.init_from == "resume":
        ckpt = load_checkpoint(ckpt_path)
        saved, saved_model = ckpt["config"], ckpt["model_args"]
        cfg = TrainConfig(**{**saved, **{k: getattr(cfg, k) for k in given if k in saved},
                             "init_from": "resume", "eval_only": cfg.eval_only, "out_dir": cfg.out_dir})
        for k in ARCHITECTURE:  # these shape (or define) the weights: they cannot change on resume
            if k in given and model_args[k] != saved_model[k]:
                raise UsageError(f"--{k} {model_args[k]} differs from the checkpoint's {saved_model[k]}; "
                                 "it cannot change on resume")
        if "block_size" in given and model_args["block_size"] > saved_model["block_size"]:
            raise UsageError(f"--block_size {model_args['block_size']} exceeds the checkpoint's "
                             f"{saved_model['block_size']}: its position embeddings end there")
        model_args = {**saved_model, **{k: model_args[k] for k in given if k in model_args}}
    # -- data
    if cfg.task == "addition":
        meta = {"kind": "addition"}
        model_args["block_size"] = addition_block_size(cfg.digits) if ckpt is None else model_args["block_size"]
        if addition_block_size(cfg.digits) > model_args["block_size"]:
            raise UsageError(f"--digits {cfg.digits} needs block_size {addition_block_size(cfg.digits)}, "
                             f"more than the checkpoint's {model_args['block_size']}")
        heldout = addition_heldout(cfg.digits, cfg.eval_problems, cfg.seed)[2].numpy()
        train_data = val_data = None
    else:
        train_data, val_data, meta = prepare_data(cfg)
        for split, data in (("training", train_data), ("validation", val_data)):
            if len(data) <= model_args["block_size"] + 1:  # fail now, not after training at the first eval
                raise RunError(f"the {split} split has {len(data)} tokens, fewer than block_size+1="
                               f"{model_args['block_size'] + 1}; use more text or a smaller --block_size")
    if ckpt is not None and {**ckpt["tokenizer"], "dtype": None} != {**meta, "dtype": None}:
        raise UsageError(f"the data's tokenizer ({meta['kind']}) is not the checkpoint's ({ckpt['tokenizer']['kind']}, "
                         "or a regex vocabulary fit on other text): token ids would not match the weights")
    tok = get_tokenizer(meta)
    model_args["vocab_size"] = tok.vocab_size
    try:
        mcfg = LoopLMConfig(**model_args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    torch.manual_seed(cfg.seed)
    model = LoopLM(mcfg).to(device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.split(":")[0])
    iter_num, best_val, last_saved = 0, float("inf"), None
    if ckpt is not None:
        # a smaller --block_size keeps the first positions of the position embedding (and their AdamW moments)
        T = mcfg.block_size
        ckpt["model"]["wpe.weight"] = ckpt["model"]["wpe.weight"][:T]
        model.load_state_dict(ckpt["model"])
        if not cfg.eval_only:
            wpe = [id(p) for g in optimizer.param_groups for p in g["params"]].index(id(model.wpe.weight))
            for k, v in ckpt["optimizer"]["state"].get(wpe, {}).items():
                if k in ("exp_avg", "exp_avg_sq"):
                    ckpt["optimizer"]["state"][wpe][k] = v[:T]
            optimizer.load_state_dict(ckpt["optimizer"])
        iter_num, best_val, last_saved = ckpt["iter_num"], ckpt["best_val_loss"], ckpt_path
    world = torch.distributed.get_world_size() if ddp else 1
    tokens_per_iter = cfg.batch_size * mcfg.block_size * cfg.gradient_accumulation_steps * world
    max_iters = cfg.max_iters
    if cfg.epochs > 0 and train_data is not None:
        max_iters = math.ceil(cfg.epochs * len(train_data) / tokens_per_iter)
    if master:
        print(f"{model.num_params():,} parameters (shared stack counted once) | {mcfg.n_layer} layers x "
              f"{mcfg.n_loop} loops | readout={mcfg.readout} per_loop_ce={mcfg.per_loop_ce} | "
              f"{tokens_per_iter:,} tokens/step | {max_iters} steps | device {device} {dtype}")
    if cfg.compile:  # stars.looplm_step_fn keeps the STARS penalty and the eval's ρ on the eager step
        model.step = torch.compile(model.step)

    def make_ckpt():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": asdict(mcfg),
                "config": asdict(cfg), "iter_num": iter_num, "best_val_loss": best_val, "tokenizer": meta}

    def lr_at(it):
        if cfg.lr_schedule == "constant":
            return cfg.learning_rate * min(1.0, (it + 1) / cfg.warmup_iters) if cfg.warmup_iters else cfg.learning_rate
        if it < cfg.warmup_iters:
            return cfg.learning_rate * (it + 1) / cfg.warmup_iters
        frac = min(1.0, (it - cfg.warmup_iters) / max(1, max_iters - cfg.warmup_iters))
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.learning_rate - cfg.min_lr)

    def evaluate(final):
        model.eval()
        K_eval = cfg.eval_loops or (32 if cfg.task == "addition" else mcfg.n_loop)
        report = {"config": {**asdict(cfg), **asdict(mcfg)}, "params": model.num_params(), "iter": iter_num}
        if cfg.task == "addition":
            report["addition"] = addition_eval(model, cfg, K_eval, device)
            val_loss = 1.0 - report["addition"]["accuracy"][str(min(mcfg.n_loop, K_eval))]
            acc = report["addition"]["accuracy"]
            print(f"step {iter_num}: exact match " + " ".join(f"K{k}={100 * acc[str(k)]:.1f}%"
                  for k in (1, 2, 4, 8, 16, 32, 64, 100) if str(k) in acc))
        else:
            rows, n_tok = evaluate_lm(model, val_data, cfg, K_eval, device, ctx)
            report["per_loop"], report["eval_tokens"] = rows, n_tok
            report["norm_convention"] = "per-token L2 norm ||H_k||_2 (RMS = L2/sqrt(n_embd))"
            val_loss = float(rows[mcfg.n_loop - 1]["ce"] if mcfg.n_loop <= K_eval else rows[-1]["ce"])
            print(f"step {iter_num}: val CE by loop " + " ".join(f"K{r['k']}={r['ce']:.4f}" for r in rows)
                  + f" | ‖H_K‖ mean {rows[-1]['norm_mean']:.1f} p99 {rows[-1]['norm_p99']:.1f} max {rows[-1]['norm_max']:.1f}"
                  f" | radial {rows[-1]['radial_fraction']:.1e} | clamp ΔCE {rows[-1]['clamp_delta_ce']:+.4f}")
            if final:
                x, _ = get_batch(val_data, 8, mcfg.block_size, torch.Generator().manual_seed(cfg.seed + 999))
                with torch.no_grad():
                    n = token_norms(model.loop_states(x.to(device), K_eval)[-1]).cpu().numpy()
                counts, edges = np.histogram(n, bins=60)
                report["norm_hist"] = {"counts": counts.tolist(), "edges": edges.tolist()}
        model.train()
        return val_loss, report

    if cfg.eval_only:  # (parse_args made sure there is a checkpoint to evaluate)
        if master:
            _, report = evaluate(True)
            finish(cfg, report)
        return 0

    # -- Ctrl-C / SIGTERM: finish the step, save, exit 130 / 143 (with torchrun every rank gets the signal)
    stop = {}
    old_handlers = {s: signal.signal(s, lambda sig, _: stop.setdefault("sig", sig))
                    for s in (signal.SIGINT, signal.SIGTERM)}
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if ckpt is None and master and os.path.exists(log_path):
        os.remove(log_path)
    model.train()
    t0, t_start, it0 = time.perf_counter(), time.perf_counter(), iter_num
    try:
        while iter_num < max_iters:
            lr = lr_at(iter_num)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # every random draw of this step comes from (seed, step, rank): resume replays it exactly
            torch.manual_seed(cfg.seed * 1_000_003 + iter_num * 1009 + rank)
            g = stars.step_generator(cfg.seed + 7919 * rank, iter_num)
            if cfg.loop_sampling == "fixed":
                t, b = mcfg.n_loop, None
            elif cfg.loop_sampling == "lognormal":
                t, b = stars.sample_loops(g, "lognormal", mu=cfg.loop_mu, sigma=cfg.loop_sigma, t_max=cfg.loop_max), None
            else:
                ng, b = stars.sample_loops(g, "poisson_lognormal", sigma=cfg.loop_sigma, t_max=cfg.loop_max,
                                           mean_loops=cfg.loop_mean, backprop=cfg.backprop_depth)
                t = ng + b
            lam = stars.stars_lambda(iter_num, cfg.stars, cfg.stars_warmup)
            loss_sum, rho, norm_K = 0.0, None, 0.0
            for _ in range(cfg.gradient_accumulation_steps):
                if cfg.task == "addition":
                    X, Y, _ = addition_batch(cfg.batch_size, cfg.digits, g, exclude=heldout)
                else:
                    X, Y = get_batch(train_data, cfg.batch_size, mcfg.block_size, g)
                X, Y = X.to(device), Y.to(device)
                with ctx:
                    states = model.loop_states(X, t, grad_loops=b, checkpoint=cfg.checkpoint_loops)
                    _, loss = model.objective(states, Y)
                    if lam > 0:  # STARS: (1-λ)·task + λ·‖Jv‖² at the last state, one extra loop step
                        n = cfg.stars_rows or X.size(0)  # the batch is random, so its first n rows are too
                        step_fn = stars.looplm_step_fn(model, model.embed(X[:n]))
                        pen, r = stars.jsrr_penalty(step_fn, states[-1][:n], mode=cfg.stars_mode, generator=g)
                        loss = stars.stars_objective(loss, pen, lam)
                        rho = r.mean()  # a tensor: read (one sync) only when the step is logged
                (loss / cfg.gradient_accumulation_steps).backward()
                # one host sync per micro-step for both logged numbers (a sync stalls a GPU)
                l, hn = torch.stack([loss.detach().float(), token_norms(states[-1].detach()).mean()]).tolist()
                loss_sum += l / cfg.gradient_accumulation_steps
                norm_K += hn / cfg.gradient_accumulation_steps
            stopping = bool(stop)
            if ddp:  # all ranks must take the same decisions below: share the loss and "was I signalled?"
                shared = torch.tensor([loss_sum, float(stopping)], device=device)
                torch.distributed.all_reduce(shared)
                loss_sum, stopping = shared[0].item() / world, shared[1].item() > 0
                # average gradients over ranks (a plain all-reduce: no DDP wrapper, unused params are fine)
                for p in model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
            # clip (or with grad_clip 0 just measure) the gradient norm: an inf/nan gradient must not reach the weights
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf")).item()
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                raise RunError(f"non-finite loss ({loss_sum:.4g}, gradient norm {grad_norm:.4g}) at step {iter_num + 1}; "
                               f"stopping. Last good checkpoint: {last_saved or 'none saved yet'} (left untouched). "
                               "Lower --learning_rate or check the data")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            if master and (iter_num % cfg.log_interval == 0 or iter_num == max_iters):
                dt = time.perf_counter() - t0
                tps = tokens_per_iter * cfg.log_interval / dt if iter_num % cfg.log_interval == 0 else 0
                eta = (time.perf_counter() - t_start) / (iter_num - it0) * (max_iters - iter_num)
                rho = None if rho is None else rho.item()
                row = {"iter": iter_num, "loss": loss_sum, "lr": lr, "loops": t, "norm_K": norm_K,
                       "tokens_per_s": tps, **({"rho": rho} if rho is not None else {})}
                print(f"step {iter_num}/{max_iters} loss {loss_sum:.4f} | {tps:,.0f} tok/s | ETA {eta / 60:.1f} min"
                      f" | ‖H_K‖ {norm_K:.1f} | loops {t}" + (f" | ρ {rho:.3f}" if rho is not None else ""), flush=True)
                with open(log_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                t0 = time.perf_counter()
            if master and (iter_num % cfg.eval_interval == 0 or iter_num == max_iters):
                val_loss, report = evaluate(iter_num == max_iters)
                with open(log_path, "a") as f:
                    f.write(json.dumps({"iter": iter_num, "val_loss": val_loss}) + "\n")
                best_val = min(best_val, val_loss)
                if cfg.always_save_checkpoint or val_loss <= best_val:
                    save_checkpoint(ckpt_path, make_ckpt())
                    last_saved = ckpt_path
                if iter_num == max_iters:
                    finish(cfg, report)
                t0 = time.perf_counter()  # evaluation time is not training throughput
            if stopping:
                if master:
                    save_checkpoint(ckpt_path, make_ckpt())
                    print(f"interrupted: saved step {iter_num} to {ckpt_path}; continue with --init_from resume",
                          file=sys.stderr)
                return 128 + stop.get("sig", signal.SIGTERM)  # (a rank stopped by another rank's signal: 143)
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if ddp:
            torch.distributed.destroy_process_group()
    if cfg.sample_tokens and master and cfg.task == "lm":
        x = torch.tensor([tok.encode("\n")], device=device)
        with torch.no_grad():
            for _ in range(cfg.sample_tokens):
                logits, _ = model(x[:, -mcfg.block_size:])
                x = torch.cat([x, torch.multinomial(F.softmax(logits[:, -1] / 0.8, -1), 1)], 1)
        print("sample:", tok.decode(x[0, 1:].tolist()))
    return 0


def finish(cfg, report):
    atomic_write_text(os.path.join(cfg.out_dir, "report.json"), json.dumps(report, indent=1))
    plot_report(cfg.out_dir, report, read_log(cfg.out_dir))
    print(f"wrote {cfg.out_dir}/report.json and plots")


if __name__ == "__main__":
    sys.exit(main())
