"""Tests of data.py: tokenizers, the token cache, the addition task, windows. Fast unless marked slow: `python -m pytest -q -m "not slow"`."""
import os
import re
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

    def no_reading(cfg):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(data, "read_texts", no_reading)
    tr2, _, _ = data.prepare_data(cfg)
    assert np.array_equal(tr, tr2) and os.stat(tmp_path / folder / "train.bin").st_mtime_ns == stamp
    # another Python process (another hash seed) must find the same folder
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import data, train; data.read_texts = None; "
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
