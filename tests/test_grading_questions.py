"""grading/questions.py: the grader's secret question per check. What the grading relies on: a seeded question is
reproducible and an unseeded one fresh; weights carry the module names and shapes the probe fills, linear weights
scaled 1/sqrt(fan_in), LayerNorm gains near 1 and biases non-zero (a submission that ignores them fails); the
LayerNorm input's variance is ~1e-6 (eps moves the output); the GELU points span [-4, 4] (exact and tanh GELU tell
apart); dropout masks keep 1 - probes.DROPOUT_P; and every answer's shape in ANSWERS is the shape the reference
computes from the question. Statistics are pooled over fixed seeds, so each assertion is deterministic."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grading import checks, questions
from grading import reference as ref
from grading.grader import CHECKS, HUB_SIZE, load_rubric
from grading.sandboxed import probes
from models.gpt2 import GPT2Model
from modules.attention import CausalSelfAttention
from modules.gpt2_layer import GPT2Layer

B, T, D, H, L, V = 3, probes.T, probes.D, probes.H, probes.L, probes.V
TOLERANCE = load_rubric()["tolerance"]  # exact / close: an output further than "close" from the reference fails
SEEDS = range(8)


def pooled(check: str, keep, seeds=SEEDS) -> torch.Tensor:
    """The values of every tensor of `check`'s question whose name `keep` accepts, over `seeds`, flattened."""
    return torch.cat([x.flatten() for s in seeds for k, x in questions.ask(check, s).items() if keep(k)])


# ---- every question -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_each_check_is_asked_finite_float32_contiguous_tensors(check):
    q = questions.ask(check, 0)
    assert q and set(questions.ANSWERS[check]), check
    for k, x in q.items():
        assert x.dtype == torch.float32 and x.is_contiguous() and bool(torch.isfinite(x).all()), (check, k)


def test_an_unknown_check_is_asked_nothing():
    assert questions.ask("attn") == {} and questions.ask("attn", seed=3) == {}


@pytest.mark.parametrize("check", CHECKS)
def test_a_seeded_question_is_reproducible_whatever_torchs_global_seed(check):
    """ask(check, seed) draws from its own generator only: torch's global random state (which a submission's code
    and torch.manual_seed in the probe change) does not enter the question."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = questions.ask(check, 11)
        torch.manual_seed(1)
        b = questions.ask(check, 11)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("check", CHECKS)
def test_unseeded_questions_are_fresh_and_not_set_by_torchs_seed(check):
    """A secret seed per ask, from `secrets`: two asks share no tensor, even with torch's global seed reset between."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = questions.ask(check)
        torch.manual_seed(0)
        b = questions.ask(check)
    assert a.keys() == b.keys()
    assert [k for k in a if torch.equal(a[k], b[k])] == []
    other = questions.ask(check, 12)
    assert [k for k in a if torch.equal(questions.ask(check, 11)[k], other[k])] == []


# ---- weights: the names and shapes the probe installs, their scale ----------------------------------------------

def module_for(check: str) -> torch.nn.Module:
    cfg = ref.config(D, H, n_layer=L, vocab_size=V, n_positions=probes.P, n_inner=questions.INNER)
    return {"attention": CausalSelfAttention, "layer": GPT2Layer, "model": GPT2Model}[check](cfg)


@pytest.mark.parametrize("check", ["attention", "layer", "model"])
def test_the_weights_are_exactly_the_state_of_the_module_the_check_grades(check):
    """Every weight the grader draws is a parameter of this project's module under the course's name, with its shape,
    and every parameter is drawn (none left at a module's default init)."""
    w = checks.weights_of(questions.ask(check, 0))
    state = module_for(check).state_dict()
    assert {k: tuple(x.shape) for k, x in w.items()} == {k: tuple(x.shape) for k, x in state.items()}


