"""How many threads decoding steps use, chosen by timing the steps themselves.

A decode step is a few hundred small products and kernels, each ending in a barrier where every thread of the team
must arrive. On a quiet machine all threads share the work and the step runs near the memory's speed. When another
process holds a core, a thread of ours waits for its turn on that core at every barrier, and a step that took 25 ms
takes 100-400 ms (docs/cpu-decoding.md, "Against the CPU engines", with a core busy): fewer threads, even one, are
then several times faster. No rule written on one machine says when: so the steps are timed, and the thread count
follows what the clock shows.

`DecodeThreads` tries the candidates (torch's thread count, its halves, down to 1) one step each at the start of a
decode loop, keeps the fastest, and re-tries each other candidate now and then (every 8 steps at first, backing off to
every 64 while it keeps losing, then as rarely as keeps its tries within 1% of the steps' time: a count at 2.4x the
best's step time every 140 steps, at most every 256), so a machine that turns busy or quiet mid-call is followed within
a few steps; a step of the best count that takes more than twice its recent median (a core just turned busy) re-tries
the others at once. A machine that turns quiet again shows in no step time (one thread runs as fast beside a busy core
as beside an idle one): so while fewer threads than the most run, the CPUs' idle time (/proc/stat, 20 us a read) is read
every QUIET_WINDOW seconds, and when the cores the other counts would add sat idle for at least QUIET_SHARE of it, those
counts are re-tried at once. On a 2-core Zen 4 (2026-11-29, gpt2, a spinning process killed after busy calls of random
lengths), the first 64-token call after a busy spell ran 1-62 of its steps on one thread (median 18) for int4 and 2-52
(median 20) for fp32 without the idle reads, 1-12 (median 10.5) and 6 with them. A re-try so called that loses (idle
cores another process's threads or the hypervisor take the moment ours want them) makes the next wait longer, 8 steps
doubling to 64, as the schedule's own. torch's thread count is restored when the loop ends. What a loop learnt (the best
count, the recent times, each candidate's period and how many steps remain until its next try, the idle reads' wait) is
remembered per (batch, quantize, model size) and the next call in this process goes on from it: the schedule counts
decode steps, not calls, so a quiet machine's short calls (64 tokens each) do not each pay a fresh round of tries of the
slower counts (on a quiet 2-core Zen 3 that round cost fp32 decoding 0.90x the fixed count's speed, 0.98x without it:
bench/compare_engines.py's "thread choice" row, docs/cpu-decoding.md).

Results do not depend on the thread count for the rows kernel (each output row is one thread's sum); torch's own
products may round differently with another count (to float rounding: a seeded sample changes only if a draw falls
within that rounding of a boundary).

GPT2_DECODE_THREADS=off keeps torch's thread count for every step; GPT2_DECODE_THREADS=N uses N threads.

A long prompt's pass is chosen for the same way, one step per block (`prompt_threads` in models/generation.py: each
block is the same products on the same shapes, so a block on one count is a fair trial of another's): with a core busy,
a 512-token prompt of gpt2 took 1.40 s on 2 threads and 0.95 s on 1 on a 2-core Zen 3 (w8a8; fp32 2.00 s and 1.35 s),
while on a quiet machine 2 threads are the faster (0.51 s against 0.83 s). What the prompts learnt is remembered per
(rows rounded up to a power of two, quantize, model size) apart from the decode steps', and times are kept per row, so
prompts of other lengths compare. The prompts' tries start backed off: a count that lost its first try waits at least
LONGEST_PERIOD blocks (five gpt2 prompts) for the next, and as long as keeps its tries within 1% of the blocks' time
(100 blocks at twice the best's), so a quiet machine pays for one slow block in its first prompt and about one in
100-256 after (the decode steps ramp 8, 16, 32, 64 first); a block of the best count at more than twice its recent
median (a core turned busy) re-tries the others at once, and idle cores re-try the larger counts, as for the steps (w8a8
512-token prompts on the Zen 4, 2026-11-29: the three prompts after each of five busy spells ran 3, 1 and 1 of their 12
blocks on one thread, 0.26, 0.23 and 0.23 s; without the idle reads up to 12, 12 and 6, 0.40, 0.40 and 0.27 s). Only
prompts whose blocks are long enough to time (PROMPT_MIN_FLOPS: about a millisecond of products) are timed. A shorter
one (the short prompt's C++ pass) takes what the decode steps of its batch learnt while the machine stays busy, torch's
count otherwise (short_prompt_threads). GPT2_PROMPT_THREADS=off / N / auto, as for the steps.

Training steps choose the same way (training/engine.py's thread_choice: fit's steps on torch's intra-op threads, one
choice a step; GPT2_TRAIN_THREADS=off / N / auto, and the CLIs' --threads N fixes the count). A step is timed from its
start to the end of its backward, per token position (stop(work=...): fine-tuning's batches differ in length, and the
update, the same time for every batch, would only blur that); the update runs on the chosen count. A step beside a
busy core costs several of the faster count's (gpt2 bf16 fine-tuning on a 2-core Xeon: 3.4 s on 2 threads against
0.6 s on 1), so the trials start backed off, as the prompts' do, a count that lost by more than twice waits as long,
and a run whose machine is busy when it starts (free_cpus: other tasks running) starts on the count that fits the
free cores, trying the larger ones after first_period steps or when the cores they would add sit idle.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import deque

import torch

ENV = "GPT2_DECODE_THREADS"
PROMPT_ENV = "GPT2_PROMPT_THREADS"
TRAIN_ENV = "GPT2_TRAIN_THREADS"
PROMPT_MIN_FLOPS = 5e8  # a prompt block's products (24 * rows * n_embd^2 flops) below this keep torch's count
FIRST_PERIOD, LONGEST_PERIOD = 8, 64  # steps between re-tries of a candidate: after a win, and the doubling's last
# A candidate that keeps losing at LONGEST_PERIOD is then re-tried so that its tries cost at most EXPLORE_SHARE of the
# steps' time: (its time / the best's - 1) / EXPLORE_SHARE steps apart, at most RAREST_PERIOD. One thread of a quiet
# 2-core Zen 5 decodes gpt2 at 1/2.4 of two's speed: a try every 64 steps cost 2.2% (0.978x the fixed count's speed
# over 16 calls in one process, one try a 64-token call), every 140 about 1%.
EXPLORE_SHARE, RAREST_PERIOD = 0.01, 256
WINDOW = 3  # the recent steps per candidate whose median is compared
QUIET_WINDOW = 0.05  # seconds of steps over which the CPUs' idle time is read (5 clock ticks of /proc/stat)
QUIET_SHARE = 0.5  # idle CPUs, as a share of those the larger counts would add, that make them worth a re-try now
_remembered: dict[tuple, dict] = {}  # a loop's key (decode: rows, quantize, parameters) -> the state its last call left


def idle_cpu_seconds() -> float | None:
    """The seconds this process's CPUs (its affinity) have spent idle since boot, from /proc/stat (idle + iowait);
    None where there is no /proc/stat to read (not Linux) or it cannot be parsed."""
    try:
        cpus = os.sched_getaffinity(0)
        ticks = 0
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("cpu") and line[3].isdigit():
                    fields = line.split()
                    if int(fields[0][3:]) in cpus:
                        ticks += int(fields[4]) + int(fields[5])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def candidates(threads: int) -> list[int]:
    """threads, its halves, down to 1: [8, 4, 2, 1] for 8; [6, 3, 1] for 6."""
    out = [threads]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def fixed_threads(env: str = ENV) -> int | None | str:
    """GPT2_DECODE_THREADS (or `env`): None when unset (adapt), 'off', or a positive int; anything else is an
    error."""
    value = os.environ.get(env, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value == "off":
        return "off"
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{env} must be 'auto', 'off' or a positive thread count, got {value!r}")


class DecodeThreads:
    """Call `step()` at the top of each decode iteration and `close()` after the loop (try/finally).

    step() records the time since the previous call against the thread count that ran it, then sets the count for
    the coming step: an untried candidate, a due re-try, or the fastest so far (median of its last WINDOW steps)."""

    def __init__(self, key: tuple = (), threads: int | None = None, active: bool = True, env: str = ENV,
                 work: float = 1.0, first_period: int = FIRST_PERIOD, start: int | None = None):
        """active=False: a loop whose work is not on the CPU's threads (a CUDA model): step() and close() do nothing.
        env: the variable that fixes the count or turns the choice off (GPT2_PROMPT_THREADS for prompts).
        work: each step's size (a prompt's rows): times are kept per unit of it, so calls of other sizes under the
        same key compare. first_period: the steps before a candidate that lost its first try is tried again (then
        doubling up to LONGEST_PERIOD; a candidate that lost its place as the best is re-tried FIRST_PERIOD steps
        later whatever this is, unless it lost by more than twice). start: where nothing is remembered, the loop
        starts on the largest candidate up to this count (free_cpus(): a core another process holds), not the most;
        the larger counts are first tried first_period steps later, or as soon as the cores they would add sit idle."""
        self.original = torch.get_num_threads()
        self.work = work
        setting = fixed_threads(env) if active else "off"
        top = threads or self.original
        if setting == "off" or (setting is None and top <= 1):
            self.options: list[int] = []
        elif isinstance(setting, int):
            self.options = [setting]
        else:
            self.options = candidates(top)
        self.key = key
        self.times = {n: deque(maxlen=WINDOW) for n in self.options}
        self.first_period = first_period
        self.period = dict.fromkeys(self.options, first_period)
        self.due = dict.fromkeys(self.options, 0)  # the step at which each candidate is next tried
        self.best = self.options[0] if self.options else None
        if start is not None and self.options:
            self.best = next((n for n in self.options if n <= start), self.options[-1])
            for n in self.options:  # the counts that do not fit: tried when due, or when the cores turn idle
                if n > self.best:
                    self.due[n] = first_period
        self.quiet_period, self.quiet_due = FIRST_PERIOD, 0  # the idle cores' re-tries: their wait, and when next
        memory = _remembered.get(key)
        if memory is not None and memory["options"] == self.options:  # go on where the last call stopped
            self.best = memory["best"]
            self.times = {n: deque(times, maxlen=WINDOW) for n, times in memory["times"].items()}
            self.period, self.due = dict(memory["period"]), dict(memory["due_in"])
            self.quiet_period, self.quiet_due = memory["quiet_period"], memory["quiet_due_in"]
        self.window: tuple[float, float] | None = None  # (perf_counter, idle CPU seconds) where the idle read began
        self.current: int | None = None
        self.steps = 0
        self.last: float | None = None
        self.history: list[int] = []  # the thread count of each step (for tests and the benchmark's note)

    def step(self) -> None:
        if not self.options:
            return
        self._end_step()
        self._watch_idle_cores()
        n = self._choose()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.current = n
        self.history.append(n)
        self.steps += 1
        self.last = time.perf_counter()

    def stop(self, work: float | None = None) -> None:
        """End the running step here: its time is recorded, and the next step() records nothing before it (a
        prompt's block hooks: the work between two blocks is not a block's; a training step's evaluations and
        checkpoints). work: this step's size, where steps differ (a fine-tuning batch's tokens), else the loop's."""
        if work is not None:
            self.work = max(work, 1e-9)
        self._end_step()
        self.last = None

    def _end_step(self) -> None:
        """Record the running step's time (per unit of work) against its count; nothing before the first step."""
        if self.last is not None and self.current is not None:
            self._record(self.current, (time.perf_counter() - self.last) / self.work)

    def _watch_idle_cores(self) -> None:
        """While fewer threads than the most run: every QUIET_WINDOW seconds, if the CPUs sat idle for QUIET_SHARE
        of the cores the larger counts would add, re-try those counts now (see the module's docstring)."""
        top = self.options[0]
        if self.steps == 0 or self.best == top or self.steps < self.quiet_due:
            self.window = None
            return
        now = time.perf_counter()
        if self.window is not None and now - self.window[0] < QUIET_WINDOW:
            return
        idle = idle_cpu_seconds()  # (read once a window: 20 us)
        if idle is None or self.window is None:
            self.window = None if idle is None else (now, idle)
            return
        idle_cpus = (idle - self.window[1]) / (now - self.window[0])
        self.window = (now, idle)
        if idle_cpus >= QUIET_SHARE * (top - self.best):
            for n in self.options:
                if n > self.best:
                    self.due[n] = self.steps
            self.quiet_due = self.steps + self.quiet_period
            self.quiet_period = min(2 * self.quiet_period, LONGEST_PERIOD)
            self.window = None

    def _median(self, n: int) -> float:
        return statistics.median(self.times[n]) if self.times[n] else float("inf")

    def _record(self, n: int, seconds: float) -> None:
        if self.steps <= 1:
            return  # the call's first step pays for what the call builds (copies, kernels, caches): no count's time
        if n == self.best:
            if self.times[n] and seconds > 2 * self._median(n):
                self.due = dict.fromkeys(self.options, self.steps)  # the machine changed: re-try the others now
            self.times[n].append(seconds)
            return
        if seconds < self._median(self.best):
            old, self.best = self.best, n  # the other count is faster now: keep it, and re-try the old best soon
            if n == self.options[0]:
                self.quiet_period = FIRST_PERIOD  # back on every core: the idle cores' next re-try waits the least
            self.times[n] = deque([seconds], maxlen=WINDOW)  # its older times were of another machine state
            # soon: FIRST_PERIOD steps; but an old best at more than twice the new one's time (a busy core, not
            # noise) waits as a count that lost its first try does (first_period)
            wait = self.first_period if 2 * seconds < self._median(old) else FIRST_PERIOD
            self.period[old], self.due[old] = wait, self.steps + wait
        else:
            self.times[n].append(seconds)
            period = min(2 * self.period[n], LONGEST_PERIOD)
            if self.period[n] >= LONGEST_PERIOD:  # a steady loser: its tries cost at most EXPLORE_SHARE of the time
                excess = seconds / self._median(self.best) - 1
                period = max(period, min(int(excess / EXPLORE_SHARE), RAREST_PERIOD))
            self.period[n] = period
            self.due[n] = self.steps + period

    def _choose(self) -> int:
        if self.steps == 0 or len(self.options) == 1:
            return self.best  # the first step also pays for anything the call builds: not a trial (nor recorded)
        for n in self.options:
            if n != self.best and not self.times[n] and self.times[self.best] and self.steps >= self.due[n]:
                return n  # untried, once the best has a time to be compared with (above a busy start: once due)
        for n in self.options:
            if n != self.best and self.steps >= self.due[n] and self.times[n]:
                return n
        return self.best

    def close(self) -> None:
        if len(self.options) > 1:  # (a fixed count has nothing to remember, and leaves the choice's memory as it was)
            _remembered[self.key] = {"options": list(self.options), "best": self.best,
                                     "times": {n: list(t) for n, t in self.times.items()},
                                     "period": dict(self.period),
                                     "due_in": {n: max(0, due - self.steps) for n, due in self.due.items()},
                                     "quiet_period": self.quiet_period,
                                     "quiet_due_in": max(0, self.quiet_due - self.steps)}
        if self.options and torch.get_num_threads() != self.original:
            torch.set_num_threads(self.original)


