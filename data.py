"""
data.py: the data of each task, and the tokenizers.

    language modelling (--task lm): WikiText-103 or WikiText-2 by name from the Hugging Face hub,
        WikiText-2 from a folder (--data_dir), any text files (--data_files), or the Python docs
        that ship with CPython (--dataset pydoc, offline). Tokenized once into memmaps.
    addition (--task addition, Paper B): "1750+4733= 3846§", the sum's digits reversed.

Batches: random windows (nanoGPT's get_batch), or, with a window stride, Paper A's epochs of
overlapping windows (windows_batch). Every batch is a pure function of (seed, step, rank), so a
resumed run draws exactly the batches the uninterrupted run would have drawn.
"""
import contextlib
import functools
import glob
import hashlib
import json
import os
import re
import socket
import sys
from collections import Counter, namedtuple

import numpy as np
import torch

from configurator import RunError, UsageError

# ---------------------------------------------------------------- tokenizers
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
                           "to a folder holding a tiktoken cache of r50k_base, or use --tokenizer bytes or regex") from None
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
    unk = 1 - sum(counts[t] for t in common) / max(1, counts.total())
    if unk > 0.5:  # most of the text would be <unk>: say so rather than train on it
        print(f"note: the regex vocabulary has only {len(common)} tokens seen at least {min_freq} times in the training "
              f"text: {unk:.0%} of its tokens will be <unk>; use more text or --tokenizer bytes", file=sys.stderr)
    return {"kind": "regex", "vocab": SPECIALS + common}


# ---------------------------------------------------------------- language-model data
def read_texts(cfg):
    """(train_text, val_text) for the chosen dataset."""
    if cfg.dataset == "pydoc":  # ships with every CPython: the quick start needs no download
        import pydoc_data.topics as t
        docs = [t.topics[k] for k in sorted(t.topics)]
        cut = int(0.9 * len(docs))
        return "\n".join(docs[:cut]), "\n".join(docs[cut:])
    if cfg.dataset == "wikitext2" and cfg.data_dir:
        def find(*names):
            for n in names:
                p = os.path.join(cfg.data_dir, n)
                if os.path.isfile(p):
                    return p
        if not os.path.isdir(cfg.data_dir):
            raise RunError(f"--data_dir {cfg.data_dir!r} is not a folder; point it at a folder of WikiText-2 files "
                           "(train.txt, valid.txt, test.txt), or leave it out to load WikiText-2 from the hub")
        train = find(f"{cfg.train_split}.txt", f"wiki.{cfg.train_split}.tokens")
        valid = find("valid.txt", "wiki.valid.tokens")
        if train is None or valid is None:
            raise RunError(f"{cfg.data_dir} needs valid.txt and {cfg.train_split}.txt (WikiText-2 splits)"
                           + ("; with only valid and test there, use --train_split test" if cfg.train_split == "train" else ""))
        return read_file(train), read_file(valid)
    if cfg.dataset == "text":
        paths = [p for p in cfg.data_files.split(",") if p]
        if not paths:
            raise RunError("--dataset text needs --data_files A.txt[,B.txt]")
        texts = [read_file(p) for p in paths]
        if len(texts) > 1 and texts[-1] in texts[:-1]:  # validating on training text would flatter every run
            raise RunError(f"--data_files: the validation file {paths[-1]} (the last one) holds the same text as a "
                           "training file; hold out another file, or give one file (its last 10% validates)")
        if len(texts) > 1:
            return "\n".join(texts[:-1]), texts[-1]  # the last file is the validation split
        cut = int(0.9 * len(texts[0]))
        return texts[0][:cut], texts[0][cut:]
    return load_hub(cfg.dataset, cfg.train_split)


# the hub's configurations: WikiText-103 raw, as Paper A's code loads it; WikiText-2 in its tokenized
# release (<unk> for rare words), the text of the usual wiki.*.tokens files that --data_dir reads
HUB = {"wikitext103": ("wikitext-103-raw-v1", "WikiText-103"), "wikitext2": ("wikitext-2-v1", "WikiText-2")}


