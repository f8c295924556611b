"""Tests of data.py: tokenizers, the token cache, the addition task, windows. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from configurator import RunError
import train
from conftest import HERE, TRAIN_ENV


def test_regex_tokenizer_cap_min_frequency_and_round_trip():
    words = [f"w{i}" for i in range(25_000)]
    meta = data.fit_regex_tokenizer(" ".join(words + words) + " once\n")
    vocab = meta["vocab"]
    assert len(vocab) == 20_000 and vocab[:4] == ["<pad>", "<unk>", "<bos>", "<eos>"] and len(set(vocab)) == 20_000
    assert "w0" in vocab and "once" not in vocab  # the cap keeps the most frequent
    text = "def f(x):\n    return x+1  # café\n\n"
    meta = data.fit_regex_tokenizer(text * 2 + "rare")
    tok = data.get_tokenizer(meta)
    assert tok.vocab_size == len(meta["vocab"]) and "\n    " in meta["vocab"] and "é" in meta["vocab"]
    assert "rare" not in meta["vocab"]  # seen once: below min frequency 2
    assert tok.decode(tok.encode(text)) == text  # whitespace runs, punctuation and non-ASCII letters round-trip
    assert tok.encode("rare") == [1]  # <unk>


@pytest.mark.slow
def test_token_cache_is_reused_across_processes(train_text_file, tmp_path, monkeypatch):
    cfg = train.TrainConfig(dataset="text", data_files=train_text_file, tokenizer="bytes", cache_dir=str(tmp_path))
    tr, va, meta = data.prepare_data(cfg)
    assert meta == {"kind": "bytes", "dtype": "uint16"} and len(tr) + len(va) == len(open(train_text_file, "rb").read())
    [folder] = os.listdir(tmp_path)
    stamp = os.stat(tmp_path / folder / "train.bin").st_mtime_ns

    def no_tokenizing(meta):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(data, "get_tokenizer", no_tokenizing)
    tr2, _, _ = data.prepare_data(cfg)
    assert np.array_equal(tr, tr2) and os.stat(tmp_path / folder / "train.bin").st_mtime_ns == stamp
    # another Python process (another hash seed) must find the same folder
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import data, train; data.get_tokenizer = None; "
            f"data.prepare_data(train.TrainConfig(dataset='text', data_files={train_text_file!r}, tokenizer='bytes', "
            f"cache_dir={str(tmp_path)!r}))")
    r = subprocess.run([sys.executable, "-c", code], env={**TRAIN_ENV, "PYTHONHASHSEED": "12345"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == [folder] and os.stat(tmp_path / folder / "train.bin").st_mtime_ns == stamp


def test_gpt2_tokenizer_round_trip(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    import tiktoken.load
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.path.join(HERE, "..", "shared", "tiktoken")
    if not os.path.isdir(cache):
        pytest.skip("no tiktoken cache (set TIKTOKEN_CACHE_DIR); the test does not download")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)

    def no_network(path):  # a test never downloads
        raise ConnectionError(f"cannot reach {path}")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    try:
        tiktoken.get_encoding("r50k_base")
    except Exception as e:
        pytest.skip(f"GPT-2 BPE not loadable offline from {cache}: {type(e).__name__}")
    tok = data.get_tokenizer({"kind": "gpt2"})
    text = "Looped transformers reuse one block K times.\n\n  Ça marche ✓"
    assert tok.vocab_size == 50257 and tok.decode(tok.encode(text)) == text
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids


def test_addition_data_format_targets_and_heldout():
    g = torch.Generator().manual_seed(0)
    x, y, codes = data.addition_batch(64, 4, g)
    tok = data.get_tokenizer({"kind": "addition"})
    assert x.shape == (64, 17) and tok.vocab_size == 15
    for row, tgt, code in zip(x.tolist(), y.tolist(), codes.tolist()):
        a, b = divmod(code, 10_000)
        s = f"{a}+{b}= {str(a + b)[::-1]}§"
        assert 1000 <= a <= 9999 and 1000 <= b <= 9999
        assert tok.decode(row) == s and row[len(s):] == [14] * (17 - len(s))  # right-padded with id 14
        eq = s.index("=")
        # targets: next token from "=" on, i.e. the space, the reversed answer and §; nothing else
        assert tgt[:eq] == [-1] * eq and tok.decode(tgt[eq:len(s) - 1]) == s[eq + 1:]
        assert tgt[len(s) - 1:] == [-1] * (17 - len(s) + 1)
    assert tok.decode(data.addition_batch(1, 4, torch.Generator().manual_seed(3))[0][0].tolist()).count("§") == 1
    # held-out problems never appear in training batches (2 digits: only 8,100 problems, collisions would be common)
    held = data.addition_heldout(2, 80)[2].numpy()
    assert len(set(held.tolist())) == 80 and data.is_heldout(torch.from_numpy(held)).all()
    for step in range(20):
        _, _, c = data.addition_batch(256, 2, torch.Generator().manual_seed(step))
        assert not np.isin(c.numpy(), held).any() and not data.is_heldout(c).any()
    # one test set whatever its size: the first 100 of 1,000 are the 100; 2% of all problems are held out
    assert torch.equal(data.addition_heldout(4, 1000)[0][:100], data.addition_heldout(4, 100)[0])
    assert abs(data.is_heldout(torch.arange(10**6, 10**8, 997)).float().mean().item() - 0.02) < 0.001
    with pytest.raises(ValueError, match="only .* held-out problems exist"):
        data.addition_heldout(2, 1000)


def test_windows_batch_walks_paper_a_epochs():
    # windows start every `stride` tokens; an epoch shows each window once, in a seeded order that a
    # resumed run replays (batch number i is a pure function of seed and i)
    toks = np.arange(1000, dtype=np.uint16)
    n = data.n_windows(len(toks), 16, 8)
    assert n == (1000 - 17) // 8 + 1
    starts = [int(x[0]) for i in range(n // 5) for x in data.windows_batch(toks, 5, 16, 8, seed=3, index=i)[0]]
    assert sorted(starts) == [8 * j for j in range(n // 5 * 5)] or len(set(starts)) == len(starts)
    x, y = data.windows_batch(toks, 4, 16, 8, seed=3, index=2)
    assert torch.equal(y, x + 1) and all(int(r[0]) % 8 == 0 for r in x)
    assert torch.equal(x, data.windows_batch(toks, 4, 16, 8, seed=3, index=2)[0])
    first = {int(r[0]) for i in range(n) for r in data.windows_batch(toks, 1, 16, 8, seed=3, index=i)[0]}
    assert first == {8 * j for j in range(n)}  # one epoch: every window exactly once
    assert [int(data.windows_batch(toks, 1, 16, 8, 3, i)[0][0, 0]) for i in range(n, 2 * n)] != \
           [int(data.windows_batch(toks, 1, 16, 8, 3, i)[0][0, 0]) for i in range(n)]  # a new order each epoch


def test_wikitext2_comes_from_the_hub_by_name_in_the_release_of_the_local_files(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    asked = []
    fake = {s: {"text": ["", f" {s} line \n", ""]} for s in ("train", "validation", "test")}  # as the hub stores them
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: asked.append(a) or fake)
    monkeypatch.setattr(data, "reachable", lambda *a, **k: True)
    cfg = train.TrainConfig(dataset="wikitext2", train_split="test", tokenizer="bytes", cache_dir=str(tmp_path))
    tr, va, _ = data.prepare_data(cfg)
    assert asked == [("Salesforce/wikitext", "wikitext-2-v1")]  # the tokenized release: <unk>, as wiki.*.tokens
    assert bytes(tr.tolist()) == b" \n test line \n \n" and bytes(va.tolist()) == b" \n validation line \n \n"


@pytest.mark.slow
def test_wikitext2_from_a_folder_trains_on_the_split_asked_for(tmp_path):
    folder = os.path.join(HERE, "..", "shared", "data", "wikitext-2")
    if not os.path.isfile(os.path.join(folder, "valid.txt")):
        pytest.skip("no local WikiText-2 files (the project reaches them from the hub)")
    cfg = train.TrainConfig(dataset="wikitext2", data_dir=folder, train_split="test", tokenizer="bytes", cache_dir=str(tmp_path))
    tr, va, _ = data.prepare_data(cfg)
    size = lambda f: len(open(os.path.join(folder, f), "rb").read())
    assert (len(tr), len(va)) == (size("test.txt"), size("valid.txt"))
    if not os.path.isfile(os.path.join(folder, "train.txt")):
        with pytest.raises(data.RunError, match="use --train_split test"):
            data.prepare_data(train.TrainConfig(dataset="wikitext2", data_dir=folder, tokenizer="bytes",
                                                cache_dir=str(tmp_path)))


def test_data_files_must_be_utf8_text_and_a_tiny_regex_vocabulary_is_reported(tmp_path, capsys):
    (tmp_path / "latin.txt").write_bytes(("café " * 100).encode("latin-1"))
    for path, msg in ((tmp_path / "latin.txt", "is not UTF-8 text (byte 0xe9 at offset 3); convert it"),
                      (tmp_path, "is a folder"), (tmp_path / "nope.txt", "not found")):
        with pytest.raises(RunError, match=re.escape(msg)):
            data.read_file(str(path))
    data.fit_regex_tokenizer("every word here is new and seen once only")
    assert "the regex vocabulary has only 1 tokens seen at least 2 times" in capsys.readouterr().err  # the space
    data.fit_regex_tokenizer("a small text\n" * 3)  # few tokens, but all of them in the vocabulary: no note
    assert capsys.readouterr().err == ""


def text_of(tokens):  # a bytes-tokenized split as text
    return bytes(tokens.tolist()).decode()


def test_token_cache_is_keyed_by_every_input_in_its_role(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta gamma\n" * 50)
    b.write_text("delta epsilon\n" * 20)
    cfg = lambda files: train.TrainConfig(dataset="text", data_files=files, tokenizer="bytes",
                                          cache_dir=str(tmp_path / "c"))
    tr, va, _ = data.prepare_data(cfg(f"{a}"))
    assert text_of(tr) + text_of(va) == a.read_text()
    # a typo in the validation file is an error, never the single-file cache
    with pytest.raises(RunError, match=re.escape(f"data file {tmp_path}/valdi.txt not found")):
        data.prepare_data(cfg(f"{a},{tmp_path}/valdi.txt"))
    assert text_of(data.prepare_data(cfg(f"{a},{b}"))[1]) == b.read_text()  # the roles: b validates
    assert text_of(data.prepare_data(cfg(f"{b},{a}"))[1]) == a.read_text()
    with pytest.raises(RunError, match="validation file .*a.txt .* holds the same text as a training file"):
        data.prepare_data(cfg(f"{a},{a}"))
    a.write_text("ALPHA beta gamma\n" + "alpha beta gamma\n" * 49)  # the same size, another text: a new cache
    assert text_of(data.prepare_data(cfg(f"{a}"))[0]).startswith("ALPHA")
    # WikiText-2 from a folder: lines moved from train to valid keep the total size, not the cache
    d = tmp_path / "wt2"
    d.mkdir()
    (d / "train.txt").write_text("one two\nthree four\n")
    (d / "valid.txt").write_text("five six\n")
    wt2 = train.TrainConfig(dataset="wikitext2", data_dir=str(d), tokenizer="bytes", cache_dir=str(tmp_path / "c"))
    data.prepare_data(wt2)
    (d / "train.txt").write_text("one two\n")
    (d / "valid.txt").write_text("three four\nfive six\n")
    tr, va, _ = data.prepare_data(wt2)
    assert (text_of(tr), text_of(va)) == ("one two\n", "three four\nfive six\n")


DAMAGED_CACHE = {  # how a token cache gets damaged -> (file, new bytes)
    "truncated to an even size": ("train.bin", lambda b: b[:len(b) // 3 // 2 * 2]),
    "an odd size": ("train.bin", lambda b: b[:-1]),
    "empty": ("train.bin", lambda b: b""),
    "val.bin missing": ("val.bin", None),
    "out-of-range ids": ("train.bin", lambda b: b"\xff\xff" + b[2:]),
}


@pytest.mark.parametrize("case", DAMAGED_CACHE)
def test_token_cache_checks_its_counts_and_checksums_and_rebuilds(case, train_text_file, tmp_path, capsys):
    cfg = train.TrainConfig(dataset="text", data_files=train_text_file, tokenizer="bytes", cache_dir=str(tmp_path))
    good = [np.array(t) for t in data.prepare_data(cfg)[:2]]
    [folder] = os.listdir(tmp_path)
    name, damage = DAMAGED_CACHE[case]
    path = tmp_path / folder / name
    if damage is None:
        path.unlink()
    else:
        path.write_bytes(damage(path.read_bytes()))
    killed = tmp_path / folder / f"{name}.{socket.gethostname()}.{2**22 + 12345}.tmp"  # a writer killed mid-write
    killed.write_bytes(b"half a file")
    capsys.readouterr()
    tr, va, _ = data.prepare_data(cfg)
    assert np.array_equal(tr, good[0]) and np.array_equal(va, good[1])
    assert f"note: the token cache {tmp_path / folder} is damaged or incomplete" in capsys.readouterr().err
    assert not killed.exists() and os.listdir(tmp_path) == [folder]


def test_interrupted_tokenizing_leaves_no_cache_folder(train_text_file, tmp_path, monkeypatch):
    def interrupted(meta):
        def encode(text):
            raise KeyboardInterrupt
        return data.Tokenizer(encode, None, 256)
    monkeypatch.setattr(data, "get_tokenizer", interrupted)
    cfg = train.TrainConfig(dataset="text", data_files=train_text_file, tokenizer="bytes", cache_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        data.prepare_data(cfg)
    assert os.listdir(tmp_path) == []


def test_a_given_regex_vocabulary_is_used_as_it_is_never_refit(tmp_path):
    lines = [f"w{i} w{i + 1} ." for i in range(200)] * 2
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines))
    cfg = train.TrainConfig(dataset="text", data_files=str(path), tokenizer="regex", cache_dir=str(tmp_path / "c"))
    _, _, meta = data.prepare_data(cfg)
    # the same text in another order, and new words: a refit would give other ids
    path.write_text("\n".join(lines[::-1] + ["brand new words"] * 50))
    assert data.prepare_data(cfg)[2]["vocab"] != meta["vocab"]
    tr, va, got = data.prepare_data(cfg, meta)
    assert got["vocab"] == meta["vocab"]
    tok = data.get_tokenizer(meta)
    text = path.read_text()
    assert np.array_equal(tr, tok.encode(text[:int(0.9 * len(text))])) and va.max() < len(meta["vocab"])


def test_zero_digit_curriculum_makes_easy_problems_and_fades_to_paper_bs():
    tok = data.get_tokenizer({"kind": "addition"})
    plain = data.addition_batch(256, 4, torch.Generator().manual_seed(3))
    same = data.addition_batch(256, 4, torch.Generator().manual_seed(3), zeros=0.0)
    assert all(torch.equal(p, q) for p, q in zip(plain, same))  # off: the very stream of a run without it
    x, _, codes = data.addition_batch(4096, 4, torch.Generator().manual_seed(3), zeros=0.5)
    a, b = codes // 10_000, codes % 10_000
    assert ((a >= 1000) & (b >= 1000)).all() and not data.is_heldout(codes).any()  # 4-digit operands, never held out
    low = torch.stack([v // 10 ** i % 10 for v in (a, b) for i in range(3)])  # the digits after the leading one
    assert abs((low == 0).float().mean().item() - (0.5 + 0.5 * 0.1)) < 0.02  # zeroed half the time, else 0 by chance
    for row, code in zip(x[:64].tolist(), codes[:64].tolist()):  # and each problem is still a right sum
        a_, b_ = divmod(code, 10_000)
        assert tok.decode(row).startswith(f"{a_}+{b_}= {str(a_ + b_)[::-1]}§")
    assert [data.addition_zeros(s, 400) for s in (0, 200, 400, 1000)] == [0.5, 0.25, 0.0, 0.0]
    assert data.addition_zeros(0, 0) == 0.0  # the default: Paper B's problems from step 0
