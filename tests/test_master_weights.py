"""optimizer.AdamW(master_weights=True): bf16 parameters with fp32 master copies, against torch.optim.AdamW run on
fp32 copies with the bf16 gradients widened (the master), in the loop, multi-tensor and fused (one-pass C++) paths."""
from __future__ import annotations

import copy

import pytest
import torch
from tolerances import ADAMW_FUSED_VS_TORCH, ADAMW_VS_TORCH

from modules import adamw as fused_kernel
from modules import rows
from optimizer import AdamW

SHAPES = [(300, 77), (5,), (fused_kernel.SMALL + 1001,)]  # a matrix, a bias, one big enough for every thread
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)


def bf16_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in SHAPES]


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).mul(0.1).bfloat16() for s in SHAPES]


def run(params, optimizer, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        for p, g in zip(params, gradients(t)):
            p.grad = g.to(p.dtype)  # the fp32 reference gets the bf16 gradient widened, exactly
        optimizer.step()


def reference(steps: int = 30):
    """torch.optim.AdamW on fp32 copies of the parameters: what each master should hold."""
    params = [torch.nn.Parameter(p.detach().float()) for p in bf16_params()]
    opt = torch.optim.AdamW(params, **HYPER, foreach=True)
    run(params, opt, steps)
    return params, opt


@pytest.mark.parametrize("path", ["loop", "foreach", "fused"])
def test_masters_follow_torch_adamw_in_fp32_and_parameters_are_their_bf16_rounding(path):
    if path == "fused" and not fused_kernel.available():
        pytest.skip("the fused AdamW kernel cannot be built here (no g++ or not x86-64)")
    params = bf16_params()
    opt = AdamW(params, **HYPER, foreach=path == "foreach", fused=path == "fused", master_weights=True)
    run(params, opt, 30)
    ref, ref_opt = reference(30)
    tolerance = ADAMW_FUSED_VS_TORCH if path == "fused" else ADAMW_VS_TORCH
    for p, q in zip(params, ref):
        state = opt.state[p]
        assert p.dtype == torch.bfloat16 and state["master"].dtype == state["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(state["master"], q.detach(), **tolerance)
        torch.testing.assert_close(state["exp_avg"], ref_opt.state[q]["exp_avg"], **ADAMW_VS_TORCH)
        torch.testing.assert_close(state["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], **ADAMW_VS_TORCH)
        assert torch.equal(p.detach(), state["master"].bfloat16())


def test_without_master_weights_bf16_parameters_step_in_bf16_as_torchs_do():
    params = bf16_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = AdamW(params, **HYPER), torch.optim.AdamW(ref, **HYPER, foreach=True)
    run(params, opt, 10)
    run(ref, ref_opt, 10)
    for p, q in zip(params, ref):
        assert "master" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(p, q, **ADAMW_VS_TORCH)


@pytest.mark.parametrize("fused", [False, True])
def test_updates_below_a_bf16_rounding_step_accumulate_in_the_master(fused):
    """The reason for masters: at lr 1e-4 each update of a weight near 4 is below half a bf16 step (2^-6 there) and
    bf16 parameters alone never move; the master accumulates the updates until the rounding does move."""
    def train(master_weights: bool) -> torch.Tensor:
        p = torch.nn.Parameter(torch.full((64,), 4.0, dtype=torch.bfloat16))
        opt = AdamW([p], lr=1e-4, fused=fused, master_weights=master_weights)
        for _ in range(200):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach()
    assert torch.equal(train(False), torch.full((64,), 4.0, dtype=torch.bfloat16))
    moved = train(True)
    assert (moved < 4.0).all() and torch.equal(moved, torch.full((64,), 4.0 - 200 * 1e-4).bfloat16())


@pytest.mark.parametrize("fused", [False, True])
def test_state_dict_round_trip_keeps_masters_and_moments_in_fp32_and_resumes_exactly(fused):
    params = bf16_params()
    opt = AdamW(params, **HYPER, fused=fused, master_weights=True)
    run(params, opt, 5)
    saved_params, saved_state = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    run(params, opt, 5, start=5)

    resumed = [torch.nn.Parameter(p) for p in saved_params]
    opt2 = AdamW(resumed, **HYPER, fused=fused, master_weights=True)
    untouched = copy.deepcopy(saved_state)
    opt2.load_state_dict(saved_state)  # torch's loader would round the fp32 state to the parameters' bf16
    assert all(opt2.state[p]["master"].dtype == torch.float32 for p in resumed)
    run(resumed, opt2, 5, start=5)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"])
    for i, state in untouched["state"].items():  # the loaded state is a copy: the steps since left the dict alone
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved_state["state"][i][key], state[key]), (i, key)


def test_without_master_weights_a_state_dict_keeps_bf16_moments_and_resumes_exactly():
    params = bf16_params()
    opt = AdamW(params, **HYPER)
    run(params, opt, 5)
    saved_params, saved_state = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    run(params, opt, 5, start=5)
    resumed = [torch.nn.Parameter(p) for p in saved_params]
    opt2 = AdamW(resumed, **HYPER)
    opt2.load_state_dict(saved_state)
    assert all(opt2.state[p][key].dtype == torch.bfloat16 for p in resumed for key in ("exp_avg", "exp_avg_sq"))
    run(resumed, opt2, 5, start=5)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])


def test_master_weights_switched_on_mid_run_start_from_the_parameters_and_widen_the_moments():
    """A group whose master_weights is turned on after bf16 steps without it: its saved state (bf16 moments, no
    master) loads with the moments in fp32, and the first step starts each master from its parameter."""
    params = bf16_params()
    opt = AdamW(params, **HYPER)
    run(params, opt, 3)
    opt.param_groups[0]["master_weights"] = True
    saved = copy.deepcopy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = AdamW(resumed, **HYPER, master_weights=True)
    opt2.load_state_dict(saved)
    for p, q in zip(params, resumed):
        assert "master" not in opt2.state[q]
        for key in ("exp_avg", "exp_avg_sq"):  # widened on loading, not left in (or rounded to) bf16
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt2.state[q][key], opt.state[p][key].float())
    for o, ps in ((opt, params), (opt2, resumed)):
        run(ps, o, 2, start=3)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], opt2.state[q]["master"])
        assert opt.state[p]["master"].dtype == opt.state[p]["exp_avg"].dtype == torch.float32


