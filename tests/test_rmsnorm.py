"""modules/rmsnorm.py: the one-pass RMSNorm kernel against torch's composite rms_norm (values and gradients, float32
to 1e-5 relative; float64 autograd as the reference of both), and a model trained through it against one trained
with it off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, check_kernel_loader, train_counting

from config import GPT2Config
from modules import rmsnorm
from modules.norms import RMSNorm

pytestmark = pytest.mark.skipif(not rmsnorm.available(), reason=f"{rmsnorm.ENV}=0 turns the RMSNorm kernel off"
                                if os.environ.get(rmsnorm.ENV) == "0" else "the RMSNorm kernel does not build here "
                                "(it needs x86-64 Linux and a C++ compiler)")


def reference(x, w, eps):
    """torch's composite in float64: the reference both float32 computations are held to."""
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    w64 = None if w is None else w.detach().double().requires_grad_(w.requires_grad)
    return x64, w64, F.rms_norm(x64, (x.shape[-1],), w64, eps)


def close(a, b, rel=1e-5):
    scale = b.abs().max().clamp_min(1e-30)
    return ((a.double() - b.double()).abs().max() / scale).item() <= rel


@pytest.mark.parametrize("shape", [(768, 128), (12, 4, 64, 32), (1, 5), (3, 33), (300, 257), (2, 1, 100)])
@pytest.mark.parametrize("weighted", [True, False])
def test_values_and_gradients_agree_with_torchs_rms_norm(shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 0.5).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).requires_grad_() if weighted else None
    dy = torch.randn(shape, generator=g)
    y = rmsnorm._RMSNorm.apply(x, w, 1e-5)
    y.backward(dy)
    x64, w64, y64 = reference(x, w, 1e-5)
    y64.backward(dy.double())
    xt = x.detach().clone().requires_grad_()
    wt = None if w is None else w.detach().clone().requires_grad_()
    yt = F.rms_norm(xt, (shape[-1],), wt, 1e-5)
    yt.backward(dy)
    assert y.dtype == torch.float32 and y.shape == x.shape
    for ours, torchs, exact in ((y, yt, y64), (x.grad, xt.grad, x64.grad)) + (
            ((w.grad, wt.grad, w64.grad),) if weighted else ()):
        assert close(ours, exact) and close(torchs, exact), ((ours.double() - exact).abs().max(),
                                                              (torchs.double() - exact).abs().max())


def test_a_frozen_weight_gets_no_gradient_and_an_input_without_grad_runs_forward_only():
    x = torch.randn(64, 48, requires_grad=True)
    w = torch.rand(48) + 0.5  # requires_grad False
    rmsnorm._RMSNorm.apply(x, w, 1e-6).sum().backward()
    assert w.grad is None and x.grad is not None
    with torch.no_grad():
        y = rmsnorm.rms_norm(torch.randn(4, 48), w, 1e-6)
    assert not y.requires_grad


def test_a_transposed_input_and_empty_rows_are_handled():
    x = torch.randn(16, 24).t()  # (24, 16), not contiguous
    w = torch.rand(16) + 0.5
    assert close(rmsnorm.rms_norm(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5))
    e = torch.randn(0, 16, requires_grad=True)
    we = w.clone().requires_grad_()
    y = rmsnorm._RMSNorm.apply(e, we, 1e-5)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(we.grad, torch.zeros(16)) and e.grad.shape == (0, 16)  # no rows: a zero weight gradient


def test_the_kernel_applies_to_float32_cpu_tensors_only():
    w = torch.ones(8)
    assert rmsnorm.applies(torch.randn(2, 8), w) and rmsnorm.applies(torch.randn(2, 8), None)
    assert not rmsnorm.applies(torch.randn(2, 8, dtype=torch.float64), None)
    assert not rmsnorm.applies(torch.randn(2, 8, dtype=torch.bfloat16), None)
    assert not rmsnorm.applies(torch.randn(2, 8), torch.ones(8, dtype=torch.float64))
    assert not rmsnorm.applies(torch.randn(2, 8), torch.ones(4))
    assert rmsnorm.applies(torch.randn(8), w) and rmsnorm.applies(torch.randn(2, 3, 8), w)  # any leading shape
    assert rmsnorm.applies(torch.randn(3, 1), None) and not rmsnorm.applies(torch.randn(3, 0), None)
    assert not rmsnorm.applies(torch.tensor(1.0), None)  # a scalar has no last dimension to normalise
    assert not rmsnorm.applies(torch.randn(2, 8), torch.ones(8, device="meta"))
    with pytest.raises(RuntimeError):  # a weight of the wrong width is torch's error, never the kernel's bad read
        rmsnorm.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    x = torch.randn(2, 8, dtype=torch.float64)  # another dtype: torch's rms_norm, same function
    assert torch.equal(rmsnorm.rms_norm(x, None, 1e-5), F.rms_norm(x, (8,), None, 1e-5))


