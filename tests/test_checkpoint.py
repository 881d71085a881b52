"""Atomic, verified training checkpoints (training/checkpoint.py), and the run folder made of them
(training/runfolder.py): OUT/last and OUT/best, new runs, resumes and --overwrite, head and LoRA weights."""
import hashlib
import io
import json
import os
import random
import shutil
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_config

from models.gpt2 import GPT2LMHeadModel, GPT2Model
from models.lora import apply_lora
from training import checkpoint as ck
from training import distributed as dist
from training import runfolder as rf
from training.batches import EpochBatches
from training.train_config import ArchitectureMismatchError, TrainConfig


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



def test_save_writes_parents_the_scheduler_the_tokenizer_and_a_head_file_transformers_reads(tmp_path):
    model, opt = _model_and_optimizer()
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)

    class Tokenizer:  # anything with save_pretrained(dir), like an HF tokenizer
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{}")
            (Path(directory) / "extras").mkdir()  # a folder in a checkpoint is kept, not hashed

    path = ck.save_checkpoint(tmp_path / "a" / "b" / "last", model, optimizer=opt, scheduler=schedule,
                              extra_tensors={"head.weight": torch.ones(2)}, tokenizer=Tokenizer())
    assert (path / "tokenizer.json").read_text() == "{}" and (path / "extras").is_dir()
    from safetensors import safe_open
    with safe_open(path / ck.EXTRA, "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' and safetensors' torch loaders expect
    on_disk = torch.load(path / ck.STATE, weights_only=True)
    assert sorted(on_disk) == ["optimizer", "scheduler", "state"] and on_disk["state"] == {}
    assert ck.load_checkpoint(path).scheduler == schedule.state_dict() == on_disk["scheduler"]
    text = (path / ck.MANIFEST).read_text()
    manifest = json.loads(text)
    assert sorted(manifest) == sorted(["config.json", ck.EXTRA, "model.safetensors", ck.STATE, "tokenizer.json"])
    assert text == json.dumps(manifest, indent=1, sort_keys=True)  # one entry per line, for a reader
    assert manifest["tokenizer.json"] == {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}


def test_stale_temporary_folders_of_dead_processes_go_and_a_live_ones_stays(tmp_path):
    import subprocess

    other = subprocess.Popen(["sleep", "60"])  # another process saving right now
    try:
        dead = tmp_path / ".my-last.tmp-999999999"  # no such process (a hyphen in the name, too)
        live = tmp_path / f".my-last.tmp-{other.pid}"
        stray = tmp_path / ".my-last.tmp-999999998"  # a file, not a folder: left alone, and no error
        for folder in (dead, live):
            folder.mkdir()
        stray.write_text("x")
        ck.save_checkpoint(tmp_path / "my-last", state={"step": 1})
        assert not dead.exists() and live.is_dir() and stray.is_file()
        assert other.poll() is None  # asking whether it is alive sent it no signal
    finally:
        other.kill()
        other.wait()


def test_a_save_interrupted_again_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    """After a crash between the renames only .last.old is whole; a second crash before the new folder is moved in
    must still leave it (the recovery moves it back first); and a leftover .last.old beside a whole last/ goes."""
    ck.save_checkpoint(tmp_path / "last", state={"step": 1})
    os.replace(tmp_path / "last", tmp_path / ".last.old")  # the first crash
    real_replace = ck.os.replace

    def crash_moving_the_new_one_in(src, dst):
        if ".tmp-" in Path(src).name:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", crash_moving_the_new_one_in)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path / "last", state={"step": 2})
    monkeypatch.undo()
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 1}
    ck.save_checkpoint(tmp_path / "last", state={"step": 2})
    shutil.copytree(tmp_path / "last", tmp_path / ".last.old")  # a crash after the new one moved in
    ck.save_checkpoint(tmp_path / "last", state={"step": 3})
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 3} and not (tmp_path / ".last.old").exists()


