"""AdamW against the CS224N reference and torch.optim.AdamW; resuming; the decay grouping rule; the schedules."""
import copy
import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import check_kernel_loader, data_path  # noqa: E402
from tolerances import ADAMW_FUSED_VS_TORCH, ADAMW_VS_COURSE, ADAMW_VS_TORCH, assert_same_update  # noqa: E402

import optimizer as optimizer_module  # noqa: E402
from modules import adamw as fused_kernel  # noqa: E402
from modules import rows  # noqa: E402
from optimizer import (  # noqa: E402
    AdamW,
    make_lr_scheduler,
    param_groups_for_weight_decay,
    warmup_cosine,
    warmup_linear,
)

EPS = 1e-6  # our default; torch.optim.AdamW defaults to 1e-8, so comparisons pass it explicitly


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: a second intra-op thread only adds synchronisation, which costs seconds when the
    other core is busy. Elementwise results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------
# The course check


def course_run(opt_class) -> torch.Tensor:
    """CS224N optimizer_test.py: 1000 steps of a 3 -> 2 linear regression."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    opt = opt_class(model.parameters(), lr=1e-3, weight_decay=1e-4, correct_bias=True)
    for _ in range(1000):
        opt.zero_grad()
        x = torch.FloatTensor(rng.uniform(size=[model.in_features]))
        y_hat = model(x)
        y = torch.Tensor([x[0] + x[1], -x[2]])
        loss = ((y - y_hat) ** 2).sum()
        loss.backward()
        opt.step()
    return model.weight.detach()


def test_course_reference():
    path = data_path("cs224n", "optimizer_test.npy")
    ref = torch.tensor(np.load(path))
    torch.testing.assert_close(course_run(AdamW), ref, **ADAMW_VS_COURSE)


# ---------------------------------------------------------------------------------------------------------------
# Against torch.optim.AdamW


class TinyNet(nn.Module):
    """Linear weights (decay), biases and a LayerNorm (no decay)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    net = TinyNet()
    with torch.no_grad():  # LayerNorm starts at ones / zeros; perturb it so its updates matter
        net.norm.weight.add_(torch.randn(16) * 0.1)
        net.norm.bias.add_(torch.randn(16) * 0.1)
    return net


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(net, opt, data, scheduler=None):
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_params_close(a: nn.Module, b: nn.Module):
    """Two nets trained by optimizer.AdamW and torch.optim.AdamW: tolerances.ADAMW_VS_TORCH (equal to the bit)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_same_update(p, q, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_matches_torch_adamw_two_groups_with_schedule(foreach):
    ours_net, torch_net = make_net(), make_net()
    ours = AdamW(param_groups_for_weight_decay(ours_net, 0.1), lr=3e-3, eps=EPS, foreach=foreach)
    groups = param_groups_for_weight_decay(torch_net, 0.1)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0 and groups[1]["params"]
    ref = torch.optim.AdamW(groups, lr=3e-3, eps=EPS, foreach=True)
    schedules = [make_lr_scheduler(o, warmup_steps=20, total_steps=150, min_ratio=0.1) for o in (ours, ref)]
    data = batches(200)
    train(ours_net, ours, data, schedules[0])
    train(torch_net, ref, data, schedules[1])
    assert_params_close(ours_net, torch_net)
    for p, q in zip(ours_net.parameters(), torch_net.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_update(ours.state[p][key], ref.state[q][key])
        assert ours.state[p]["step"].item() == ref.state[q]["step"].item() == 200


@pytest.mark.parametrize("path", ["foreach", "loop", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 1.0])
def test_a_decay_of_zero_or_one_matches_torch_adamw(path, weight_decay):
    """The boundary decays: 0 (no decay at all) and 1 (theta shrinks by lr each step), on every path."""
    if path == "fused" and not fused_kernel.available():
        pytest.skip("the fused AdamW kernel cannot be built here (no g++ or not x86-64)")
    ours_net, torch_net = make_net(), make_net()
    ours = AdamW(ours_net.parameters(), lr=3e-2, eps=EPS, weight_decay=weight_decay, foreach=path == "foreach",
                 fused=path == "fused")
    ref = torch.optim.AdamW(torch_net.parameters(), lr=3e-2, eps=EPS, weight_decay=weight_decay, foreach=True)
    data = batches(20)
    train(ours_net, ours, data)
    train(torch_net, ref, data)
    for p, q in zip(ours_net.parameters(), torch_net.parameters()):
        torch.testing.assert_close(p, q, **(ADAMW_FUSED_VS_TORCH if path == "fused" else ADAMW_VS_TORCH))


def test_foreach_blocks_and_loop_agree_bit_for_bit(monkeypatch):
    """Cutting tensors into blocks (here 7 float32 elements, so most tensors are split) changes no bit."""
    monkeypatch.setattr(optimizer_module, "BLOCK_BYTES", 28)
    nets = [make_net(), make_net()]
    opts = [AdamW(net.parameters(), lr=1e-2, weight_decay=0.05, foreach=f) for net, f in zip(nets, (True, False))]
    data = batches(20)
    for net, opt in zip(nets, opts):
        train(net, opt, data)
    for p, q in zip(*(net.parameters() for net in nets)):
        assert torch.equal(p, q)


def test_the_multi_tensor_path_cuts_and_packs_blocks_of_at_most_block_bytes(monkeypatch):
    """The blocks `_blocks` hands the foreach kernels (the sizes of each block's pieces): per device and dtype, in
    order; a contiguous tensor larger than BLOCK_BYTES is cut into flat pieces of at most BLOCK_BYTES; pieces are
    packed into a block until the next would not fit; a non-contiguous tensor is never cut (nor preceded by an empty
    block); off the CPU (here the meta device) a device and dtype are one block; a block holds at least one
    element."""
    monkeypatch.setattr(optimizer_module, "BLOCK_BYTES", 28)  # 7 float32 or 14 bfloat16 elements

    def blocks(*tensors):
        cut = optimizer_module._blocks(tensors, tensors, tensors, tensors, [1] * len(tensors), 0.9, 0.999, True)
        return [[piece.numel() for piece in block[0]] for block in cut]

    sizes = [torch.zeros(n) for n in (2, 3, 1, 16, 4, 3)]
    assert blocks(*sizes) == [[2, 3, 1], [7], [7], [2, 4], [3]]
    assert blocks(torch.zeros(4, 3).t(), torch.zeros(2)) == [[12], [2]]
    assert blocks(torch.zeros(4), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16),
                  torch.zeros(3)) == [[4, 3], [10], [6]]
    assert blocks(torch.zeros(5), torch.zeros(3), torch.zeros(4)) == [[5], [3, 4]]  # each new block starts empty
    assert blocks(torch.zeros(20, device="meta"), torch.zeros(30, device="meta")) == [[20, 30]]
    monkeypatch.setattr(optimizer_module, "BLOCK_BYTES", 3)  # less than one float32: a block still takes one element
    assert blocks(torch.zeros(3)) == [[1], [1], [1]]


def test_without_bias_correction_follows_the_equations():
    """correct_bias=False: theta -= lr * m / (sqrt(v) + eps) with the raw moments (decay first)."""
    lr, (b1, b2), wd = 1e-2, (0.9, 0.99), 0.1
    torch.manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    opt = AdamW([w], lr=lr, betas=(b1, b2), weight_decay=wd, correct_bias=False)
    theta, m, v = w.detach().clone(), torch.zeros_like(w), torch.zeros_like(w)
    for _ in range(5):
        g = torch.randn_like(w)
        w.grad = g.clone()
        opt.step()
        theta = theta * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        theta = theta - lr * m / (v.sqrt() + EPS)
        torch.testing.assert_close(w.detach(), theta, atol=1e-12, rtol=1e-12)


def test_first_step_size():
    """With bias correction the first step moves every coordinate by about lr; without, by (1-b1)/sqrt(1-b2) lr."""
    for correct_bias, expected in [(True, 1.0), (False, 0.1 / math.sqrt(0.001))]:
        w = torch.zeros(100, requires_grad=True)
        w.grad = torch.randn(100).sign() * (1 + torch.rand(100))  # |g| >= 1, so eps is negligible
        AdamW([w], lr=1e-3, correct_bias=correct_bias).step()
        torch.testing.assert_close(w.detach(), -1e-3 * expected * w.grad.sign(), atol=0, rtol=1e-4)


def test_defaults_are_the_courses():
    """CS224N's AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True): torch's
    lr and betas, but not its eps (1e-8) or weight decay (1e-2); the multi-tensor path, no kernel, no masters."""
    w = torch.zeros(2, requires_grad=True)
    assert AdamW([w]).defaults == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                                       foreach=True, fused=False, master_weights=False)
    ref = torch.optim.AdamW([w]).defaults
    assert (ref["lr"], ref["betas"], ref["eps"], ref["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)


def test_deterministic():
    runs = []
    for _ in range(2):
        net = make_net()
        train(net, AdamW(net.parameters(), lr=1e-2, weight_decay=0.01), batches(30))
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_resume_from_state_dict_matches_uninterrupted_run():
    data = batches(40)
    net = make_net()
    opt = AdamW(param_groups_for_weight_decay(net, 0.1), lr=1e-2)
    sched = make_lr_scheduler(opt, warmup_steps=5, total_steps=40, schedule="linear")
    train(net, opt, data[:20], sched)

    buffer = io.BytesIO()  # round trip through torch.save, as a checkpoint would
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    train(net, opt, data[20:], sched)  # the uninterrupted run

    resumed = make_net(seed=123)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = AdamW(param_groups_for_weight_decay(resumed, 0.1), lr=1e-2)
    # Build the scheduler before loading the optimizer's state: LambdaLR's constructor resets the group lr.
    resumed_sched = make_lr_scheduler(resumed_opt, warmup_steps=5, total_steps=40, schedule="linear")
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_sched.load_state_dict(checkpoint["scheduler"])
    train(resumed, resumed_opt, data[20:], resumed_sched)

    for p, q in zip(net.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_moves_to_torch_adamw_and_back():
    data = batches(30)
    net, ref_net = make_net(), make_net()
    ours = AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS, foreach=True)
    train(net, ours, data[:10])
    train(ref_net, ref, data[:10])
    # Each state goes into a fresh optimizer of the other kind built with other hyperparameters and no state, so
    # the continuation matches only if the moments, step counts and hyperparameters are all taken from the state.
    ours_state, ref_state = copy.deepcopy(ours.state_dict()), copy.deepcopy(ref.state_dict())
    net_b, ref_net_b = make_net(), make_net()
    net_b.load_state_dict(ref_net.state_dict())
    ref_net_b.load_state_dict(net.state_dict())
    ours_b = AdamW(net_b.parameters(), lr=0.5, weight_decay=0.0, eps=EPS)
    ref_b = torch.optim.AdamW(ref_net_b.parameters(), lr=0.5, weight_decay=0.0, eps=EPS, foreach=True)
    ours_b.load_state_dict(ref_state)  # ours continues torch's run
    ref_b.load_state_dict(ours_state)  # torch continues ours
    assert ours_b.param_groups[0]["lr"] == ref_b.param_groups[0]["lr"] == 1e-2
    assert float(ours_b.state[next(net_b.parameters())]["step"]) == 10
    train(net_b, ours_b, data[10:])
    train(ref_net_b, ref_b, data[10:])
    train(net, ours, data[10:])  # the uninterrupted runs
    train(ref_net, ref, data[10:])
    assert_params_close(net_b, ref_net)
    assert_params_close(ref_net_b, net)


def test_skips_parameters_without_grad_and_returns_closure_loss():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    opt = AdamW([a, b], lr=0.1, weight_decay=0.5)

    def closure():
        opt.zero_grad()
        loss = (a * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert b.grad is None and torch.equal(b, torch.ones(3)) and not opt.state[b]
    assert (a < 1).all() and opt.state[a]["step"].item() == 1


def test_bfloat16_parameters_update_in_their_dtype():
    w = torch.ones(4, 4, dtype=torch.bfloat16, requires_grad=True)
    w.grad = torch.full_like(w, 0.5)
    opt = AdamW([w], lr=0.1)
    opt.step()
    assert opt.state[w]["exp_avg"].dtype == torch.bfloat16 and w.dtype == torch.bfloat16
    torch.testing.assert_close(w.detach().float(), torch.full((4, 4), 0.9), atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1e-3), "Invalid learning rate: -0.001 (must be >= 0)"),
        (dict(lr=float("nan")), "Invalid learning rate: nan (must be >= 0)"),
        (dict(eps=-1e-8), "Invalid epsilon value: -1e-08 (must be >= 0)"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1 (must be >= 0)"),
        (dict(betas=(-0.1, 0.999)), "Invalid beta parameter at index 0: -0.1 (must be in [0, 1))"),
        (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0 (must be in [0, 1))"),
        (dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0 (must be in [0, 1))"),
        (dict(betas=(0.9, -1e-3)), "Invalid beta parameter at index 1: -0.001 (must be in [0, 1))"),
        (dict(betas=(0.9,)), "Invalid betas: (0.9,) (need two values)"),
        (dict(betas=(0.9, 0.99, 0.999)), "Invalid betas: (0.9, 0.99, 0.999) (need two values)"),
    ],
)
def test_invalid_hyperparameters_raise(kwargs, message):
    w = torch.zeros(2, requires_grad=True)
    for make in (lambda: AdamW([w], **kwargs), lambda: AdamW([{"params": [w], **kwargs}])):  # group overrides too
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == message


def test_the_edges_of_the_valid_ranges_are_accepted():
    """lr, eps, weight decay and both betas of 0 are valid. At lr 0 nothing moves; at lr 1 every entry moves by
    exactly 1 against its gradient's sign (with betas of 0 and no eps, m / sqrt(v) = g / |g|)."""
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = AdamW([w], lr=0.0, eps=0.0, weight_decay=0.0, betas=(0.0, 0.0))
    w.grad = torch.tensor([0.5, -4.0])
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([1.0, -2.0]))
    opt.param_groups[0]["lr"] = 1.0
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([0.0, -1.0]))


