"""modules/gelu.py: GPT-2's GELU (tanh form) in the rows kernel, forward and backward, against the exact function in
float64 (torch's autograd) and against torch's float32 gelu(approximate="tanh"); where gelu_new takes it (with
autograd or without) and where it keeps torch's; and a model trained 20 steps through it against one trained with
torch's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, train_counting

from config import GPT2Config
from modules import gelu, rows
from modules.gpt2_layer import ACTIVATION_FNS

pytestmark = pytest.mark.skipif(not gelu.available(), reason=f"{gelu.ENV}=0 turns the GELU kernel off"
                                if os.environ.get(gelu.ENV) == "0" else "the rows kernel does not build here (it "
                                "needs AVX2 or AVX512 on x86-64 Linux and a C++ compiler)")

POINTS = torch.cat([torch.linspace(-30, 30, 60001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, 88.0])])


def exact(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU (tanh form) of x and dy times its derivative, in float64."""
    x64 = x.detach().double().requires_grad_()
    y64 = F.gelu(x64, approximate="tanh")
    y64.backward(dy.double())
    return y64.detach(), x64.grad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", ["native", "avx2"])
def test_the_backward_is_the_exact_derivative_to_float_rounding(form, threads):
    """dx = dy GELU'(x) within 4e-7 relative plus 1e-7 absolute of float64 autograd's from -30 to 30, at 0, at huge
    inputs and on a tail shorter than a vector (torch's own float32 backward: 1.0e-6 absolute on the same points,
    on the Ice Lake Xeon this was written on); the forward is tests/test_fast_step.py's."""
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    dy = torch.randn(POINTS.shape, generator=torch.Generator().manual_seed(threads))
    dx = torch.empty_like(POINTS)
    lib.rows_gelu_tanh_backward(POINTS.data_ptr(), dy.data_ptr(), dx.data_ptr(), POINTS.numel(), threads)
    _, want = exact(POINTS, dy)
    err = (dx.double() - want).abs()
    assert (err <= 4e-7 * want.abs() + 1e-7).all(), (POINTS[err.argmax()], err.max())
    ones = torch.ones_like(POINTS)
    lib.rows_gelu_tanh_backward(POINTS.data_ptr(), ones.data_ptr(), dx.data_ptr(), POINTS.numel(), threads)
    assert torch.equal(dx[-7:-3], torch.full((4,), 0.5)) and dx[-3] == 1.0 and abs(dx[-2]) < 1e-20 and dx[-1] == 1.0


@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 5), (7,), (2, 0, 4), (4097,)])
def test_values_and_gradients_agree_with_torchs_gelu(shape):
    """Through gelu_new in a step: values and gradients of any shape (a tail of 1-7 values, none, one thread or
    two) within float32 rounding of the exact function, as close as torch's own float32 are."""
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * 3).requires_grad_()
    dy = torch.randn(shape, generator=g)
    y = gelu.gelu_new(x)
    y.backward(dy)
    xt = x.detach().clone().requires_grad_()
    yt = F.gelu(xt, approximate="tanh")
    yt.backward(dy)
    y64, dx64 = exact(x, dy)
    assert y.shape == x.shape and y.dtype == torch.float32 and x.grad.shape == x.shape
    scale = dy.abs().double()  # the gradient's rounding: dy's times that of GELU's derivative
    for ours, torchs, want, unit in ((y, yt, y64, 1.0), (x.grad, xt.grad, dx64, scale)):
        err = (ours.double() - want).abs()
        assert (err <= 4e-7 * want.abs() + 2e-7 * unit).all(), (x.flatten()[err.argmax()], err.max())
        assert ((ours.double() - torchs.double()).abs() <= 2e-5 * want.abs() + 2e-6 * unit).all()


def test_a_transposed_input_gets_the_gradient_of_its_own_layout():
    x = torch.randn(16, 24).t().requires_grad_()  # (24, 16), not contiguous
    dy = torch.randn(24, 16)
    gelu.gelu_new(x).backward(dy)
    _, want = exact(x, dy)
    assert x.grad.shape == (24, 16) and torch.allclose(x.grad.double(), want, rtol=4e-7, atol=1e-7)


