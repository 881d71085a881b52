"""Atomic, verified training checkpoints (training/checkpoint.py)."""
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config

from models.gpt2 import GPT2LMHeadModel
from training import checkpoint as ck


def _model_and_optimizer():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h5"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 257, (2, 6))
    model(ids, labels=ids)["loss"].backward()
    opt.step()
    return model, opt


def test_round_trip_of_model_optimizer_state_and_extra_tensors(tmp_path):
    model, opt = _model_and_optimizer()
    ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 7, "best": 0.5},
                       extra_tensors={"head.weight": torch.arange(4.0)})
    loaded = ck.load_checkpoint(tmp_path / "last")
    assert loaded.state == {"step": 7, "best": 0.5}
    assert torch.equal(loaded.extra_tensors["head.weight"], torch.arange(4.0))
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded.optimizer)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    again = GPT2LMHeadModel.from_pretrained(loaded.path)
    assert torch.equal(again.gpt.word_embedding.weight, model.gpt.word_embedding.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # no temporary or old folders left


def test_rng_states_restore_exactly(tmp_path):
    gen = torch.Generator().manual_seed(3)
    state = ck.capture_rng(gen)
    first = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=gen))
    ck.save_checkpoint(tmp_path / "c", state={"rng": state})
    ck.restore_rng(ck.load_checkpoint(tmp_path / "c").state["rng"], gen)
    second = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=gen))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


def test_corrupt_truncated_and_incomplete_checkpoints_are_refused(tmp_path):
    model, opt = _model_and_optimizer()
    path = ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 1})
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(data[:-10])
    with pytest.raises(ck.CorruptCheckpointError, match="truncated"):
        ck.load_checkpoint(path)
    data[-5] ^= 0xFF
    weights.write_bytes(data)
    with pytest.raises(ck.CorruptCheckpointError, match="checksum"):
        ck.load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="incomplete"):
        ck.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_checkpoint(tmp_path / "never")


def test_crash_between_renames_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 1})
    real_replace = ck.os.replace

    def crash_after_moving_the_old_aside(src, dst):  # (os.replace also renames files inside the new folder)
        real_replace(src, dst)
        if Path(dst).name == ".last.old":  # old folder moved aside, new one not yet in place
            raise KeyboardInterrupt

    monkeypatch.setattr(ck.os, "replace", crash_after_moving_the_old_aside)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 2})
    monkeypatch.undo()
    assert not (tmp_path / "last").exists() and (tmp_path / ".last.old").is_dir()  # the window this test is about
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 1}  # resolved from .last.old
    ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 3})  # and the next save recovers
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