def test_sparse_gradients_raise():
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError) as error:
        AdamW(emb.parameters()).step()
    assert str(error.value) == "AdamW does not support sparse gradients (use torch.optim.SparseAdam)"


def test_complex_parameters_raise():
    z = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    z.grad = torch.ones_like(z)
    with pytest.raises(RuntimeError) as error:
        AdamW([z]).step()
    assert str(error.value) == "AdamW does not support complex parameters"


def test_a_parameter_without_a_gradient_is_skipped_not_the_rest_of_its_group():
    frozen, a, b = (nn.Parameter(torch.ones(3)) for _ in range(3))
    opt = AdamW([frozen, a, b], lr=0.1)
    a.grad, b.grad = torch.ones(3), -torch.ones(3)
    opt.step()
    assert torch.equal(frozen.detach(), torch.ones(3)) and not opt.state[frozen]
    assert torch.allclose(a.detach(), torch.full((3,), 0.9)) and torch.allclose(b.detach(), torch.full((3,), 1.1))


# ---------------------------------------------------------------------------------------------------------------
# Decay grouping


class TiedLM(nn.Module):
    """The head is registered before the embedding it is tied to, and one layer is frozen."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 20, bias=False)
        self.embedding = nn.Embedding(20, 8)
        self.head.weight = self.embedding.weight
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(()))


def test_param_groups_rule():
    model = TiedLM()
    decay, no_decay = param_groups_for_weight_decay(model, weight_decay=0.1)
    assert decay["param_names"] == ["proj.weight"] and decay["weight_decay"] == 0.1
    # named_parameters order: a module's own parameters first, then its children's
    assert no_decay["param_names"] == ["scale", "head.weight", "proj.bias", "norm.weight", "norm.bias"]
    assert no_decay["weight_decay"] == 0.0
    assert no_decay["params"][1] is model.embedding.weight  # the tied tensor, once
    decay, no_decay = param_groups_for_weight_decay(model, 0.1, decay_embeddings=True)
    assert decay["param_names"] == ["head.weight", "proj.weight"]
    AdamW(param_groups_for_weight_decay(model, 0.1))  # accepted, no duplicate-parameter warning or error


# ---------------------------------------------------------------------------------------------------------------
# Schedules


@pytest.mark.parametrize("schedule", [warmup_cosine, warmup_linear])
def test_schedule_landmarks(schedule):
    kw = dict(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert schedule(0, **kw) == pytest.approx(0.1)  # first step already trains
    assert schedule(4, **kw) == pytest.approx(0.5)
    assert schedule(9, **kw) == 1.0 and schedule(10, **kw) == 1.0  # end of warmup, start of decay
    assert schedule(60, **kw) == pytest.approx(0.55)  # halfway down: both shapes pass the midpoint
    assert schedule(110, **kw) == pytest.approx(0.1) and schedule(10_000, **kw) == 0.1  # the floor
    values = [schedule(s, **kw) for s in range(10, 200)]
    assert all(a >= b for a, b in zip(values, values[1:])) and min(values) == pytest.approx(0.1)
    assert schedule(0, 0, 100) == 1.0 and schedule(100, 0, 100) == 0.0  # no warmup, floor 0


def test_schedule_shapes_differ():
    kw = dict(warmup_steps=0, total_steps=100)
    assert warmup_linear(25, **kw) == pytest.approx(0.75)
    assert warmup_cosine(25, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_schedule_invalid_arguments():
    with pytest.raises(ValueError, match=r"^need 0 <= warmup_steps <= total_steps, got 10 and 5$"):
        warmup_cosine(0, warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match=r"^need 0 <= warmup_steps <= total_steps, got -1 and 5$"):
        warmup_linear(0, warmup_steps=-1, total_steps=5)
    with pytest.raises(ValueError, match=r"^min_ratio must be in \[0, 1\], got 1\.5$"):
        warmup_linear(0, warmup_steps=0, total_steps=5, min_ratio=1.5)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_lr_scheduler(AdamW([torch.zeros(1, requires_grad=True)]), 1, 2, schedule="step")


@pytest.mark.parametrize("schedule", [warmup_cosine, warmup_linear])
def test_schedule_edges(schedule):
    """A warmup as long as the whole run (no decay phase: flat at the end), and a floor of 1 (no decay at all)."""
    assert [schedule(s, 4, 4, 0.5) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 0.5, 0.5]
    assert [schedule(s, 2, 6, 1.0) for s in range(8)] == [0.5] + [1.0] * 7


def learning_rates(steps: int, **schedule) -> list[float]:
    """The learning rate of each of `steps` AdamW steps at lr 1.0 under make_lr_scheduler(**schedule)."""
    w = torch.zeros(1, requires_grad=True)
    opt = AdamW([w], lr=1.0)
    sched = make_lr_scheduler(opt, **schedule)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(1)
        opt.step()
        sched.step()
    return seen


def test_make_lr_scheduler_drives_the_learning_rate():
    seen = learning_rates(6, warmup_steps=2, total_steps=4, min_ratio=0.25, schedule="linear")
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.625, 0.25, 0.25])


def test_make_lr_scheduler_defaults_to_a_cosine_down_to_zero():
    seen = learning_rates(5, warmup_steps=0, total_steps=4)
    assert seen == pytest.approx([warmup_cosine(s, 0, 4) for s in range(5)]) and seen[-1] == 0.0
    assert seen[1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


# ---------------------------------------------------------------------------------------------------------------
# AdamW(fused=True): the one-pass C++ kernel (modules/adamw.cpp)

needs_fused_kernel = pytest.mark.skipif(not fused_kernel.available(),
                                        reason="the fused AdamW kernel cannot be built here (no g++ or not x86-64)")


def test_the_fused_adamw_kernel_loads_once_under_its_switch_and_a_failed_build_names_itself(monkeypatch):
    check_kernel_loader(monkeypatch, fused_kernel, "GPT2_FUSED_ADAMW",
                        r"^the fused AdamW kernel modules/adamw\.cpp could not be built \(OSError: no compiler here\); "
                        r"AdamW\(fused=True\) runs the multi-tensor path$")


def test_the_kernels_constants_are_the_updates_and_a_small_tensor_gets_one_thread():
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, bias_correction1=0.5,
                 bias_correction2_sqrt=0.25)
    torch.set_num_threads(3)  # restored after the test (conftest.restore_threads)
    small, big = fused_kernel._scalars(fused_kernel.SMALL - 1, **hyper), fused_kernel._scalars(fused_kernel.SMALL, **hyper)
    assert small[-1] == 1 and big[-1] == 3  # a parallel region costs more than it saves below SMALL elements
    assert small[:-1] == big[:-1] == (1 - 1e-3 * 0.1, 1 - 0.9, 0.999, 1 - 0.999, 0.25, 1e-8, -1e-3 / 0.5)


MASTER_ARGS = ("master", "low", "g", "m", "v")
NOT_FOR_THE_MASTER_KERNEL = {  # one argument replaced: what the kernel cannot read as it reads its tensors
    "master in bf16": ("master", lambda: torch.zeros(2, 3, dtype=torch.bfloat16)),
    "master not contiguous": ("master", lambda: torch.zeros(3, 2).t()),
    "low in fp32": ("low", lambda: torch.zeros(2, 3)),
    "low not contiguous": ("low", lambda: torch.zeros(3, 2, dtype=torch.bfloat16).t()),
    "low not on the CPU": ("low", lambda: torch.zeros(2, 3, dtype=torch.bfloat16, device="meta")),
    "low of another shape": ("low", lambda: torch.zeros(3, 2, dtype=torch.bfloat16)),
    "gradient in fp32": ("g", lambda: torch.zeros(2, 3)),
    "gradient not contiguous": ("g", lambda: torch.zeros(3, 2, dtype=torch.bfloat16).t()),
    "gradient of another shape": ("g", lambda: torch.zeros(3, 2, dtype=torch.bfloat16)),
    "first moment in fp64": ("m", lambda: torch.zeros(2, 3, dtype=torch.float64)),
    "first moment not contiguous": ("m", lambda: torch.zeros(3, 2).t()),
    "second moment of another shape": ("v", lambda: torch.zeros(6)),
}


@pytest.mark.parametrize("why", list(NOT_FOR_THE_MASTER_KERNEL))
def test_the_master_kernel_applies_only_to_what_it_reads(why):
    args = {"master": torch.zeros(2, 3), "low": torch.zeros(2, 3, dtype=torch.bfloat16),
            "g": torch.zeros(2, 3, dtype=torch.bfloat16), "m": torch.zeros(2, 3), "v": torch.zeros(2, 3)}
    assert fused_kernel.applies_master(*(args[k] for k in MASTER_ARGS))
    name, make = NOT_FOR_THE_MASTER_KERNEL[why]
    args[name] = make()
    assert not fused_kernel.applies_master(*(args[k] for k in MASTER_ARGS)), why


@needs_fused_kernel
def test_a_fused_step_bumps_the_version_of_every_tensor_it_writes_and_of_none_it_reads():
    """The derived-weight caches and autograd see the kernels' writes (issue 52): each written tensor's version goes
    up by one, as after one in-place torch op; the gradient's stays."""
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, bias_correction1=0.1,
                 bias_correction2_sqrt=0.0316)
    p, g, m, v = torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)
    before = [t._version for t in (p, g, m, v)]
    fused_kernel.step(p, g, m, v, **hyper)
    assert [t._version - b for t, b in zip((p, g, m, v), before)] == [1, 0, 1, 1]
    master, g16, m, v = torch.randn(10), torch.randn(10).bfloat16(), torch.zeros(10), torch.zeros(10)
    low = master.bfloat16()
    before = [t._version for t in (master, low, g16, m, v)]
    fused_kernel.step_master(master, low, g16, m, v, **hyper)
    assert [t._version - b for t, b in zip((master, low, g16, m, v), before)] == [1, 1, 0, 1, 1]


