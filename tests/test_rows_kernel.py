"""modules/rows.cpp, the decoding kernel for a few rows times a weight, in its AVX512 and AVX2 forms: against F.linear
(fp32 rounding of sums up to 768 long: atol 1e-4) for every row count it takes, the weight dtypes it reads, tails of
in_features that are not a multiple of the vector width, with and without bias; and the refusals. int4 weights
against F.linear on their dequantized values (in_features whole groups of 32 or 64, no tail by construction)."""
import re

import pytest
import torch
import torch.nn.functional as F

from modules import rows
from modules.quant import Int4Weight, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not rows.available(), reason="the rows kernel cannot be built here (needs an x86 "
                                "CPU with AVX2 and FMA on Linux, and a C++ compiler)")


@pytest.fixture(params=["native", "avx2"], scope="module")
def lib(request):
    """The kernel built for this CPU, and its AVX2 + FMA path (which an AVX512 CPU runs too)."""
    return None if request.param == "native" else rows.library(rows.AVX2)


SHAPES = [(96, 64), (37, 45), (5, 17), (130, 768), (3, 7)]  # in_features: whole vectors, tails, shorter than a vector


@pytest.mark.parametrize("batch", range(1, rows.MAX_ROWS + 1))
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_equals_f_linear(batch, shape, lib):
    g = torch.Generator().manual_seed(batch * 1000 + shape[1])
    out_f, in_f = shape
    x, w, b = torch.randn(batch, in_f, generator=g), torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, w, b, lib=lib), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(rows.rows_linear(x, w, lib=lib), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", range(1, rows.MAX_ROWS + 1))
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_weights_equal_the_fp32_product_rounded_once(batch, shape, lib):
    """bf16 weights and input: the kernel sums in fp32 and rounds the output to bf16 once."""
    g = torch.Generator().manual_seed(7 + batch)
    out_f, in_f = shape
    x = torch.randn(1, batch, in_f, generator=g).bfloat16()
    w, b = torch.randn(out_f, in_f, generator=g).bfloat16(), torch.randn(out_f, generator=g).bfloat16()
    with torch.no_grad():
        y = rows.rows_linear(x, w, b, lib=lib)
    assert y.dtype == torch.bfloat16 and y.shape == (1, batch, out_f)
    exact = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(y.double(), exact.to(torch.bfloat16).double(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("batch", [2, 5, 8])
@pytest.mark.parametrize("in_f", [768, 2048])
def test_bf16_weights_by_rows_sum_exact_products_in_fp32(form, batch, in_f):
    """2-8 rows by bf16 weights in fp32 output: rows of bf16 numbers (a bf16 model's; vdpbf16ps on an AVX512-BF16 CPU,
    one weight row at a time up to 1024 inputs, R in lockstep beyond, 37 rows leaving a tail) and rows that are not
    (the FMA form: x not rounded to bf16) both give the fp32 sum of the exact products, to fp32 rounding of the
    double product (x rounded to bf16 would miss it by about 0.1)."""
    lib = rows.library(rows.NATIVE if form == "native" else rows.AVX2)
    g = torch.Generator().manual_seed(batch + in_f)
    w = torch.randn(37, in_f, generator=g).bfloat16()
    for x in (torch.randn(batch, in_f, generator=g).bfloat16().float(), torch.randn(batch, in_f, generator=g)):
        with torch.no_grad():
            y = rows.rows_linear(x, w, lib=lib)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_weights_equal_the_dequantized_product(batch, shape, lib):
    g = torch.Generator().manual_seed(11 + batch)
    out_f, in_f = shape
    x, w, b = torch.randn(batch, in_f, generator=g), torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    q = quantize_int8(w)
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, q.q, b, q.scale, lib=lib), F.linear(x, q.dequantize(), b),
                                   rtol=1e-5, atol=1e-4)


INT4_SHAPES = [(96, 64), (37, 96), (5, 32), (130, 768), (3, 160), (1, 256)]  # odd out_features; 1..24 groups


@pytest.mark.parametrize("batch", range(1, rows.MAX_ROWS + 1))
@pytest.mark.parametrize("shape", INT4_SHAPES)
def test_int4_weights_equal_the_dequantized_product(batch, shape, lib):
    """Each group's scale applied to its own columns: weights that differ by 1000x between groups, and rows that
    reach the -8 nibble (which quantize_int4 never writes) besides -7..7, so a wrong nibble, sign or group shows."""
    g = torch.Generator().manual_seed(23 + batch + shape[1])
    out_f, in_f = shape
    x, b = torch.randn(batch, in_f, generator=g), torch.randn(out_f, generator=g)
    w = torch.randn(out_f, in_f, generator=g) * torch.logspace(-2, 1, in_f // 32).repeat_interleave(32)
    q = quantize_int4(w)
    q = Int4Weight(q.q.clone(), q.scale, q.group)
    q.q[0, ::7] = 0x88  # -8 in both nibbles at a few places of row 0
    assert int(q.values().min()) == -8
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, q.q, b, q.scale, lib=lib), F.linear(x, q.dequantize(), b),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(rows.rows_linear(x, q.q, None, q.scale, lib=lib), F.linear(x, q.dequantize()),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_int4_groups_of_64_and_bf16_inputs(batch, lib):
    g = torch.Generator().manual_seed(5 + batch)
    x, w, b = torch.randn(batch, 192, generator=g), torch.randn(41, 192, generator=g), torch.randn(41, generator=g)
    q = quantize_int4(w, group=64)
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, q.q, b, q.scale, lib=lib), F.linear(x, q.dequantize(), b),
                                   rtol=1e-5, atol=1e-4)
        y = rows.rows_linear(x.bfloat16(), q.q, b, q.scale, lib=lib)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.bfloat16().float(), q.dequantize(), b), rtol=8e-3, atol=1e-2)