def test_every_kind_of_unreadable_checkpoint_says_what_is_wrong(tmp_path):
    path = ck.save_checkpoint(tmp_path / "c", state={"step": 1})
    (path / ck.MANIFEST).write_text("{not json")
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^checkpoint {path}: manifest\.json is not valid JSON \("):
        ck.load_checkpoint(path)
    path = ck.save_checkpoint(tmp_path / "c", state={"step": 1})
    (path / ck.STATE).unlink()
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^checkpoint {path} is missing training_state\.pt$"):
        ck.load_checkpoint(path)

    def rewritten(state_bytes: bytes) -> Path:  # a training_state.pt that its manifest vouches for
        folder = ck.save_checkpoint(tmp_path / "c", state={"step": 1})
        (folder / ck.STATE).write_bytes(state_bytes)
        manifest = json.loads((folder / ck.MANIFEST).read_text())
        manifest[ck.STATE] = {"bytes": len(state_bytes), "sha256": hashlib.sha256(state_bytes).hexdigest()}
        (folder / ck.MANIFEST).write_text(json.dumps(manifest))
        return folder

    buf = io.BytesIO()
    torch.save({"state": {"step": Fraction(1, 3)}}, buf)  # a Python object: unpickling it could run code
    path = rewritten(buf.getvalue())
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^refusing to load {path / ck.STATE}: it holds Python "
                                                        r"objects other than tensors and plain values, which could "
                                                        r"run code when unpickled \(weights_only=True\)$"):
        ck.load_checkpoint(path)
    path = rewritten(b"not a torch file")
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^checkpoint {path}: cannot read training_state\.pt \("):
        ck.load_checkpoint(path)


def test_read_step_reads_the_counter_alone_and_names_a_broken_file(tmp_path):
    ck.save_checkpoint(tmp_path / "last", state={"step": 42, "big": torch.zeros(1000)})
    assert ck.read_step(tmp_path / "last") == 42
    os.replace(tmp_path / "last", tmp_path / ".last.old")  # a crash between renames: the survivor is read
    assert ck.read_step(tmp_path / "last") == 42
    (tmp_path / ".last.old" / ck.STATE).write_bytes(b"broken")
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^checkpoint {tmp_path / '.last.old'}: cannot read its step "
                                                        r"from training_state\.pt \(.*\); pass --overwrite to start "
                                                        r"afresh$"):
        ck.read_step(tmp_path / "last")


def test_read_step_does_not_unpickle_python_objects(tmp_path):
    """read_step chooses between folders before any is verified, so it must not run a file's pickled code either."""
    path = ck.save_checkpoint(tmp_path / "last", state={"step": 1})
    torch.save({"state": {"step": Fraction(7, 2)}}, path / ck.STATE)  # int() of it would be 3
    with pytest.raises(ck.CorruptCheckpointError, match=rf"(?s)^checkpoint {path}: cannot read its step from "
                                                        r"training_state\.pt \(.*Unsupported global"):
        ck.read_step(path)


def test_a_checkpoint_written_on_a_gpu_resumes_and_reads_its_step_on_a_cpu_only_machine(tmp_path, monkeypatch):
    """A run trained on a GPU machine is resumed or chosen on a CPU-only one: its training_state.pt tags each tensor
    with cuda:0, and both readers map them to the CPU. torch's own serializer writes the GPU's tags here, its
    location tag forced to cuda:0, so no GPU is needed."""
    model, opt = _model_and_optimizer()
    with monkeypatch.context() as gpu:
        gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        path = ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, state={"step": 5})
    if not torch.cuda.is_available():  # the file really is a GPU's: a plain load refuses it here
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(path / ck.STATE, weights_only=True)
    assert ck.read_step(path) == 5
    loaded = ck.load_checkpoint(path)
    saved = opt.state_dict()["state"]
    for i, moments in loaded.optimizer["state"].items():
        assert moments["exp_avg"].device.type == "cpu"
        torch.testing.assert_close(moments["exp_avg"], saved[i]["exp_avg"], rtol=0, atol=0)


