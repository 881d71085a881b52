"""modules/rows.py's plan: which build of the decoding kernel (native, AVX2) each weight kind takes, chosen by timing
on this machine, cached beside the kernel, shown by `python -m modules.rows`, off with GPT2_DECODE_PLAN=off."""
import json
import subprocess
import sys

import pytest
import torch

from modules import rows
from modules.quant import quantize

AVX512 = rows.available() and torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.fixture
def fresh_plan(monkeypatch, tmp_path):
    """No plan in memory, the kernel cache in tmp_path, the plan switched on; restored afterwards."""
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2_DECODE_PLAN", raising=False)
    monkeypatch.setattr(rows, "machine_busy", lambda: None)  # the test suite itself loads the machine
    monkeypatch.setattr(rows, "time_prefetch", lambda lib, **k: dict(PREFETCH_SPEEDS))  # timed in its own tests
    monkeypatch.setattr(rows, "time_prompt_rows", lambda lib, counts=rows.PROMPT_ROWS_TIMED: {
        str(n): dict(PROMPT_SPEEDS[str(n)]) for n in counts})  # likewise (tests/test_prompt_kernel.py)
    yield tmp_path
    for lib in [rows._load(), *rows._forms.values()] if rows.available() else []:
        lib.rows_prefetch(rows.PREFETCH_DEFAULT)  # a plan that chose another distance set it on the loaded kernels


PROMPT_SPEEDS = {"16": {"kernel": 12.0, "torch": 7.0}, "32": {"kernel": 5.1, "torch": 5.0},  # the plan takes 16
                 "64": {"kernel": 5.0, "torch": 5.0}, "128": {"kernel": 3.0, "torch": 5.0}}
# per kind: fp32 and int4 read 10% faster at 4096 (the plan takes it), int8 slower (it keeps the default), w8a8 5%
# faster at 2048, w4a8 within the margin everywhere
PREFETCH_SPEEDS = {"fp32": {"1024": 10.0, "2048": 10.4, "4096": 11.0}, "int8": {"1024": 10.0, "2048": 9.0, "4096": 8.9},
                   "int4": {"1024": 5.0, "2048": 5.2, "4096": 5.5}, "w8a8": {"1024": 10.0, "2048": 10.5, "4096": 10.4},
                   "w4a8": {"1024": 10.0, "2048": 10.3, "4096": 10.4}}


@pytest.mark.skipif(not AVX512, reason="two forms of the kernel exist only on an AVX512 CPU with the kernel built")
def test_a_form_or_distance_that_does_not_win_a_second_timing_is_not_taken(fresh_plan, monkeypatch):
    """The first timing takes AVX2 for fp32 and int8 and 4096 bytes for int4 and w4a8; the second, of those kinds
    only, finds fp32's AVX2 and int4's 4096 within the margin: they go back to native and the default."""
    first = {"fp32": {"native": 20.0, "avx2": 22.0}, "int8": {"native": 10.0, "avx2": 12.0},
             "int4": {"native": 6.0, "avx2": 5.0}, "w8a8": {"native": 14.0, "avx2": 12.0},
             "w4a8": {"native": 8.0, "avx2": 8.0}}
    second = {"fp32": {"native": 20.0, "avx2": 20.5}, "int8": {"native": 10.0, "avx2": 11.0}}
    asked = []
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: asked.append(k.get("kinds")) or
                        ({kind: second[kind] for kind in k["kinds"]} if k.get("kinds") else first))
    ahead_first = {kind: {"1024": 10.0, "2048": 10.0, "4096": 12.0 if kind in ("int4", "w4a8") else 10.0}
                   for kind in rows.PLAN_KINDS}
    ahead_second = {"int4": {"1024": 10.0, "2048": 10.4, "4096": 10.4}, "w4a8": {"1024": 10.0, "2048": 9.0,
                                                                                    "4096": 10.5}}
    monkeypatch.setattr(rows, "time_prefetch", lambda lib, **k: asked.append(k.get("kinds")) or
                        ({kind: ahead_second[kind] for kind in k["kinds"]} if k.get("kinds") else ahead_first))
    chosen = rows.plan()
    assert asked == [None, None, ["fp32", "int8"], ["int4", "w4a8"]]
    assert chosen["forms"] == {"fp32": "native", "int8": "avx2", "int4": "native", "w8a8": "native",
                               "w4a8": "native"}
    assert chosen["prefetch"] == {"fp32": 1024, "int8": 1024, "int4": 1024, "w8a8": 1024, "w4a8": 4096, "bf16": 1024}
    assert chosen["speeds"] == first and chosen["confirmed_by"]["speeds"] == second