def test_embedding_weights_are_the_models_embeddings():
    state = module_for("model").state_dict()
    q = questions.ask("embed", 0)
    assert {k: tuple(x.shape) for k, x in checks.weights_of(q).items()} == \
        {k: tuple(state[k].shape) for k in ("word_embedding.weight", "pos_embedding.weight")}


def test_linear_weights_are_scaled_by_one_over_sqrt_fan_in_and_biases_are_not_zero():
    """Each projection keeps its input's scale (std(W) * sqrt(fan_in) ~ 1), so the layers' outputs stay O(1) and the
    absolute tolerances mean the same everywhere; biases of std ~0.2, so a dropped or mis-mapped bias shows."""
    for name in ("self_attention.query", "self_attention.key", "self_attention.value", "attention_dense",
                 "interm_dense", "out_dense"):
        w = pooled("layer", lambda k, n=name: k == f"{n}.weight")
        fan_in = questions.ask("layer", 0)[f"{name}.weight"].shape[1]
        assert 0.9 < float(w.std()) * fan_in ** 0.5 < 1.1 and abs(float(w.mean())) < 0.05 / fan_in ** 0.5, name
        b = pooled("layer", lambda k, n=name: k == f"{n}.bias")
        assert 0.15 < float(b.std()) < 0.25 and float(b.abs().max()) < 1.0, (name, float(b.std()))


@pytest.mark.parametrize("check", ["layer", "model"])
def test_layer_norm_gains_are_near_one_and_biases_non_zero(check):
    """LayerNorm gains near 1 (positive, ~1 +- 0.2: the eps is read off gain * (x - mean) / sqrt(var + eps)), biases
    of std ~0.2; each LayerNorm separately, pooled over seeds."""
    names = [k[:-len(".weight")] for k in questions.ask(check, 0) if k.endswith("layer_norm.weight")]
    assert len(names) == (2 if check == "layer" else 2 * L + 1), names
    for name in names:
        gain = pooled(check, lambda k, n=name: k == f"{n}.weight")
        assert bool((gain > 0).all()) and float((gain - 1).abs().max()) < 1.0, name
        assert abs(float(gain.mean()) - 1) < 0.1 and 0.15 < float(gain.std()) < 0.25, (name, gain.mean(), gain.std())
        bias = pooled(check, lambda k, n=name: k == f"{n}.bias")
        assert abs(float(bias.mean())) < 0.1 and 0.15 < float(bias.std()) < 0.25, (name, bias.mean(), bias.std())
        assert float(bias.abs().max()) < 1.0, name


@pytest.mark.parametrize("check", ["layer", "model"])
def test_a_layer_norm_that_ignores_its_gain_or_bias_fails_on_the_question(check):
    q = questions.ask(check, 0)
    x = q["x"] if check == "layer" else q["head.input"]
    for name in [k[:-len(".weight")] for k in q if k.endswith("layer_norm.weight")]:
        gain, bias = q[f"{name}.weight"], q[f"{name}.bias"]
        want = F.layer_norm(x, (D,), gain, bias, 1e-5)
        for wrong in (F.layer_norm(x, (D,), None, bias, 1e-5), F.layer_norm(x, (D,), gain, None, 1e-5)):
            assert checks.max_err(wrong, want) > TOLERANCE["close"], name


# ---- the measuring inputs: LayerNorm eps, GELU --------------------------------------------------------------------

@pytest.mark.parametrize("check", ["layer", "model"])
def test_the_layer_norm_input_has_variance_near_1e_6_where_eps_moves_the_output(check):
    for s in SEEDS:
        q = questions.ask(check, s)
        x = q["ln.input"]
        assert x.shape == questions.ANSWERS["layer"]["ln.attention_layer_norm"], x.shape
        var = x.double().var(-1, unbiased=False)
        assert bool(((var > 3e-7) & (var < 3e-6)).all()), (s, var)
        gain, bias = q["final_layer_norm.weight" if check == "model" else "out_layer_norm.weight"], \
            q["final_layer_norm.bias" if check == "model" else "out_layer_norm.bias"]
        # eps 1e-5 against none: the output shrinks ~3x, far past "close", so a wrong eps fails
        assert checks.max_err(F.layer_norm(x, (D,), gain, bias, 0.0), F.layer_norm(x, (D,), gain, bias, 1e-5)) > 0.5


