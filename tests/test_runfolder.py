"""A training run's folder (training/runfolder.py) by what it promises: a run saved part way and resumed continues
bit for bit; a LoRA run's checkpoints are adapters that PEFT loads onto their base; --overwrite removes the run's
checkpoints and records, whatever state a crash left them in, and nothing else; weights go into the model they fit
and are refused, by name, by one they do not fit. (tests/test_checkpoint.py tests the checkpoint folders themselves.)"""
from __future__ import annotations

import types

import pytest
import torch
from conftest import make_hf_model, tiny_config

from models.gpt2 import GPT2LMHeadModel, GPT2Model
from models.lora import apply_lora
from tasks.char_tokenizer import CharTokenizer
from training import distributed as dist
from training import runfolder as rf
from training.batches import EpochBatches
from training.checkpoint import capture_rng, load_checkpoint, save_checkpoint
from training.train_config import ArchitectureMismatchError, TrainConfig

ROWS = torch.randint(0, 257, (8, 7), generator=torch.Generator().manual_seed(5))


class Run:
    """What fit() keeps for one run: a model with dropout (so the RNG matters), an optimizer, a decaying schedule,
    a loss scaler that changes its scale every step and a shuffled batch source. `seed` sets the initial weights."""

    def __init__(self, seed: int, model: torch.nn.Module | None = None):
        torch.manual_seed(seed)
        self.model = model or GPT2LMHeadModel(tiny_config("h5", resid_pdrop=0.2))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (s + 1))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
        self.batches = EpochBatches(len(ROWS), 2, 1, 2, 3, lambda idx: {"x": ROWS[idx]})
        self.state = rf.RunState()

    def steps(self, n: int) -> None:
        self.model.train()
        for _ in range(n):
            step = self.batches.next_step()
            ids = step.micro[0].batch["x"]
            self.scaler.scale(self.model(ids, labels=ids)["loss"]).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.schedule.step()
            self.state.step += 1
            self.state.epoch = step.epoch

    def save(self, out, best: bool = False, run_info=None, tokenizer=None) -> None:
        rf.save_run(out, self.model, self.state, run_info or {"lr": 1e-2}, best, self.opt, self.schedule,
                    self.scaler, self.batches, tokenizer)

    def resume(self, out, run_info=None, weights_loaded: bool = False) -> rf.RunState:
        ck = rf.open_run(TrainConfig(output_dir=str(out), resume=True))
        self.state = rf.resume_run(ck, self.model, self.opt, self.schedule, self.scaler, self.batches,
                                   run_info or {"lr": 1e-2}, weights_loaded)
        return self.state


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- save_run / resume_run: an exact continuation ---------------------------------------------------------------

def test_a_run_saved_after_2_steps_and_resumed_by_a_new_process_ends_as_the_uninterrupted_run(tmp_path):
    whole = Run(0)
    whole.steps(2)
    whole.state.best = {"step": 2, "epoch": 0.5, "metrics": {"acc": 0.25}}
    whole.state.history = [{"acc": 0.25}]
    whole.state.log_sums, whole.state.wall_s = {"loss": 3.5}, 1.25
    whole.save(tmp_path / "run", best=True, tokenizer=CharTokenizer.from_text("ab c"))
    saved_state = rf.RunState(**vars(whole.state))
    whole.steps(2)
    expected_draw = torch.rand(4)

    torch.manual_seed(123)  # a new process: other RNG states, other initial weights
    torch.rand(50)
    resumed = Run(1)
    assert resumed.resume(tmp_path / "run") == saved_state  # step, epoch, best, history, sums: as saved
    assert resumed.batches.position == 2 and resumed.schedule.last_epoch == 2
    assert resumed.scaler.get_scale() == 2.0 ** 10  # grown once per step, and carried on
    resumed.steps(2)
    assert same_tensors(resumed.model.state_dict(), whole.model.state_dict())  # dropout masks, batches, lr alike
    assert same_tensors(resumed.opt.state_dict()["state"][0], whole.opt.state_dict()["state"][0])
    assert resumed.scaler.get_scale() == whole.scaler.get_scale() and resumed.state.step == 4
    assert torch.equal(torch.rand(4), expected_draw)

    best = load_checkpoint(tmp_path / "run" / "best")  # the weights, the counters and the run's settings
    assert best.state == {"step": 2, "epoch": 0.5, "best": saved_state.best, "run": {"lr": 1e-2}}
    assert best.optimizer is None and best.scheduler is None
    for name in ("best", "last"):  # each checkpoint carries the run's tokenizer
        assert CharTokenizer.from_pretrained(tmp_path / "run" / name).chars == [" ", "a", "b", "c"]


