"""models/decode_threads.py: the decode steps' thread count follows the measured step times (a simulated clock
stands in for a quiet and a busy machine), is restored afterwards, and never changes greedy tokens."""
import pytest
import torch

from config import GPT2Config
from models import decode_threads, fast_step
from models.decode_threads import DecodeThreads, candidates, fixed_threads
from models.gpt2 import GPT2LMHeadModel


@pytest.fixture
def threads4():
    """torch at 4 threads (allowed on any machine; the candidates are then 4, 2, 1), restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    decode_threads._last_pick.clear()
    yield
    torch.set_num_threads(old)
    decode_threads._last_pick.clear()


class Clock:
    """perf_counter for decode_threads: each step costs cost(thread count) seconds of simulated time."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: self.now)

    def run(self, picker: DecodeThreads, steps: int, cost) -> list[int]:
        start = len(picker.history)
        for _ in range(steps):
            picker.step()
            self.now += cost(torch.get_num_threads())
        return picker.history[start:]


def test_candidates_halve_down_to_one():
    assert candidates(1) == [1]
    assert candidates(2) == [2, 1]
    assert candidates(8) == [8, 4, 2, 1]
    assert candidates(6) == [6, 3, 1]


@pytest.mark.parametrize("value, expected", [("", None), ("auto", None), ("off", "off"), ("OFF", "off"), ("3", 3)])
def test_the_setting_is_read(monkeypatch, value, expected):
    monkeypatch.setenv("GPT2_DECODE_THREADS", value)
    assert fixed_threads() == expected


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_setting_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("GPT2_DECODE_THREADS", value)
    with pytest.raises(ValueError, match="GPT2_DECODE_THREADS"):
        DecodeThreads()


def test_a_quiet_machine_keeps_all_threads(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    history = clock.run(picker, 200, lambda n: 0.040 / n)  # the work splits evenly
    assert sorted(set(history[:4])) == [1, 2, 4]  # each candidate tried once at the start
    assert history[-50:].count(4) >= 46  # re-tries back off to one per candidate every 64 steps
    assert history.count(4) >= 180
    picker.close()
    assert torch.get_num_threads() == 4


def test_a_busy_machine_moves_to_fewer_threads(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    busy = {4: 0.400, 2: 0.200, 1: 0.025}  # every barrier waits for a thread whose core is taken
    history = clock.run(picker, 100, busy.get)
    assert history[3:].count(1) >= 90
    assert torch.get_num_threads() == 1  # during the loop
    picker.close()
    assert torch.get_num_threads() == 4  # restored
    # the next call of the same shape starts from the pick
    assert DecodeThreads().best == 1


def test_the_pick_follows_the_machine_when_it_changes(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    quiet = {4: 0.010, 2: 0.020, 1: 0.040}
    busy = {4: 0.400, 2: 0.200, 1: 0.025}
    clock.run(picker, 100, quiet.get)
    assert picker.best == 4
    turned_busy = clock.run(picker, 40, busy.get)
    assert turned_busy.index(1) <= 3  # a step twice as slow as usual re-tries the others at once
    assert turned_busy[10:].count(1) >= 25
    turned_quiet = clock.run(picker, 200, quiet.get)
    assert turned_quiet[-50:].count(4) >= 46  # found again by the re-tries
    picker.close()


@pytest.mark.parametrize("setting, expected", [("off", {4}), ("2", {2})])
def test_a_fixed_setting_is_kept(monkeypatch, threads4, setting, expected):
    monkeypatch.setenv("GPT2_DECODE_THREADS", setting)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    assert set(clock.run(picker, 30, lambda n: 0.01 * n)) <= expected  # even where fewer would be faster
    picker.close()
    assert torch.get_num_threads() == 4


def _tiny():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64)).eval()


def test_generate_gives_the_same_tokens_at_every_thread_count(monkeypatch, threads4):
    model, ids = _tiny(), torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    outs = {}
    for setting in ("off", "1", "2", "auto"):
        monkeypatch.setenv("GPT2_DECODE_THREADS", setting)
        outs[setting] = model.generate(ids, max_new_tokens=12)
        beams = model.generate(ids, max_new_tokens=6, num_beams=3)
        assert torch.get_num_threads() == 4, setting  # restored after each call
        outs[setting + " beams"] = beams
    assert all(torch.equal(outs["off"], outs[s]) for s in ("1", "2", "auto"))
    assert all(torch.equal(outs["off beams"], outs[s + " beams"]) for s in ("1", "2", "auto"))


@pytest.mark.parametrize("step", ["0", "1"])
def test_generate_restores_the_thread_count_when_a_step_fails(monkeypatch, threads4, step):
    monkeypatch.setenv("GPT2_DECODE_THREADS", "1")
    monkeypatch.setenv("GPT2_DECODE_STEP", step)  # torch's decode step, or the C++ one (models/fast_step.py)
    model = _tiny()

    def broken(*args, **kwargs):
        raise RuntimeError("a step failed")

    monkeypatch.setattr(model.gpt, "decode_step", broken)
    monkeypatch.setattr(fast_step.FastStep, "__call__", broken)
    with pytest.raises(RuntimeError, match="a step failed"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert torch.get_num_threads() == 4


def test_generate_runs_without_autograd_when_called_directly(monkeypatch):
    """models.generation.generate itself (not only the model's method) takes no gradients: a decode step under
    autograd would record a graph and miss the kernels that need it off."""
    from models.generation import generate

    monkeypatch.setenv("GPT2_DECODE_STEP", "0")  # the C++ step has no autograd to take
    model, seen = _tiny(), []
    step = model.gpt.decode_step
    monkeypatch.setattr(model.gpt, "decode_step", lambda *a: seen.append(torch.is_grad_enabled()) or step(*a))
    with torch.enable_grad():
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=3)
    assert seen == [False, False]


def test_an_inactive_picker_changes_nothing(monkeypatch, threads4):
    """A loop off the CPU (a CUDA model): no thread count is set, and the setting is not even read."""
    monkeypatch.setenv("GPT2_DECODE_THREADS", "not a number")
    clock, picker = Clock(monkeypatch), DecodeThreads(active=False)
    assert clock.run(picker, 10, lambda n: 0.01 * n) == [] and torch.get_num_threads() == 4
    picker.close()
    assert torch.get_num_threads() == 4
