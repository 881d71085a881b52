"""Muon against torch.optim.Muon; resuming; the Muon / AdamW parameter split; MuonWithAdamW under the engine's
drivers (LambdaLR, GradScaler); run_pretrain.py --optimizer muon end to end."""
import copy
import io

import pytest
import torch
from torch import nn

import run_pretrain
from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel, GPT2Model
from optimizer import AdamW, Muon, MuonWithAdamW, adjusted_lr, make_lr_scheduler, muon_param_groups, orthogonalize

SHAPES = [(8, 8), (12, 5), (5, 12), (16, 6)]  # square, tall, wide: the orientation and the lr adjustment differ


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation (seconds when the other core is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def matrices(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]


def two_groups(params: list[nn.Parameter]) -> list[dict]:
    """The first two matrices with the defaults, the others with their own lr and weight decay."""
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.01, "weight_decay": 0.05}]


def steps(params: list[nn.Parameter], opts: list, n: int, seed: int = 1, schedulers=()) -> None:
    """n steps of random gradients (the same for every run with this seed)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad
        for opt in opts:
            opt.step()
        for s in schedulers:
            s.step()


# ---------------------------------------------------------------------------------------------------------------
# Against torch.optim.Muon


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_matches_torch_muon_over_200_steps(nesterov, adjust_lr_fn):
    """Two groups, weight decay, a warmup + cosine schedule: equal to 1e-6 (absolute) after 200 steps; in practice
    bit for bit, since the operations are torch's in the same order and dtypes (bf16 Newton-Schulz)."""
    ours_params, ref_params = matrices(), matrices()
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours = Muon(two_groups(ours_params), **hyper)
    ref = torch.optim.Muon(two_groups(ref_params), **hyper)
    schedules = [make_lr_scheduler(o, warmup_steps=20, total_steps=150, min_ratio=0.1) for o in (ours, ref)]
    for params, opt, sched in zip((ours_params, ref_params), (ours, ref), schedules):
        steps(params, [opt], 200, schedulers=[sched])
    for p, q in zip(ours_params, ref_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"], atol=1e-6,
                                   rtol=0)
    assert ours.param_groups[1]["lr"] == ref.param_groups[1]["lr"] != ours.param_groups[0]["lr"]


def test_state_dict_round_trip_resumes_bit_for_bit():
    """20 steps in one go equal 10 steps, a state dict through torch.save / weights_only load, 10 more."""
    params = matrices()
    opt = Muon(two_groups(params), lr=0.02)
    sched = make_lr_scheduler(opt, warmup_steps=5, total_steps=20)
    steps(params, [opt], 10, seed=1, schedulers=[sched])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    steps(params, [opt], 10, seed=2, schedulers=[sched])  # the uninterrupted run

    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    resumed_opt = Muon(two_groups(resumed), lr=0.5, momentum=0.5)  # the state brings back the run's own values
    resumed_sched = make_lr_scheduler(resumed_opt, warmup_steps=5, total_steps=20)
    resumed_opt.load_state_dict(saved["optimizer"])
    resumed_sched.load_state_dict(saved["scheduler"])
    steps(resumed, [resumed_opt], 10, seed=2, schedulers=[resumed_sched])
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}