def test_a_temporary_folder_of_another_users_live_process_stays(tmp_path, monkeypatch):
    """Where the pid belongs to another user, asking whether it is alive raises PermissionError: it is alive."""
    folder = tmp_path / ".last.tmp-4242"
    folder.mkdir()
    real_kill = os.kill

    def kill(pid, sig):
        if pid == 4242:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    ck.save_checkpoint(tmp_path / "last", state={"step": 1})
    assert folder.is_dir()


def test_resume_rule_names_each_changed_setting_and_lets_only_the_extendable_grow():
    saved = {"lr": 1e-3, "seed": 1, "epochs": 3, "data": "a.csv"}
    ck.check_resume_settings(saved, dict(saved), "OUT/last")
    ck.check_resume_settings(saved, {**saved, "epochs": 5}, "OUT/last", extendable=("epochs",))  # may grow
    ck.check_resume_settings(saved, {**saved, "new_flag": True}, "OUT/last")  # not recorded then: not compared
    ck.check_resume_settings({"lr": 1e-3}, {"lr": 1e-3, "epochs": 2}, "x", extendable=("epochs",))
    with pytest.raises(ValueError) as e:
        ck.check_resume_settings(saved, {**saved, "lr": 1e-2, "data": "b.csv", "epochs": 2}, "OUT/last",
                                 extendable=("epochs", "max_iters"))
    assert str(e.value) == ("cannot resume OUT/last: these settings differ from the saved run's: lr was 0.001, now "
                            "0.01; data was 'a.csv', now 'b.csv'; epochs was 3, now 2 (it may only grow). Pass the "
                            "run's own settings (only epochs, max_iters may be raised), or start a new run")
    with pytest.raises(ValueError, match=r"^cannot resume x: these settings differ from the saved run's: epochs was 3, "
                                         r"now 4\. Pass the run's own settings \(only none may be raised\)"):
        ck.check_resume_settings(saved, {"epochs": 4}, "x")
    with pytest.raises(ValueError, match=r"epochs was 3, now 2 \(it may only grow\)\. Pass"):
        ck.check_resume_settings(saved, {"epochs": 2}, "x", extendable=("epochs",))


def test_rng_restores_from_lists_and_without_the_generator_it_saved():
    gen = torch.Generator().manual_seed(3)
    state = ck.capture_rng(gen)
    expected = (random.random(), torch.rand(1, generator=gen))
    state["python"] = json.loads(json.dumps(state["python"]))  # tuples as lists (as JSON, or an older writer)
    ck.restore_rng(state)  # no generator given: its saved state is not needed
    assert random.random() == expected[0]
    ck.restore_rng(state, gen)
    assert torch.equal(torch.rand(1, generator=gen), expected[1])

# ---- the run folder (training/runfolder.py) ----------------------------------------------------------------------

class Headed(torch.nn.Module):
    """A task model as the tasks build them: a GPT-2 body `.gpt` and a head."""

    def __init__(self, head: str = "head", **config):
        super().__init__()
        self.gpt = GPT2Model(tiny_config("h5", **config))
        setattr(self, head, torch.nn.Linear(20, 3))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_task_models_body_and_head_round_trip_and_another_head_or_architecture_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Headed()
    rf.save_model(tmp_path / "best", model, state={"step": 3})
    assert (tmp_path / "best" / "config.json").is_file()  # the body in HF format, the head beside it
    from safetensors.torch import load_file
    assert sorted(load_file(tmp_path / "best" / ck.EXTRA)) == ["head.bias", "head.weight"]
    torch.manual_seed(1)
    again = Headed()
    assert rf.load_weights(again, tmp_path / "best").state == {"step": 3} and _same_weights(again, model)
    path = tmp_path / "best"
    with pytest.raises(ValueError, match=rf"^checkpoint {path} holds head tensors \['head.bias', 'head.weight'\], "
                                         r"the model expects \['classifier.bias', 'classifier.weight'\]$"):
        rf.load_weights(Headed("classifier"), path)
    with pytest.raises(ArchitectureMismatchError, match=rf"^checkpoint {path} is a different architecture from the "
                                                        r"model \(checkpoint vs model\): n_layer 2 vs 3$"):
        rf.load_weights(Headed(n_layer=3), path)
    with pytest.raises(ArchitectureMismatchError, match=r"model\): n_positions 32 vs 40, n_layer 2 vs 3$"):
        rf.check_architecture(tiny_config("h5"), tiny_config("h5", n_layer=3, n_positions=40), path)
    rf.check_architecture(tiny_config("h5"), tiny_config("h5", resid_pdrop=0.3), path)  # not the architecture
    config = tiny_config("h5")
    older = SimpleNamespace(**{k: getattr(config, k) for k in rf.ARCHITECTURE if k != "logit_softcap"})
    rf.check_architecture(older, config, path)  # a field an older config lacks counts as None (its default)
    rf.check_architecture(config, older, path)


