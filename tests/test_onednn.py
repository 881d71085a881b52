"""modules/onednn.py: fp32 products of many rows without gradients through oneDNN's inner product: its values against
F.linear's, where modules.linear.Linear takes it and where not, and the per-machine choice (timed twice, cached, not
timed on a busy machine, forced by GPT2_ONEDNN_LINEAR)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import onednn, rows
from modules.linear import Linear

needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                       and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                  reason="torch has no oneDNN inner product here")


@needs_onednn
def test_its_products_are_f_linears_to_float_rounding():
    torch.manual_seed(0)
    w, b = torch.randn(1030, 256), torch.randn(1030)
    for x in (torch.randn(300, 256), torch.randn(2, 150, 256), torch.randn(256, 40).t()):  # 2-D, 3-D, strided
        for bias in (b, None):
            torch.testing.assert_close(onednn.linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


@pytest.fixture
def spy(monkeypatch):
    """The row counts onednn.linear was called with."""
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda x, w, b=None: calls.append(x.shape[:-1].numel()) or real(x, w, b))
    return calls


@needs_onednn
def test_a_linear_takes_it_for_many_fp32_rows_without_gradients_only(monkeypatch, spy):
    monkeypatch.setenv(onednn.ENV, "1")
    monkeypatch.setenv(rows.PROMPT_ENV, "0")  # the rows kernel's product of many rows out of the way
    torch.manual_seed(0)
    layer = Linear(512, 512)  # 2^18 values: the smallest weight it takes
    x = torch.randn(1, 40, 512)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
        layer(torch.randn(1, 8, 512))  # 8 rows: the rows kernel's (or a decode path's)
        Linear(511, 512)(torch.randn(40, 511))  # a smaller weight: F.linear
        layer.to(torch.bfloat16)(torch.randn(1, 40, 512, dtype=torch.bfloat16))
        layer.float()
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    layer(x)  # gradients to take: F.linear's autograd (training's oneDNN products off)
    assert spy == [40]
    monkeypatch.setenv(onednn.ENV, "0")
    with torch.no_grad():
        layer(x)
    assert spy == [40]


@needs_onednn
def test_a_models_evaluation_with_it_gives_f_linears_logits(monkeypatch, spy):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=1024, n_positions=64)).eval()
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(rows.PROMPT_ENV, "0")
    monkeypatch.setenv(onednn.ENV, "1")
    with torch.no_grad():
        taken = model(ids)["logits"]
    # the MLP's two products a layer (1024 x 256: 2^18 values; attention's are smaller), then the tied LM head
    assert spy == [60] * 2 * 2 + [60]
    monkeypatch.setenv(onednn.ENV, "0")
    with torch.no_grad():
        plain = model(ids)["logits"]
    torch.testing.assert_close(taken, plain, atol=1e-5, rtol=1e-5)


def test_oneDNN_is_chosen_only_where_both_timings_read_it_margin_faster():
    fast, tie = {"onednn": 1.4, "torch": 1.0}, {"onednn": 1.04, "torch": 1.0}
    assert onednn.decide(fast, fast) and not onednn.decide(fast, tie) and not onednn.decide(tie, fast)


@pytest.fixture
def fresh(onednn_fresh):
    return onednn_fresh  # conftest's: no setting, an empty kernel cache, no choice made yet


def test_the_choice_is_timed_once_cached_and_read_by_later_processes(monkeypatch, fresh):
    timings = iter([{"onednn": 1.4, "torch": 1.0}, {"onednn": 1.3, "torch": 1.0}])
    monkeypatch.setattr(onednn, "time_products", lambda: next(timings))
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    chosen = onednn.choice()
    assert chosen["takes"] and chosen["source"].startswith("timed, cached in ")
    (cached,) = fresh.glob("onednn-linear-*.json")
    assert json.loads(cached.read_text()) == chosen
    monkeypatch.setattr(onednn, "_choices", {})  # a later process: reads the file, times nothing
    monkeypatch.setattr(onednn, "time_products", lambda: pytest.fail("timed again"))
    assert onednn.choice() == chosen


def test_a_busy_machine_is_not_timed_and_keeps_f_linear_for_the_process(monkeypatch, fresh):
    monkeypatch.setattr(rows, "machine_busy", lambda: "load average 3.0 on 2 cores")
    monkeypatch.setattr(onednn, "time_products", lambda: pytest.fail("timed on a busy machine"))
    chosen = onednn.choice()
    assert not chosen["takes"] and chosen["source"] == "not timed: the machine is busy (load average 3.0 on 2 cores)"
    assert list(fresh.iterdir()) == []


def test_the_setting_forces_either_side_and_anything_else_is_an_error(monkeypatch, fresh):
    monkeypatch.setattr(onednn, "time_products", lambda: pytest.fail("timed with a setting"))
    monkeypatch.setenv(onednn.ENV, "1")
    assert onednn.choice() == {"takes": True, "source": f"{onednn.ENV}=1"}
    monkeypatch.setenv(onednn.ENV, "yes")
    with pytest.raises(ValueError, match=f"^{onednn.ENV} must be 0 \\(F.linear\\), 1 \\(oneDNN\\) or unset"):
        onednn.choice()
    monkeypatch.undo()
    monkeypatch.setenv(onednn.ENV, "0")
    assert not onednn.available() and onednn.choice()["takes"] is False


def test_a_cache_that_cannot_be_written_keeps_the_choice_for_the_process(monkeypatch, fresh):
    blocked = fresh / "a file where the cache folder would be"
    blocked.write_text("")
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(blocked))
    monkeypatch.setattr(onednn, "time_products", lambda: {"onednn": 1.4, "torch": 1.0})
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    chosen = onednn.choice()
    assert chosen["takes"] and chosen["source"].startswith("timed, not cached (")
    assert onednn.choice() is chosen  # asked again in this process: not timed again


def test_the_kernel_keeps_only_the_rows_it_timed_faster_than_oneDNN_in_both_timings():
    first = {"16": {"kernel": 15.0, "onednn": 10.0}, "32": {"kernel": 8.7, "onednn": 7.8},
             "64": {"kernel": 4.3, "onednn": 4.5}, "128": {"kernel": 2.2, "onednn": 2.7}}
    again = {**first, "32": {"kernel": 8.0, "onednn": 7.8}}  # within MARGIN the second time
    assert onednn.kernel_limit(first, first) == 32 and onednn.kernel_limit(first, again) == 16
    lost = {**first, "16": {"kernel": 10.0, "onednn": 10.0}}
    assert onednn.kernel_limit(lost, first) == rows.MAX_ROWS  # not past a loss, whatever follows


def test_the_timing_races_the_kernel_against_oneDNN_at_the_plans_rows_and_caches_the_limit(monkeypatch, fresh):
    monkeypatch.setattr(onednn, "time_products", lambda: {"onednn": 1.4, "torch": 1.0})
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    monkeypatch.setattr(rows, "available", lambda: True)
    monkeypatch.setattr(rows, "plan", lambda: {"prompt_rows": 64})
    asked = []
    speeds = {"16": {"kernel": 15.0, "onednn": 10.0}, "32": {"kernel": 8.7, "onednn": 7.8},
              "64": {"kernel": 4.3, "onednn": 4.5}}
    monkeypatch.setattr(onednn, "time_kernel_rows", lambda counts: asked.append(counts) or speeds)
    chosen = onednn.choice()
    assert asked == [[16, 32, 64]] * 2 and chosen["kernel_rows"] == 32 and chosen["kernel_speeds"] == [speeds] * 2
    (cached,) = fresh.glob("onednn-linear-*.json")
    assert json.loads(cached.read_text()) == chosen
    monkeypatch.setattr(onednn, "_choices", {})  # F.linear chosen: the plan's limit stands, nothing raced
    monkeypatch.setattr(onednn, "time_products", lambda: {"onednn": 1.0, "torch": 1.0})
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(fresh / "other"))
    assert "kernel_rows" not in onednn.choice() and len(asked) == 2


def test_the_kernels_rows_are_the_plans_lowered_to_oneDNNs_limit_unless_set(monkeypatch):
    monkeypatch.delenv(rows.PROMPT_ENV, raising=False)
    monkeypatch.setattr(rows, "prompt_rows", lambda: 128)
    monkeypatch.setattr(onednn, "choice", lambda: {"takes": True, "kernel_rows": 16})
    assert onednn.kernel_rows() == 16
    monkeypatch.setattr(onednn, "choice", lambda: {"takes": False, "kernel_rows": 16})  # F.linear past the kernel
    assert onednn.kernel_rows() == 128  # the plan's limit
    monkeypatch.setattr(onednn, "choice", lambda: {"takes": True})  # forced (GPT2_ONEDNN_LINEAR=1): not raced
    assert onednn.kernel_rows() == 128
    monkeypatch.setattr(onednn, "choice", lambda: {"takes": True, "kernel_rows": 16})
    monkeypatch.setenv(rows.PROMPT_ENV, "128")  # the setting stands
    assert onednn.kernel_rows() == 128
    monkeypatch.delenv(rows.PROMPT_ENV)
    monkeypatch.setattr(rows, "prompt_rows", lambda: rows.MAX_ROWS)  # no kernel past 8 rows: the choice not asked
    monkeypatch.setattr(onednn, "choice", lambda: pytest.fail("asked"))
    assert onednn.kernel_rows() == rows.MAX_ROWS


@needs_onednn
def test_a_prompts_linear_past_the_kernels_rows_takes_oneDNN_a_decode_steps_rows_keep_the_kernel(monkeypatch, spy):
    if not rows.available():
        pytest.skip("the rows kernel does not build here")
    monkeypatch.delenv(rows.PROMPT_ENV, raising=False)
    monkeypatch.setattr(rows, "prompt_rows", lambda: 128)
    monkeypatch.setattr(onednn, "choice", lambda: {"takes": True, "kernel_rows": 16})
    chunked, real = [], rows.chunked_linear
    monkeypatch.setattr(rows, "chunked_linear", lambda x, w, b=None: chunked.append(x.shape[:-1].numel())
                        or real(x, w, b))
    torch.manual_seed(0)
    layer = Linear(512, 512)
    with torch.no_grad():
        for n in (16, 17, 40):
            x = torch.randn(n, 512)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
        assert chunked == [16] and spy == [17, 40]
        step = torch.randn(40, 1, 512)  # 40 rows of one token each: a batched decode step's
        torch.testing.assert_close(layer(step), F.linear(step, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    assert chunked == [16, 40] and spy == [17, 40]


@needs_onednn
def test_the_timings_report_both_contenders_at_their_row_counts():
    speeds = onednn.time_products(megabytes=1, rounds=1, n=12)
    assert set(speeds) == {"onednn", "torch"} and min(speeds.values()) > 0
    if rows.available():
        raced = onednn.time_kernel_rows([9, 16], megabytes=1, rounds=1)
        assert sorted(raced) == ["16", "9"] and all(set(s) == {"kernel", "onednn"} and min(s.values()) > 0
                                                    for s in raced.values())


def test_the_cache_file_is_named_by_the_cpu_torch_the_rows_timed_and_the_kernels_source(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    path = onednn._path()
    assert path.parent == tmp_path and len(path.name) == len("onednn-linear-.json") + 16
    monkeypatch.setattr(onednn, "PROMPT_ROWS", 128)
    assert onednn._path() != path
    monkeypatch.undo()
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "rows.cpp"
    source.write_bytes(rows.SOURCE.read_bytes() + b"// changed\n")
    monkeypatch.setattr(rows, "SOURCE", source)
    assert onednn._path() != path


def test_margins_are_met_at_equality_and_scale_with_the_contenders_speeds():
    at = {"onednn": 2.0 * rows.MARGIN, "torch": 2.0}
    assert onednn.decide(at, at) and not onednn.decide({"onednn": 1.5, "torch": 2.0}, at)
    first = {"16": {"kernel": 2.0 * rows.MARGIN, "onednn": 2.0}, "32": {"kernel": 1.5, "onednn": 2.0}}
    assert onednn.kernel_limit(first, first) == 16


def test_without_oneDNN_the_choice_says_why(monkeypatch, fresh):
    monkeypatch.setattr(onednn, "has_inner_product", lambda: False)
    assert onednn.choice() == {"takes": False, "source": "torch has no oneDNN inner product here"}
    monkeypatch.setenv(onednn.ENV, "0")
    assert onednn.choice() == {"takes": False, "source": f"{onednn.ENV}=0"}


def test_no_kernel_race_without_the_kernel_or_the_plans_prompt_rows(monkeypatch, fresh):
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    timings = [{"onednn": 1.4, "torch": 1.0}, {"onednn": 1.3, "torch": 1.0}]
    monkeypatch.setattr(onednn, "time_kernel_rows", lambda counts: pytest.fail("raced"))
    for available, plan in ((False, lambda: pytest.fail("asked the plan")), (True, lambda: {})):
        monkeypatch.setattr(onednn, "_choices", {})
        monkeypatch.setenv("GPT2_KERNEL_CACHE", str(fresh / str(available)))
        monkeypatch.setattr(onednn, "time_products", iter(timings).__next__)
        monkeypatch.setattr(rows, "available", lambda: available)
        monkeypatch.setattr(rows, "plan", plan)
        assert onednn.choice() == {"takes": True, "speeds": timings, "source": onednn.choice()["source"]}
    monkeypatch.setattr(onednn, "_choices", {})
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(fresh / "eight"))
    monkeypatch.setattr(onednn, "time_products", iter(timings).__next__)
    monkeypatch.setattr(rows, "plan", lambda: {"prompt_rows": rows.MAX_ROWS})
    assert "kernel_rows" not in onednn.choice()


def test_the_kernels_side_of_the_race_is_the_prompts_product_with_its_bias(monkeypatch):
    if not rows.available():
        pytest.skip("the rows kernel does not build here")
    calls, real = [], rows.many_rows
    monkeypatch.setattr(rows, "many_rows",
                        lambda x, w, b, lib: calls.append((x.shape[0], b, lib)) or real(x, w, b, lib))
    onednn.time_kernel_rows([9], megabytes=1, rounds=1)
    assert calls and all(n == 9 and b is not None and lib is rows.prompt_library() for n, b, lib in calls)