def test_state_dict_moves_to_torch_muon_and_back():
    ours_params, ref_params = matrices(), matrices()
    ours, ref = Muon(ours_params, lr=0.02), torch.optim.Muon(ref_params, lr=0.02)
    steps(ours_params, [ours], 5)
    steps(ref_params, [ref], 5)
    ours_b_params = [nn.Parameter(p.detach().clone()) for p in ref_params]  # ours continues torch's run ...
    ref_b_params = [nn.Parameter(p.detach().clone()) for p in ours_params]  # ... and torch continues ours
    ours_b, ref_b = Muon(ours_b_params, lr=0.5), torch.optim.Muon(ref_b_params, lr=0.5)
    ours_b.load_state_dict(copy.deepcopy(ref.state_dict()))  # no ns_dtype in torch's groups: ours takes bf16
    ref_b.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert ours_b.param_groups[0]["lr"] == 0.02 and ours_b.param_groups[0]["ns_dtype"] == torch.bfloat16
    for params, opt in ((ours_params, ours), (ref_params, ref), (ours_b_params, ours_b), (ref_b_params, ref_b)):
        steps(params, [opt], 5, seed=2)
    for a, b in zip(ours_params, ref_b_params):
        assert torch.equal(a, b)
    for a, b in zip(ref_params, ours_b_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalize_brings_singular_values_near_one(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(16, 64), (64, 16), (48, 20)]:
        x = torch.randn(shape, generator=g) * 1e3  # the scale goes: the input is divided by its norm
        o = orthogonalize(x, dtype=dtype)
        assert o.shape == shape and o.dtype == dtype
        s = torch.linalg.svdvals(o.float())
        assert 0.6 < s.min() and s.max() < 1.2, (shape, s.min(), s.max())
    assert torch.equal(orthogonalize(torch.zeros(4, 3), dtype=torch.float32), torch.zeros(4, 3))


def test_float32_newton_schulz_leaves_the_momentum_buffer_alone():
    """Without Nesterov the update is the momentum buffer itself; an fp32 iteration must not divide it in place."""
    (p,) = matrices()[:1]
    opt = Muon([p], lr=0.02, nesterov=False, momentum=0.5, ns_dtype=torch.float32)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, 0.5))


def test_a_groups_newton_schulz_dtype_is_the_one_its_step_iterates_in():
    """One step without momentum or decay moves p by -lr' * orthogonalize(grad) in the group's ns_dtype: float32's
    result, which bf16's iteration does not give."""
    (p,) = matrices()[:1]
    start, grad = p.detach().clone(), torch.randn_like(p)
    opt = Muon([p], lr=0.02, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=torch.float32)
    p.grad = grad.clone()
    opt.step()
    step = adjusted_lr(0.02, None, p.shape)
    torch.testing.assert_close(p.detach(), start - step * orthogonalize(grad, dtype=torch.float32), rtol=0, atol=1e-6)
    assert not torch.allclose(p.detach(), start - step * orthogonalize(grad), rtol=0, atol=1e-4)


def test_adjusted_lr_is_torchs():
    """Jordan's sqrt(max(1, rows / cols)) and Moonshot's 0.2 sqrt(max(rows, cols)), on the first two sides of any
    shape (as torch.optim.Muon's, which also reads a convolution's (out, in, h, w) so)."""
    cases = {((12, 3), None): 0.02 * 2, ((12, 3), "original"): 0.02 * 2, ((3, 12), None): 0.02,
             ((16, 4, 3, 3), None): 0.02 * 2, ((3, 12), "match_rms_adamw"): 0.02 * 0.2 * 12**0.5,
             ((12, 3), "match_rms_adamw"): 0.02 * 0.2 * 12**0.5, ((16, 4, 3, 3), "match_rms_adamw"): 0.02 * 0.2 * 4}
    for (shape, fn), expected in cases.items():
        assert adjusted_lr(0.02, fn, torch.Size(shape)) == pytest.approx(expected, rel=1e-12), (shape, fn)
        assert adjusted_lr(0.02, fn, torch.Size(shape)) == torch.optim._muon._adjust_lr(0.02, fn, torch.Size(shape))
    with pytest.raises(ValueError) as error:
        adjusted_lr(0.02, "rms", torch.Size((3, 3)))
    assert str(error.value) == "Invalid adjust_lr_fn: 'rms' (choose from None, 'original', 'match_rms_adamw')"


def test_a_matrix_without_a_gradient_is_skipped_not_the_rest_of_its_group():
    frozen, a = matrices()[:2]
    before = frozen.detach().clone(), a.detach().clone()
    opt = Muon([frozen, a], lr=0.02)
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(frozen.detach(), before[0]) and not opt.state[frozen]
    assert not torch.equal(a.detach(), before[1]) and "momentum_buffer" in opt.state[a]