def test_resume_loads_the_weights_unless_the_caller_built_the_model_from_the_checkpoint(tmp_path):
    run = Run(0)
    run.steps(1)
    run.save(tmp_path)
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    other = Run(1)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    other.resume(tmp_path, weights_loaded=True)
    assert same_tensors(other.model.state_dict(), before)
    other.resume(tmp_path)
    assert same_tensors(other.model.state_dict(), weights)


def test_resume_refuses_changed_settings_and_lets_epochs_and_max_iters_grow(tmp_path):
    run = Run(0)
    run.save(tmp_path, run_info={"lr": 1e-2, "epochs": 2, "max_iters": 10, "seed": 3})
    grown = {"lr": 1e-2, "epochs": 3, "max_iters": 20, "seed": 3}
    assert Run(1).resume(tmp_path, grown).step == 0
    with pytest.raises(ValueError, match=rf"^cannot resume {tmp_path / 'last'}: these settings differ from the saved "
                                         r"run's: seed was 3, now 4\. Pass the run's own settings \(only epochs, "
                                         r"max_iters may be raised\), or start a new run$"):
        Run(1).resume(tmp_path, {**grown, "seed": 4})


def test_a_last_from_before_the_settings_were_recorded_resumes_with_nothing_to_compare(tmp_path):
    run, rng = Run(0), capture_rng()
    draw = torch.rand(2)
    save_checkpoint(tmp_path / "last", run.model, optimizer=run.opt, scheduler=run.schedule,
                    state={"step": 3, "rng": rng, "batches": {"position": 3}})
    resumed = Run(1)
    assert resumed.resume(tmp_path, {"lr": 1e-2, "seed": 3}) == rf.RunState(step=3)
    assert torch.equal(torch.rand(2), draw) and resumed.batches.position == 3


def test_under_torchrun_each_rank_continues_its_own_rng_and_only_rank_0_keeps_the_summed_meters(tmp_path,
                                                                                             monkeypatch):
    """Two ranks draw different dropout masks: OUT/last keeps both RNG states (rank 0 gathers them), and each
    rank of the resumed run continues its own; a rank beyond those saved (more processes now) takes rank 0's."""
    seeds = {0: 10, 1: 11}
    states, draws = [], {}
    for r, seed in seeds.items():
        torch.manual_seed(seed)
        states.append(capture_rng())
        draws[r] = torch.rand(3)
    monkeypatch.setattr(dist, "gather_objects", lambda obj: list(states))
    run = Run(0)
    run.state.log_sums, run.state.eval_sums = {"loss": 1.0}, {"loss": 2.0}
    run.save(tmp_path)
    for r in (1, 0, 2):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        got = Run(1).resume(tmp_path)
        assert torch.equal(torch.rand(3), draws[r if r < 2 else 0]), r
        assert (got.log_sums, got.eval_sums) == (({"loss": 1.0}, {"loss": 2.0}) if r == 0 else ({}, {}))

    monkeypatch.setattr(dist, "gather_objects", lambda obj: [obj])  # one process: its RNG state alone
    monkeypatch.setattr(dist, "rank", lambda: 0)
    torch.manual_seed(12)
    run.save(tmp_path)
    draw = torch.rand(3)
    assert "rank_rng" not in load_checkpoint(tmp_path / "last").state
    Run(1).resume(tmp_path)
    assert torch.equal(torch.rand(3), draw)