def test_the_kernel_takes_float32_and_bf16_cpu_tensors_with_autograd_only_in_a_step(monkeypatch):
    """A gradient taken through it: the kernel's autograd Function. No gradient (grad mode off, or an input that
    requires none: evaluation, a prompt's pass): one kernel call, the same values as the Function's forward, within
    2e-7 relative + 5e-8 of the exact function, the input untouched. float64, a meta tensor, the switch off (or no
    build): torch's gelu bit for bit."""
    calls, forwards = [], []
    real, real_forward = gelu._GELU.apply, gelu.forward
    monkeypatch.setattr(gelu._GELU, "apply", lambda x: calls.append(x.shape) or real(x))
    monkeypatch.setattr(gelu, "forward", lambda x: forwards.append(x.shape) or real_forward(x))
    x = torch.randn(4, 8) * 4
    before = x.clone()
    with torch.no_grad():
        y = gelu.gelu_new(x.requires_grad_())
    y64, _ = exact(x, torch.ones_like(x))
    assert ((y.double() - y64).abs() <= 2e-7 * y64.abs() + 5e-8).all() and torch.equal(x, before)
    assert not torch.equal(y, F.gelu(x, approximate="tanh"))  # torch's differs in its last bits somewhere
    assert torch.equal(gelu.gelu_new(x.detach()), y)  # grad mode on, no gradient asked
    bf = torch.randn(2, 3, 5, dtype=torch.bfloat16).transpose(1, 2)  # not contiguous
    assert torch.equal(gelu.gelu_new(bf), gelu._GELU.apply(bf.detach().requires_grad_()).detach())
    assert calls == [(2, 5, 3)] and forwards == [(4, 8), (4, 8), (2, 5, 3), (2, 5, 3)]
    calls.clear()
    t = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.equal(gelu.gelu_new(t), F.gelu(t, approximate="tanh"))
    assert not gelu.takes(torch.randn(2, device="meta")) and not gelu.applies(torch.randn(2, device="meta",
                                                                                           requires_grad=True))
    assert calls == [] and len(forwards) == 4
    gelu.gelu_new(x.detach().requires_grad_())
    gelu.gelu_new(torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True))  # a bf16-weights step
    assert calls == [(4, 8), (2, 3)] and gelu.applies(x) and not gelu.applies(x.detach())
    assert ACTIVATION_FNS["gelu_new"] is gelu.gelu_new and ACTIVATION_FNS["gelu_pytorch_tanh"] is gelu.gelu_new
    monkeypatch.setattr(gelu, "_on", False)  # the switch (GPT2_FAST_GELU=0) or no build: torch's everywhere
    t = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(gelu.gelu_new(t), F.gelu(t, approximate="tanh")) and len(calls) == 2
    with torch.no_grad():
        assert torch.equal(gelu.gelu_new(t), F.gelu(t, approximate="tanh")) and len(forwards) == 6


def train(steps: int, kernel: bool, monkeypatch) -> list[float]:
    """GPT-2 (tanh GELU, LayerNorm, dropout on) trained `steps` AdamW steps from one seed."""
    monkeypatch.setattr(gelu, "_on", kernel)
    return train_counting(GPT2Config(vocab_size=61, n_positions=32, n_embd=48, n_layer=2, n_head=3, resid_pdrop=0.1,
                                     embd_pdrop=0.1, attn_pdrop=0.1), steps)


def test_twenty_steps_through_the_kernel_track_torchs_gelu(monkeypatch):
    """Path matrix (issue 52): the same 20 steps with dropout on, the kernel against torch's gelu: float32 rounding
    apart at each step, so the losses stay within 1e-4 of each other; and the kernel's run is its own twin."""
    calls = []
    real = gelu._GELU.apply
    monkeypatch.setattr(gelu._GELU, "apply", lambda x: calls.append(1) or real(x))
    ours = train(20, True, monkeypatch)
    assert len(calls) == 20 * 2  # each step, each layer
    torchs = train(20, False, monkeypatch)
    assert len(calls) == 40
    assert ours[-1] < ours[0] - 0.3, ours  # it trains
    assert max(abs(a - b) for a, b in zip(ours, torchs)) < 1e-4, list(zip(ours, torchs))
    assert train(20, True, monkeypatch) == ours


