"""models/decode_threads.py: the decode steps' thread count follows the measured step times (a simulated clock
stands in for a quiet and a busy machine), is restored afterwards, and never changes greedy tokens."""
import os
import time

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
    decode_threads._remembered.clear()
    yield
    torch.set_num_threads(old)
    decode_threads._remembered.clear()


@pytest.fixture(autouse=True)
def no_idle_reads(monkeypatch):
    """The simulated clocks below have no CPUs to read: the idle cores' signal is off unless a test simulates it."""
    monkeypatch.setattr(decode_threads, "idle_cpu_seconds", lambda: None)


class Clock:
    """perf_counter for decode_threads: each step costs cost(thread count) seconds of simulated time. With `cpus`,
    the CPUs' idle time is simulated too: a step on n threads leaves idle(n) CPUs idle for its time (by default the
    cpus - n that it does not use)."""

    def __init__(self, monkeypatch, cpus: int | None = None):
        self.now, self.idle_seconds, self.cpus = 0.0, 0.0, cpus
        monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: self.now)
        if cpus is not None:
            monkeypatch.setattr(decode_threads, "idle_cpu_seconds", lambda: self.idle_seconds)

    def run(self, picker: DecodeThreads, steps: int, cost, idle=None) -> list[int]:
        start = len(picker.history)
        for _ in range(steps):
            picker.step()
            n = torch.get_num_threads()
            self.now += cost(n)
            if self.cpus is not None:
                self.idle_seconds += (idle(n) if idle else self.cpus - n) * cost(n)
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


def tries(history: list[int], n: int) -> list[int]:
    return [i for i, m in enumerate(history) if m == n]


def test_a_losing_candidate_is_retried_at_doubling_intervals_then_within_one_percent_of_the_time(monkeypatch,
                                                                                                  threads4):
    """The schedule's rules, step by step: each loss doubles the candidate's period (8 -> 16 -> 32 -> 64), then a
    steady loser waits until its tries cost EXPLORE_SHARE of the time ((its time / the best's - 1) / 1%: 100 steps at
    twice the best's, 256 at most: one thread of a quiet Zen 5 at 2.4x two's cost 2.2% at every 64); its times are
    the ones measured, and the best's window is the last WINDOW steps."""
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    cost = {4: 0.25, 2: 0.5, 1: 1.0}  # exact in binary: every comparison below is exact
    history = clock.run(picker, 700, cost.get)
    at = tries(history, 2)
    # a try is recorded at the next step, which sets its next one a period later: one step more than the period apart
    assert [b - a for a, b in zip(at, at[1:])] == [period + 1 for period in (16, 32, 64, 100, 100, 100, 100, 100)]
    assert picker.period[2] == 100 and picker.best == 4
    at = tries(history, 1)  # four times the best's: (4 - 1) / 1% = 300 steps, past the rarest
    assert [b - a for a, b in zip(at, at[1:])][3:] == [decode_threads.RAREST_PERIOD + 1] * (len(at) - 4)
    assert picker.period[1] == decode_threads.RAREST_PERIOD
    assert list(picker.times[2]) == [0.5] * 3 and list(picker.times[4]) == [0.25] * 3
    assert picker.times[4].maxlen == decode_threads.WINDOW


