"""fit()'s thread choice (training/engine.py's thread_choice, models/decode_threads.py): a simulated clock makes
steps on more threads slow (a busy core) or fast (a quiet machine); the steps move to the faster count, evaluations
run on it, torch's count is restored after the run, and a fixed count, a split batch, --compile, another device or
GPT2_TRAIN_THREADS=off keep torch's count. The CLIs' --threads reaches the engine as a fixed count."""
import argparse

import pytest
import torch
from test_engine_parts import lm_batches, lm_loss, run_cfg, tiny_lm, token_rows

from models import decode_threads
from models.decode_threads import TRAIN_ENV, DecodeThreads
from tasks import finetune, pretrain
from training.engine import fit, thread_choice

BUSY = {4: 0.400, 2: 0.200, 1: 0.050}  # seconds a step: every barrier waits for the thread whose core is taken
QUIET = {4: 0.040, 2: 0.080, 1: 0.160}


@pytest.fixture
def threads4(monkeypatch):
    """torch at 4 threads (the candidates 4, 2, 1), the choice on (the suite's conftest turns it off), no idle reads
    (the simulated clock has no CPUs), no remembered choice; restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    monkeypatch.setenv(TRAIN_ENV, "auto")
    monkeypatch.setattr(decode_threads, "idle_cpu_seconds", lambda: None)
    monkeypatch.setattr(decode_threads, "free_cpus", lambda: None)  # (the suite's own workers keep cores busy)
    decode_threads._remembered.clear()
    yield
    torch.set_num_threads(old)
    decode_threads._remembered.clear()


class SimulatedSteps:
    """perf_counter for the choice: each loss call (one a step) costs cost[threads] seconds of simulated time; the
    thread count of every step and evaluation is kept."""

    def __init__(self, monkeypatch, cost: dict):
        self.now, self.cost, self.steps, self.evaluations = 0.0, cost, [], []
        monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: self.now)

    def loss(self, model, batch):
        n = torch.get_num_threads()
        self.steps.append(n)
        self.now += self.cost[n]
        return lm_loss(model, batch)

    def evaluate(self, model):
        self.evaluations.append(torch.get_num_threads())
        return {"acc": 0.0}


def train(tmp_path, clock: SimulatedSteps, steps: int = 80, **cfg):
    return fit(tiny_lm(), lm_batches(token_rows(2 * steps), 2), clock.loss, clock.evaluate,
               run_cfg(tmp_path, eval_interval=steps // 2, **cfg), {})


def test_beside_a_busy_core_the_steps_and_evaluations_move_to_one_thread_and_torchs_count_returns(
        monkeypatch, tmp_path, threads4):
    clock = SimulatedSteps(monkeypatch, BUSY)
    train(tmp_path, clock)
    assert clock.steps[:4] == [4, 4, 2, 1]  # the first two on torch's count (the first is not timed), a try of each
    retries = [(i, n) for i, n in enumerate(clock.steps) if n != 1 and i >= 3]
    assert retries == [(67, 4), (68, 2)]  # each lost by more than twice: re-tried LONGEST_PERIOD steps later
    assert clock.evaluations == [1, 1]  # an evaluation runs on the steps' count
    assert torch.get_num_threads() == 4
    # a second run in the process starts from what the first learnt
    again = SimulatedSteps(monkeypatch, BUSY)
    train(tmp_path / "again", again, steps=10)
    assert again.steps == [1] * 10


def test_a_run_that_starts_beside_a_busy_core_starts_on_the_free_cores_and_tries_the_larger_counts(
        monkeypatch, tmp_path, threads4):
    monkeypatch.setattr(decode_threads, "free_cpus", lambda: 3)  # one of 4 CPUs taken: 2 threads fit, 4 do not
    clock = SimulatedSteps(monkeypatch, {4: 0.400, 2: 0.100, 1: 0.150})
    train(tmp_path, clock, steps=70)
    # untimed first step, a time, a try of the smaller count; the larger one waits LONGEST_PERIOD steps
    assert [(i, n) for i, n in enumerate(clock.steps) if n != 2] == [(2, 1), (64, 4), (67, 1)], clock.steps
    assert clock.evaluations == [2, 2]


def test_a_busy_start_tries_the_larger_counts_as_soon_as_the_cores_they_would_add_sit_idle(monkeypatch, threads4):
    now, idle = [0.0], [0.0]
    monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(decode_threads, "idle_cpu_seconds", lambda: idle[0])
    picker = DecodeThreads(("idle start",), env=TRAIN_ENV, first_period=decode_threads.LONGEST_PERIOD, start=1)
    for _ in range(12):
        picker.step()
        n = torch.get_num_threads()
        now[0] += 0.1 / n  # the other process has ended: every count runs at full speed
        idle[0] += (4 - n) * 0.1 / n
    picker.close()
    assert picker.history[:2] == [1, 1] and picker.history[2:5] == [4, 2, 4], picker.history
    assert picker.history[-5:] == [4] * 5


def test_a_narrow_win_retries_the_old_best_soon_and_a_decisive_one_late(monkeypatch, threads4):
    """A count that lost its place by less than twice the new best's time (noise, or a mildly busy core) is tried
    again FIRST_PERIOD steps later; one that lost by more waits as long as a first loss (training: LONGEST_PERIOD)."""
    for cost, retried_at in (({4: 0.100, 2: 0.080, 1: 0.300}, 11), ({4: 0.100, 2: 0.040, 1: 0.300}, 67)):
        decode_threads._remembered.clear()
        now = [0.0]
        monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: now[0])
        picker = DecodeThreads(("narrow",), env=TRAIN_ENV, first_period=decode_threads.LONGEST_PERIOD)
        for _ in range(70):
            picker.step()
            now[0] += cost[torch.get_num_threads()]
        picker.close()
        assert picker.history[:4] == [4, 4, 2, 1]
        assert [i for i, n in enumerate(picker.history) if n == 4 and i > 1][0] == retried_at, picker.history


@pytest.mark.parametrize("start, best", [(4, 4), (3, 2), (2, 2), (1, 1), (0, 1), (-2, 1)])
def test_a_start_takes_the_largest_count_that_fits_and_one_thread_when_none_does(threads4, start, best):
    picker = DecodeThreads(("start",), env=TRAIN_ENV, first_period=decode_threads.LONGEST_PERIOD, start=start)
    assert picker.best == best
    assert picker.due == {n: decode_threads.LONGEST_PERIOD if n > best else 0 for n in (4, 2, 1)}


def test_free_cpus_counts_the_affinity_less_the_other_running_tasks_at_their_fewest(monkeypatch):
    readings = iter([3, 2, 4])  # running tasks, this one included: a task that ran for a moment is not a busy core
    monkeypatch.setattr(decode_threads, "running_tasks", lambda: next(readings))
    monkeypatch.setattr(decode_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    slept = []
    monkeypatch.setattr(decode_threads.time, "sleep", slept.append)
    assert decode_threads.free_cpus() == 3
    assert slept == [0.005, 0.005]  # between the readings, not after the last
    monkeypatch.setattr(decode_threads, "running_tasks", lambda: None)
    assert decode_threads.free_cpus() is None


def test_on_a_quiet_machine_the_slower_counts_are_tried_once_then_within_one_percent_of_the_time(monkeypatch, tmp_path,
                                                                                               threads4):
    clock = SimulatedSteps(monkeypatch, QUIET)
    train(tmp_path, clock, steps=300)
    assert clock.steps[:4] == [4, 4, 2, 1]
    later = [i for i, n in enumerate(clock.steps) if n != 4 and i >= 4]
    # each loser waits until its try costs 1% of the steps' time: 2 threads at twice 4's time 100 steps, 1 thread at
    # four times (300) the longest, 256
    assert later == [103, 204, 260], later
    assert clock.evaluations == [4, 4]
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("setting, expected", [("off", 4), ("2", 2)])
def test_the_variable_turns_the_choice_off_or_fixes_the_count(monkeypatch, tmp_path, threads4, setting, expected):
    monkeypatch.setenv(TRAIN_ENV, setting)
    clock = SimulatedSteps(monkeypatch, BUSY)
    train(tmp_path, clock, steps=10)
    assert clock.steps == [expected] * 10
    assert torch.get_num_threads() == 4


def test_a_fixed_thread_count_keeps_torchs_count_however_slow(monkeypatch, tmp_path, threads4):
    clock = SimulatedSteps(monkeypatch, BUSY)
    train(tmp_path, clock, steps=10, threads=4)
    assert clock.steps == [4] * 10 and clock.evaluations == [4, 4]


@pytest.mark.parametrize("why", ["threads", "split_batch", "compile", "device", "world", "off"])
def test_the_choice_is_inactive_where_it_does_not_apply(monkeypatch, tmp_path, threads4, why):
    params = list(tiny_lm().parameters())
    cfg = run_cfg(tmp_path, threads=2 if why == "threads" else 0, compile=why == "compile")
    device = torch.device("meta" if why == "device" else "cpu")
    workers = 4 if why == "split_batch" else 1
    monkeypatch.setattr("training.distributed.world_size", lambda: 2 if why == "world" else 1)
    if why == "off":
        monkeypatch.setenv(TRAIN_ENV, "off")
    assert thread_choice(cfg, device, workers, params).options == []
    monkeypatch.setenv(TRAIN_ENV, "auto")
    monkeypatch.setattr("training.distributed.world_size", lambda: 1)
    active = thread_choice(run_cfg(tmp_path), torch.device("cpu"), 1, params)
    assert active.options == [4, 2, 1]
    assert active.key == ("train", "float32", sum(p.numel() for p in params))


def test_times_are_compared_per_unit_of_each_steps_work(monkeypatch, threads4):
    """A fine-tuning step's batch has its own length: stop(work=positions) keeps a step's time per position, so a
    count that ran a long batch is not taken for the slower one."""
    torch.set_num_threads(2)
    now = [0.0]
    monkeypatch.setattr(decode_threads.time, "perf_counter", lambda: now[0])
    picker = DecodeThreads(("per-position",), env=TRAIN_ENV)
    for _ in range(40):
        picker.step()
        n = torch.get_num_threads()
        positions = 100 if n == 2 else 10  # 2 threads: 1 ms a position on long batches; 1 thread: 2 ms on short
        now[0] += positions * (0.001 if n == 2 else 0.002)
        picker.stop(work=positions)
    assert picker.best == 2 and picker.history[3:].count(2) >= 36
    assert picker.work == 100  # the last step's
    picker.close()


def test_the_clis_thread_count_reaches_the_engine_as_a_fixed_count():
    assert pretrain.train_config(pretrain.PretrainConfig(data="x", threads=3)).threads == 3
    assert pretrain.train_config(pretrain.PretrainConfig(data="x")).threads == 0
    parser = argparse.ArgumentParser()
    finetune.add_training_args(parser, epochs=1, batch_size=8, lr_help="")
    for argv, expected in (([], 0), (["--threads", "1"], 1)):
        args = parser.parse_args(argv)
        args.bf16 = args.fp16 = False  # (the course switches a task's parser adds)
        assert finetune.train_config(args, "out", 1e-3, torch.device("cpu")).threads == expected