# ---- LoRA runs: the checkpoints are adapters in PEFT's format ------------------------------------------------------

def _random_adapters(model, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # lora_B starts at zero: make the adapter count
    return model


def _peft_logits(adapter_folder, ids):
    peft = pytest.importorskip("peft")
    model = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter_folder))  # the base named in the adapter
    return model.eval()(ids).logits


def test_a_lora_run_on_a_saved_base_checkpoints_adapters_that_peft_loads_onto_that_base(tmp_path):
    base = tmp_path / "hf"
    make_hf_model(tiny_config("h5")).save_pretrained(base)
    model = apply_lora(GPT2LMHeadModel.from_pretrained(base), rank=2, base_model=str(base))
    run = Run(0, _random_adapters(model))
    run.steps(1)
    run.save(tmp_path / "run", best=True)
    for name in ("last", "best"):
        assert sorted(p.name for p in (tmp_path / "run" / name).iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors", "manifest.json", "training_state.pt"]
    assert not (tmp_path / "run" / "base").exists()  # the base is where the adapter says: nothing to write
    ids = ROWS[:2]
    model.eval()
    with torch.no_grad():
        ours = model(ids)["logits"]
        torch.testing.assert_close(_peft_logits(tmp_path / "run" / "last", ids), ours, atol=1e-5, rtol=1e-5)

    again = _random_adapters(apply_lora(GPT2LMHeadModel.from_pretrained(base), rank=2), seed=8)
    rf.load_weights(again, tmp_path / "run" / "best")
    assert same_tensors(again.state_dict(), model.state_dict())


def test_a_lora_run_on_a_random_base_writes_the_base_once_beside_its_checkpoints_for_peft(tmp_path):
    torch.manual_seed(0)
    model = _random_adapters(apply_lora(GPT2LMHeadModel(tiny_config("h5")), rank=2, base_model="random:h5"))
    run = Run(0, model)
    run.save(tmp_path / "run", best=True)
    base = tmp_path / "run" / "base"
    written = (base / "model.safetensors").stat()
    run.steps(1)
    run.save(tmp_path / "run", best=True)
    assert (base / "model.safetensors").stat().st_ino == written.st_ino  # the frozen base is written once
    ids = ROWS[:2]
    model.eval()
    with torch.no_grad():
        ours = model(ids)["logits"]
        for name in ("last", "best"):
            torch.testing.assert_close(_peft_logits(tmp_path / "run" / name, ids), ours, atol=1e-5, rtol=1e-5)


def test_adapters_and_whole_models_do_not_mix(tmp_path):
    whole = tmp_path / "whole"
    rf.save_model(whole, GPT2LMHeadModel(tiny_config("h5")), state={})
    with pytest.raises(ValueError, match=rf"^checkpoint {whole} holds a whole model, but this run trains LoRA "
                                         r"adapters \(--lora_rank\)$"):
        rf.load_weights(apply_lora(GPT2LMHeadModel(tiny_config("h5")), rank=2), whole)
    adapter = tmp_path / "adapter"
    rf.save_model(adapter, apply_lora(GPT2LMHeadModel(tiny_config("h5")), rank=2), state={})
    with pytest.raises(ValueError, match=rf"^checkpoint {adapter} holds a LoRA adapter, not a whole model: give "
                                         r"the --lora_\* flags it was trained with \(its adapter_config\.json "
                                         r"lists them\)$"):
        rf.load_weights(GPT2LMHeadModel(tiny_config("h5")), adapter)


# ---- weights in and out: which part goes where, and what does not fit ---------------------------------------------

class Classifier(torch.nn.Module):
    """A task model as tasks/ builds them: a body `.gpt` and a head with a buffer."""

    def __init__(self, seed: int, **config):
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = GPT2Model(tiny_config("h5", **config))
        self.head = torch.nn.Linear(20, 3)
        self.register_buffer("prior", torch.rand(3))


def test_a_bare_body_an_lm_and_a_task_model_round_trip_and_the_body_is_in_hf_format(tmp_path):
    import transformers

    for make in (lambda s: GPT2Model(tiny_config("h5")), lambda s: GPT2LMHeadModel(tiny_config("h5")), Classifier):
        torch.manual_seed(0)
        model = make(0)
        rf.save_model(tmp_path / "m", model, state={"step": 1}, tokenizer=None)
        torch.manual_seed(1)
        again = make(1)
        assert rf.load_weights(again, tmp_path / "m").state == {"step": 1}
        assert same_tensors(again.state_dict(), model.state_dict()), type(model).__name__
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "m" / "extra.safetensors")) == ["head.bias", "head.weight", "prior"]
    hf = transformers.GPT2Model.from_pretrained(tmp_path / "m").eval()  # the body alone, as transformers reads it
    with torch.no_grad():
        torch.testing.assert_close(hf(ROWS[:2]).last_hidden_state, model.gpt.eval()(ROWS[:2])["last_hidden_state"])