def test_a_tie_keeps_the_best_and_a_win_resets_the_winners_times_and_soon_retries_the_loser(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads()
    tied = clock.run(picker, 40, {4: 0.25, 2: 0.25, 1: 0.25}.get)  # as fast as the best is no win
    # the best throughout: each other count is tried at steps 2-3 and once more after its 16 steps, nothing else
    assert picker.best == 4 and len(tied) - tied.count(4) == 4, tied
    clock.run(picker, 20, {4: 0.25, 2: 0.5, 1: 0.5}.get)
    fast = {4: 0.25, 2: 0.5, 1: 0.125}
    history = clock.run(picker, 70, fast.get)
    won = history.index(1)
    assert picker.best == 1 and picker.times[1].maxlen == decode_threads.WINDOW
    assert history[won + 1:won + 9] == [1] * 8  # the old best is re-tried FIRST_PERIOD steps after the win, not before
    assert history[won + 9] == 4


def test_only_a_step_more_than_twice_the_best_median_retries_the_others_at_once(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    for slower, at_once in ((2.0, False), (3.0, True)):
        clock, picker = Clock(monkeypatch), DecodeThreads()
        clock.run(picker, 100, {4: 0.25, 2: 0.5, 1: 1.0}.get)
        after = clock.run(picker, 3, {4: 0.25 * slower, 2: 0.5, 1: 1.0}.get)
        assert (after[1] != 4) == at_once, (slower, after)
        picker.close()


def test_one_thread_is_no_choice_two_are_and_the_first_step_runs_the_best(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    assert DecodeThreads(threads=1).options == [] and DecodeThreads(threads=2).options == [2, 1]
    clock, picker = Clock(monkeypatch), DecodeThreads()
    history = clock.run(picker, 40, {4: 0.25, 2: 0.5, 1: 1.0}.get)
    # step 0 runs the best and is not recorded (it also pays for what the call builds), step 1 the best again for a
    # time to compare with, steps 2 and 3 the untried ones, then the loser 2 again once its period of 16 has passed
    # since step 3 recorded it
    assert history[:4] == [4, 4, 2, 1] and tries(history, 2)[:2] == [2, 19]


def test_the_next_call_goes_on_from_the_last_ones_schedule_and_times(monkeypatch, threads4):
    """Calls of 64 steps on a quiet machine: the first call tries the slower counts and backs off; the calls after it
    go on counting steps from where it stopped (no fresh round of tries per call), so over many calls the slower
    counts run about once per LONGEST_PERIOD steps each, as in one long call."""
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, cost = Clock(monkeypatch), {4: 0.25, 2: 0.5, 1: 1.0}
    first = DecodeThreads(key=("k",))
    history = clock.run(first, 64, cost.get)
    first.close()
    assert history[:4] == [4, 4, 2, 1]
    later = []
    for _ in range(10):
        picker = DecodeThreads(key=("k",))
        later += clock.run(picker, 64, cost.get)
        picker.close()
    # 640 steps: each of the two slower counts about every 100 and 256 steps (a fresh round of tries per call: about
    # 60; every 64 steps: 20)
    assert later[0] == 4 and 6 <= len(later) - later.count(4) <= 12, len(later) - later.count(4)
    assert all(t.maxlen == decode_threads.WINDOW for t in picker.times.values())  # remembered windows stay WINDOW long
    one_call = DecodeThreads(key=("long",))
    long_history = clock.run(one_call, 704, cost.get)
    assert abs((len(later) - later.count(4)) - (len(long_history[64:]) - long_history[64:].count(4))) <= 2
    # another thread count (other candidates) starts afresh
    torch.set_num_threads(2)
    fresh = DecodeThreads(key=("k",))
    assert fresh.best == 2 and all(not t for t in fresh.times.values())


def test_a_remembered_quiet_machine_that_turned_busy_is_left_within_a_few_steps(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock = Clock(monkeypatch)
    picker = DecodeThreads(key=("k",))
    clock.run(picker, 200, {4: 0.25, 2: 0.5, 1: 1.0}.get)
    picker.close()
    busy = {4: 1.0, 2: 0.6, 1: 0.5}  # a core turned busy between the calls: fewer threads are faster now
    picker = DecodeThreads(key=("k",))
    history = clock.run(picker, 12, busy.get)
    picker.close()
    # steps 0 and 1 run the remembered best; step 1's time (step 0's may pay for what the call builds) is 4x its
    # median, so the others are tried at once and win
    assert history[:2] == [4, 4] and history[2:4] == [2, 1] and history.count(4) <= 3, history
    assert picker.best == 1


def test_a_fixed_count_leaves_the_remembered_choice_as_it_was(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, busy = Clock(monkeypatch), {4: 1.0, 2: 0.6, 1: 0.5}
    picker = DecodeThreads(key=("k",))
    clock.run(picker, 20, busy.get)
    picker.close()
    assert decode_threads._remembered[("k",)]["best"] == 1
    monkeypatch.setenv("GPT2_DECODE_THREADS", "2")
    fixed = DecodeThreads(key=("k",))
    assert clock.run(fixed, 5, busy.get) == [2] * 5
    fixed.close()
    monkeypatch.delenv("GPT2_DECODE_THREADS")
    again = DecodeThreads(key=("k",))
    assert again.best == 1 and clock.run(again, 1, busy.get) == [1]


def test_stop_ends_a_step_and_times_are_kept_per_unit_of_work(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads(work=4)
    picker.step()
    clock.now += 8.0
    picker.stop()
    assert not picker.times[4]  # the call's first step: no count's time
    picker.step()
    clock.now += 1.0
    picker.stop()
    assert list(picker.times[4]) == [0.25]
    clock.now += 100.0  # between two steps (a prompt's work outside its blocks): not a step's
    picker.step()
    assert list(picker.times[4]) == [0.25] and picker.current == 2
    clock.now += 1.0
    picker.stop()
    picker.stop()  # a second stop records nothing
    assert list(picker.times[2]) == [0.25] and list(picker.times[4]) == [0.25]
    assert DecodeThreads(active=False).stop() is None  # an inactive picker: nothing to stop


# ---- a long prompt's blocks (models/generation.py's prompt_threads) -------------------------------------------------

def _blocks_on_a_clock(monkeypatch, model, cost):
    """Each block of `model` costs cost(thread count) simulated seconds; returns the list of each block's count."""
    clock, counts = Clock(monkeypatch), []

    def block_ran(module, args, output):  # registered first: runs before prompt_threads' own end-of-block hook
        counts.append(torch.get_num_threads())
        clock.now += cost(torch.get_num_threads())

    for layer in model.gpt.gpt_layers:
        layer.register_forward_hook(block_ran)
    return counts


def _deep_tiny():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=6, n_head=2, n_embd=32, vocab_size=97, n_positions=64)).eval()


def test_a_long_prompts_blocks_move_to_the_faster_thread_count_and_the_next_prompt_remembers(monkeypatch, threads4):
    from models import generation

    for env in ("GPT2_PROMPT_THREADS", "GPT2_DECODE_THREADS"):  # both choices on (a CI matrix run turns them off)
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)  # the tiny model's prompt counts as long
    model, ids = _deep_tiny(), torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    counts = _blocks_on_a_clock(monkeypatch, model, {4: 1.0, 2: 0.6, 1: 0.5}.get)  # a core busy: fewer are faster
    model.generate(ids, max_new_tokens=1)
    # blocks 0 and 1 run torch's count (block 0 is no one's time), blocks 2 and 3 the untried ones; 1 thread won
    assert counts == [4, 4, 2, 1, 1, 1], counts
    assert torch.get_num_threads() == 4
    assert all(not layer._forward_pre_hooks and len(layer._forward_hooks) == 1 for layer in model.gpt.gpt_layers)
    counts.clear()
    model.generate(ids[:, :18], max_new_tokens=1)  # another length of the same size class: goes on from the last
    # no fresh round of tries: the losers come back FIRST_PERIOD blocks after they lost, counted across the calls
    assert counts == [1, 1, 1, 1, 1, 4], counts
    prompt_keys = [k for k in decode_threads._remembered if k[0] == "prompt"]
    assert len(prompt_keys) == 1 and len(decode_threads._remembered) == 2  # apart from the decode steps' memory


def test_a_short_prompt_and_a_fixed_setting_keep_their_count(monkeypatch, threads4):
    from models import generation

    model, ids = _deep_tiny(), torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    counts = _blocks_on_a_clock(monkeypatch, model, {4: 1.0, 2: 0.6, 1: 0.5}.get)
    monkeypatch.delenv("GPT2_PROMPT_THREADS", raising=False)
    model.generate(ids, max_new_tokens=1)  # 24 * 20 * 32^2 flops a block: below PROMPT_MIN_FLOPS, not timed
    assert counts == [4] * 6 and not [k for k in decode_threads._remembered if k[0] == "prompt"]
    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)
    for setting, expected in (("off", 4), ("2", 2)):
        monkeypatch.setenv("GPT2_PROMPT_THREADS", setting)
        counts.clear()
        model.generate(ids, max_new_tokens=1)
        assert counts == [expected] * 6 and torch.get_num_threads() == 4, (setting, counts)
    monkeypatch.setenv("GPT2_PROMPT_THREADS", "two")
    with pytest.raises(ValueError, match="GPT2_PROMPT_THREADS"):
        model.generate(ids, max_new_tokens=1)


@pytest.mark.parametrize("beams", [1, 3])
def test_a_prompt_gives_the_same_tokens_at_every_thread_setting(monkeypatch, threads4, beams):
    from models import generation

    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)
    model, ids = _deep_tiny(), torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    outs = {}
    for setting in ("off", "1", "2", "auto", "auto"):
        monkeypatch.setenv("GPT2_PROMPT_THREADS", setting)
        outs[setting] = model.generate(ids, max_new_tokens=8, num_beams=beams)
    assert all(torch.equal(outs["off"], outs[s]) for s in ("1", "2", "auto"))


def test_a_failing_block_restores_the_count_and_removes_the_hooks(monkeypatch, threads4):
    from models import generation

    monkeypatch.delenv("GPT2_PROMPT_THREADS", raising=False)
    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)
    model = _deep_tiny()
    _blocks_on_a_clock(monkeypatch, model, {4: 1.0, 2: 0.6, 1: 0.5}.get)

    def broken(module, args):
        if torch.get_num_threads() == 1:
            raise RuntimeError("a block failed")

    model.gpt.gpt_layers[4].register_forward_pre_hook(broken)  # runs before the block's own: sees block 3's count, 1
    with pytest.raises(RuntimeError, match="a block failed"):
        model.generate(torch.randint(0, 97, (1, 20)), max_new_tokens=1)
    assert torch.get_num_threads() == 4
    assert [len(layer._forward_pre_hooks) for layer in model.gpt.gpt_layers] == [0, 0, 0, 0, 1, 0]


