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
from optimizer import AdamW, Muon, MuonWithAdamW, make_lr_scheduler, muon_param_groups, orthogonalize

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


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), "learning rate"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(eps=0.0), "eps"),
    (dict(ns_coefficients=(3.4, -4.7)), "ns_coefficients"),
    (dict(ns_steps=100), "ns_steps"),
    (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
    (dict(ns_dtype=torch.int32), "ns_dtype"),
])
def test_invalid_hyperparameters_raise(kwargs, match):
    w = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=match):
        Muon([w], **kwargs)
    with pytest.raises(ValueError, match=match):  # a group's own override is checked too
        Muon([{"params": [w], **kwargs}])


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
    with pytest.raises(ValueError, match="no 2-D parameters inside a module named 'layers'"):
        muon_param_groups(model, 0.1, blocks="layers")
    assert isinstance(model.gpt, GPT2Model)


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
