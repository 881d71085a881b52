"""fp32 products of 9 to rows.prompt_rows() rows without gradients (a short prompt's pass) through the rows kernel's
product of many rows (modules/rows.py, modules/linear.py): the same values as F.linear
to float rounding, taken only where the plan timed it faster or GPT2_PROMPT_KERNEL says so, never with gradients,
bf16, more rows or a small weight."""
import pytest
import torch
import torch.nn.functional as F

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import rows
from modules.linear import Linear

needs_kernel = pytest.mark.skipif(not rows.available(), reason="the rows kernel does not build here")


@pytest.fixture
def spy(monkeypatch):
    """The row counts chunked_linear was asked for."""
    asked, real = [], rows.chunked_linear
    monkeypatch.setattr(rows, "chunked_linear",
                        lambda x, w, b=None: asked.append(x.shape[:-1].numel()) or real(x, w, b))
    return asked


@needs_kernel
@pytest.mark.parametrize("n", [9, 10, 11, 12, 13, 14, 15, 16, 21, 47, 64, 100, 128])  # every size of the last group
def test_a_short_prompts_products_take_the_kernel_in_chunks_with_f_linears_values(monkeypatch, spy, n):
    monkeypatch.setenv("GPT2_PROMPT_KERNEL", "128")
    torch.manual_seed(0)
    layer = Linear(256, 1030)  # 2^18 values and a few more: about the smallest weight the chunks take
    x = torch.randn(1, n, 256)
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    assert spy == [n] and y.shape == (1, n, 1030)
    with torch.no_grad():  # other layouts: a 2-D input, a non-contiguous one, no bias
        torch.testing.assert_close(layer(x[0]), F.linear(x[0], layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
        xt = torch.randn(256, n).t()
        torch.testing.assert_close(layer(xt), F.linear(xt, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
        plain = Linear(256, 1030, bias=False)
        torch.testing.assert_close(plain(x), F.linear(x, plain.weight), atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_2_to_8_rows_take_the_kernels_few_row_product(monkeypatch, dtype, n):
    """A prompt of 2-8 tokens through the layers (where the C++ prompt pass does not run: hooks, LoRA, a bf16 model):
    the kernel's product of a few rows, as a decode step's, prepared for that many rows; F.linear's values to float
    rounding. Its few-row sgemm made gpt2's 2-8-token prompts 1.9-2.2x slower in fp32 and 1.25-1.5x in bf16 (Zen 4,
    2026-12-02). One row (a 2-D input), 9 rows, gradients and autocast keep the other paths."""
    asked, real = [], rows.prepared
    monkeypatch.setattr(rows, "prepared", lambda *a, **k: asked.append(k.get("rows")) or real(*a, **k))
    torch.manual_seed(n)
    layer = Linear(64, 96).to(dtype)
    x = torch.randn(1, n, 64, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        y, flat = layer(x), layer(x[0])
    assert asked == [n, n] and y.dtype == dtype and y.shape == (1, n, 96) and flat.shape == (n, 96)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), **tol)
    torch.testing.assert_close(flat, y[0], atol=0, rtol=0)
    asked.clear()
    layer(x)  # gradients on
    with torch.no_grad():
        layer(x[0, :1])  # one row, 2-D
        layer(torch.randn(1, 9, 64, dtype=dtype))  # 9 rows
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = layer.float()(x.float())
    assert asked == [] and auto.dtype == torch.bfloat16


@needs_kernel
def test_gradients_bf16_more_rows_small_weights_and_the_switch_keep_f_linear(monkeypatch, spy):
    monkeypatch.setenv("GPT2_PROMPT_KERNEL", "32")
    layer = Linear(512, 512)
    with torch.no_grad():
        layer(torch.randn(1, 33, 512))  # past the limit set
        layer(torch.randn(1, 8, 512))  # 8 rows: the kernel's own path, not the chunks
        layer.to(torch.bfloat16)(torch.randn(1, 16, 512, dtype=torch.bfloat16))
        layer.float()
        Linear(511, 513)(torch.randn(1, 16, 511))  # under 2^18 values: F.linear (a 128-wide model ran 0.5x)
    layer(torch.randn(1, 16, 512))  # gradients on: training is F.linear's
    assert spy == []
    monkeypatch.setenv("GPT2_PROMPT_KERNEL", "0")
    with torch.no_grad():
        layer(torch.randn(1, 16, 512))
    assert spy == [] and rows.prompt_rows() == rows.MAX_ROWS
    monkeypatch.setenv("GPT2_PROMPT_KERNEL", "32")
    with torch.no_grad():
        layer(torch.randn(1, 16, 512))
    assert spy == [16]


@needs_kernel
@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_of_many_rows_over_every_block_shape_equals_f_linear(form, threads):
    """rows_product_many itself, in both builds: weights of fewer rows than a step (12 or 6 weight rows), a part step
    at the end, `in` shorter than a chunk of the sums (256), a part chunk at the end, several chunks; input rows of one
    block of a vector's width or less (AVX512 16, AVX2 8), of whole blocks of two widths, and a last block of one
    width after whole ones; with and without bias, on 1 and 2 threads."""
    torch.manual_seed(0)
    lib, before = rows._load() if form == "native" else rows.library(rows.AVX2), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out_f in (1, 5, 12, 13, 37):
            for in_f in (17, 256, 600):
                w, b = torch.randn(out_f, in_f), torch.randn(out_f)
                for n in (1, 7, 8, 9, 16, 17, 24, 32, 33, 40, 48, 49):
                    x = torch.randn(n, in_f)
                    for bias in (b, None):
                        torch.testing.assert_close(rows.many_rows(x, w, bias, lib), F.linear(x, w, bias),
                                                   atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="^the rows kernel's product of many rows takes at least one row, got 0$"):
        rows.many_rows(torch.randn(0, 16), torch.randn(4, 16), None, lib)
    with pytest.raises(ValueError, match="^chunked_linear takes fp32 x"):
        rows.chunked_linear(torch.randn(9, 16), torch.randn(16, 4).t())


@needs_kernel
def test_prompts_take_the_native_build_whatever_form_the_plan_took_for_one_row(monkeypatch):
    monkeypatch.setattr(rows, "_plan", {"forms": {kind: "avx2" for kind in rows.PLAN_KINDS}, "speeds": {}})
    monkeypatch.delenv("GPT2_DECODE_PLAN", raising=False)
    set_for, real = [], rows._set_prefetch
    monkeypatch.setattr(rows, "_set_prefetch", lambda lib, chosen: set_for.append(lib) or real(lib, chosen))
    assert rows.prompt_library() is rows._load() and rows.prompt_library() is rows._load()
    assert set_for == [rows._load()]  # the plan's distances set once for this plan, not at every product
    monkeypatch.setenv("GPT2_DECODE_PLAN", "avx2")  # a form forced: the prompt's products take it too
    assert rows.prompt_library().rows_vector_width() == 8


@needs_kernel
def test_longer_inputs_do_not_ask_the_plan(monkeypatch, spy):
    """Past the largest count the plan times (GPT2_PROMPT_KERNEL unset) no plan is asked for, so an evaluation's long
    batches never pay for a first plan's timing; within it the plan decides."""
    monkeypatch.delenv("GPT2_PROMPT_KERNEL", raising=False)
    monkeypatch.setattr(rows, "plan", lambda: pytest.fail("the plan was asked for a count it never takes"))
    layer = Linear(512, 512)
    with torch.no_grad():
        for n in (rows.PROMPT_ROWS_TIMED[-1] + 1, 512):
            torch.testing.assert_close(layer(torch.randn(1, n, 512)).shape, torch.Size([1, n, 512]))
    assert spy == []
    monkeypatch.setattr(rows, "plan", lambda: {"forms": {}, "prompt_rows": 16})
    with torch.no_grad():
        layer(torch.randn(1, 16, 512))
        layer(torch.randn(1, 17, 512))
    assert spy == [16]


def test_a_bad_setting_is_an_error_naming_it(monkeypatch):
    for bad in ("yes", "-1", "1.5"):
        monkeypatch.setenv("GPT2_PROMPT_KERNEL", bad)
        with pytest.raises(ValueError, match="GPT2_PROMPT_KERNEL"):
            rows.prompt_rows()


def test_the_limit_is_the_largest_count_up_to_which_the_kernel_won_every_timing():
    choose = rows.choose_prompt_rows
    assert choose({"16": "kernel", "32": "kernel", "64": "torch"}) == 32
    assert choose({"64": "kernel", "16": "kernel", "32": "kernel"}) == 64
    assert choose({"16": "torch", "32": "kernel", "64": "kernel"}) == rows.MAX_ROWS  # not past a loss
    assert choose({"16": "kernel", "32": "torch", "64": "kernel"}) == 16


def test_a_second_timing_that_disagrees_lowers_the_limit(monkeypatch, tmp_path):
    """The plan confirms the counts where the kernel won: here 32 wins the first timing and not the second."""
    monkeypatch.setattr(rows, "_plan", None)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2_DECODE_PLAN", raising=False)
    monkeypatch.delenv("GPT2_PROMPT_KERNEL", raising=False)
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    if not rows.available() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        assert rows.prompt_rows() == rows.MAX_ROWS  # no plan here: F.linear beyond 8 rows
        return
    flat = {kind: {"native": 10.0, "avx2": 10.0} for kind in rows.PLAN_KINDS}
    monkeypatch.setattr(rows, "time_forms", lambda libs, **k: {kind: flat[kind] for kind in k.get("kinds") or flat})
    monkeypatch.setattr(rows, "time_prefetch", lambda lib, **k: {kind: {"1024": 1.0} for kind in rows.PLAN_KINDS})
    lose = {"64": {"kernel": 4.0, "torch": 5.0}, "128": {"kernel": 4.0, "torch": 5.0}}
    first = {"16": {"kernel": 12.0, "torch": 7.0}, "32": {"kernel": 7.0, "torch": 5.0}, **lose}
    second = {"16": {"kernel": 12.0, "torch": 7.0}, "32": {"kernel": 5.1, "torch": 5.0}, **lose}
    asked = []
    monkeypatch.setattr(rows, "time_prompt_rows", lambda lib, counts=rows.PROMPT_ROWS_TIMED: asked.append(list(counts))
                        or {str(n): (second if len(asked) > 1 else first)[str(n)] for n in counts})
    chosen = rows.plan()
    assert asked == [[16, 32, 64, 128], [16, 32]]
    assert chosen["prompt_rows"] == 16 and rows.prompt_rows() == 16


@needs_kernel
def test_the_timing_reports_both_contenders_per_count():
    speeds = rows.time_prompt_rows(rows._load(), [9, 16], megabytes=4, rounds=1)
    assert sorted(speeds) == ["16", "9"] and all(set(s) == {"kernel", "torch"} and min(s.values()) > 0
                                                 for s in speeds.values())


@needs_kernel
def test_a_prompt_and_decode_steps_of_nine_or_more_rows_take_the_kernel_with_the_same_tokens(monkeypatch, spy):
    """A batch of 12 prompts (run_sonnet.py's dev set): the prompt's 60 rows, then each step's 12 rows, its LM head
    too, through the kernel; the greedy tokens are F.linear's (GPT2_PROMPT_KERNEL=0), the logits to float rounding."""
    monkeypatch.delenv("GPT2_DECODE_STEP", raising=False)  # the C++ step on (its default), then off below
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=4, n_embd=512, vocab_size=600, n_positions=64)).eval()
    ids = torch.randint(0, 600, (12, 5))
    outs = {}
    for setting in ("0", "128"):
        monkeypatch.setenv("GPT2_PROMPT_KERNEL", setting)
        spy.clear()
        with torch.no_grad():
            outs[setting] = model.generate(ids, max_new_tokens=6, do_sample=False)
        outs[setting + "rows"] = list(spy)
        with torch.no_grad():
            outs[setting + "logits"] = model(ids)["logits"]
    assert torch.equal(outs["0"], outs["128"]) and outs["0rows"] == []
    torch.testing.assert_close(outs["0logits"], outs["128logits"], atol=1e-4, rtol=1e-4)
    # the prompt's 60 rows through q, k, v, the projection and the MLP's two, and the LM head (600 x 512) for each of
    # the 6 new tokens; the 5 steps after the first token run their blocks in the C++ step (the kernel's many-row
    # product there: models/fast_step.py) ...
    assert outs["128rows"] == [60] * 6 + [12] * 6, outs["128rows"]
    # ... and in decode_step, where it is off: 12 rows through those six in each of the 5 steps
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    spy.clear()
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), outs["0"])
    assert list(spy) == [60] * 6 + [12] * (6 * 5 + 6), list(spy)


def test_no_kernel_here_means_no_chunks_whatever_the_setting(monkeypatch):
    """GPT2_ROWS_KERNEL=0 (or a machine where the kernel does not build) with GPT2_PROMPT_KERNEL set: F.linear, not
    a crash in a kernel that is not there."""
    monkeypatch.setenv("GPT2_PROMPT_KERNEL", "128")
    monkeypatch.setattr(rows, "available", lambda: False)
    assert rows.prompt_rows() == rows.MAX_ROWS and not rows.takes_chunks(16)
    layer = Linear(512, 1024)
    x = torch.randn(1, 16, 512)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