def test_another_form_is_chosen_only_when_clearly_faster():
    speeds = {"fp32": {"native": 20.0, "avx2": 20.9}, "int8": {"native": 10.0, "avx2": 11.0},
              "int4": {"native": 6.0, "avx2": 5.0}}
    assert rows.choose(speeds) == {"fp32": "native", "int8": "avx2", "int4": "native"}
    # exactly MARGIN faster is enough; a kind timed in other forms only takes the fastest of them
    assert rows.choose({"fp32": {"native": 20.0, "avx2": 21.0}, "int8": {"avx2": 0.5}}) == {"fp32": "avx2",
                                                                                          "int8": "avx2"}


def test_the_plan_can_be_switched_off(fresh_plan, monkeypatch):
    monkeypatch.setenv("GPT2_DECODE_PLAN", "off")
    monkeypatch.setattr(rows, "time_forms", lambda *a, **k: pytest.fail("timed with the plan off"))
    chosen = rows.plan()
    native = {kind: "native" for kind in ("fp32", "int8", "int4", "w8a8", "w4a8", "bf16")}
    assert chosen == {"forms": native, "speeds": {}, "source": "GPT2_DECODE_PLAN=off"}
    monkeypatch.setenv("GPT2_DECODE_PLAN", "on")
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setattr(rows, "_capability", lambda: "AVX2")  # one form of the kernel: nothing to choose
    chosen = rows.plan()
    assert chosen == {"forms": native, "speeds": {}, "source": "one form of the kernel here"}


@pytest.mark.skipif(not AVX512, reason="two forms of the kernel exist only on an AVX512 CPU with the kernel built")
def test_the_plan_is_timed_once_and_cached(fresh_plan, monkeypatch):
    speeds = {"fp32": {"native": 20.0, "avx2": 19.0}, "int8": {"native": 10.0, "avx2": 12.0},
              "int4": {"native": 6.0, "avx2": 5.0}, "w8a8": {"native": 14.0, "avx2": 12.0},
              "w4a8": {"native": 8.0, "avx2": 9.0}}
    timed = []
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: timed.append((libs, k.get("kinds"))) or speeds)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(fresh_plan / "x" / "y"))  # folders the plan's file needs are made
    chosen = rows.plan()
    # every kind timed in the native build and the AVX2 one, by name; then the kinds that left native, again
    (libs, kinds), (libs_again, kinds_again) = timed
    assert kinds is None and kinds_again == ["int8", "w4a8"] and libs_again is libs
    assert sorted(libs) == ["avx2", "native"] and libs["native"] is rows._load()
    assert libs["avx2"].rows_vector_width() == 8
    assert chosen["forms"] == {"fp32": "native", "int8": "avx2", "int4": "native", "w8a8": "native",
                               "w4a8": "avx2"} and chosen["speeds"] == speeds
    assert chosen["prefetch"] == {"fp32": 4096, "int8": 1024, "int4": 4096, "w8a8": 2048, "w4a8": 1024}
    assert chosen["prefetch_speeds"] == PREFETCH_SPEEDS
    assert chosen["prompt_rows"] == 16 and chosen["prompt_speeds"] == PROMPT_SPEEDS
    assert chosen["confirmed_by"] == {"speeds": speeds, "prefetch_speeds": PREFETCH_SPEEDS,  # the fakes' one answer
                                      "prompt_speeds": {"16": PROMPT_SPEEDS["16"]}}
    fresh_plan = fresh_plan / "x" / "y"
    (cached,) = fresh_plan.glob("plan-*")  # one whole file, no temporary one left
    assert cached.name == f"plan-{rows._cache_key(rows.SOURCE, 'prompt rows 16 32 64 128')}.json"
    assert chosen["source"] == f"timed, cached in {cached}" and json.loads(cached.read_text()) == chosen
    assert rows.library_for("int8").rows_vector_width() == 8  # the AVX2 build
    assert rows.library_for("fp32").rows_vector_width() == 16
    for asked in ("fp32", "int8"):  # whichever form is handed out, every kind's distance is the plan's
        lib = rows.library_for(asked)
        assert [lib.rows_prefetch_kind(rows.KIND_INDEX[k], 0) for k in ("fp32", "int8", "int4", "w8a8", "w4a8")] == \
            [4096, 1024, 4096, 2048, 1024], asked
        assert lib.rows_prefetch_kind(1, 0) == rows.PREFETCH_DEFAULT  # bf16, which the plan does not time
    # a product with int8 activations takes its own kind's form: w8a8 native although int8 weights take AVX2
    asked, real = [], rows.library_for
    monkeypatch.setattr(rows, "library_for", lambda kind: asked.append(kind) or real(kind))
    for mode in ("w8a8", "w4a8", "int8", "int4"):
        q = quantize(torch.randn(8, 64), mode)
        rows.prepared(q.q, scale=q.scale, int8_activations=mode.startswith("w"))
    assert asked == ["w8a8", "w4a8", "int8", "int4"]
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setattr(rows, "time_forms", lambda *a, **k: pytest.fail("timed again despite the cache"))
    assert rows.plan()["forms"] == chosen["forms"]
    cached.unlink()  # --retime: the folder is there now, and the new timing is cached in it
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: speeds)
    assert rows.plan()["source"] == f"timed, cached in {cached}" and cached.is_file()