def fixed_gradient_run(opt_factory, steps: int = 200):
    """Parameters of several shapes (one above the kernel's one-thread limit, so its OpenMP loop runs) updated from
    the same gradient sequence whatever the parameters are: differences cannot feed back through the gradients."""
    torch.manual_seed(0)
    shapes = [(3000, 77), (5,), (128, 130), (fused_kernel.SMALL + 1001,)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = opt_factory(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@needs_fused_kernel
@pytest.mark.parametrize("correct_bias", [True, False])
def test_fused_moments_equal_torch_and_parameters_within_a_rounding(correct_bias):
    hyper = dict(lr=1e-3, eps=EPS, weight_decay=0.01)
    fused, fused_opt = fixed_gradient_run(lambda ps: AdamW(ps, fused=True, correct_bias=correct_bias, **hyper))
    if correct_bias:
        ref, ref_opt = fixed_gradient_run(lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper))
    else:  # torch has no correct_bias=False: there the reference is our multi-tensor path (torch's own operations)
        ref, ref_opt = fixed_gradient_run(lambda ps: AdamW(ps, correct_bias=False, **hyper))
    start, _ = fixed_gradient_run(lambda ps: AdamW(ps, lr=0.0), steps=0)
    for p, q, p0 in zip(fused, ref, start):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_update(fused_opt.state[p][key], ref_opt.state[q][key])
        torch.testing.assert_close(p, q, **ADAMW_FUSED_VS_TORCH)
        assert (p - p0).abs().max() > 100 * ADAMW_FUSED_VS_TORCH["atol"]  # the run moved them far beyond it


@needs_fused_kernel
def test_fused_really_runs_the_kernel(monkeypatch):
    calls = []
    real = fused_kernel.step
    monkeypatch.setattr(fused_kernel, "step", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    params, _ = fixed_gradient_run(lambda ps: AdamW(ps, lr=1e-3, fused=True), steps=2)
    assert calls == [p.shape for p in params] * 2


@needs_fused_kernel
def test_fused_leaves_what_it_cannot_take_to_the_multi_tensor_path():
    """bf16 and non-contiguous parameters take the foreach path: the same bits as AdamW(fused=False)."""
    def params():
        torch.manual_seed(3)
        return [nn.Parameter(torch.randn(40, 30).t()), nn.Parameter(torch.randn(50).bfloat16()),
                nn.Parameter(torch.randn(20, 20))]
    a, b = params(), params()
    opt_a, opt_b = AdamW(a, lr=1e-2, weight_decay=0.1, fused=True), AdamW(b, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g).to(x.dtype)
            y.grad = x.grad.clone()
        opt_a.step()
        opt_b.step()
    assert not a[0].is_contiguous()
    for x, y in zip(a[:2], b[:2]):
        assert torch.equal(x, y)
    torch.testing.assert_close(a[2], b[2], **ADAMW_FUSED_VS_TORCH)


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major memory: equal to `t`, not contiguous."""
    return t.t().contiguous().t()


@needs_fused_kernel
@pytest.mark.parametrize("odd", ["param", "grad", "exp_avg", "exp_avg_sq"])
def test_fused_leaves_a_parameter_with_any_non_contiguous_tensor_to_the_multi_tensor_path(odd):
    """The kernel reads every tensor as contiguous memory: a parameter whose own tensor, gradient or either moment
    is not (a strided view; a gradient or moment with other strides, as from a state dict saved where the parameter
    was transposed) takes the multi-tensor path, the same bits as AdamW(fused=False)."""
    def run(fused: bool) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        data = torch.randn(40, 60)
        p = nn.Parameter(data[:, ::2] if odd == "param" else data[:, :30].contiguous())
        opt = AdamW([p], lr=1e-2, weight_decay=0.1, fused=fused)
        if odd.startswith("exp_avg"):  # a fresh state whose one moment is column-major
            state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(40, 30), "exp_avg_sq": torch.zeros(40, 30)}
            state[odd] = transposed_copy(state[odd])
            opt.load_state_dict({"state": {0: state}, "param_groups": opt.state_dict()["param_groups"]})
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            grad = torch.randn(40, 30, generator=g)
            p.grad = transposed_copy(grad) if odd == "grad" else grad
            opt.step()
        tensors = {"param": p, "grad": p.grad, **opt.state[p]}
        assert [k for k in ("param", "grad", "exp_avg", "exp_avg_sq") if not tensors[k].is_contiguous()] == [odd]
        return p.detach(), opt.state[p]

    (fused, fused_state), (ref, ref_state) = run(True), run(False)
    assert torch.equal(fused, ref)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fused_state[key], ref_state[key])


@needs_fused_kernel
def test_fused_without_the_kernel_is_the_multi_tensor_path(monkeypatch):
    nets = [make_net(), make_net()]
    monkeypatch.setattr(fused_kernel, "_library", False)  # as with GPT2_FUSED_ADAMW=0 or no compiler
    train(nets[0], AdamW(nets[0].parameters(), lr=1e-2, fused=True), batches(10))
    train(nets[1], AdamW(nets[1].parameters(), lr=1e-2), batches(10))
    assert_params_close(*nets)


@needs_fused_kernel
def test_fused_kernel_avx2_form_equals_the_native_one():
    """The kernel built for AVX2 + FMA (as on a Zen 3) gives the native build's bits (here AVX512 where present)."""
    torch.manual_seed(0)
    n = fused_kernel.SMALL + 1001
    start = [torch.randn(n), torch.randn(n) * 1e-2, torch.randn(n) * 1e-3, torch.rand(n) * 1e-4]
    out = []
    for lib in (fused_kernel.library(), fused_kernel.library(rows.AVX2)):
        p, g, m, v = (t.clone() for t in start)
        fused_kernel.step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                          bias_correction1=1 - 0.9**3, bias_correction2_sqrt=(1 - 0.999**3) ** 0.5, lib=lib)
        out.append((p, m, v))
    for a, b in zip(*out):
        assert torch.equal(a, b)


@needs_fused_kernel
def test_fused_state_dict_resumes_exactly_and_loads_from_torch():
    data = batches(30)
    net, again = make_net(), make_net()
    run = AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(net, run, data)
    first = AdamW(again.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(again, first, data[:12])
    resumed = AdamW(again.parameters(), lr=0.5, fused=True)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    train(again, resumed, data[12:])
    for p, q in zip(net.parameters(), again.parameters()):
        assert torch.equal(p, q)
    ref_net, ours_net = make_net(), make_net()
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, eps=EPS, foreach=True)
    train(ref_net, ref, data[:5])
    ours_net.load_state_dict(ref_net.state_dict())
    ours = AdamW(ours_net.parameters(), lr=1.0, eps=EPS)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch says fused=None: ours continues unfused, to the bit
    assert not ours.param_groups[0]["fused"]
    train(ours_net, ours, data[5:])
    train(ref_net, ref, data[5:])
    assert_params_close(ours_net, ref_net)


@pytest.mark.parametrize("loaded", [True, False], ids=["dynamo-loaded", "dynamo-not-loaded"])
@pytest.mark.parametrize("name", ["zero_grad", "state_dict", "load_state_dict", "add_param_group"])
def test_torchs_methods_skip_their_dynamo_wrapper_only_while_the_compiler_is_not_loaded(monkeypatch, name, loaded):
    """optimizer._without_dynamo_import: torch.optim.Optimizer's method as torch wraps it once torch._dynamo is
    imported, the function under the wrapper (its __wrapped__) before."""
    opt = AdamW(nn.Linear(3, 2).parameters(), lr=1e-3)
    args = {"zero_grad": (), "state_dict": (), "add_param_group": ({"params": [nn.Parameter(torch.ones(2))]},),
            "load_state_dict": (torch.optim.Optimizer.state_dict.__wrapped__(opt),)}[name]
    real = getattr(torch.optim.Optimizer, name)
    calls = []

    def plain(self, *args, **kwargs):
        calls.append("plain")
        return real.__wrapped__(self, *args, **kwargs)

    def wrapped(self, *args, **kwargs):
        calls.append("wrapped")
        return real.__wrapped__(self, *args, **kwargs)
    wrapped.__wrapped__ = plain
    monkeypatch.setattr(torch.optim.Optimizer, name, wrapped)
    if loaded:
        monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", torch))
    else:
        monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    getattr(opt, name)(*args)
    assert calls == ["wrapped" if loaded else "plain"]


def test_a_training_process_with_our_optimizers_never_imports_the_compiler():
    """Building AdamW and MuonWithAdamW, stepping, zeroing, saving and loading their state: torch._dynamo (2 s of
    imports) stays unloaded, as it does in run_pretrain.py's runs."""
    code = """
import sys, torch
from torch import nn
from optimizer import AdamW, MuonWithAdamW, muon_param_groups
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
groups = muon_param_groups(model, 0.1, blocks="0")
for opt in (AdamW(model.parameters(), lr=1e-3), MuonWithAdamW(groups, lr=1e-3)):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