# ---------------------------------------------------------------------------------------------------------------
# What Muon refuses


def test_parameters_that_are_not_matrices_are_refused_naming_their_shape():
    with pytest.raises(ValueError, match=r"shape \(3,\): give it to AdamW instead"):
        Muon([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"parameter bias has shape \(3,\)"):  # named parameters are named
        Muon(nn.Linear(4, 3).named_parameters())
    opt = Muon([nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(ValueError, match=r"shape \(2, 3, 3\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 3, 3))]})
    with pytest.raises(ValueError, match=r"shape \(3,\): give it to AdamW"):
        MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])
    with pytest.raises(ValueError, match="'use_muon'"):
        MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(3, 3))]}])


def test_sparse_gradients_and_complex_matrices_raise():
    w = nn.Parameter(torch.zeros(3, 3))
    w.grad = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError) as error:
        Muon([w]).step()
    assert str(error.value) == "Muon does not support sparse gradients"
    z = nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
    z.grad = torch.ones_like(z)
    with pytest.raises(RuntimeError) as error:
        Muon([z]).step()
    assert str(error.value) == "Muon does not support complex parameters"


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1e-3), "Invalid learning rate: -0.001 (must be >= 0)"),
    (dict(lr=float("nan")), "Invalid learning rate: nan (must be >= 0)"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1 (must be >= 0)"),
    (dict(momentum=1.0), "Invalid momentum value: 1.0 (must be in [0, 1))"),
    (dict(momentum=-0.1), "Invalid momentum value: -0.1 (must be in [0, 1))"),
    (dict(eps=0.0), "Invalid eps value: 0.0 (must be > 0: it keeps a zero update from dividing by zero)"),
    (dict(ns_coefficients=(3.4, -4.7)), "Invalid ns_coefficients: (3.4, -4.7) (need three values a, b, c)"),
    (dict(ns_coefficients=(3.4, -4.7, 2.0, 0.1)),
     "Invalid ns_coefficients: (3.4, -4.7, 2.0, 0.1) (need three values a, b, c)"),
    (dict(ns_steps=100), "Invalid ns_steps: 100 (must be an integer in [0, 100))"),
    (dict(ns_steps=-1), "Invalid ns_steps: -1 (must be an integer in [0, 100))"),
    (dict(ns_steps=5.0), "Invalid ns_steps: 5.0 (must be an integer in [0, 100))"),
    (dict(adjust_lr_fn="rms"), "Invalid adjust_lr_fn: 'rms' (choose from None, 'original', 'match_rms_adamw')"),
    (dict(ns_dtype=torch.int32), "Invalid ns_dtype: torch.int32 (need a floating torch.dtype)"),
    (dict(ns_dtype="float32"), "Invalid ns_dtype: float32 (need a floating torch.dtype)"),
])
def test_invalid_hyperparameters_raise(kwargs, message):
    w = nn.Parameter(torch.zeros(2, 2))
    for params in ([w], [{"params": [w], **kwargs}]):  # a group's own override is checked too
        with pytest.raises(ValueError) as error:
            Muon(params, **(kwargs if params[0] is w else {}))
        assert str(error.value) == message
    with pytest.raises(ValueError) as error:  # and each Muon group of MuonWithAdamW
        MuonWithAdamW([{"params": [w], "use_muon": True, **kwargs}])
    assert str(error.value) == message


def test_the_edges_of_the_valid_ranges_are_accepted():
    """Zero lr, decay and momentum, no Newton-Schulz iteration at all, the largest step count: valid settings."""
    w = nn.Parameter(torch.ones(2, 2))
    edges = dict(lr=0.0, weight_decay=0.0, momentum=0.0, ns_steps=0)
    opt = Muon([w], **edges)
    w.grad = torch.eye(2)
    opt.step()
    assert torch.equal(w.detach(), torch.ones(2, 2)) and torch.equal(opt.state[w]["momentum_buffer"], torch.eye(2))
    Muon([w], ns_steps=99, ns_dtype=torch.float32).step()
    assert not torch.equal(w.detach(), torch.ones(2, 2))
    for kwargs in (edges, dict(ns_steps=99)):
        MuonWithAdamW([{"params": [w], "use_muon": True, **kwargs}])