def _lora_lm(seed: int, base_model: str | None):
    torch.manual_seed(0)  # the same base weights every time
    model = GPT2LMHeadModel(tiny_config("h5"))
    torch.manual_seed(seed)
    apply_lora(model, rank=2, base_model=base_model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            torch.nn.init.normal_(p)  # lora_B starts at zero: make the adapters differ by seed
    return model


def test_a_lora_run_saves_its_adapter_and_a_random_base_once_and_loads_only_into_a_lora_model(tmp_path, monkeypatch):
    bases = []
    real_save_base = rf.save_base
    monkeypatch.setattr(rf, "save_base", lambda model, d: bases.append(Path(d)) or real_save_base(model, d))
    model = _lora_lm(1, "random:h5")
    out = tmp_path / "run"
    rf.save_model(out / "last", model, state={"step": 1})
    rf.save_model(out / "best", model, state={"step": 1})
    assert bases == [(out / "base").resolve()]  # written once, beside last/ and best/
    assert (out / "base" / "config.json").is_file() and not (out / "last" / "config.json").exists()
    adapter = json.loads((out / "last" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((out / "base").resolve())  # PEFT finds the base there
    again = _lora_lm(2, "random:h5")
    rf.load_weights(again, out / "last")
    assert _same_weights(again, model)

    named = _lora_lm(1, "gpt2")
    rf.save_model(tmp_path / "named", named, state={})
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "gpt2"
    assert bases == [(out / "base").resolve()]  # a base the hub has is not written

    whole = tmp_path / "whole"
    rf.save_model(whole, GPT2LMHeadModel(tiny_config("h5")), state={})
    with pytest.raises(ValueError, match=rf"^checkpoint {out / 'last'} holds a LoRA adapter, not a whole model: give "
                                         r"the --lora_\* flags it was trained with \(its adapter_config.json lists "
                                         r"them\)$"):
        rf.load_weights(GPT2LMHeadModel(tiny_config("h5")), out / "last")
    with pytest.raises(ValueError, match=rf"^checkpoint {whole} holds a whole model, but this run trains LoRA adapters "
                                         r"\(--lora_rank\)$"):
        rf.load_weights(_lora_lm(1, "random:h5"), whole)


def _run_folder(out: Path) -> None:
    """A run folder in every state a crash or an earlier run can leave, plus a file of the user's."""
    for name in ("last", "best", ".last.old", ".best.old", ".last.tmp-123", "tensorboard"):
        (out / name).mkdir(parents=True)
        (out / name / "x").write_text("x")
    for name in ("metrics.jsonl", "curves.png", "notes.txt"):
        (out / name).write_text("x")


def test_overwrite_removes_the_runs_checkpoints_and_records_and_keeps_other_files(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _run_folder(out)
    rf.remove_run(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert capsys.readouterr().out == f"--overwrite: removed the checkpoints in {out}\n"
    (out / "metrics.jsonl").write_text("x")
    rf.remove_run(out)  # records only: nothing to say about checkpoints
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and capsys.readouterr().out == ""
    rf.remove_run(tmp_path / "never")  # no folder yet: nothing to do
    _run_folder(tmp_path / "other")
    monkeypatch.setattr(dist, "rank", lambda: 1)
    rf.remove_run(tmp_path / "other")  # under torchrun only rank 0 removes
    assert len(list((tmp_path / "other").iterdir())) == 9


def test_open_run_refuses_a_used_folder_resumes_only_a_whole_last_and_overwrite_starts_afresh(tmp_path):
    out = tmp_path / "run"
    cfg = lambda **kw: TrainConfig(output_dir=str(out), **kw)  # noqa: E731
    assert rf.open_run(cfg()) is None  # a new run, no folder yet
    with pytest.raises(FileNotFoundError, match=rf"^--resume: no checkpoint to continue in {out} \(it has no last/\)$"):
        rf.open_run(cfg(resume=True))
    ck.save_checkpoint(out / "best", state={"step": 2})
    with pytest.raises(FileNotFoundError, match=r"^--resume: no checkpoint to continue in .*\(it has no last/\)$"):
        rf.open_run(cfg(resume=True))  # best/ alone cannot be continued
    with pytest.raises(FileExistsError, match=rf"^{out / 'best'} already holds a checkpoint: pass --resume to continue "
                                              r"it or --overwrite to start again \(or choose another --output_dir\)$"):
        rf.open_run(cfg())
    ck.save_checkpoint(out / "last", state={"step": 4})
    with pytest.raises(FileExistsError, match=rf"^{out / 'last'} already holds"):
        rf.open_run(cfg())  # last/ is named first
    assert rf.open_run(cfg(max_steps=3)) is None  # a benchmark writes no checkpoint
    assert rf.open_run(cfg(resume=True)).state == {"step": 4}
    assert rf.open_run(cfg(resume=True, overwrite=True)).state == {"step": 4}  # --resume wins: nothing removed
    (out / "last" / ck.STATE).write_bytes(b"broken")
    with pytest.raises(ck.CorruptCheckpointError, match=r"\(truncated\?\); --resume cannot "
                                                        r"continue it: pass --overwrite to start afresh$"):
        rf.open_run(cfg(resume=True))
    assert rf.open_run(cfg(overwrite=True)) is None and not (out / "last").exists() and not (out / "best").exists()


def _training_parts(seed: int):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_config("h5"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    batches = EpochBatches(8, 2, 1, 2, 0, lambda idx: {"x": torch.tensor(idx)})
    return model, opt, schedule, torch.amp.GradScaler("cpu", enabled=False), batches


STATE_KEYS = ["batches", "best", "epoch", "eval_sums", "evaluated_at", "history", "last_eval", "log_sums", "overflows",
              "rng", "run", "scaler", "skipped", "step", "wall_s"]


def test_last_holds_everything_a_resume_restores_in_the_format_it_reads(tmp_path):
    model, opt, schedule, scaler, batches = _training_parts(0)
    ids = torch.randint(0, 257, (2, 6))
    model(ids, labels=ids)["loss"].backward()
    opt.step()
    schedule.step()
    for _ in range(3):
        batches.next_step()
    best = {"step": 3, "epoch": 0.75, "metrics": {"acc": 0.5}}
    state = rf.RunState(step=3, epoch=0.75, best=best, last_eval={"acc": 0.5}, evaluated_at=3, history=[{"acc": 0.5}],
                        skipped=1, overflows=2, wall_s=1.5, log_sums={"loss": 2.0}, eval_sums={"loss": 4.0})
    run_info = {"lr": 1e-3, "epochs": 2}
    rf.save_run(tmp_path, model, state, run_info, True, opt, schedule, scaler, batches)
    after_save = torch.rand(3)

    saved = torch.load(tmp_path / "last" / ck.STATE, weights_only=True)["state"]
    assert sorted(saved) == STATE_KEYS and saved["batches"] == {"position": 3} and saved["run"] == run_info
    assert "rank_rng" not in saved  # one process: its own RNG only
    assert ck.load_checkpoint(tmp_path / "best").state == {"step": 3, "epoch": 0.75, "best": best, "run": run_info}

    model2, opt2, schedule2, scaler2, batches2 = _training_parts(1)
    got = rf.resume_run(ck.load_checkpoint(tmp_path / "last"), model2, opt2, schedule2, scaler2, batches2,
                        run_info, weights_loaded=False)
    assert got == state and batches2.position == 3 and _same_weights(model2, model)
    assert schedule2.last_epoch == 1 and torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                                                     opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the saved run's did
    with pytest.raises(ValueError, match=r"^cannot resume .*: these settings differ from the saved run's: lr was "
                                         r"0\.001, now 0\.01"):
        rf.resume_run(ck.load_checkpoint(tmp_path / "last"), *_training_parts(1), {"lr": 1e-2, "epochs": 2}, False)


def test_a_last_written_by_an_earlier_version_resumes(tmp_path):
    """OUT/last as a version without some of today's counters wrote it (plain dict keys: a renamed key would strand
    every such run), its weights already in the model (weights_loaded); the scaler's state absent."""
    model, opt, schedule, scaler, batches = _training_parts(0)
    rng = ck.capture_rng()
    expected = torch.rand(2)
    ck.save_checkpoint(tmp_path / "last", model, optimizer=opt, scheduler=schedule,
                       state={"step": 5, "epoch": 1.25, "best": None, "history": [], "skipped": 0,
                              "rng": rng, "batches": {"position": 5}, "run": {"lr": 1e-3}})
    got = rf.resume_run(ck.load_checkpoint(tmp_path / "last"), model, opt, schedule, scaler, batches, {"lr": 1e-3},
                        weights_loaded=True)
    assert got == rf.RunState(step=5, epoch=1.25) and batches.position == 5
    assert torch.equal(torch.rand(2), expected)


def test_each_rank_resumes_its_own_rng_and_only_rank_0_carries_the_sums(tmp_path, monkeypatch):
    batches = EpochBatches(8, 2, 1, 2, 0, None)
    states, draws = [], []
    for seed in (10, 11):  # each rank's RNG state and what it draws next
        torch.manual_seed(seed)
        states.append(ck.capture_rng())
        draws.append(torch.rand(2))
    saved = {"rng": states[0], "rank_rng": states, "batches": {"position": 2}}
    monkeypatch.setattr(dist, "rank", lambda: 1)
    rf.restore_rng_state(saved, batches)
    assert torch.equal(torch.rand(2), draws[1]) and batches.position == 2
    monkeypatch.setattr(dist, "rank", lambda: 2)  # more ranks now than saved: rank 0's state
    rf.restore_rng_state(saved, batches)
    assert torch.equal(torch.rand(2), draws[0])
    monkeypatch.setattr(dist, "gather_objects", lambda obj: [obj, obj])
    assert sorted(rf.rng_state(batches)) == ["batches", "rank_rng", "rng"]

    model, opt, schedule, scaler, _ = _training_parts(0)
    monkeypatch.setattr(dist, "rank", lambda: 0)
    state = rf.RunState(step=2, log_sums={"loss": 1.0}, eval_sums={"loss": 2.0})
    rf.save_run(tmp_path, model, state, {}, False, opt, schedule, scaler, batches)
    assert not (tmp_path / "best").exists()
    monkeypatch.setattr(dist, "rank", lambda: 1)
    rf.save_run(tmp_path / "rank1", model, state, {}, True, opt, schedule, scaler, batches)
    assert not (tmp_path / "rank1").exists()  # only rank 0 writes
    got = rf.resume_run(ck.load_checkpoint(tmp_path / "last"), model, opt, schedule, scaler, batches, {}, True)
    assert got.step == 2 and got.log_sums == {} and got.eval_sums == {}  # rank 0's sums are already over all ranks