@pytest.mark.parametrize("check", ["layer", "model"])
def test_the_gelu_points_span_minus_4_to_4_jittered_and_tell_exact_from_tanh(check):
    grid = torch.linspace(-4, 4, questions.GELU_POINTS)
    seen = []
    for s in SEEDS:
        x = questions.ask(check, s)["gelu.input"]
        assert x.shape == questions.ANSWERS["layer"]["gelu"], x.shape
        assert -4 <= float(x.min()) < -3.99 and 4 <= float(x.max()) < 4.01, (float(x.min()), float(x.max()))
        jitter = x - grid
        assert bool((jitter >= 0).all()) and float(jitter.max()) < 0.01 and float(jitter.std()) > 0.002, s
        assert bool((x.diff() > 0).all())
        assert checks.gelu_of(F.gelu(x), x) == "exact" and checks.gelu_of(F.gelu(x, approximate="tanh"), x) == "tanh"
        seen.append(x)
    assert not torch.equal(seen[0], seen[1])  # jittered per question: a submission cannot tabulate the points


# ---- training-mode inputs ---------------------------------------------------------------------------------------

def test_dropout_masks_are_binary_distinct_and_keep_one_minus_the_probes_rate():
    p = probes.DROPOUT_P
    kept = n = 0
    for s in SEEDS:
        q = questions.ask("layer", s)
        a, b = q["train.mask_attention"], q["train.mask_out"]
        assert a.shape == b.shape == questions.ANSWERS["layer"]["train"]
        assert set(a.unique().tolist()) == set(b.unique().tolist()) == {0.0, 1.0} and not torch.equal(a, b)
        for m in (a, b):
            assert checks.kept_fraction_problem(int(m.sum()), m.numel(), p) == "", s
            kept, n = kept + int(m.sum()), n + m.numel()
    assert abs(kept / n - (1 - p)) < 0.02, kept / n