def test_a_quiet_machines_prompts_try_the_slower_counts_once_then_every_longest_period(monkeypatch, threads4):
    from models import generation

    monkeypatch.delenv("GPT2_PROMPT_THREADS", raising=False)
    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)
    model, ids = _deep_tiny(), torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    counts = _blocks_on_a_clock(monkeypatch, model, {4: 0.25, 2: 0.5, 1: 1.0}.get)  # quiet: all threads fastest
    for _ in range(20):  # 120 blocks
        model.generate(ids, max_new_tokens=1)
    slower = [i for i, n in enumerate(counts) if n != 4]
    # blocks 2 and 3 try the others (block 0 may pay for what the call builds, block 1 is the time to beat); each
    # lost and waits at least LONGEST_PERIOD blocks, counted across the prompts: as a steady loser does, until its
    # tries cost 1% of the time (2 threads at twice 4's time: 100 blocks; 1 thread: 256)
    assert slower == [2, 3, 3 + 100], slower


def test_with_two_candidates_the_other_is_tried_wins_and_is_remembered(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, busy = Clock(monkeypatch), {2: 1.0, 1: 0.5}
    picker = DecodeThreads(key=("two",), threads=2)
    assert picker.options == [2, 1] and clock.run(picker, 4, busy.get) == [2, 2, 1, 1]
    picker.close()
    assert decode_threads._remembered[("two",)]["best"] == 1 and torch.get_num_threads() == 4


def test_a_calls_first_step_runs_the_best_even_when_another_is_due(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, cost = Clock(monkeypatch), {4: 0.25, 2: 0.5, 1: 1.0}
    first = DecodeThreads(key=("k",))
    clock.run(first, 19, cost.get)  # 2 lost at step 2 and is due again at step 19: the next call's first step
    first.close()
    assert decode_threads._remembered[("k",)]["due_in"][2] == 0
    picker = DecodeThreads(key=("k",))
    assert clock.run(picker, 2, cost.get) == [4, 2]  # step 0 pays for what the call builds: the due try waits


def test_an_inactive_or_fixed_picker_leaves_a_count_set_during_the_loop(monkeypatch, threads4):
    for picker in (DecodeThreads(active=False), DecodeThreads(threads=1)):
        torch.set_num_threads(2)  # the loop's own work changed torch's count
        picker.close()
        assert torch.get_num_threads() == 2
        torch.set_num_threads(4)


def test_a_steps_time_is_kept_per_unit_of_work(monkeypatch, threads4):
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock, picker = Clock(monkeypatch), DecodeThreads(work=4)
    picker.step()
    clock.now += 8.0
    picker.step()  # step 0's time: not recorded
    clock.now += 1.0
    picker.step()
    assert list(picker.times[4]) == [0.25]


QUIET = {4: 0.010, 2: 0.020, 1: 0.040}  # a quiet 4-core machine: the work splits evenly
BUSY = {4: 0.400, 2: 0.200, 1: 0.025}  # other processes hold the cores: every barrier waits


def test_a_machine_that_turned_quiet_is_back_on_every_core_within_the_idle_window(monkeypatch, threads4):
    """One thread runs as fast beside busy cores as beside idle ones, so no step time shows a busy spell's end; the
    CPUs' idle time does, and the larger counts are re-tried within QUIET_WINDOW of steps (at 40 ms a step: the 4th
    step), not when the schedule's 64-step period comes round. Then the next call goes on at 4 threads."""
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock = Clock(monkeypatch, cpus=4)
    picker = DecodeThreads(key=("k",))
    clock.run(picker, 300, BUSY.get, idle=lambda n: 0)  # other processes hold the cores: nothing idle
    assert picker.best == 1 and picker.period[4] == decode_threads.RAREST_PERIOD  # 16x one thread's time
    picker.close()
    picker = DecodeThreads(key=("k",))
    turned_quiet = clock.run(picker, 64, QUIET.get)
    picker.close()
    assert turned_quiet.index(4) <= 5 and turned_quiet[8:].count(4) >= 52, turned_quiet
    assert picker.best == 4 and picker.quiet_period == decode_threads.FIRST_PERIOD


def test_idle_cores_that_do_not_help_are_retried_at_doubling_intervals(monkeypatch, threads4):
    """Cores that read idle while more threads still run slower (the hypervisor or another process takes them the
    moment ours want them): each re-try the idle time calls loses and the next waits longer, 8 steps doubling to 64,
    so the steps off the best count stay about one try of the larger counts every 64 steps (the schedule's own: every
    256 here, where 2 and 4 threads take 8 and 16 times one thread's time)."""
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    clock = Clock(monkeypatch, cpus=4)
    picker = DecodeThreads(key=("k",))
    history = clock.run(picker, 1000, BUSY.get, idle=lambda n: 4 - n)
    picker.close()
    assert picker.best == 1 and picker.quiet_period == decode_threads.LONGEST_PERIOD
    tail = history[-640:]
    assert 15 <= len(tail) - tail.count(1) <= 30, len(tail) - tail.count(1)  # without the idle reads: 5
    calls = []  # the same 640 steps as ten calls of 64: the wait goes on from call to call, as the schedule does
    for _ in range(10):
        picker = DecodeThreads(key=("k",))
        calls += clock.run(picker, 64, BUSY.get, idle=lambda n: 4 - n)
        picker.close()
    assert 15 <= len(calls) - calls.count(1) <= 30, len(calls) - calls.count(1)


def test_a_busy_machines_idle_time_below_the_share_calls_no_retry(monkeypatch, threads4):
    """QUIET_SHARE of the 3 cores that 4 threads would add to 1: 1.5 idle CPUs re-try the others, 1.4 leave the
    schedule as it would be with nothing idle."""
    monkeypatch.delenv("GPT2_DECODE_THREADS", raising=False)
    histories = {}
    for idle_cpus in (0.0, 1.4, 1.6):
        decode_threads._remembered.clear()
        clock = Clock(monkeypatch, cpus=4)
        picker = DecodeThreads()
        clock.run(picker, 200, BUSY.get, idle=lambda n: 0)
        assert picker.best == 1
        histories[idle_cpus] = clock.run(picker, 40, BUSY.get, idle=lambda n, i=idle_cpus: i if n == 1 else 0)
        picker.close()
    assert histories[1.4] == histories[0.0]
    assert histories[1.6] != histories[0.0] and histories[1.6][:8].count(4) == 1, histories[1.6]


def test_idle_cpu_seconds_reads_proc_stat_or_says_none(monkeypatch):
    monkeypatch.undo()  # the real reader (the autouse fixture replaced it)
    first = decode_threads.idle_cpu_seconds()
    if not os.path.exists("/proc/stat"):
        assert first is None
        return
    time.sleep(0.05)
    second = decode_threads.idle_cpu_seconds()
    assert isinstance(first, float) and first > 0 and second >= first
    monkeypatch.setattr(decode_threads.os, "sched_getaffinity", lambda pid: {10**6}, raising=False)
    assert decode_threads.idle_cpu_seconds() == 0.0  # no CPU of this process in the file: nothing idle
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert decode_threads.idle_cpu_seconds() is None


@pytest.mark.parametrize("case, expected", [
    ("none remembered", None), ("all threads", None), ("others running", 1), ("one other, 4 cpus", 1),
    ("nothing else running", None), ("free cpus enough", None), ("not readable", 1), ("prompt threads off", None),
    ("prompt threads fixed", None)])
def test_a_short_prompt_takes_the_steps_count_while_another_task_runs(monkeypatch, threads4, case, expected):
    """short_prompt_threads: the decode steps' learnt count where their last call ended below the most threads (4) and
    fewer of this process's CPUs than that are free now (procs_running counts this task too); None otherwise
    (torch's count), and always with GPT2_PROMPT_THREADS set; /proc/stat not readable: the steps' count."""
    key = (1, None, 1234)
    if case != "none remembered":
        decode_threads._remembered[key] = {"options": [4, 2, 1], "best": 4 if case == "all threads" else 1}
    cpus, running = {"one other, 4 cpus": (4, 2), "nothing else running": (4, 1), "free cpus enough": (6, 3),
                     "not readable": (4, None)}.get(case, (2, 2))
    monkeypatch.setattr(decode_threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(decode_threads, "running_tasks", lambda: running)
    if case.startswith("prompt threads"):
        monkeypatch.setenv("GPT2_PROMPT_THREADS", "off" if case.endswith("off") else "2")
    else:
        monkeypatch.delenv("GPT2_PROMPT_THREADS", raising=False)
    assert decode_threads.short_prompt_threads(key) == expected


def test_the_running_tasks_are_read_from_proc_stat(monkeypatch):
    import builtins
    import io

    real_open = builtins.open
    for text, expected in (("cpu  1 2 3\nprocs_running 3\nprocs_blocked 0\n", 3), ("cpu  1 2 3\n", None),
                           ("procs_running x\n", None)):
        monkeypatch.setattr(builtins, "open", lambda path, *a, t=text, **k: io.StringIO(t) if path == "/proc/stat"
                            else real_open(path, *a, **k))
        assert decode_threads.running_tasks() == expected
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert decode_threads.running_tasks() is None
    monkeypatch.undo()
    if os.path.exists("/proc/stat"):
        assert decode_threads.running_tasks() >= 1  # this test's own process runs


def test_the_short_prompts_pass_runs_on_the_learnt_count_and_restores_torchs(monkeypatch, threads4):
    """generate's short prompt (the C++ pass) on what short_prompt_threads gives for the decode steps' key (rows,
    quantize, parameters), torch's count again after it; None keeps torch's."""

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=97, n_positions=64)).eval()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = model.gpt.new_cache(1, 8)  # the pass needs what the step needs (GPT2_DECODE_STEP=0: neither runs)
    if fast_step.prompt_why_not(model, ids, None, cache, fast_step.why_not(model, 1, None, cache)) is not None:
        pytest.skip("the short prompt's C++ pass does not run here")
    asked, during = [], []
    real_pass = fast_step.FastPrompt.__call__
    monkeypatch.setattr(fast_step.FastPrompt, "__call__",
                        lambda self, *a: during.append(torch.get_num_threads()) or real_pass(self, *a))
    expected = model.generate(ids, max_new_tokens=3)
    for learnt in (1, 2, None):
        monkeypatch.setattr(decode_threads, "remembers_fewer_threads", lambda: True)  # (a busy spell remembered)
        monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key, n=learnt: asked.append(key) or n)
        during.clear()
        assert torch.equal(model.generate(ids, max_new_tokens=3), expected)
        assert during == [learnt or 4] and torch.get_num_threads() == 4
    assert asked[-1] == (1, None, sum(p.numel() for p in model.parameters()))
    monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key: 1)
    monkeypatch.setattr(fast_step.FastPrompt, "__call__", lambda self, *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model.generate(ids, max_new_tokens=3)
    assert torch.get_num_threads() == 4  # restored when the pass fails


def test_a_short_prompt_through_the_layers_takes_the_learnt_count_too(monkeypatch, threads4):
    """A prompt the C++ pass does not take (padding here) and too short to time its blocks: its layers run on what
    short_prompt_threads gives; a prompt long enough to time keeps the blocks' own choice and never asks it."""
    model, asked, counts = _deep_tiny(), [], []
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the layers' pass
    for layer in model.gpt.gpt_layers:
        layer.register_forward_pre_hook(lambda *_: counts.append(torch.get_num_threads()))
    monkeypatch.setattr(decode_threads, "remembers_fewer_threads", lambda: True)  # (a busy spell remembered)
    monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key: asked.append(key) or 1)
    model.generate(ids, mask, max_new_tokens=1)
    assert asked == [(2, None, sum(p.numel() for p in model.parameters()))]
    assert counts[:len(model.gpt.gpt_layers)] == [1] * len(model.gpt.gpt_layers) and torch.get_num_threads() == 4
    from models import generation

    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)  # now timed: the blocks' choice, not the short rule
    asked.clear()
    model.generate(ids, mask, max_new_tokens=1)
    assert asked == []