def test_a_checkpoint_with_another_head_is_refused_naming_both(tmp_path):
    rf.save_model(tmp_path / "c", Classifier(0), state={})
    lm = tmp_path / "lm"
    rf.save_model(lm, GPT2LMHeadModel(tiny_config("h5")), state={})
    with pytest.raises(ValueError, match=rf"^checkpoint {lm} holds head tensors \[\], the model expects "
                                         r"\['head\.bias', 'head\.weight', 'prior'\]$"):
        rf.load_weights(Classifier(1), lm)
    with pytest.raises(ValueError, match=rf"^checkpoint {tmp_path / 'c'} holds head tensors \['head\.bias', "
                                         r"'head\.weight', 'prior'\], the model expects \[\]$"):
        rf.load_weights(GPT2LMHeadModel(tiny_config("h5")), tmp_path / "c")


def test_a_checkpoint_of_another_architecture_is_refused_with_each_difference(tmp_path):
    rf.save_model(tmp_path / "c", Classifier(0), state={})
    with pytest.raises(ArchitectureMismatchError, match=rf"^checkpoint {tmp_path / 'c'} is a different architecture "
                                                        r"from the model \(checkpoint vs model\): n_embd 20 vs 40, "
                                                        r"n_layer 2 vs 3$"):
        rf.load_weights(Classifier(1, n_embd=40, n_layer=3), tmp_path / "c")
    rf.load_weights(Classifier(1, resid_pdrop=0.3, attn_pdrop=0.2), tmp_path / "c")  # dropout is no architecture
    # a config object without some fields (an older version's) reads them as None
    old = types.SimpleNamespace(**{k: getattr(tiny_config("h5"), k) for k in rf.ARCHITECTURE if k != "logit_softcap"})
    rf.check_architecture(old, tiny_config("h5", logit_softcap=None), "old")
    with pytest.raises(ArchitectureMismatchError, match=r"^checkpoint old is .*: logit_softcap None vs 30\.0$"):
        rf.check_architecture(old, tiny_config("h5", logit_softcap=30.0), "old")
    with pytest.raises(ArchitectureMismatchError, match=r"^checkpoint new is .*: logit_softcap 30\.0 vs None$"):
        rf.check_architecture(tiny_config("h5", logit_softcap=30.0), old, "new")


# ---- a new run, a resumed one, --overwrite -------------------------------------------------------------------------

def _leftovers(out):
    """What runs and crashes leave in OUT: checkpoints whole, moved aside or half written, records, and the user's."""
    for name in ("last", "best", ".last.old", ".best.old", ".best.tmp-99999", "tensorboard", "notes"):
        (out / name).mkdir(parents=True)
        (out / name / "f").write_text("x")
    for name in ("metrics.jsonl", "curves.png", "last.txt", "best-run.json", ".last.older", "config.yaml"):
        (out / name).write_text("x")