def running_tasks() -> int | None:
    """The tasks runnable on the machine at this instant (/proc/stat's procs_running, this one included); None where
    it cannot be read."""
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_cpus(reads: int = 3, gap: float = 0.005) -> int | None:
    """The CPUs of this process's affinity that no other task holds: the affinity's count less the other tasks
    running (running_tasks()), the most over `reads` readings `gap` seconds apart (a task that runs for a moment is
    not a busy core); None where /proc/stat cannot be read."""
    seen = []
    for i in range(reads):
        running = running_tasks()
        if running is None:
            return None
        seen.append(len(os.sched_getaffinity(0)) - (running - 1))
        if i + 1 < reads:
            time.sleep(gap)
    return max(seen)


def remembers_fewer_threads() -> bool:
    """Whether some loop's last call ended on fewer threads than the most (else short_prompt_threads is None for
    every key, and a caller need not build one: a key's parameter count is ~0.3 ms of gpt2's 148 tensors)."""
    return any(memory["best"] != memory["options"][0] for memory in _remembered.values())


def short_prompt_threads(key: tuple) -> int | None:
    """The thread count for a prompt too short to time (the short prompt's C++ pass: 16 tokens of gpt2 take 24 ms on
    2 threads of a quiet Zen 4), or None for torch's: what the decode steps of `key` learnt, where their last call
    ended on fewer threads than the most and another task is running now (/proc/stat's procs_running: fewer CPUs of
    this process's free than the most threads; not readable: the steps' count). An idle reading over the time since
    that call would not do: between calls the other core may idle while a busy one stays busy. Beside a busy core, a
    16-token prompt's first token took 156 ms (60-294) on 2 threads against 63 on 1; quiet, 38 against 61 (gpt2,
    Zen 4, 2026-12-02): each of the pass's parallel regions waits for the thread that shares the busy core.
    GPT2_PROMPT_THREADS set (off or a count): None."""
    memory = _remembered.get(key)
    if fixed_threads(PROMPT_ENV) is not None or memory is None or memory["best"] == memory["options"][0]:
        return None
    running = running_tasks()
    if running is not None and len(os.sched_getaffinity(0)) - (running - 1) >= memory["options"][0]:
        return None  # nothing else runs now: every thread has a core
    return memory["best"]