@pytest.mark.skipif(not AVX512, reason="two forms of the kernel exist only on an AVX512 CPU with the kernel built")
def test_timing_runs_every_kind_in_every_form():
    libs = {"native": rows.library(), "avx2": rows.library(rows.AVX2)}
    speeds = rows.time_forms(libs, megabytes=1, rounds=1)
    assert set(speeds) == {"fp32", "int8", "int4", "w8a8", "w4a8", "bf16"}
    assert all(set(s) == {"native", "avx2"} and min(s.values()) > 0 for s in speeds.values())


def test_the_command_shows_the_plan():
    out = subprocess.run([sys.executable, "-m", "modules.rows"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "GPT2_DECODE_PLAN": "off"})
    assert out.returncode == 0, out.stderr
    assert "plan (GPT2_DECODE_PLAN=off)" in out.stdout and "int8" in out.stdout


@pytest.mark.skipif(not AVX512, reason="two forms of the kernel exist only on an AVX512 CPU with the kernel built")
def test_a_busy_machine_is_not_timed_and_nothing_is_cached(fresh_plan, monkeypatch):
    monkeypatch.setattr(rows, "machine_busy", lambda: "load average 3.5 on 2 cores")
    monkeypatch.setattr(rows, "time_forms", lambda *a, **k: pytest.fail("timed on a busy machine"))
    chosen = rows.plan()
    assert chosen == {"forms": {kind: "native" for kind in rows.PLAN_KINDS}, "speeds": {},
                      "source": "not timed: the machine is busy (load average 3.5 on 2 cores)"}
    assert not list(fresh_plan.glob("plan-*.json"))