def test_loaded_masters_and_moments_go_to_the_parameters_device():
    """The meta device stands in for an accelerator: the state saved on the CPU follows each parameter."""
    params = bf16_params()
    opt = AdamW(params, **HYPER, master_weights=True)
    run(params, opt, 1)
    elsewhere = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    moved = AdamW(elsewhere, **HYPER, master_weights=True)
    moved.load_state_dict(opt.state_dict())
    for p in elsewhere:
        assert {key: (t.device.type, t.dtype) for key, t in moved.state[p].items() if key != "step"} == {
            key: ("meta", torch.float32) for key in ("master", "exp_avg", "exp_avg_sq")}


def test_fp32_parameters_in_a_master_weights_group_step_as_without_it():
    a = [torch.nn.Parameter(p.detach().float()) for p in bf16_params()]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = AdamW(a, **HYPER, master_weights=True), AdamW(b, **HYPER)
    run(a, opt_a, 5)
    run(b, opt_b, 5)
    for p, q in zip(a, b):
        assert torch.equal(p, q) and "master" not in opt_a.state[p]


def test_the_fused_path_really_runs_the_master_kernel(monkeypatch):
    if not fused_kernel.available():
        pytest.skip("the fused AdamW kernel cannot be built here (no g++ or not x86-64)")
    calls = []
    real = fused_kernel.step_master
    monkeypatch.setattr(fused_kernel, "step_master", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    params = bf16_params()
    run(params, AdamW(params, **HYPER, fused=True, master_weights=True), 2)
    assert len(calls) == 2 * len(SHAPES)


def test_the_avx2_build_of_the_master_kernel_gives_the_native_builds_bits():
    if not fused_kernel.available() or "avx2" not in rows.cpu_flags().split():
        pytest.skip("the fused AdamW kernel or AVX2 is not available here")
    results = []
    for flags in (rows.NATIVE, rows.AVX2):
        lib = fused_kernel.library(flags)
        torch.manual_seed(0)
        master = torch.randn(100_003)
        low, g = master.bfloat16(), torch.randn(100_003).bfloat16()
        m, v = torch.randn(100_003), torch.rand(100_003)
        fused_kernel.step_master(master, low, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                 bias_correction1=0.1, bias_correction2_sqrt=0.0316, lib=lib)
        results.append((master, low, m, v))
    for a, b in zip(*results):
        assert torch.equal(a, b)