def test_muon_with_adamw_refuses_groups_without_a_kind_saying_how_to_make_them():
    message = ("MuonWithAdamW takes parameter groups (dicts) that each say 'use_muon': True (hidden 2-D matrices) or "
               "False (AdamW: embeddings, heads, gains, biases); muon_param_groups(model, weight_decay) makes them")
    w = nn.Parameter(torch.zeros(3, 3))
    for params in ([w], [{"params": [w]}], [{"params": [w], "use_muon": "yes"}]):
        with pytest.raises(ValueError) as error:
            MuonWithAdamW(params)
        assert str(error.value) == message
    opt = MuonWithAdamW([{"params": [w], "use_muon": True}])
    with pytest.raises(ValueError) as error:
        opt.add_param_group([nn.Parameter(torch.zeros(3))])  # not a dict
    assert str(error.value) == message


# ---------------------------------------------------------------------------------------------------------------
# Defaults: those of torch.optim.Muon (and, in MuonWithAdamW's AdamW groups, those of our AdamW)

# torch.optim.Muon's signature on torch 2.13, Keller Jordan's values (https://kellerjordan.github.io/posts/muon/)
TORCH_MUON_DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                           ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None)
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True, foreach=True)


def test_muons_defaults_are_torch_muons():
    """Muon's names and defaults mirror torch.optim.Muon's (ns_dtype, ours, defaults to torch's bf16 iteration)."""
    ours, ref = Muon(matrices()).defaults, torch.optim.Muon(matrices()).defaults
    assert {k: ref[k] for k in TORCH_MUON_DEFAULTS} == TORCH_MUON_DEFAULTS
    assert ours == {**TORCH_MUON_DEFAULTS, "ns_dtype": torch.bfloat16}


def kinds(opt: MuonWithAdamW) -> tuple[dict, dict]:
    """The AdamW group and the Muon group of `opt` without their parameters."""
    adamw, muon = ({k: v for k, v in g.items() if k not in ("params", "use_muon")} for g in opt.param_groups)
    return adamw, muon


def one_of_each() -> list[dict]:
    matrix, gain = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))
    return [{"params": [gain], "use_muon": False}, {"params": [matrix], "use_muon": True}]


def test_muon_with_adamw_groups_take_adamws_and_muons_defaults():
    """Groups that name only their kind get AdamW's defaults (AdamW groups) and Muon's (Muon groups), but for the two
    documented ones: a Muon group's lr is muon_lr (Jordan's 0.02), and both kinds decay by weight_decay (0.0, AdamW's
    default, not Muon's 0.1)."""
    adamw, muon = kinds(MuonWithAdamW(one_of_each()))
    assert adamw == ADAMW_DEFAULTS
    assert {k: AdamW([nn.Parameter(torch.zeros(1))]).defaults[k] for k in ADAMW_DEFAULTS} == ADAMW_DEFAULTS
    assert muon == {**TORCH_MUON_DEFAULTS, "ns_dtype": torch.bfloat16, "lr": 0.02, "weight_decay": 0.0}