def test_busy_means_load_above_three_quarters_of_the_cores(monkeypatch):
    monkeypatch.setattr(rows.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(rows.os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    assert "3.5 on 4 cores" in rows.machine_busy()
    monkeypatch.setattr(rows.os, "getloadavg", lambda: (2.5, 0.0, 0.0))
    assert rows.machine_busy() is None


class FakeKernel:
    """Stands in for a built kernel in time_forms: records each rows_product call's arguments and advances `clock`
    (a one-item list that time.perf_counter reads in the test) by `seconds`: a timing that load cannot stretch."""

    def __init__(self, seconds: float, clock: list):
        self.seconds, self.clock, self.calls = seconds, clock, []

    def rows_product(self, kind, rows_, x, in_f, w, scale, bias, y, out_f, threads, group):
        self.calls.append((kind, rows_, in_f, out_f, scale is not None, bias, threads, group))
        self.clock[0] += self.seconds
        return 0


def test_timing_reads_each_kinds_weights_in_gpt2_sized_matrices_and_reports_gb_per_second(monkeypatch):
    """time_forms on stand-in kernels: per kind, one-row products of 3072 x 768 weights (int4 two values a byte, with
    its 32-column scales; int8 with row scales; fp32 without), as many as fill `megabytes`, `rounds` times in each
    form; GB/s is the bytes read over the median round's time (on a fake clock: real sleeps stretched under load, and
    the test failed on a busy machine)."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    fast, slow = FakeKernel(0.002, clock), FakeKernel(0.004, clock)
    speeds = rows.time_forms({"native": slow, "avx2": fast}, megabytes=18, rounds=3)
    kinds = {0: "fp32", 1: "bf16", 2: "int8", 3: "int4", 4: "w8a8", 5: "w4a8"}  # rows_product's codes (4, 5: int8
    # activations)
    per_kind = {"fp32": 18 * 2**20 // (3072 * 768 * 4), "bf16": 18 * 2**20 // (3072 * 768 * 2),
                "int8": 18 * 2**20 // (3072 * 768), "int4": 16}
    per_kind.update(w8a8=per_kind["int8"], w4a8=per_kind["int4"])
    for lib in (fast, slow):
        assert {kinds[c[0]] for c in lib.calls} == set(per_kind)
        for code, name in kinds.items():
            calls = [c for c in lib.calls if c[0] == code]
            assert len(calls) == 3 * per_kind[name], name
            assert {c[1:] for c in calls} == {(1, 768, 3072, name not in ("fp32", "bf16"), None,
                                               torch.get_num_threads(), 32)}
    weight_bytes = {"fp32": 3072 * 768 * 4, "bf16": 3072 * 768 * 2, "int8": 3072 * 768, "int4": 3072 * 384,
                    "w8a8": 3072 * 768, "w4a8": 3072 * 384}
    for name, count in per_kind.items():
        for form, seconds in (("native", 0.004), ("avx2", 0.002)):
            expected = count * weight_bytes[name] / (count * seconds) / 1e9  # each round: count products
            assert speeds[name][form] == pytest.approx(expected, rel=1e-9), (name, form)
    fast.calls.clear()  # kinds=: those kinds only (the plan's second timing of the kinds that left native)
    assert list(rows.time_forms({"avx2": fast}, megabytes=18, rounds=1, kinds=["w4a8", "int8"])) == ["int8", "w4a8"]
    assert {c[0] for c in fast.calls} == {2, 5}


class FakePrefetching(FakeKernel):
    """A FakeKernel whose products take less time the further ahead it prefetches, and that records each distance."""

    def __init__(self, clock: list):
        super().__init__(0.0, clock)
        self.ahead, self.set = rows.PREFETCH_DEFAULT, []

    def rows_prefetch(self, ahead):
        if ahead > 0:
            self.ahead = ahead
            self.set.append(ahead)
        return self.ahead

    def rows_product(self, *args):
        self.seconds = {1024: 0.004, 2048: 0.003, 4096: 0.002}[self.ahead]
        return super().rows_product(*args)


def test_the_prefetch_distances_are_timed_on_every_kind_and_the_kernel_left_at_the_default(monkeypatch):
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    lib = FakePrefetching(clock)
    speeds = rows.time_prefetch(lib, megabytes=18, rounds=3)
    assert list(speeds) == ["fp32", "int8", "int4", "w8a8", "w4a8", "bf16"]  # each kind's own speeds
    for kind, by_distance in speeds.items():
        assert list(by_distance) == ["1024", "2048", "4096"]
        assert by_distance["4096"] == pytest.approx(2 * by_distance["1024"], rel=1e-9), kind
        assert by_distance["2048"] == pytest.approx(4 / 3 * by_distance["1024"], rel=1e-9), kind
    assert {c[0] for c in lib.calls} == {0, 1, 2, 3, 4, 5}  # every kind, integer products included
    assert lib.set[:3] == [1024, 2048, 4096] and lib.set[-1] == rows.PREFETCH_DEFAULT == lib.ahead


def test_another_prefetch_distance_is_taken_only_when_clearly_faster():
    assert rows.choose_prefetch({"1024": 10.0, "2048": 10.4, "4096": 10.49}) == 1024
    assert rows.choose_prefetch({"1024": 10.0, "2048": 10.5, "4096": 10.4}) == 2048
    assert rows.choose_prefetch({"1024": 10.0, "4096": 9.0}) == 1024


@pytest.mark.skipif(not rows.available(), reason="the rows kernel cannot be built here")
def test_the_kernel_reads_the_distance_it_is_given_with_the_same_results(monkeypatch):
    lib = rows.library(rows.NATIVE)
    w = quantize(torch.randn(96, 768), "w8a8")
    x = torch.randn(3, 768)
    try:
        assert lib.rows_prefetch(0) == rows.PREFETCH_DEFAULT  # 0: asks without setting
        want = rows.run(rows.prepared(w.q, scale=w.scale, lib=lib, int8_activations=True), x)
        assert lib.rows_prefetch(4096) == 4096 and lib.rows_prefetch(-1) == 4096
        assert torch.equal(rows.run(rows.prepared(w.q, scale=w.scale, lib=lib, int8_activations=True), x), want)
    finally:
        lib.rows_prefetch(rows.PREFETCH_DEFAULT)
    try:
        assert lib.rows_prefetch_kind(5, 0) == rows.PREFETCH_DEFAULT and lib.rows_prefetch_kind(6, 4096) == -1
        assert lib.rows_prefetch_kind(5, 4096) == 4096 and lib.rows_prefetch_kind(4, 0) == rows.PREFETCH_DEFAULT
        w4 = quantize(torch.randn(96, 768), "w4a8")
        assert torch.equal(rows.run(rows.prepared(w4.q, scale=w4.scale, lib=lib, int8_activations=True), x),
                           rows.run(rows.prepared(w4.q, scale=w4.scale, lib=lib, int8_activations=True), x))
        assert lib.rows_prefetch(2048) == 2048 and lib.rows_prefetch_kind(5, 0) == 2048  # every kind at once
    finally:
        lib.rows_prefetch(rows.PREFETCH_DEFAULT)
    monkeypatch.setattr(rows, "plan", lambda: {"forms": {}, "speeds": {}, "prefetch": {"w8a8": 2048}})
    lib = rows.library_for("fp32")  # the plan's distances, set as any form is handed out
    assert lib.rows_prefetch_kind(rows.KIND_INDEX["w8a8"], 0) == 2048 and lib.rows_prefetch_kind(0, 0) == 1024
    lib.rows_prefetch(rows.PREFETCH_DEFAULT)
    monkeypatch.setattr(rows, "plan", lambda: {"forms": {}, "speeds": {}})  # a plan cached before distances
    assert rows.library_for("fp32").rows_prefetch(0) == rows.PREFETCH_DEFAULT
    assert rows.prefetch_of({"prefetch": 4096}, "int4") == 4096  # one distance for every kind (an older plan)


def test_busy_is_strictly_above_three_quarters_and_an_unknown_core_count_is_one(monkeypatch):
    monkeypatch.setattr(rows.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(rows.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert rows.machine_busy() is None
    monkeypatch.setattr(rows.os, "cpu_count", lambda: None)
    monkeypatch.setattr(rows.os, "getloadavg", lambda: (0.8, 0.0, 0.0))
    assert rows.machine_busy() == "load average 0.8 on 1 cores"


@pytest.mark.skipif(not AVX512, reason="two forms of the kernel exist only on an AVX512 CPU with the kernel built")
def test_a_plan_that_cannot_be_timed_or_cached_says_why(fresh_plan, monkeypatch):
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: (_ for _ in ()).throw(RuntimeError("no AVX2 build")))
    assert rows.plan() == {"forms": {kind: "native" for kind in rows.PLAN_KINDS}, "speeds": {},
                           "source": "not timed (RuntimeError: no AVX2 build)"}
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setattr(rows, "machine_busy", lambda: "load average 3.5 on 2 cores")
    assert rows.plan()["source"] == "not timed: the machine is busy (load average 3.5 on 2 cores)"
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    speeds = {k: {"native": 1.0, "avx2": 2.0} for k in ("fp32", "int8", "int4", "w8a8", "w4a8")}
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: speeds)
    monkeypatch.setattr(rows, "_plan_path", lambda: fresh_plan / "missing" / "plan.json")
    monkeypatch.setattr(rows.Path, "mkdir", lambda *a, **k: (_ for _ in ()).throw(PermissionError("read-only")))
    chosen = rows.plan()  # a cache it cannot write: the plan holds for this process
    assert chosen["forms"] == {kind: "avx2" for kind in speeds}
    assert chosen["source"] == "timed, not cached (read-only)" and not list(fresh_plan.rglob("*.json"))


def test_the_kernel_loads_once_where_the_cpu_has_avx2_and_says_what_runs_instead_when_it_cannot(monkeypatch):
    monkeypatch.setattr(rows, "_library", None)
    monkeypatch.setenv("GPT2_ROWS_KERNEL", "0")
    assert rows.available() is False
    monkeypatch.delenv("GPT2_ROWS_KERNEL")
    for capability, loads in (("DEFAULT", False), ("AVX2", True), ("AVX512", True)):
        monkeypatch.setattr(rows, "_library", None)
        monkeypatch.setattr(rows, "_capability", lambda c=capability: c)
        monkeypatch.setattr(rows, "library", lambda: "the library")
        assert rows.available() is loads and rows._load() == ("the library" if loads else False)
    monkeypatch.setattr(rows, "_library", None)
    monkeypatch.setattr(rows, "library", lambda: (_ for _ in ()).throw(RuntimeError("g++: not found")))
    with pytest.warns(UserWarning) as caught:
        assert rows.available() is False
    assert str(caught[0].message) == ("the decoding kernel modules/rows.cpp could not be built (RuntimeError: g++: "
                                      "not found); decoding uses torch's products (slower)")