def test_the_switch_and_the_build_decide_once_and_small_tensors_take_one_thread(monkeypatch):
    for env, built, on in (("0", True, False), ("1", True, True), (None, True, True), (None, False, False)):
        monkeypatch.setattr(gelu, "_on", None)
        monkeypatch.setattr(rows, "available", lambda built=built: built)
        if env is None:
            monkeypatch.delenv(gelu.ENV, raising=False)
        else:
            monkeypatch.setenv(gelu.ENV, env)
        assert gelu.available() is on and gelu._on is on, (env, built)
        monkeypatch.setenv(gelu.ENV, "1" if env == "0" else "0")
        assert gelu.available() is on  # read once: a later change of the environment is not seen
    torch.set_num_threads(2)  # conftest's restore_threads gives the count back
    assert gelu._threads(gelu.SMALL - 1) == 1 and gelu._threads(gelu.SMALL) == 2


def test_the_switch_turns_the_kernel_off_in_a_new_process():
    code = "from modules import gelu; print(gelu.available())"
    run = lambda env: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                     check=True, env=env).stdout.strip()
    assert run({**os.environ, gelu.ENV: "0"}) == "False"
    assert run({k: v for k, v in os.environ.items() if k != gelu.ENV}) == "True"


@pytest.mark.parametrize("n", [60008, 4099, 23, 8, 5])
def test_the_native_and_avx2_builds_give_each_value_the_same_result(n):
    """16 lanes at a time in the native build of an AVX512 CPU, 8 in the AVX2 build: the same operations lane by lane,
    so forward and backward agree bit for bit whatever the length (wide vectors, an 8-wide rest, a scalar tail)."""
    x = POINTS[torch.randperm(POINTS.numel(), generator=torch.Generator().manual_seed(n))[:n]].contiguous()
    dy = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    out = {}
    for form, lib in (("native", rows._load()), ("avx2", rows.library(rows.AVX2))):
        y, dx = torch.empty_like(x), torch.empty_like(x)
        lib.rows_gelu_tanh(x.data_ptr(), y.data_ptr(), n, 2)
        lib.rows_gelu_tanh_backward(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), n, 2)
        out[form] = (y, dx)
    assert torch.equal(out["native"][0], out["avx2"][0]) and torch.equal(out["native"][1], out["avx2"][1])