def load_hub(dataset, train_split="train"):
    """(train_text, validation_text) of WikiText by name from the Hugging Face hub (cached after once)."""
    name, title = HUB[dataset]
    if not os.environ.get("HF_HUB_OFFLINE") and not reachable("huggingface.co"):
        # no network: use only the local Hugging Face cache, and fail in a second instead of retrying for half a minute
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        ds = datasets.load_dataset("Salesforce/wikitext", name)
        # the hub keeps the files' lines as rows, their blank lines (" \n") as empty rows: put those back,
        # so that the text is the files' text, byte for byte
        text = lambda split: "".join(row or " \n" for row in ds[split]["text"])
        return text(train_split), text("validation")
    except Exception as e:
        raise RunError(f"cannot load {title} from the Hugging Face hub ({type(e).__name__}); offline? use "
                       "--dataset wikitext2 --data_dir DIR (a folder of WikiText-2 files), --dataset text "
                       "--data_files FILE, or --dataset pydoc") from None


def reachable(host, port=443, timeout=3.0):
    """Can we open a TCP connection to host within timeout seconds? (A cheap test for "offline".)"""
    import socket
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_file(path, what="data file"):
    """A UTF-8 text file, or one line saying why not (missing, a folder, unreadable, not UTF-8, empty)."""
    if os.path.isdir(path):
        raise RunError(f"{what} {path} is a folder; give a text file")
    if not os.path.isfile(path):
        raise RunError(f"{what} {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except PermissionError:
        raise RunError(f"{what} {path} is not readable (permission denied)") from None
    except UnicodeDecodeError as e:  # training on replacement characters would "work" and mean nothing
        raise RunError(f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                       "convert it, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise RunError(f"{what} {path} is empty")
    return text


def prepare_data(cfg, meta=None):
    """Tokenize once into uint16/uint32 memmaps under cache_dir; later runs reuse them. meta: a checkpoint's
    tokenizer, used as it is (a regex vocabulary is never refit); else --tokenizer's (regex: fit on the
    training text). Returns (train_tokens, val_tokens, tokenizer_meta).

    The cache is keyed by what it is built from: the text of each split (a SHA-1 of the content of every
    input file, in its role; the hub's datasets by name), the tokenizer and its vocabulary. Its meta.json,
    written last, records each split's token count and checksum; every load checks them (load_cache)."""
    if isinstance(cfg, dict):  # a checkpoint's settings (sample.py)
        names = ("dataset", "data_dir", "data_files", "tokenizer", "cache_dir", "train_split")
        defaults = {"data_dir": "", "data_files": "", "train_split": "train", "cache_dir": "data_cache"}
        cfg = namedtuple("DataSettings", names)(**{**defaults, **{k: v for k, v in cfg.items() if k in names}})
    hub = cfg.dataset in HUB and not (cfg.dataset == "wikitext2" and cfg.data_dir)
    texts = None if hub else read_texts(cfg)  # a missing or unreadable input is an error, never a smaller key
    source = [cfg.dataset, cfg.train_split] if hub else [hashlib.sha1(t.encode()).hexdigest() for t in texts]
    kind = meta["kind"] if meta else cfg.tokenizer
    hub_split = "" if cfg.train_split == "train" or cfg.dataset not in HUB else f"-{cfg.train_split}"
    prefix = re.sub(r"\W", "_", f"{cfg.dataset}{hub_split}-{kind}-")
    # a stable digest (not hash(), which changes with every Python process): the cache outlives the run
    name = lambda *key: os.path.join(cfg.cache_dir, prefix + hashlib.sha1(json.dumps(key).encode()).hexdigest()[:12])
    folder = name(source, kind)
    if meta and "vocab" in meta and (cache_meta(folder) or {}).get("vocab") != meta["vocab"]:
        folder = name(source, kind, meta["vocab"])  # a vocabulary fit on other text: a cache of its own
    cached = load_cache(folder)
    if cached:
        return cached
    train_text, val_text = texts or read_texts(cfg)
    meta = {k: meta[k] for k in ("kind", "vocab") if k in meta} if meta else \
        fit_regex_tokenizer(train_text) if kind == "regex" else {"kind": kind}
    tok = get_tokenizer(meta)
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    record = {"tokens": [], "sha1": []}
    from tqdm import tqdm
    try:
        os.makedirs(folder, exist_ok=True)
        for split, text in (("train", train_text), ("val", val_text)):
            lines = text.splitlines(keepends=True)
            chunks = ["".join(lines[i:i + 2000]) for i in range(0, len(lines), 2000)]
            ids = np.array([i for c in tqdm(chunks, desc=f"tokenizing {split}", disable=None) for i in tok.encode(c)],
                           dtype=dtype)
            if not len(ids):
                raise RunError(f"the {split} split of --dataset {cfg.dataset} has no tokens; use more text")
            # atomic: torchrun ranks may tokenize at the same time, and a killed writer's file is cleaned up
            atomic_write(os.path.join(folder, f"{split}.bin"), ids.tofile)
            record["tokens"].append(len(ids))
            record["sha1"].append(hashlib.sha1(ids).hexdigest())
        meta["dtype"] = np.dtype(dtype).name
        atomic_write_text(os.path.join(folder, "meta.json"), json.dumps({**meta, **record}))  # last: complete
    except BaseException as e:  # failed or interrupted (Ctrl-C, SIGTERM): no empty cache folder stays behind
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # (only if empty)
        if isinstance(e, OSError):
            raise RunError(f"cannot write the token cache in {folder} ({e.strerror}); pick another --cache_dir") from None
        raise
    return load_cache(folder)


def cache_meta(folder):
    """A token cache's meta.json, or None."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_cache(folder):
    """(train, val, tokenizer meta) of the token cache in folder, checked against the token counts and
    SHA-1s its meta.json records; None if there is none, or, with a note, if it is damaged (a truncated
    or edited .bin, a missing one): prepare_data then rebuilds it."""
    meta = cache_meta(folder)
    if meta is None:
        return None
    try:
        splits = [np.memmap(os.path.join(folder, f"{s}.bin"), dtype=meta["dtype"], mode="r") for s in ("train", "val")]
        counts, sums = meta.pop("tokens"), meta.pop("sha1")
        if [len(d) for d in splits] == counts and [hashlib.sha1(d).hexdigest() for d in splits] == sums:
            return (*splits, meta)
        why = "its token files are not the ones meta.json records"
    except (OSError, KeyError, TypeError, ValueError) as e:  # missing, empty, an odd size; an older cache's meta.json
        why = f"{type(e).__name__}: {e}"
    print(f"note: the token cache {folder} is damaged or incomplete ({why}); rebuilding it", file=sys.stderr)
    return None


def get_batch(data, batch_size, block_size, generator):
    """Random windows (nanoGPT); in training the generator is the step's batch stream (train.step_streams),
    so a resumed run draws exactly the batches the uninterrupted run would have drawn."""
    if len(data) <= block_size + 1:
        raise RunError(f"split has {len(data)} tokens, fewer than block_size+1={block_size + 1}; lower --block_size")
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
    return x, y


def windows_batch(data, batch_size, block_size, stride, seed, index):
    """Batch number `index` of Paper A's epochs: the windows data[s:s+block_size+1] start every
    `stride` tokens (stride block_size/2: each token is seen twice an epoch), and each epoch walks
    through a fresh permutation of them, seeded by (seed, epoch). Returns (x, y)."""
    n = n_windows(len(data), block_size, stride)
    if n < 1:
        raise RunError(f"split has {len(data)} tokens, fewer than block_size+1={block_size + 1}; lower --block_size")
    picks = []
    for i in range(index * batch_size, (index + 1) * batch_size):
        epoch, j = divmod(i, n)
        picks.append(int(epoch_order(n, seed, epoch)[j]) * stride)
    x = torch.stack([torch.from_numpy(data[s:s + block_size].astype(np.int64)) for s in picks])
    y = torch.stack([torch.from_numpy(data[s + 1:s + 1 + block_size].astype(np.int64)) for s in picks])
    return x, y


@functools.lru_cache(maxsize=2)
def epoch_order(n, seed, epoch):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7_919 + epoch))


def n_windows(n_tokens, block_size, stride):
    """Windows in one epoch: how train.py turns --epochs into steps."""
    return max(0, (n_tokens - block_size - 1) // stride + 1)


def atomic_write(path, write):
    """write(tmp_path), then rename over path: a crash mid-write never leaves a torn file at path.
    The temporary file is removed if the write fails, and those of killed processes (kill -9 mid-write)
    on this machine are removed by the next write. (Per process: two ranks may write one token cache at once.)"""
    host = socket.gethostname()  # (a shared file system: only this machine's processes can be checked)
    for old in glob.glob(glob.escape(f"{path}.{host}.") + "*.tmp"):
        pid = old[len(f"{path}.{host}."):-4]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(old)
    tmp = f"{path}.{host}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def atomic_write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def padded_vocab(n):
    """GPT-2's 50,257 tokens -> 50,304 rows, a multiple of 64 (as nanoGPT), so that the readout's matmuls
    align on a GPU. The extra rows are never targets, and sample.py never samples them."""
    return -(-n // 64) * 64


def load_task_data(cfg, model_args, ckpt):
    """train.py's data: (train tokens, validation tokens, tokenizer metadata), checked against model_args
    (addition sets its block_size); with a checkpoint, tokenized by its tokenizer (never a refit)."""
    kind = "addition" if cfg.task == "addition" else cfg.tokenizer
    if ckpt is not None and ckpt["tokenizer"]["kind"] != kind:
        raise UsageError(f"the data's tokenizer ({kind}) is not the checkpoint's ({ckpt['tokenizer']['kind']}): token "
                         "ids would not match the weights")
    if cfg.task == "addition":
        need = addition_block_size(cfg.digits)
        model_args["block_size"] = need if ckpt is None else model_args["block_size"]
        if need > model_args["block_size"]:
            raise UsageError(f"--digits {cfg.digits} needs block_size {need}, more than the checkpoint's "
                             f"{model_args['block_size']}")
        try:  # the test set (training never draws it, whatever the evaluation settings: data.is_heldout)
            addition_heldout(cfg.digits, cfg.eval_problems)
        except ValueError as e:
            raise UsageError(f"--eval_problems {cfg.eval_problems}: {e}") from None
        train_data, val_data, meta = None, None, {"kind": "addition"}
    else:
        train_data, val_data, meta = prepare_data(cfg, ckpt and ckpt["tokenizer"])
        for split, d in (("training", train_data), ("validation", val_data)):
            if len(d) <= model_args["block_size"] + 1:  # fail now, not after training at the first eval
                raise RunError(f"the {split} split has {len(d)} tokens, fewer than block_size+1="
                               f"{model_args['block_size'] + 1}; use more text or a smaller --block_size")
    return train_data, val_data, meta


# ---------------------------------------------------------------- addition data (Paper B)
def addition_block_size(digits):
    return 2 * digits + 3 + digits + 2   # "a+b= " + reversed sum (<= digits+1 digits) + "§"


def is_heldout(codes):
    """The held-out problems: 1 in 50, picked by a hash of the problem (code a·10^d + b), so the
    split is the same for every seed and every evaluation setting, and training never sees them."""
    return (codes % 2_147_483_647) * 48_271 % 2_147_483_647 % 50 == 0


def _problems(n, digits, generator, heldout, zeros=0.0):
    lo, hi = 10 ** (digits - 1), 10 ** digits
    a = torch.randint(lo, hi, (n,), generator=generator)
    b = torch.randint(lo, hi, (n,), generator=generator)
    if zeros > 0:  # the curriculum's easy problems: each digit after the leading one is forced to 0 with probability `zeros`
        place = 10 ** torch.arange(digits - 1)  # (the leading digit stays 1-9: still d-digit operands)
        a, b = (v - (v.unsqueeze(1) // place % 10 * place * (torch.rand(n, digits - 1, generator=generator) < zeros)).sum(1)
                for v in (a, b))
    bad = is_heldout(a * hi + b) != heldout
    while not heldout and bad.any():  # redraw the held-out problems (2%)
        a[bad] = torch.randint(lo, hi, (int(bad.sum()),), generator=generator)
        b[bad] = torch.randint(lo, hi, (int(bad.sum()),), generator=generator)
        bad = is_heldout(a * hi + b)
    return (a[~bad], b[~bad]) if heldout else (a, b)


def addition_batch(n, digits, generator, heldout=False, zeros=0.0):
    """n training problems "1750+4733= 3846§" (sum reversed, least significant digit first),
    right-padded; with heldout=True, a random subset of the n that are held out. Targets cover
    the space, the answer digits and § only. zeros > 0: each operand digit but the leading one is forced
    to 0 with that probability (easy problems, for a curriculum: addition_zeros). Returns (x, y, codes a·10^d + b)."""
    a, b = _problems(n, digits, generator, heldout, zeros)
    d, s = digits, a + b
    L = d + (s >= 10 ** d).long()                                       # the sum has d or d+1 digits
    pos = torch.arange(addition_block_size(d))
    col = lambda v, i: v.unsqueeze(1) // 10 ** i % 10                 # digit i (0 = least significant)
    ids = torch.full((len(a), len(pos)), len(ADDITION_CHARS))           # pad (ids: "0123456789+= §", pad)
    ids[:, :d] = col(a, torch.arange(d - 1, -1, -1))                    # a, most significant first
    ids[:, d], ids[:, 2 * d + 1], ids[:, 2 * d + 2] = 10, 11, 12        # "+", "=", " "
    ids[:, d + 1:2 * d + 1] = col(b, torch.arange(d - 1, -1, -1))
    j = pos - (2 * d + 3)                                               # the answer's j-th digit, reversed
    ans = (j >= 0) & (j < L.unsqueeze(1))
    ids = torch.where(ans, col(s, j.clamp(0, d)), ids)
    x = torch.where(j == L.unsqueeze(1), 13, ids)                       # "§" after the answer
    # targets: the next token, from "=" (predict " ") to the last digit (predict "§")
    y = torch.full_like(x, -1)
    t = pos[:-1]
    keep = (t >= 2 * d + 1) & (t < (2 * d + 3 + L).unsqueeze(1))
    y[:, :-1] = torch.where(keep, x[:, 1:], -1)
    return x, y, a * 10 ** d + b


def addition_zeros(step, steps):
    """The zero-digit curriculum (train.py --zero_digits_steps N): the probability that an operand digit (not the
    leading one) is forced to 0, from 0.5 at step 0 down to 0 at step N, then 0 (Paper B's uniform problems). Why:
    on the loss plateau every answer digit is at chance, because digit j of the sum, (a_j + b_j + carry) mod 10,
    tells nothing about a_j alone: attending to one operand earns no gradient until the model attends to both (a
    saddle). Where b_j is 0 the digit is a_j itself, and attending to a_j pays at once."""
    return 0.5 * max(0.0, 1 - step / steps) if steps else 0.0


def addition_heldout(digits, n):
    """The test set: the first n distinct held-out problems of a fixed stream (the same for every
    run, so seeds and settings are compared on the same problems; the first 100 are the public
    protocol's)."""
    g, parts, seen = torch.Generator().manual_seed(10_000), [], set()
    for _ in range(50 + n // 1000):
        x, y, c = addition_batch(100_000, digits, g, heldout=True)  # ~2,000 held out per draw
        keep = [i for i, v in enumerate(c.tolist()) if not (v in seen or seen.add(v))]
        parts.append((x[keep], y[keep], c[keep]))
        if len(seen) >= n:
            return tuple(torch.cat(t)[:n] for t in zip(*parts))
    raise ValueError(f"only {len(seen)} held-out problems exist with {digits} digits; ask for fewer")


def train_batch(cfg, run, g, micro):
    """This micro-step's (x, y) on the device: addition problems, random windows, or Paper A's epochs."""
    if cfg.task == "addition":
        zeros = addition_zeros(run.iter_num, cfg.zero_digits_steps)  # the curriculum's easy problems, if on
        x, y, _ = addition_batch(cfg.batch_size, cfg.digits, g, zeros=zeros)
    elif cfg.window_stride:
        index = (run.iter_num * cfg.gradient_accumulation_steps + micro) * run.world + run.rank
        x, y = windows_batch(run.train_data, cfg.batch_size, run.block_size, cfg.window_stride, cfg.seed, index)
    else:
        x, y = get_batch(run.train_data, cfg.batch_size, run.block_size, g)
    if "cuda" in run.device:  # page-locked: the copy runs asynchronously, the step does not wait for it
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