def test_muon_with_adamw_hands_each_keyword_to_its_kinds_groups_and_steps_as_muon_and_adamw_would():
    adamw_hyper = dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.05, correct_bias=False, foreach=False)
    muon_hyper = dict(momentum=0.9, nesterov=False, ns_coefficients=(3.0, -3.5, 1.5), ns_steps=3,
                      adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
    combined = one_of_each()
    opt = MuonWithAdamW(combined, **adamw_hyper, muon_lr=0.05, ns_eps=1e-4, **muon_hyper)
    adamw, muon = kinds(opt)
    assert adamw == adamw_hyper
    assert muon == {**muon_hyper, "lr": 0.05, "weight_decay": 0.05, "eps": 1e-4}

    apart = one_of_each()
    for a, b in zip(combined, apart):
        b["params"][0].data.copy_(a["params"][0])
    pair = [AdamW(apart[0]["params"], **adamw_hyper),
            Muon(apart[1]["params"], lr=0.05, weight_decay=0.05, eps=1e-4, **muon_hyper)]
    params = [g["params"][0] for g in combined]
    steps(params, [opt], 3)
    steps([g["params"][0] for g in apart], pair, 3)
    for a, b in zip(params, (g["params"][0] for g in apart)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# The split and the combined optimizer


def tiny_gpt(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_split_gives_muon_exactly_the_blocks_matrices():
    model = tiny_gpt()
    decay, no_decay, muon = muon_param_groups(model, 0.1)
    assert [g["use_muon"] for g in (decay, no_decay, muon)] == [False, False, True]
    named = dict(model.named_parameters())  # the tied LM head is word_embedding.weight: listed once
    blocks = [n for n, p in named.items() if ".gpt_layers." in n and p.ndim == 2]
    assert muon["param_names"] == blocks and len(blocks) == 2 * 6  # q, k, v, attention_dense, interm, out
    assert decay["params"] == []  # GPT-2 has no matrix outside the blocks but its (tied) embeddings
    assert set(no_decay["param_names"]) == set(named) - set(blocks)
    assert no_decay["param_names"].count("gpt.word_embedding.weight") == 1 and no_decay["weight_decay"] == 0.0
    assert all(named[n] is p for g in (decay, no_decay, muon) for n, p in zip(g["param_names"], g["params"]))


def test_split_of_a_model_with_a_head_and_frozen_weights():
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = tiny_gpt().gpt
            self.head = nn.Linear(16, 3)

    model = Classifier()
    model.gpt.gpt_layers[0].interm_dense.weight.requires_grad_(False)
    decay, no_decay, muon = muon_param_groups(model, 0.1)
    assert decay["param_names"] == ["head.weight"] and decay["weight_decay"] == 0.1  # a head is AdamW's
    assert "head.bias" in no_decay["param_names"]
    assert len(muon["params"]) == 11 and "gpt.gpt_layers.0.interm_dense.weight" not in muon["param_names"]
    with pytest.raises(ValueError, match="^Classifier has no 2-D parameters inside a module named 'layers'"):
        muon_param_groups(model, 0.1, blocks="layers")
    assert isinstance(model.gpt, GPT2Model)


def test_split_with_decaying_embeddings_decays_them_in_adamw():
    """decay_embeddings=True: the word and position embeddings join AdamW's decaying group; Muon's matrices stay."""
    model = tiny_gpt()
    _, _, muon = muon_param_groups(model, 0.1)
    decay, no_decay, muon_too = muon_param_groups(model, 0.1, decay_embeddings=True)
    assert decay["param_names"] == ["gpt.word_embedding.weight", "gpt.pos_embedding.weight"]
    assert decay["weight_decay"] == 0.1 and decay["use_muon"] is False
    assert muon_too["param_names"] == muon["param_names"]
    assert all(p.ndim == 1 for p in no_decay["params"])


class ProjectedEmbedding(nn.Embedding):
    """An embedding with a projection inside it: the projection's matrix belongs to a Linear, not to an embedding."""

    def __init__(self):
        super().__init__(20, 4)
        self.up = nn.Linear(4, 8, bias=False)


class Block(nn.Module):
    """A block with, besides its matrix, what Muon must not take: an embedding table, a 3-D weight and a gain."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.table = nn.Embedding(5, 8)
        self.mix = nn.Parameter(torch.randn(2, 8, 8))
        self.gain = nn.Parameter(torch.ones(8))
        self.embed = ProjectedEmbedding()


class Deep(nn.Module):
    """The blocks three modules down ("net.trunk.layers"), and an embedding outside them."""

    def __init__(self, block=Block):
        super().__init__()
        self.net = nn.Module()
        self.net.trunk = nn.Module()
        self.net.trunk.layers = nn.ModuleList([block(), block()])
        self.vocab = nn.Embedding(20, 8)


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_split_takes_only_the_blocks_matrices_that_are_not_embeddings_at_any_depth(decay_embeddings):
    """Muon gets exactly the 2-D weights found under a module named `blocks` however deep it sits, minus the
    weights of embeddings there (whichever group those go to); a 3-D weight there is AdamW's, and so is an
    embedding's own table, though not the matrix of a Linear inside an embedding module."""
    model = Deep()
    decay, no_decay, muon = muon_param_groups(model, 0.1, blocks="layers", decay_embeddings=decay_embeddings)
    prefixes = ["net.trunk.layers.0.", "net.trunk.layers.1."]
    assert muon["param_names"] == [f"{b}{n}" for b in prefixes for n in ("proj.weight", "embed.up.weight")]
    tables = ["vocab.weight"] + [f"{b}{n}" for b in prefixes for n in ("table.weight", "embed.weight")]
    assert (set(tables) <= set(decay["param_names"])) == decay_embeddings
    assert (set(tables) <= set(no_decay["param_names"])) != decay_embeddings
    assert {f"{b}mix" for b in prefixes} <= set(decay["param_names"])
    assert {f"{b}gain" for b in prefixes} <= set(no_decay["param_names"])
    assert sorted(decay["param_names"] + no_decay["param_names"] + muon["param_names"]) == sorted(
        n for n, _ in model.named_parameters())


class NoMatrices(nn.Module):
    """A block whose only 2-D weight is an embedding table (and a 3-D weight, a gain): nothing for Muon."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5, 8)
        self.mix = nn.Parameter(torch.randn(2, 8, 8))
        self.gain = nn.Parameter(torch.ones(8))


def test_blocks_without_matrices_of_their_own_are_refused_naming_the_model():
    with pytest.raises(ValueError, match=r"^Deep has no 2-D parameters inside a module named 'layers': Muon needs"):
        muon_param_groups(Deep(NoMatrices), 0.1, blocks="layers")
    with pytest.raises(ValueError, match=r"^Deep has no 2-D parameters"):
        muon_param_groups(Deep(NoMatrices), 0.1, blocks="layers", decay_embeddings=True)


def lm_steps(model, opt, n: int, scaler=None, seed: int = 3) -> None:
    """n steps of next-token loss on random ids (the same for every run with this seed)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 40, (4, 16), generator=g)
        logits = model(ids[:, :-1])["logits"]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()


def test_muon_with_adamw_is_muon_and_adamw_side_by_side():
    """One optimizer with both kinds of group steps exactly as a Muon and an AdamW over the same split, under one
    LambdaLR that scales both learning rates."""
    hyper = dict(betas=(0.9, 0.99), eps=1e-8)
    combined_model, pair_model = tiny_gpt(), tiny_gpt()
    combined = MuonWithAdamW(muon_param_groups(combined_model, 0.1), lr=1e-3, muon_lr=0.02,
                             ns_dtype=torch.float32, **hyper)
    *adamw_groups, muon_group = muon_param_groups(pair_model, 0.1)
    muon, adamw = Muon([muon_group], lr=0.02, ns_dtype=torch.float32), AdamW(adamw_groups, lr=1e-3, **hyper)
    schedules = [make_lr_scheduler(o, warmup_steps=2, total_steps=6, min_ratio=0.1) for o in (combined, muon, adamw)]

    class Pair:  # what the loop needs of an optimizer, for the two side by side
        def zero_grad(self, set_to_none=True):
            muon.zero_grad(set_to_none)
            adamw.zero_grad(set_to_none)

        def step(self):
            muon.step()
            adamw.step()

    for i in range(6):
        lm_steps(combined_model, combined, 1, seed=i)
        lm_steps(pair_model, Pair(), 1, seed=i)
        for s in schedules:
            s.step()
    for (name, a), b in zip(combined_model.named_parameters(), pair_model.parameters()):
        assert torch.equal(a, b), name
    assert [g["lr"] for g in combined.param_groups] == [adamw.param_groups[0]["lr"]] * 2 + [muon.param_groups[0]["lr"]]
    assert combined.param_groups[2]["lr"] / combined.param_groups[0]["lr"] == pytest.approx(20)


def test_muon_with_adamw_under_a_grad_scaler_and_through_its_state_dict():
    """GradScaler unscales every group's gradients (a power-of-two scale: bit for bit the unscaled run), and a
    state dict resumes the combined optimizer exactly."""
    models = [tiny_gpt(), tiny_gpt()]
    opts = [MuonWithAdamW(muon_param_groups(m, 0.1), lr=1e-3, muon_lr=0.02, ns_dtype=torch.float32) for m in models]
    lm_steps(models[0], opts[0], 3)
    lm_steps(models[1], opts[1], 3, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)

    buffer = io.BytesIO()
    torch.save({"model": models[0].state_dict(), "optimizer": opts[0].state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    lm_steps(models[0], opts[0], 3, seed=4)
    resumed = tiny_gpt(seed=9)
    resumed.load_state_dict(saved["model"])
    resumed_opt = MuonWithAdamW(muon_param_groups(resumed, 0.0), lr=0.1, muon_lr=0.5, ns_dtype=torch.float32)
    resumed_opt.load_state_dict(saved["optimizer"])
    lm_steps(resumed, resumed_opt, 3, seed=4)
    for a, b in zip(models[0].parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    kinds = {frozenset(s) for s in opts[0].state_dict()["state"].values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}


# ---------------------------------------------------------------------------------------------------------------
# run_pretrain.py --optimizer muon

TEXT = "".join(f"{w} the {v} of {n}, said the {w}.\n" for w, v, n in zip(
    ["king", "queen", "fool", "knight"] * 40, ["crown", "song", "sword", "word", "heart"] * 32,
    ["york", "rome", "kent"] * 54))
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "16", "--batch_size", "4",
        "--eval_iters", "2", "--log_interval", "5", "--num_samples", "0", "--threads", "1", "--warmup_iters", "3",
        "--eval_interval", "5", "--lr_decay_iters", "20", "--optimizer", "muon"]


def pretrain(data, out_dir, *extra):
    return run_pretrain.main(["--data", str(data), "--out_dir", str(out_dir), *TINY, *extra])


def test_pretraining_with_muon_trains_checkpoints_and_resumes_exactly(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT, encoding="utf-8")
    full = pretrain(data, tmp_path / "full", "--max_iters", "20")
    assert "optimizer: Muon (lr 0.02, Newton-Schulz in" in capsys.readouterr().out
    losses = [h["val_loss"] for h in full["history"]]  # steps 0, 5, ..., 20 (AdamW: 3.19 -> 3.09)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.1
    assert (tmp_path / "full" / "best").is_dir() and (tmp_path / "full" / "last").is_dir()

    pretrain(data, tmp_path / "split", "--max_iters", "10")
    resumed = pretrain(data, tmp_path / "split", "--max_iters", "20", "--resume")
    assert resumed["steps_run"] == 10 and resumed["val_loss"] == full["val_loss"]
    for (name, a), b in zip(full["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name

    with pytest.raises(ValueError, match="optimizer was 'muon', now 'adamw'"):
        pretrain(data, tmp_path / "split", "--max_iters", "30", "--resume", "--optimizer", "adamw")
    with pytest.raises(ValueError, match="muon_lr was 0.02, now 0.05"):
        pretrain(data, tmp_path / "split", "--max_iters", "30", "--resume", "--muon_lr", "0.05")


def test_a_bigram_table_has_no_matrices_for_muon(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_pretrain.parse_args(["--data", "x.txt", "--arch", "bigram", "--optimizer", "muon"])
    assert "--optimizer muon do(es) not apply" in capsys.readouterr().err
