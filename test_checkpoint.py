"""Tests of checkpoint.py: checkpoints checked on load. (The out_dir's rules, which need a run, are in test_train.py.)"""
import dataclasses
import math

import pytest
import torch

import checkpoint
import train
from conftest import file_bytes


# a checkpoint from elsewhere (another version, a hand edit) -> the piece of the one line that names the field
DAMAGED_CHECKPOINTS = {
    "config None": (lambda c: c.update(config=None), "config is a NoneType, not a dict"),
    "a string learning rate": (lambda c: c["config"].update(learning_rate="3e-4"),
                               "config.learning_rate expects float, got '3e-4'"),
    "iter_num a string": (lambda c: c.update(iter_num="6"), "iter_num is '6'"),
    "best_val_loss nan": (lambda c: c.update(best_val_loss=math.nan), "best_val_loss is nan"),
    "a tokenizer without kind": (lambda c: c["tokenizer"].pop("kind"), "tokenizer.kind is None"),
    "a regex tokenizer without vocab": (lambda c: c.update(tokenizer={"kind": "regex"}), "tokenizer.vocab is not a list"),
    "a vocabulary larger than the model's": (lambda c: c["model_args"].update(vocab_size=100) or c["model"].update(
        {k: c["model"][k][:100] for k in ("wte.weight", "lm_head.weight") if k in c["model"]}),
        "the tokenizer has 256 tokens, more than model_args.vocab_size 100"),
    "model_args without n_embd": (lambda c: c["model_args"].pop("n_embd"), "model_args lacks n_embd"),
    "model_args of the wrong type": (lambda c: c["model_args"].update(n_layer="1"), "model_args.n_layer expects int, got '1'"),
    "model_args of another shape": (lambda c: c["model_args"].update(mlp_hidden=64),
                                    "model.blocks.0.mlp.c_fc.weight has shape (256, 32), but model_args make (128, 32)"),
    "a weight missing": (lambda c: c["model"].pop("wpe.weight"), "model.wpe.weight is missing"),
    "a weight not a tensor": (lambda c: c["model"].update({"wpe.weight": [0.0]}), "model.wpe.weight is not a tensor"),
    "optimizer state not a dict": (lambda c: c["optimizer"].update(state=[]), "optimizer.state is not a dict"),
}


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_every_checkpoint_field_is_checked_on_load_with_one_line(case, tmp_path, capsys):
    import sample
    from conftest import one_error_line, tiny
    m = tiny(vocab_size=256, n_layer=1)
    ckpt = {"model": m.state_dict(), "optimizer": m.configure_optimizers(0.01, 1e-3).state_dict(),
            "model_args": dataclasses.asdict(m.config), "config": dataclasses.asdict(train.TrainConfig(tokenizer="bytes")),
            "iter_num": 6, "best_val_loss": 5.0, "tokenizer": {"kind": "bytes", "dtype": "uint16"}}
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    checkpoint.load_checkpoint(path)  # sound
    damage, msg = DAMAGED_CHECKPOINTS[case]
    damage(ckpt)
    torch.save(ckpt, path)
    before = file_bytes(path)
    for main, argv in ((train.main, ["--init_from", "resume", "--eval_only"]), (train.main, ["--init_from", "resume"]),
                       (sample.main, [])):
        assert main(argv + ["--out_dir", str(tmp_path), "--device", "cpu"]) == 1
        assert f"error: checkpoint {path}: {msg}" in one_error_line(capsys)
    assert file_bytes(path) == before