def test_the_module_takes_the_kernel_and_keeps_its_dtype(monkeypatch):
    calls = []
    real = rmsnorm._RMSNorm.apply
    monkeypatch.setattr(rmsnorm._RMSNorm, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    norm = RMSNorm(32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16 and norm(x.float()).dtype == torch.float32
    assert calls == [torch.float32, torch.float32]  # bf16 is widened to float32 first, as Llama's RMSNorm


def train(steps: int, kernel: bool) -> list[float]:
    """A model with RMSNorm and QK-norm trained `steps` AdamW steps (dropout on) from one seed."""
    config = GPT2Config(vocab_size=61, n_positions=32, n_embd=48, n_layer=2, n_head=3, norm="rmsnorm", bias=False,
                        qk_norm=True, position_embedding="rope", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    saved, rmsnorm._library = rmsnorm._library, (rmsnorm._library if kernel else False)
    try:
        return train_counting(config, steps)
    finally:
        rmsnorm._library = saved


def test_twenty_steps_through_the_kernel_track_torchs_rms_norm():
    """Path matrix (issue 52): the same 20 steps with dropout on, the kernel against torch's composite: float32
    rounding apart at each step, so the losses stay within 1e-4 of each other."""
    ours, torchs = train(20, kernel=True), train(20, kernel=False)
    assert ours[-1] < ours[0] - 0.3, ours  # it trains
    assert max(abs(a - b) for a, b in zip(ours, torchs)) < 1e-4, list(zip(ours, torchs))


def test_the_switch_turns_the_kernel_off_in_a_new_process():
    code = "from modules import rmsnorm; print(rmsnorm.available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, rmsnorm.ENV: "0"}).stdout
    assert out.strip() == "False"


def test_the_kernel_loads_once_under_its_switch_and_a_failed_build_names_itself(monkeypatch):
    """modules/rmsnorm.py's own loader (conftest.check_kernel_loader); a fresh build computes what the loaded one does
    (its argument types: 64-bit pointers and a float eps, which ctypes' defaults would cut or pass as a double)."""
    assert check_kernel_loader(monkeypatch, rmsnorm, rmsnorm.ENV, r"^the RMSNorm kernel modules/rmsnorm\.cpp could not "
                                                                  r"be built \(OSError: no compiler here\); RMSNorm runs "
                                                                  r"torch's")
    x = torch.randn(40, 24, requires_grad=True)
    w = (torch.rand(24) + 0.5).requires_grad_()
    runs = []
    for lib in (rmsnorm._load(), rmsnorm.library()):
        monkeypatch.setattr(rmsnorm, "_library", lib)
        x.grad = w.grad = None
        y = rmsnorm.rms_norm(x, w, 1e-3)
        y.backward(torch.linspace(-1, 1, 40 * 24).reshape(40, 24))
        runs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert close(runs[0][0], F.rms_norm(x.detach(), (24,), w.detach(), 1e-3))  # eps 1e-3 reached the kernel


def test_any_thread_count_gives_the_same_bits():
    """Rows are independent and the weight's gradient is summed by fixed chunks of rows: a run repeats exactly
    with another thread count (above the size where the kernel splits the rows)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(700, 96, generator=g, requires_grad=True)
    w = (torch.rand(96, generator=g) + 0.5).requires_grad_()
    dy = torch.randn(700, 96, generator=g)
    assert x.numel() >= rmsnorm.SMALL
    runs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            x.grad = w.grad = None
            y = rmsnorm.rms_norm(x, w, 1e-5)
            y.backward(dy)
            runs.append((y.detach(), x.grad, w.grad))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