def test_int4_refusals_name_the_problem(lib):
    q = quantize_int4(torch.randn(4, 64))
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert rows.applies(x, q.q) and not rows.applies(x[:, :32], q.q)  # int4: two features a byte
        with pytest.raises(ValueError, match="needs .out, in / group. group scales, got None"):
            rows.rows_linear(x, q.q, lib=lib)
        with pytest.raises(ValueError, match=r"group scales, got \(4,\)"):
            rows.rows_linear(x, q.q, None, q.scale[:, 0], lib=lib)
        with pytest.raises(ValueError, match="groups of a multiple of 32 values, got 16"):
            rows.rows_linear(x, q.q, None, torch.ones(4, 4), lib=lib)
        for shape in ((5, 2), (4, 0), (4, 3)):  # scales for another row count, none per row, groups that do not divide
            message = f"an int4 weight of 4 rows and 64 features needs (out, in / group) group scales, got {shape}"
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                rows.rows_linear(x, q.q, None, torch.ones(shape), lib=lib)
    # the kernel's own check, for callers other than rows.py: -2 and nothing written for a group that does not fit
    kernel = lib or rows.library()
    y = torch.full((1, 4), 7.0)
    assert kernel.rows_product(3, 1, x.data_ptr(), 64, q.q.data_ptr(), torch.ones(4, 4).data_ptr(), None,
                               y.data_ptr(), 4, 1, 16) == -2
    assert kernel.rows_product(3, 1, x.data_ptr(), 64, q.q.data_ptr(), None, None, y.data_ptr(), 4, 1, 32) == -2
    assert torch.equal(y, torch.full((1, 4), 7.0))


def test_refusals_name_the_problem():
    x, w = torch.randn(9, 16), torch.randn(4, 16)
    with torch.no_grad():
        assert not rows.applies(x, w)  # 9 rows: more than the kernel takes
        with pytest.raises(ValueError, match="^the rows kernel takes 1 to 8 rows, got 9$"):
            rows.rows_linear(x, w)
        assert rows.prepared(w)(x[:6].view(2, 3, 16)).shape == (2, 3, 4)  # any leading shape
        with pytest.raises(ValueError, match="^an int8 weight needs its per-row scale$"):
            rows.rows_linear(x[:1], quantize_int8(w).q)
        with pytest.raises(ValueError, match=r"^the weight must be contiguous \(row-major\)$"):
            rows.rows_linear(x[:1], torch.randn(16, 4).t())
        assert rows.applies(x[:8], w)
        assert not rows.applies(x[:1], w.t())  # a transposed view: not row-major
    assert not rows.applies(x[:1], w)  # gradients on: training takes F.linear