def test_an_entry_is_dropped_exactly_when_its_uniform_draw_is_below_p(monkeypatch):
    """P(u < p) = p for u uniform on [0, 1), float32 draws included (with `u > p` kept, the draw u == p would be
    dropped too: a rate 2^-24 above p)."""
    p, step = probes.DROPOUT_P, 2.0 ** -24
    u = torch.tensor([0.0, p - step, p, p + step, 1 - step])
    monkeypatch.setattr(questions.torch, "rand", lambda *args, **kwargs: u.clone())
    assert questions.dropout_mask(torch.Generator(), u.shape).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_the_training_attention_input_starts_with_one_hot_positions():
    """Through forward(), value copies the input's first T features into every head: with one-hot positions there,
    the output of head h at query i is row i of its probability matrix (the rest of the input is random). Through
    attention(key, query, value, mask), query and key are given per batch row and head, (B, h, T, hd), as the course's
    attention() takes them."""
    for s in SEEDS:
        q = questions.ask("attention", s)
        assert q["train.q"].shape == q["train.k"].shape == (B, H, T, D // H), (q["train.q"].shape, q["train.k"].shape)
        x = q["train.x"]
        assert x.shape == (B, T, D) and torch.equal(x[..., :T], torch.eye(T).expand(B, T, T))
        rest = x[..., T:]
        assert 0.7 < float(rest.std()) < 1.3 and not torch.equal(rest[0], rest[1]), s
        w = {k: v for k, v in q.items() if k.split(".")[0] in ("query", "key")}
        w["value.weight"], w["value.bias"] = torch.zeros(D, D), torch.zeros(D)
        for h in range(H):
            w["value.weight"][h * (D // H) + torch.arange(T), torch.arange(T)] = 1.0
        out = ref.f_attention(x, w, checks.MASKS["right"], H).view(B, T, H, D // H).transpose(1, 2)[..., :T]
        assert checks.max_err(out, checks.reference_probs(q, "forward()")) < 1e-6, s


# ---- ids ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("check, high, seeds", [("embed", V, range(60)), ("model", V, range(60)),
                                                ("from_pretrained", 1000, range(1000))])
def test_token_ids_are_whole_numbers_over_the_whole_range(check, high, seeds):
    """embed and model: any id of the tiny vocabulary, 0 and V-1 included; from_pretrained: the first 1000 ids of
    GPT-2's vocabulary."""
    ids = pooled(check, lambda k: k == "ids", seeds)
    assert questions.ask(check, 0)["ids"].shape == (B, T)
    assert torch.equal(ids, ids.round()) and int(ids.min()) == 0 and int(ids.max()) == high - 1


# ---- the head and AdamW questions -------------------------------------------------------------------------------

def test_the_second_word_embedding_tells_a_tied_head_from_an_untied_one():
    q = questions.ask("model", 0)
    h, e, e2 = q["head.input"], q["word_embedding.weight"], q["head.word_embedding"]
    assert e2.shape == e.shape and h.shape == (B, T, D)
    assert checks.max_err(F.linear(h, e2), F.linear(h, e)) > TOLERANCE["close"]
    spread = pooled("model", lambda k: k == "head.word_embedding")
    assert 0.9 < float(spread.std()) < 1.1  # like word_embedding.weight: N(0, 1)


def test_adamw_question_is_200_batches_of_16_and_targets_are_the_stated_functions():
    """200 steps (the check's words: "200 steps against torch.optim.AdamW") of 16 samples of the net's 4 inputs;
    y = (x0 * x1, x2 - x3); the net starts from the question's init, every init tensor used."""
    for s in SEEDS:
        q = questions.ask("adamw", s)
        x, y = q["x"], q["y"]
        assert x.shape == (200, 16, 4) and y.shape == (200, 16, 2), (x.shape, y.shape)
        assert torch.equal(y[..., 0], x[..., 0] * x[..., 1]) and torch.equal(y[..., 1], x[..., 2] - x[..., 3])
        net = probes.adamw_net(q)
        assert {f"init.{n}" for n, _ in net.named_parameters()} == {k for k in q if k.startswith("init.")}
        assert all(torch.equal(p, q[f"init.{n}"]) for n, p in net.named_parameters())
        assert net(x[0]).shape == y[0].shape


def test_adamw_initial_weights_are_of_std_one_half():
    """Each init tensor ~N(0, 0.25): the tanh units work in their curved range and the decayed group's weights are
    large enough that a mis-scaled decay moves them past the tolerance (probes.adamw_groups)."""
    for name in ("init.0.weight", "init.0.bias", "init.2.weight", "init.2.bias"):
        w = pooled("adamw", lambda k, n=name: k == n, range(40))
        assert 0.4 < float(w.std()) < 0.6 and float(w.abs().max()) < 2.5, (name, float(w.std()))


# ---- ANSWERS: the shapes the references have -------------------------------------------------------------------

def reference_shapes(check: str, q: dict) -> dict:
    """name -> the shape of what the check compares that answer with, computed from the question as the check does."""
    w = checks.weights_of(q)
    masks = checks.MASKS
    if check == "attention":
        out = {f"forward.{c}": ref.attention(w, q["x"], m, H).shape for c, m in masks.items()}
        out["attention.left"] = ref.f_attention(q["x"], w, masks["left"], H).shape
        out["probs.eval"] = checks.reference_probs(q, "attention()").shape
        out["probs.train"] = checks.reference_probs(q, "forward()").shape
        return out
    if check == "layer":
        out = {f"forward.{c}": ref.layer(w, q["x"], m, H, "tanh", 1e-5, 1e-5).shape for c, m in masks.items()}
        out["add"] = (q["add.input"] + F.linear(q["add.output"], w["attention_dense.weight"])).shape
        drop = (q["train.mask_attention"], q["train.mask_out"], probes.DROPOUT_P)
        out["train"] = ref.f_layer(q["x"], w, masks["nopad"], H, "tanh", 1e-5, 1e-5, drop=drop).shape
        out["gelu"] = F.gelu(q["gelu.input"]).shape
    elif check == "model":
        layers = [dict(probes.STAND_IN) for _ in range(L)]
        h, last = ref.f_model(q["ids"].long(), masks["right"], w, H, layers, 1e-5, "tanh")
        out = {"last_hidden_state": h.shape, "last_token": last.shape,
               "logits": F.linear(q["head.input"], w["word_embedding.weight"]).shape,
               "logits.tied": F.linear(q["head.input"], q["head.word_embedding"]).shape}
        for k in w:  # interm_af measured per layer, on the GELU points
            if k.endswith("interm_dense.weight"):
                out[f"gelu.{k[:-len('.interm_dense.weight')]}"] = F.gelu(q["gelu.input"]).shape
    elif check == "embed":
        ids = q["ids"].long()
        want = F.embedding(ids, w["word_embedding.weight"]) + w["pos_embedding.weight"][: ids.shape[1]]
        return {"embed": want.shape, "embed.train": want.shape}
    elif check == "adamw":
        out = {f"torch.{n}": p.shape for n, p in probes.adamw_net(q).named_parameters()}
        out["course.weight"] = torch.nn.Linear(3, 2, bias=False).weight.shape  # the course's optimizer_test model
        return out
    else:  # from_pretrained: the hub checkpoint's outputs on the question's ids
        return {"last_hidden_state": (*q["ids"].shape, HUB_SIZE["n_embd"]), "last_token": (B, HUB_SIZE["n_embd"])}
    for k in w:  # each LayerNorm measured on the small-variance input
        if k.endswith("layer_norm.weight"):
            name = k[:-len(".weight")]
            out[f"ln.{name}"] = F.layer_norm(q["ln.input"], (D,), w[k], w[f"{name}.bias"], 1e-5).shape
    return out


@pytest.mark.parametrize("check", CHECKS)
def test_each_answer_has_the_shape_of_its_reference(check):
    q = questions.ask(check, 0)
    want = {k: tuple(s) for k, s in reference_shapes(check, q).items()}
    tables = [questions.ANSWERS[check]] + ([questions._model_answers()] if check == "model" else [])
    for table in tables:  # ANSWERS["model"] is built by _model_answers
        assert {k: tuple(s) for k, s in table.items()} == want


def test_each_interface_contract_names_outputs_the_grader_asks_for_with_the_shape_it_says():
    """questions.CONTRACTS in the course's symbols equals ANSWERS' shapes; each names a rubric part; the unmerged
    heads are the only other shape the grader reads (attention's, (B, h, T, hd))."""
    symbols = {"B": questions.B, "T": questions.T, "C": questions.D, "V": questions.V}
    rubric = load_rubric()["checks"]
    for check, contracts in questions.CONTRACTS.items():
        for key, (part, function, shape) in contracts.items():
            names = [n for n in questions.ANSWERS[check] if n == key or (key.endswith(".") and n.startswith(key))]
            assert names and part in rubric[check] and function, (check, key)
            want = tuple(symbols[s] for s in shape.strip("()").split(", "))
            for name in names:
                assert questions.ANSWERS[check][name] == want and questions.contract(check, name)[0] == part
    assert questions.contract("layer", "ln.out_layer_norm") is None and questions.contract("adamw", "x") is None
    for name, shape in questions.UNMERGED["attention"].items():
        assert questions.contract("attention", name) and shape == (questions.B, questions.H, questions.T, questions.HD)