@pytest.mark.parametrize("n", [60008, 4099, 23, 8, 5])
def test_the_native_and_avx2_builds_round_bf16_alike(n):
    """bf16 values (a --dtype bf16-weights step) go a vector at a time, widened in register and rounded back by each
    build's vector rounding (AVX512: 16 lanes; AVX2: 8, packed back in order); the rest by the scalar rounding. Both
    builds give the same bits, NaN and infinities included (the native build's rounding is held to the exact values
    in test_bf16_values_and_gradients_are_the_exact_ones_rounded_once)."""
    x = POINTS[torch.randperm(POINTS.numel(), generator=torch.Generator().manual_seed(n))[:n]].bfloat16()
    x[n // 2] = float("nan")
    x[n // 3] = float("inf")
    dy = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).bfloat16()
    out = {}
    for form, lib in (("native", rows._load()), ("avx2", rows.library(rows.AVX2))):
        y, dx = torch.empty_like(x), torch.empty_like(x)
        lib.rows_gelu_tanh_bf16(x.data_ptr(), None, y.data_ptr(), n, 2)
        lib.rows_gelu_tanh_bf16(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), n, 2)
        out[form] = (y.view(torch.int16), dx.view(torch.int16))
    assert torch.equal(out["native"][0], out["avx2"][0]) and torch.equal(out["native"][1], out["avx2"][1])
    assert out["native"][0].view(torch.bfloat16)[n // 2].isnan()


@pytest.mark.parametrize("n", [1, 15, 2047, 2048, 2049, 3 * 2048 + 21, 40000])
def test_bf16_values_and_gradients_are_the_exact_ones_rounded_once(n):
    """bf16 (a --dtype bf16-weights step): each value widened, GELU and its derivative in fp32, rounded to bf16 once,
    as torch's bf16 gelu does: against the float64 formulas rounded to bf16, equal but where the fp32 arithmetic
    lands on the other side of a rounding boundary (one bf16 step; 1.3% of 40000 normal values times 3, where torch's
    bf16 ops are off for 6.7%: at most 2%, and never more often than torch's), and within one step of torch's bf16
    gelu and gelu_backward (or 1e-5 where torch's flush to 0); one thread and two give the same bits; a NaN stays a
    NaN."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).bfloat16()
    x[0] = float("nan") if n > 1 else x[0]
    dy = torch.randn(n, generator=g).bfloat16()
    xs = x.detach().requires_grad_()
    y = gelu.gelu_new(xs)
    y.backward(dy)
    assert y.dtype == xs.grad.dtype == torch.bfloat16
    v = x.double()  # GELU = v sigmoid(2u) in float64 (0.5 v (1 + tanh u) would round to 0 below v = -7)
    u = 0.7978845608028654 * (v + 0.044715 * v ** 3)
    sig = torch.sigmoid(2 * u)
    want = (v * sig).bfloat16()
    du = 2 * 0.7978845608028654 * (1 + 3 * 0.044715 * v ** 2)
    dwant = (dy.double() * (sig + v * sig * (1 - sig) * du)).bfloat16()
    for got, ref, ref_torch in ((y.detach(), want, F.gelu(x, approximate="tanh")),
                                (xs.grad, dwant, torch.ops.aten.gelu_backward(dy, x, approximate="tanh"))):
        finite = ~torch.isnan(ref)
        assert bool(torch.isnan(got[~finite]).all())
        off = int((got[finite] != ref[finite]).sum())
        assert off <= max(1, n // 50) and off <= max(1, int((ref_torch[finite] != ref[finite]).sum()))
        step = torch.finfo(torch.bfloat16).eps * ref[finite].double().abs().clamp_min(1e-30)
        assert bool(((got[finite].double() - ref[finite].double()).abs() <= step).all())
        # torch's tanh form gives 0 below v = -5, where GELU and its derivative are under 1e-5: the kernel their values
        tstep = torch.finfo(torch.bfloat16).eps * ref_torch[finite].double().abs() + 1e-5
        assert bool(((got[finite].double() - ref_torch[finite].double()).abs() <= tstep).all())
    lib = rows._load()
    one, two = torch.empty_like(x), torch.empty_like(x)
    lib.rows_gelu_tanh_bf16(x.data_ptr(), None, one.data_ptr(), n, 1)
    lib.rows_gelu_tanh_bf16(x.data_ptr(), None, two.data_ptr(), n, 2)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16)) and torch.equal(one[1:], y.detach()[1:])


@pytest.mark.parametrize("form", ["native", "avx2"])
def test_the_vector_bf16_rounding_is_torchs_conversion_bit_for_bit(form):
    """The rounding the bf16 kernels share (rows.cpp's store_bf16, AVX512 and AVX2 forms, and the scalar one for the
    rest): on every tie (low half exactly 0x8000, both parities), one bit either side of it, NaNs of any payload
    (quiet and signalling), infinities, subnormals and random floats, the same bits as torch's .bfloat16()."""
    g = torch.Generator().manual_seed(0)
    high = torch.randint(0, 1 << 16, (4000,), generator=g, dtype=torch.int64) << 16
    patterns = [high | 0x8000, high | 0x7FFF, high | 0x8001, high | 0x0000, high | 0xFFFF,
                torch.tensor([0x7F800000, 0xFF800000, 0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0xFFC12345, 0x7F808000,
                              0x00000001, 0x00008000, 0x80018000, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000])]
    bits = torch.cat(patterns)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)  # as signed 32-bit values
    x = torch.cat([bits.view(torch.float32), torch.randn(1001, generator=g) * 1e3])
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    lib.rows_round_bf16(x.data_ptr(), y.data_ptr(), x.numel())
    expected = x.bfloat16()
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    assert torch.equal(y.view(torch.int16)[nan] & 0x7FC0, torch.full_like(y.view(torch.int16)[nan], 0x7FC0))  # quiet