def _spread_model(seed=0):
    """A tiny GPT-2 with weights large enough that logits are spread and greedy choices are decisive, and biases
    that are not zero (GPT-2's init zeroes them, which would hide a dropped bias)."""
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(seed)
    m = GPT2LMHeadModel(tiny_config("h4-wide")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.mul_(4.0 if p.dim() == 2 else 1.0)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_with_the_kernel_everywhere_equals_generation_without(monkeypatch, dtype):
    """Decoding with the kernel on every product it takes (layers and LM head, batch 1 and left-padded batch 3)
    gives the tokens of decoding with torch's products, and the kernel really ran."""
    m = _spread_model().to(dtype)
    ids = torch.randint(0, m.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    monkeypatch.setattr(rows, "pays", lambda dtype, n: False)
    without = [m.generate(ids[:1], max_new_tokens=8), m.generate(ids, mask, max_new_tokens=8)]
    calls = []
    real = rows.run  # every decode product through the kernel: prepared once per call, then run on each step's rows
    monkeypatch.setattr(rows, "pays", lambda dtype, n: 1 <= n <= rows.MAX_ROWS)
    monkeypatch.setattr(rows, "run", lambda call, x: calls.append(x.shape) or real(call, x))
    with_kernel = [m.generate(ids[:1], max_new_tokens=8), m.generate(ids, mask, max_new_tokens=8)]
    assert calls, "the kernel was never called"
    for a, b in zip(with_kernel, without):
        assert torch.equal(a, b)


# ---- the decisions around the kernel, on any CPU ---------------------------------------------------------------------

PAYS = [  # (weight dtype, rows, capability) -> whether the kernel pays (rows.pays' docstring and docs/performance.md)
    (torch.uint8, 1, "AVX2", True), (torch.uint8, 8, "AVX512", True), (torch.uint8, 0, "AVX512", False),
    (torch.uint8, 9, "AVX2", False), (torch.uint8, 1, "DEFAULT", False),
    (torch.float32, 1, "AVX512", True), (torch.float32, 8, "AVX512", True), (torch.float32, 9, "AVX512", False),
    (torch.float32, 0, "AVX512", False), (torch.float32, 1, "AVX2", True), (torch.float32, 8, "AVX2", True),
    (torch.float32, 9, "AVX2", False), (torch.float32, 1, "DEFAULT", False), (torch.int8, 4, "AVX512", True),
    (torch.int8, 1, "AVX2", True), (torch.int8, 8, "AVX2", True), (torch.int8, 9, "AVX2", False),
    (torch.int8, 0, "AVX2", False), (torch.int8, 1, "DEFAULT", False), (torch.bfloat16, 1, "AVX512", True),
    (torch.bfloat16, 2, "AVX512", True), (torch.bfloat16, 8, "AVX512", True), (torch.bfloat16, 9, "AVX512", False),
    (torch.bfloat16, 0, "AVX512", False), (torch.bfloat16, 1, "AVX2", True), (torch.bfloat16, 8, "AVX2", True),
    (torch.bfloat16, 9, "AVX2", False), (torch.bfloat16, 1, "DEFAULT", False), (torch.float16, 1, "AVX512", False),
    (torch.float16, 1, "AVX2", False), (torch.float64, 2, "AVX2", False),
]


@pytest.mark.parametrize("dtype, n, capability, expected", PAYS)
def test_the_kernel_pays_where_it_was_measured_faster(monkeypatch, dtype, n, capability, expected):
    monkeypatch.setattr(rows, "_capability", lambda: capability)
    assert rows.pays(dtype, n) is expected


def test_the_loader_refuses_other_systems_and_machines_and_warns_from_the_callers_line(monkeypatch):
    """load_kernel builds only on x86-64 Linux (platform.machine() says x86_64, or AMD64) with the switch not "0"
    and `usable()` true; a failed build warns at the line that asked for the kernel, three calls up (the caller of
    available(), which calls _load(), which calls load_kernel)."""
    import platform
    import sys

    monkeypatch.delenv("GPT2_SOME_KERNEL", raising=False)  # unset: on
    built = lambda: "library"  # noqa: E731
    assert rows.load_kernel("GPT2_SOME_KERNEL", built, "k", "fallback") == "library"
    assert rows.load_kernel("GPT2_SOME_KERNEL", built, "k", "fallback", usable=lambda: False) is False
    monkeypatch.setattr(platform, "machine", lambda: "AMD64")
    assert rows.load_kernel("GPT2_SOME_KERNEL", built, "k", "fallback") == "library"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert rows.load_kernel("GPT2_SOME_KERNEL", built, "k", "fallback") is False
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert rows.load_kernel("GPT2_SOME_KERNEL", built, "k", "fallback") is False
    monkeypatch.setattr(sys, "platform", "linux")

    def failing():
        raise RuntimeError("x" * 600)

    lines = []

    def _load():
        lines.append(sys._getframe().f_lineno + 1)
        return rows.load_kernel("GPT2_SOME_KERNEL", failing, "the kernel x.cpp", "torch's runs")

    def available():
        return _load()

    with pytest.warns(UserWarning) as caught:
        lines.append(sys._getframe().f_lineno + 1)
        assert available() is False
    warning = caught[0]
    assert str(warning.message) == f"the kernel x.cpp could not be built (RuntimeError: {'x' * 500}); torch's runs"
    # Under mutation testing (bench/mutation.py) each function runs inside one wrapper more (mutmut's trampoline,
    # which sets __wrapped__), so the same stacklevel lands one frame lower: on _load's line.
    wrapped = hasattr(rows.load_kernel, "__wrapped__")
    assert (warning.filename, warning.lineno) == (__file__, lines[1] if wrapped else lines[0])


def test_library_step_is_fp32s_plan_by_default_and_refuses_without_the_kernel(monkeypatch):
    """One row: the plan's form for the kind; 2-8 rows: the prompt's library (the native build, or the forced form)."""
    asked = []
    monkeypatch.setattr(rows, "library_for", lambda kind: asked.append(kind) or "lib")
    monkeypatch.setattr(rows, "prompt_library", lambda: "prompt lib")
    assert rows.library_step() == "lib" and rows.library_step("int4") == "lib" and asked == ["fp32", "int4"]
    assert rows.library_step("bf16", 2) == rows.library_step("fp32", 8) == "prompt lib" and len(asked) == 2
    monkeypatch.setattr(rows, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^the rows kernel is not available here \(modules/rows\.py\)$"):
        rows.library_step()


def test_applies_counts_the_rows_of_any_leading_shape_even_for_one_input_feature():
    w, w1 = torch.randn(4, 16), torch.randn(4, 1)
    with torch.no_grad():
        assert rows.applies(torch.randn(2, 4, 16), w)  # (2, 4, 16): 8 rows
        assert rows.applies(torch.randn(1, 1, 16), w)
        assert not rows.applies(torch.randn(3, 3, 16), w)  # 9 rows
        assert not rows.applies(torch.randn(0, 16), w)  # no rows
        assert rows.applies(torch.randn(8, 1), w1) and not rows.applies(torch.randn(9, 1), w1)


def test_rows_linear_runs_the_kernel_it_is_given():
    """lib= is how the AVX2 form is tested on an AVX512 CPU: the product must come from that library."""
    real = rows.library(rows.AVX2)

    class Spy:
        calls = 0

        def __getattr__(self, name):
            Spy.calls += 1
            return getattr(real, name)

    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, w, lib=Spy()), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert Spy.calls


def test_each_weight_kind_takes_the_kernel_form_its_plan_chose(monkeypatch):
    asked = []
    real = rows.library_for
    monkeypatch.setattr(rows, "library_for", lambda kind: asked.append(kind) or real(kind))
    w = torch.randn(4, 64)
    for weight, scale in ((w, None), (quantize_int8(w).q, quantize_int8(w).scale), (w.bfloat16(), None),
                          (quantize_int4(w).q, quantize_int4(w).scale)):
        rows.prepared(weight, None, scale)
    assert asked == ["fp32", "int8", "bf16", "int4"]


def test_a_fresh_cache_builds_the_kernel_under_its_key_and_a_failed_build_says_what_the_compiler_said(
        monkeypatch, tmp_path):
    """_build in an empty cache (its folders made as needed): the library lands under the source's stem and its key,
    loads, and computes; a source that does not compile raises with the command and the last 2000 characters of
    the compiler's messages."""
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path / "a" / "b"))
    built = rows._build(rows.AVX2)
    assert built == tmp_path / "a" / "b" / f"rows-{rows._cache_key(rows.SOURCE, ' '.join(rows.AVX2))}.so"
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == [built.name]  # no temporary folder left
    # built with OpenMP: its parallel loops run on the threads asked for (without -fopenmp the pragmas are dropped
    # and the library, linking no libgomp, runs on one thread)
    assert b"libgomp.so" in built.read_bytes()
    lib = rows.library(rows.AVX2)
    x, w = torch.randn(1, 16), torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(rows.rows_linear(x, w, lib=lib), F.linear(x, w), atol=1e-5, rtol=1e-5)
    bad = tmp_path / "bad.cpp"
    bad.write_text("".join(f"int f{i}() {{ return undefined_{i}; }}\n" for i in range(60)))
    with pytest.raises(RuntimeError) as raised:
        rows._build(rows.NATIVE, source=bad)
    command, _, messages = str(raised.value).partition(" failed:\n")
    assert command.split()[1:2] == ["-O3"] and command.endswith(f"-std=c++17 {bad} -o {command.split()[-1]}")
    assert "undefined_59" in messages and len(messages) == 2000  # the end of a longer output


def test_the_kernel_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("GPT2_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert rows._cache_dir() == tmp_path / "gpt2-cs224n" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert rows._cache_dir() == rows.Path.home() / ".cache" / "gpt2-cs224n" / "kernels"