def test_overwrite_removes_checkpoints_in_any_state_and_records_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "run"
    _leftovers(out)
    rf.remove_run(out)
    assert sorted(p.name for p in out.iterdir()) == [".last.older", "best-run.json", "config.yaml", "last.txt",
                                                     "notes"]
    assert (out / "notes" / "f").is_file()
    assert capsys.readouterr().out == f"--overwrite: removed the checkpoints in {out}\n"


@pytest.mark.parametrize("left", [".best.old", ".last.tmp-4242", "best", "last"])
def test_overwrite_says_so_when_any_checkpoint_went_and_is_silent_about_records_alone(tmp_path, capsys, left):
    out = tmp_path / "run"
    (out / left).mkdir(parents=True)
    (out / "metrics.jsonl").parent.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("x")
    rf.remove_run(out)
    assert list(out.iterdir()) == []
    assert capsys.readouterr().out == f"--overwrite: removed the checkpoints in {out}\n"
    (out / "curves.png").write_text("x")
    (out / "tensorboard").mkdir()
    rf.remove_run(out)
    assert list(out.iterdir()) == [] and capsys.readouterr().out == ""


def test_overwrite_removes_a_file_where_a_checkpoint_folder_belongs_and_ignores_a_missing_folder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last").write_text("not a folder")
    rf.remove_run(out)
    assert list(out.iterdir()) == []
    rf.remove_run(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_overwrite_removes_a_linked_checkpoint_folder_as_a_link_and_keeps_what_it_points_to(tmp_path, capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    save_checkpoint(elsewhere, state={"step": 1})
    out.mkdir()
    (out / "last").symlink_to(elsewhere, target_is_directory=True)
    assert rf.open_run(TrainConfig(output_dir=str(out), overwrite=True)) is None  # not "pass --overwrite"
    assert list(out.iterdir()) == [] and load_checkpoint(elsewhere).state == {"step": 1}
    assert capsys.readouterr().out == f"--overwrite: removed the checkpoints in {out}\n"


def test_only_rank_0_removes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _leftovers(out)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    rf.remove_run(out)
    assert len(list(out.iterdir())) == 13


def test_a_new_run_refuses_a_folder_with_a_checkpoint_and_overwrite_clears_it(tmp_path):
    out = tmp_path / "run"
    cfg = lambda **kw: TrainConfig(output_dir=str(out), **kw)  # noqa: E731
    save_checkpoint(out / "best", state={"step": 2})
    with pytest.raises(FileExistsError, match=rf"^{out / 'best'} already holds a checkpoint: pass --resume to continue "
                                              r"it or --overwrite to start again \(or choose another --output_dir\)$"):
        rf.open_run(cfg())
    with pytest.raises(FileNotFoundError, match=rf"^--resume: no checkpoint to continue in {out} \(it has no last/\)$"):
        rf.open_run(cfg(resume=True))
    save_checkpoint(out / "last", state={"step": 4})
    (out / "last").rename(out / ".last.old")  # a crash between the renames of a save: last/ is the old one
    assert rf.open_run(cfg(resume=True)).state == {"step": 4}
    with pytest.raises(FileExistsError, match=rf"^{out / 'last'} already holds a checkpoint"):
        rf.open_run(cfg())
    assert rf.open_run(cfg(max_steps=2)) is None and (out / ".last.old").is_dir()  # a benchmark writes nothing
    assert rf.open_run(cfg(overwrite=True, resume=True)).state == {"step": 4}  # --resume keeps the run
    assert rf.open_run(cfg(overwrite=True)) is None
    assert list(out.iterdir()) == []


def test_resume_of_a_damaged_last_names_the_damage_and_the_way_out(tmp_path):
    out = tmp_path / "run"
    save_checkpoint(out / "last", state={"step": 4})
    (out / "last" / "training_state.pt").write_bytes(b"x")
    with pytest.raises(rf.CorruptCheckpointError, match=rf"^checkpoint {out / 'last'}: training_state\.pt has 1 "
                                                        r"bytes, expected \d+ \(truncated\?\); --resume cannot "
                                                        r"continue it: pass --overwrite to start afresh$"):
        rf.open_run(TrainConfig(output_dir=str(out), resume=True))