REAL_IDLE_CPU_SECONDS = decode_threads.idle_cpu_seconds  # (the autouse fixture replaces it in every test)


def test_the_idle_seconds_are_this_processs_cpus_idle_and_iowait_ticks(monkeypatch):
    """idle_cpu_seconds: the idle + iowait columns of the cpuN lines of the CPUs in this process's affinity (not the
    'cpu' total, not other CPUs), over the clock tick."""
    import builtins
    import io

    stat = ("cpu  9 9 9 900 90 9 9\ncpu0 1 2 3 100 10 7 8\ncpu1 1 2 3 200 20 7 8\ncpu2 1 2 3 400 40 7 8\n"
            "procs_running 2\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(stat) if path == "/proc/stat"
                        else real_open(path, *a, **k))
    monkeypatch.setattr(decode_threads.os, "sched_getaffinity", lambda pid: {0, 2} if pid == 0 else {1})
    monkeypatch.setattr(decode_threads.os, "sysconf", lambda name: 100 if name == "SC_CLK_TCK" else 0)
    assert REAL_IDLE_CPU_SECONDS() == pytest.approx((100 + 10 + 400 + 40) / 100)


def test_a_quiet_process_asks_no_short_prompt_count_and_counts_no_parameters(monkeypatch, threads4):
    """remembers_fewer_threads: some loop's last call ended below its most threads. Until then a short prompt asks
    short_prompt_threads nothing (its key's parameter count is not built); after a busy loop, it asks."""
    assert not decode_threads.remembers_fewer_threads()
    decode_threads._remembered[("a",)] = {"options": [4, 2, 1], "best": 4}
    assert not decode_threads.remembers_fewer_threads()
    decode_threads._remembered[("b",)] = {"options": [4, 2, 1], "best": 2}
    assert decode_threads.remembers_fewer_threads()
    decode_threads._remembered.clear()
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=97, n_positions=64)).eval()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    asked = []
    monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key: asked.append(key) or None)
    monkeypatch.setenv("GPT2_DECODE_THREADS", "auto")
    model.generate(ids, max_new_tokens=1)
    assert asked == []
    decode_threads._remembered[("b",)] = {"options": [4, 2, 1], "best": 2}
    model.generate(ids, max_new_tokens=1)
    assert asked == [(1, None, sum(p.numel() for p in model.parameters()))]
