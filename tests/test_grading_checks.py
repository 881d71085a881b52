"""grading/checks.py's verdicts, driven in this process (no sandbox): each check given the answers of a correct
submission (the reference's own outputs on the grader's question) scores full marks with nothing to report, and
given the answers of a submission with one typical bug it names that bug, costs the parts it should, and says so in
the grader's words. Fast: the questions are seeded and the answers computed here."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grading import checks, questions
from grading import reference as ref
from grading.grader import load_rubric
from grading.sandbox import Run
from grading.sandboxed import probes

MASKS, H, P, D = checks.MASKS, probes.H, probes.DROPOUT_P, probes.D


def scorer() -> checks.Scorer:
    """The default rubric's scorer, built in each test (not at import, so the test exercises its construction)."""
    return checks.Scorer(load_rubric())


def ok(tensors: dict, given: dict, values: dict | None = None, notes=()) -> Run:
    return Run(info={"status": "ok", "message": "", "notes": list(notes), "values": values or {}},
               tensors=tensors, given=given, output="printed")


def keep_mask(shape, seed=0) -> torch.Tensor:
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= P).float()


def summary(result: checks.CheckResult) -> dict:
    return {p.name: (p.status, p.points) for p in result.parts}


def shift_forward(t: dict, by: float) -> None:
    """Every padding case's forward() answer off by `by`, in place."""
    for c in MASKS:
        t[f"forward.{c}"] = t[f"forward.{c}"] + by


# ---- attention ------------------------------------------------------------------------------------------------------

def attention_answers(g: dict, bugs=(), route="attention()") -> dict:
    w = {k: v for k, v in g.items() if k.split(".")[0] in ("query", "key", "value")}
    t = {f"forward.{c}": ref.f_attention(g["x"], w, m, H, bugs) for c, m in MASKS.items()}
    t["attention.left"] = t["forward.left"]
    pe = checks.reference_probs(g, route, tuple(b for b in bugs if b in checks.PROBS_BUGS))
    t["probs.eval"], t["probs.train"] = pe, pe * keep_mask(pe.shape) / (1 - P)
    return t


@pytest.fixture(scope="module")
def attention_q():
    return questions.ask("attention", 1)


def test_a_correct_attention_scores_full_marks(attention_q):
    result = checks.check_attention(ok(attention_answers(attention_q), attention_q, notes=["a note"]), scorer())
    assert summary(result) == {"forward": ("pass", 8.0), "attention": ("pass", 4.0), "training": ("pass", 4.0)}
    assert (result.verdict, result.score, result.max_score, result.diagnosis) == ("pass", 16.0, 16.0, "")
    assert result.messages == ["a note"] and result.output == "printed"
    training = result.parts[2]
    assert training.message == ("training mode: no masked position gets probability; dropout acts on the "
                                "probabilities (attention())")
    doc = result.to_dict()
    assert doc["score"] == 16.0 and doc["max_score"] == 16.0 and doc["verdict"] == "pass"
    assert doc["parts"][0].pop("error") < 1e-6
    assert doc["parts"][0] == {"name": "forward", "max": 8.0, "points": 8.0, "status": "pass", "message": ""}
    assert set(doc) == {"name", "score", "max_score", "verdict", "diagnosis", "diagnosis_key", "messages", "info",
                        "parts", "output"} and doc["output"] == "printed" and doc["name"] == "attention"


def test_attention_without_attention_is_graded_through_forward(attention_q):
    t = attention_answers(attention_q)
    del t["attention.left"]
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert result.parts[1].message == checks.THROUGH_FORWARD and result.parts[1].status == "pass"
    shift_forward(t, 0.5)
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert (result.parts[1].status, result.parts[1].message) == (
        "fail", f"attention() (through forward()) differs from the reference (max error 0.5) {checks.THROUGH_FORWARD}")


@pytest.mark.parametrize("bug", ref.ATTENTION_BUGS)
def test_an_attention_bug_is_named_and_costs_forward_and_attention(attention_q, bug):
    result = checks.check_attention(ok(attention_answers(attention_q, (bug,)), attention_q), scorer())
    assert result.diagnosis_key == bug and result.diagnosis == ref.BUGS[bug]
    forward, attention, training = result.parts
    assert (forward.status, forward.points, attention.points) == ("fail", 0.0, 0.0)
    assert forward.message.startswith("forward() (no padding, right and left padding) differs from the reference "
                                      "(max error "), forward.message
    assert attention.message.startswith("attention() differs from the reference (max error ")
    # training is judged on that bug's probabilities: only a missing causal mask shows there too (future keys)
    if bug == "no_causal":
        assert training.message.startswith("in training mode masked positions get probability (up to ")
        assert (training.status, result.verdict, result.score) == ("fail", "fail", 0.0)
    else:
        assert (training.status, result.verdict, result.score) == ("pass", "partial", 4.0)


def test_an_attention_bug_is_named_whatever_the_padding_holds(attention_q):
    """The diagnosis, like the score, looks at the real positions only."""
    t = attention_answers(attention_q, ("no_scale",))
    for c, m in MASKS.items():
        t[f"forward.{c}"] = t[f"forward.{c}"].masked_fill(~m.bool()[..., None], 123.0)
    t["attention.left"] = t["forward.left"]
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert result.diagnosis_key == "no_scale" and result.diagnosis == ref.BUGS["no_scale"]


def test_attention_off_by_a_little_is_close_without_a_bug_named(attention_q):
    t = attention_answers(attention_q)
    shift_forward(t, 1e-3)
    t["attention.left"] = t["forward.left"]
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert summary(result)["forward"] == ("close", 4.0) and summary(result)["attention"] == ("close", 2.0)
    assert result.diagnosis_key == "" and result.diagnosis.startswith("no typical bug matches exactly (closest: ")
    assert result.parts[0].message.startswith("forward() (no padding, right and left padding) close but not exact "
                                              "(max error 0.001 > 1e-05): look for a small deviation")
    assert (result.verdict, result.score) == ("partial", 10.0)


def training_of(g, t, values=None) -> tuple[checks.Part, checks.CheckResult]:
    result = checks.check_attention(ok(t, g, values), scorer())
    return result.parts[2], result


def test_attention_training_without_dropout_is_named(attention_q):
    t = attention_answers(attention_q)
    t["probs.train"] = t["probs.eval"].clone()
    part, result = training_of(attention_q, t)
    assert (part.status, part.points) == ("fail", 0.0)
    assert part.message == ("in training mode the attention probabilities are not dropped out (probed through "
                            "attention(), dropout p=0.5)")
    assert result.diagnosis_key == "no_attention_dropout" and result.diagnosis == checks.BUGS["no_attention_dropout"]


def test_attention_dropout_before_the_softmax_leaks_and_is_named(attention_q):
    g = attention_q
    t = attention_answers(g)
    q, k = g["train.q"], g["train.k"]
    scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5) * keep_mask((3, H, 7, 7), 1) / (1 - P)
    allowed = ref.bool_mask(MASKS["right"])
    t["probs.train"] = F.softmax(scores.masked_fill(~allowed, 0.0), -1)  # masked keys get probability
    part, result = training_of(g, t)
    leak = float(t["probs.train"][~allowed.expand_as(t["probs.train"]) & MASKS["right"].bool()[:, None, :, None]].max())
    assert part.message == (f"in training mode masked positions get probability (up to {leak:.2g}); dropout is not "
                            f"applied to the probabilities after the softmax (kept entries are not p/(1-p)) (probed "
                            f"through attention(), dropout p=0.5)")
    assert result.diagnosis_key == "dropout_before_softmax"


def test_attention_dropout_on_minus_inf_scores_is_a_leak(attention_q):
    """Dropout applied to scores already at -inf gives NaN at the masked keys (0 * -inf): that is a leak, not 0."""
    t = attention_answers(attention_q)
    masked = ~ref.bool_mask(MASKS["right"]).expand_as(t["probs.train"])
    t["probs.train"] = t["probs.train"].masked_fill(masked, float("nan"))
    part, _ = training_of(attention_q, t)
    assert (part.status, part.points, part.message) == (
        "fail", 0.0, "in training mode masked positions get probability (up to inf) (probed through attention(), "
                     "dropout p=0.5)")


def test_attention_dropout_at_the_wrong_rate_is_found(attention_q):
    t = attention_answers(attention_q)
    pe = t["probs.eval"]
    t["probs.train"] = pe * (torch.rand(pe.shape, generator=torch.Generator().manual_seed(2)) >= 0.1) / (1 - P)
    part, result = training_of(attention_q, t)
    assert part.status == "fail" and part.message.startswith(
        "in training mode the attention probabilities are not dropped out at rate p: ")
    assert part.message.endswith("(6 standard deviations) (probed through attention(), dropout p=0.5)")
    assert result.diagnosis_key == ""
    kept, n = (int(x) for x in part.message.split(": ")[1].split(" entries kept")[0].split(" of "))
    assert kept > 0.8 * n  # the entries it kept (about 90%), not the ones it dropped


def test_attention_training_is_not_graded_on_eval_probabilities_not_the_references(attention_q):
    t = attention_answers(attention_q)
    t["probs.eval"] = t["probs.eval"] + 1e-3
    part, _ = training_of(attention_q, t)
    not_graded = ("fail", 0.0, "training mode not graded: the eval-mode attention probabilities (probed through "
                               "attention()) are not the reference's")
    assert (part.status, part.points, part.message) == not_graded
    del t["probs.train"]
    assert training_of(attention_q, t)[0].status == "fail"
    t = attention_answers(attention_q)  # right eval-mode probabilities, no training-mode ones
    del t["probs.train"]
    part, _ = training_of(attention_q, t)
    assert (part.status, part.points, part.message) == not_graded


def off_eval(t: dict, by: float) -> dict:
    """The answers with eval-mode probabilities off by `by` where they are not 0 (masked keys stay at 0) and
    training-mode ones dropped out from those."""
    pe = t["probs.eval"] + by * (t["probs.eval"] > 0)
    return {**t, "probs.eval": pe, "probs.train": pe * keep_mask(pe.shape) / (1 - P)}


@pytest.mark.parametrize("bugs, graded", [((), False), (("no_scale",), True), (("softmax_axis",), True),
                                          (("merge_no_transpose",), False)])
def test_eval_probabilities_are_held_to_1e5_or_to_a_named_bugs_match(attention_q, bugs, graded):
    """The eval-mode probabilities must be the reference's within 1e-5; a forward() diagnosed with a bug of the
    probabilities is held to that bug's probabilities within MATCH (1e-4), as the diagnosis is; a bug elsewhere
    (merging the heads) leaves the probabilities to the 1e-5 of a correct one."""
    t = off_eval(attention_answers(attention_q, bugs), 5e-5)
    part, result = training_of(attention_q, t)
    assert result.diagnosis_key == (bugs[0] if bugs else "")
    assert part.status == ("pass" if graded else "fail"), part.message
    assert part.message.startswith("training mode not graded") != graded


def test_attention_dropout_is_judged_on_the_real_queries_only(attention_q):
    """Padded query rows are not graded: left undropped there, with the real rows' kept count near the edge of
    KEPT_Z standard deviations, the training part passes (counting the padded rows in would put it past)."""
    t = attention_answers(attention_q)
    pe = t["probs.eval"]
    real_q = MASKS["right"].bool()[:, None, :, None].expand_as(pe)
    live = real_q & ref.bool_mask(MASKS["right"]).expand_as(pe) & (pe > 0)
    n = int(live.sum())
    keep_n = int(n * (1 - P) + checks.KEPT_Z * math.sqrt(n * P * (1 - P))) - 1
    keep = torch.zeros(n)
    keep[:keep_n] = 1.0
    keep = keep[torch.randperm(n, generator=torch.Generator().manual_seed(3))]
    pt = pe.clone()  # padded query rows: as in eval mode
    pt[live] = pe[live] * keep / (1 - P)
    part, result = training_of(attention_q, {**t, "probs.train": pt})
    assert (part.status, result.diagnosis_key) == ("pass", ""), part.message
    assert int((~real_q & (pe > 0)).sum()) > 40  # what the padded rows would add


def test_attention_training_through_forward_uses_the_forward_route(attention_q):
    t = attention_answers(attention_q, route="forward()")
    part, _ = training_of(attention_q, t, {"probs_route": "forward()"})
    assert part.status == "pass" and part.message.endswith("(forward())")
    part, _ = training_of(attention_q, t)  # the attention() route's reference: other inputs
    assert part.status == "fail" and "(probed through attention())" in part.message


# ---- kept fraction, max_err, Scorer -------------------------------------------------------------------------------

def test_kept_fraction_problem_within_six_standard_deviations():
    assert checks.kept_fraction_problem(0, 0, P) == "no entry to judge the dropout on"
    assert checks.kept_fraction_problem(500, 1000, P) == ""
    assert checks.kept_fraction_problem(80, 100, 0.5) == checks.kept_fraction_problem(20, 100, 0.5) == ""  # 6 sd: 30
    assert checks.kept_fraction_problem(81, 100, 0.5) == "81 of 100 entries kept where dropout with p=0.5 keeps 50 " \
                                                         "+- 30 (6 standard deviations)"
    sd = (1000 * P * (1 - P)) ** 0.5
    assert checks.kept_fraction_problem(int(500 + 6 * sd), 1000, P) == ""
    assert checks.kept_fraction_problem(math.ceil(500 - 6 * sd), 1000, P) == ""
    assert checks.kept_fraction_problem(math.floor(500 - 6 * sd), 1000, P).startswith("405 of 1000 entries kept")
    assert checks.kept_fraction_problem(int(500 + 6 * sd) + 1, 1000, P) == \
        "595 of 1000 entries kept where dropout with p=0.5 keeps 500 +- 95 (6 standard deviations)"
    assert checks.kept_fraction_problem(1000, 1000, P).startswith("1000 of 1000 entries kept")
    assert checks.kept_fraction_problem(0, 1000, P).startswith("0 of 1000 entries kept")


def test_max_err_over_rows_missing_and_non_finite():
    a, b = torch.zeros(2, 3, 1), torch.zeros(2, 3, 1)
    a[1, 2] = 5.0
    rows = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert checks.max_err(a, b) == 5.0 and checks.max_err(a, b, rows) == 0.0
    assert checks.max_err(None, b) == checks.max_err(a[:1], b) == float("inf")
    a[0, 0] = float("nan")
    assert checks.max_err(a, b) == float("inf")
    assert checks.max_err(torch.zeros(0), torch.zeros(0)) == 0.0


def test_scorer_bounds_are_inclusive_and_messages_name_the_part():
    for err, status, points in ((1e-5, "pass", 8.0), (1e-2, "close", 4.0), (0.011, "fail", 0.0)):
        part = checks.Part("forward", 8.0)
        scorer().score(part, err, what="forward()")
        assert (part.status, part.points, part.error) == (status, points, err)
    part = checks.Part("forward", 8.0)
    scorer().score(part, 0.5, what="forward()")
    assert part.message == "forward() differs from the reference (max error 0.5)"
    scorer().score(part, float("inf"), what="forward()")
    assert part.message == "forward() has the wrong shape or non-finite values"
    scorer().score(part, 1e-4, exact=1e-3, what="x")
    assert part.status == "pass"
    assert [(p.name, p.max) for p in scorer().parts("layer")] == [("add", 3.0), ("forward", 9.0), ("training", 2.0)]


# ---- failed runs, answers, part failures ---------------------------------------------------------------------------

@pytest.mark.parametrize("run, status, message", [
    (Run(problem="timed out after 5 s"), "error", "timed out after 5 s"),
    (Run(info={"status": "not_implemented", "message": "TODO"}), "not implemented", "not implemented: TODO"),
    (Run(info={"status": "error", "message": "ValueError: x"}), "error", "the submission raised ValueError: x"),
    (Run(info={"status": "weird"}), "error", "the check produced no result"),
    (Run(info={"status": "not_implemented"}), "not implemented", "not implemented: "),
    (Run(info={"status": "error"}), "error", "the submission raised "),
])
def test_a_run_without_a_result_scores_zero_and_says_why(run, status, message):
    run.findings = ["wrote /tmp/x"]
    result = checks.check_embed(run, scorer())
    assert [(p.status, p.points, p.message) for p in result.parts] == [(status, 0.0, message)] * 2
    assert result.verdict == status and result.messages == [message, "finding: wrote /tmp/x"]


def test_a_device_finding_is_reported_with_the_error():
    run = Run(info={"status": "error", "message": "RuntimeError: cuda", "device": "asked for a GPU"})
    result = checks.check_embed(run, scorer())
    assert result.messages == ["the submission raised RuntimeError: cuda", "finding: asked for a GPU"]


def test_unasked_or_misshapen_answers_are_dropped_and_said():
    g = questions.ask("embed", 0)
    want = F.embedding(g["ids"].long(), g["word_embedding.weight"]) + g["pos_embedding.weight"][:7]
    t = {"embed": want, "embed.train": want[:, :3], **{f"extra{i}": torch.zeros(1) for i in range(5)}}
    result = checks.check_embed(ok(t, g), scorer())
    contract = ("finding: the interface contract: GPT2Model.embed (training mode) returns shape (3, 3, 32), not the "
                "course's (B, T, C) = (3, 7, 32): training scores 0")
    assert result.messages == [
        "finding: the check returned 5 tensor(s) the grader did not ask for or of the wrong shape, ignored: "
        "extra0 (1,), extra1 (1,), extra2 (1,), extra3 (1,), extra4 (1,)", contract]
    assert result.parts[1].message == ("GPT2Model.embed (training mode) returns shape (3, 3, 32), not the course's "
                                       "(B, T, C) = (3, 7, 32) (the interface contract)")
    t["extra5"] = torch.zeros(2)  # six: five named, then "..."
    assert checks.check_embed(ok(t, g), scorer()).messages == [
        "finding: the check returned 6 tensor(s) the grader did not ask for or of the wrong shape, ignored: "
        "extra0 (1,), extra1 (1,), extra2 (1,), extra3 (1,), extra4 (1,) ...", contract]


# ---- the interface contract: an output of another shape than the course's costs its part, naming the shape ------

def unmerge(y: torch.Tensor) -> torch.Tensor:
    """(B, T, C) -> (B, h, T, hd): the heads as attention() holds them before the merge."""
    return y.view(y.shape[0], y.shape[1], H, -1).transpose(1, 2)


def test_attention_returning_the_heads_unmerged_loses_forward_and_attention_and_names_the_shape(attention_q):
    """forward() and attention() both (B, h, T, hd) (the starter's forward() returns attention()'s output, so the
    student's own layer breaks on it): right values once merged, but the broken contract costs both parts; the
    dropout in training mode is graded on its own."""
    t = attention_answers(attention_q)
    for name in ("forward.nopad", "forward.right", "forward.left", "attention.left"):
        t[name] = unmerge(t[name])
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert summary(result) == {"forward": ("fail", 0.0), "attention": ("fail", 0.0), "training": ("pass", 4.0)}
    assert (result.verdict, result.diagnosis_key, result.diagnosis) == ("partial", "heads_unmerged",
                                                                        checks.BUGS["heads_unmerged"])
    forward, attention, _ = result.parts
    assert forward.message == ("CausalSelfAttention.forward returns the heads unmerged, (B, h, T, hd) = (3, 4, 7, 8), "
                               "not the course's (B, T, C) = (3, 7, 32) (the interface contract)")
    assert attention.message == ("attention() returns the heads unmerged, (B, h, T, hd) = (3, 4, 7, 8), not the "
                                 "course's (B, T, C) = (3, 7, 32) (the interface contract)")
    assert result.messages == [
        "finding: the interface contract: CausalSelfAttention.forward returns the heads unmerged, (B, h, T, hd) = "
        "(3, 4, 7, 8), not the course's (B, T, C) = (3, 7, 32): forward scores 0",
        "finding: the interface contract: attention() returns the heads unmerged, (B, h, T, hd) = (3, 4, 7, 8), not "
        "the course's (B, T, C) = (3, 7, 32): attention scores 0"]
    # with a bug in the values as well, that bug is named (the grader merges the heads to read them)
    t = attention_answers(attention_q, ("no_scale",))
    for name in ("forward.nopad", "forward.right", "forward.left", "attention.left"):
        t[name] = unmerge(t[name])
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert result.diagnosis_key == "no_scale" and summary(result)["forward"] == ("fail", 0.0)
    assert any(m.startswith("finding: the interface contract: CausalSelfAttention.forward") for m in result.messages)


def test_attention_unmerged_where_forward_merges_them_keeps_its_points(attention_q):
    """attention() may hold the heads unmerged where the submission's forward() merges them: the module's output
    keeps the course's (B, T, C) (a real submission's refactored split, correct by the hand verdict)."""
    t = attention_answers(attention_q)
    t["attention.left"] = unmerge(t["attention.left"])
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert (result.score, result.verdict, result.diagnosis_key) == (16.0, "pass", "")
    assert result.messages == ["attention() returns the heads unmerged (B, h, T, hd) and forward() merges them, so "
                               "forward() keeps the course's (B, T, C): attention() graded merged"]


def test_attention_through_forward_shares_forwards_broken_contract(attention_q):
    t = attention_answers(attention_q)
    del t["attention.left"]
    for c in MASKS:
        t[f"forward.{c}"] = t[f"forward.{c}"].transpose(1, 2).contiguous()  # (B, C, T): another wrong shape
    result = checks.check_attention(ok(t, attention_q), scorer())
    assert summary(result) == {"forward": ("fail", 0.0), "attention": ("fail", 0.0), "training": ("pass", 4.0)}
    assert result.parts[1].message == ("CausalSelfAttention.forward returns shape (3, 32, 7), not the course's "
                                       "(B, T, C) = (3, 7, 32) (the interface contract)")
    assert result.diagnosis_key == ""


def test_a_layer_whose_forward_breaks_the_shape_loses_forward_and_names_it(layer_q):
    t = layer_answers(layer_q)
    for c in MASKS:
        t[f"forward.{c}"] = unmerge(t[f"forward.{c}"])
    t["train"] = unmerge(t["train"])
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert summary(result) == {"add": ("pass", 3.0), "forward": ("fail", 0.0), "training": ("fail", 0.0)}
    assert result.parts[1].message == ("GPT2Layer.forward returns shape (3, 4, 7, 8), not the course's (B, T, C) = "
                                       "(3, 7, 32) (the interface contract)")
    assert "finding: the interface contract: GPT2Layer.forward returns shape (3, 4, 7, 8), not the course's " \
           "(B, T, C) = (3, 7, 32): forward scores 0" in result.messages
    assert not any("did not ask for" in m for m in result.messages)


@pytest.mark.parametrize("name, shape, part, said", [
    ("last_token", lambda x: x[:, None], "forward", "GPT2Model.forward()['last_token'] returns shape (3, 1, 32), not "
                                                    "the course's (B, C) = (3, 32)"),
    ("last_hidden_state", lambda x: x[:, :, None], "forward",
     "GPT2Model.forward()['last_hidden_state'] returns shape (3, 7, 1, 32), not the course's (B, T, C) = (3, 7, 32)"),
    ("logits", lambda x: x.transpose(1, 2), "hidden_state_to_token",
     "hidden_state_to_token returns shape (3, 97, 7), not the course's (B, T, V) = (3, 7, 97)"),
])
def test_a_model_output_of_another_shape_costs_its_part_and_names_the_shape(model_case, name, shape, part, said):
    g, t = model_case
    t = {**t, name: shape(t[name]).contiguous()}
    if name == "logits":
        t["logits.tied"] = shape(t["logits.tied"]).contiguous()
    result = checks.check_model(ok(t, g), scorer())
    other = {"forward": "hidden_state_to_token", "hidden_state_to_token": "forward"}[part]
    assert summary(result)[part] == ("fail", 0.0) and summary(result)[other][0] == "pass"
    assert {p.name: p.message for p in result.parts}[part] == said + " (the interface contract)"
    assert result.messages == [f"finding: the interface contract: {said}: {part} scores 0"]


def test_finish_fails_a_close_part_that_matches_a_bug_and_leaves_skipped_parts_out_of_the_verdict():
    result = checks.CheckResult("attention", scorer().parts("attention"), diagnosis_key="no_scale")
    forward, attention, training = result.parts
    scorer().score(forward, 1e-3, what="forward() (no padding)")
    attention.points, attention.status = attention.max, "pass"
    training.status = "skipped"
    checks.finish(result)
    assert (forward.status, forward.points, forward.message) == (
        "fail", 0.0, "forward() (no padding) matches a typical bug (max error 0.001)")
    result = checks.CheckResult("attention", scorer().parts("attention"))
    for p in result.parts[:2]:
        p.points, p.status = p.max, "pass"
    result.parts[2].status = "skipped"
    assert checks.finish(result).verdict == "pass"
    result = checks.CheckResult("attention", scorer().parts("attention"))
    result.parts[1].points, result.parts[1].status = 0.5, "close"  # half a point is partial, not a fail
    assert checks.finish(result).verdict == "partial"


def test_part_failures_score_zero_with_their_reason():
    result = checks.CheckResult("model", scorer().parts("model"))
    failed = checks.part_failures(result, {"parts": {"forward": "not implemented: TODO", "hidden_state_to_token": "boom"}})
    assert failed == {"forward", "hidden_state_to_token"}
    assert [(p.status, p.message) for p in result.parts] == [
        ("not implemented", "forward: not implemented: TODO"), ("error", "hidden_state_to_token: boom")]
    assert checks.part_failures(result, {"parts": "x"}) == set() and checks.values_of(Run(info={"values": 3})) == {}


# ---- layer ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer_q():
    return questions.ask("layer", 2)


def layer_answers(g, act="exact", eps=(1e-5, 1e-5), bugs=(), drop="right") -> dict:
    w = checks.weights_of(g)
    t = {f"forward.{c}": ref.f_layer(g["x"], w, m, H, act, *eps, bugs) for c, m in MASKS.items()}
    t["add"] = g["add.input"] + F.linear(g["add.output"], w["attention_dense.weight"], w["attention_dense.bias"])
    masks = (g["train.mask_attention"], g["train.mask_out"], P)
    t["train"] = {"right": lambda: ref.f_layer(g["x"], w, MASKS["nopad"], H, act, *eps, bugs, drop=masks),
                  "never": lambda: t["forward.nopad"],
                  "swapped": lambda: ref.f_layer(g["x"], w, MASKS["nopad"], H, act, *eps, bugs,
                                                 drop=(masks[1], masks[0], P))}[drop]()
    for n, e in zip(("attention_layer_norm", "out_layer_norm"), eps):
        t[f"ln.{n}"] = F.layer_norm(g["ln.input"], (D,), g[f"{n}.weight"], g[f"{n}.bias"], e)
    t["gelu"] = F.gelu(g["gelu.input"], approximate="tanh" if act == "tanh" else "none")
    return t


def test_a_correct_layer_scores_full_marks_and_its_exact_gelu_is_noted(layer_q):
    t = layer_answers(layer_q)
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert summary(result) == {"add": ("pass", 3.0), "forward": ("pass", 9.0), "training": ("pass", 2.0)}
    assert (result.verdict, result.diagnosis_key, result.messages) == ("pass", "", [])
    tanh_t = layer_answers(layer_q, "tanh")
    apart = max(checks.max_err(tanh_t[f"forward.{c}"], t[f"forward.{c}"], m) for c, m in MASKS.items())
    assert apart > 1e-4 and result.info == [
        f"uses exact GELU (F.gelu, as the course's starter gives); transformers' GPT-2 uses the tanh approximation: "
        f"with it the outputs differ by up to {apart:.2g} (no points lost)"]
    tanh = checks.check_layer(ok(layer_answers(layer_q, "tanh", (1e-3, 1e-6)), layer_q), scorer())
    assert tanh.score == 14 and tanh.info == [] and tanh.messages == []


def test_a_layer_whose_norms_and_gelu_cannot_be_read_is_graded_with_the_defaults_and_says_so(layer_q):
    t = layer_answers(layer_q, "tanh")
    for k in ("ln.attention_layer_norm", "ln.out_layer_norm", "gelu"):
        del t[k]
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.messages == [
        "attention_layer_norm does not act as a LayerNorm on the grader's input; graded with eps 1e-5",
        "out_layer_norm does not act as a LayerNorm on the grader's input; graded with eps 1e-5",
        "interm_af not found as exact or tanh GELU; graded with the closer one (tanh)"]
    assert result.score == 14


def test_a_wrong_add_is_named_in_its_message(layer_q):
    t = layer_answers(layer_q)
    result = checks.check_layer(ok({**t, "add": t["add"] + 0.5}, layer_q), scorer())
    assert (result.parts[0].status, result.parts[0].message) == (
        "fail", "add() differs from the reference (max error 0.5)")


@pytest.mark.parametrize("what", ["attention", "layer"])
def test_the_functional_reference_is_checked_against_the_module_and_a_difference_stops_the_grader(
        attention_q, layer_q, what, monkeypatch):
    """The functional twin (which also makes the bug variants) is held to the module reference (transformers'
    layer, the course's attention) within 1e-5 on the real positions; past that the grader stops with its own bug,
    naming which reference."""
    name = {"attention": "f_attention", "layer": "f_layer"}[what]
    real = getattr(ref, name)
    monkeypatch.setattr(ref, name, lambda *args, **kw: real(*args, **kw) + 1e-3)
    check, t, g = {"attention": (checks.check_attention, attention_answers(attention_q), attention_q),
                   "layer": (checks.check_layer, layer_answers(layer_q), layer_q)}[what]
    with pytest.raises(RuntimeError, match=rf"^grader bug: the functional {what} reference differs from the module "
                                           rf"reference by 0\.001$"):
        check(ok(t, g), scorer())


def test_add_is_graded_through_forward_when_absent(layer_q):
    t = layer_answers(layer_q)
    del t["add"]
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.parts[0].status == "pass" and result.parts[0].message == " " + checks.THROUGH_FORWARD
    shift_forward(t, 0.5)
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert (result.parts[0].status, result.parts[0].message) == (
        "fail", f"add() (through forward()) differs from the reference (max error 0.5) {checks.THROUGH_FORWARD}")


@pytest.mark.parametrize("bug", ["no_ln_attn", "post_ln", "residual_normed", "no_causal"])
def test_a_layer_bug_is_named_and_costs_forward_only(layer_q, bug):
    result = checks.check_layer(ok(layer_answers(layer_q, bugs=(bug,)), layer_q), scorer())
    assert result.diagnosis_key == bug and result.diagnosis == ref.BUGS[bug]
    assert summary(result) == {"add": ("pass", 3.0), "forward": ("fail", 0.0), "training": ("pass", 2.0)}
    assert result.parts[1].message.startswith("forward() differs from the reference (max error ")


@pytest.mark.parametrize("drop, message", [
    ("never", "training mode: the residual dropouts are never applied"),
    ("swapped", "training mode: the residual dropouts are not applied (once each) to the outputs of attention_dense "
                "and out_dense")])
def test_misplaced_residual_dropout_is_named(layer_q, drop, message):
    result = checks.check_layer(ok(layer_answers(layer_q, drop=drop), layer_q), scorer())
    training = result.parts[2]
    assert (training.status, training.points, training.message) == ("fail", 0.0, message)
    assert (result.diagnosis_key, result.diagnosis) == ("dropout_misplaced", checks.BUGS["dropout_misplaced"])
    assert (result.verdict, result.score) == ("partial", 12.0)


@pytest.mark.parametrize("act", ["exact", "tanh"])
def test_residual_dropout_never_applied_is_told_from_misplaced_with_the_layers_gelu_and_bug(layer_q, act):
    """"Never applied" means the training output is the eval output of the same layer (its GELU, its known bug);
    an output near it but not it (off by 1e-3) is a misplaced dropout."""
    result = checks.check_layer(ok(layer_answers(layer_q, act, drop="never"), layer_q), scorer())
    assert result.parts[2].message == "training mode: the residual dropouts are never applied"
    t = layer_answers(layer_q, act, bugs=("post_ln",), drop="never")
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.diagnosis_key == "post_ln"
    assert (result.parts[2].status, result.parts[2].message) == (
        "fail", "training mode: the residual dropouts are never applied")
    t = layer_answers(layer_q, act)
    t["train"] = t["forward.nopad"] + 1e-3
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.parts[2].message == ("training mode: the residual dropouts are not applied (once each) to the "
                                       "outputs of attention_dense and out_dense")


@pytest.mark.parametrize("bugs, graded", [((), False), (("post_ln",), True)])
def test_layer_training_is_held_to_1e5_or_to_a_named_bugs_match(layer_q, bugs, graded):
    """The training-mode output is the grader's within 1e-5; with forward()'s bug named, within MATCH (1e-4) of
    that bug's training-mode output, as the diagnosis is."""
    t = layer_answers(layer_q, bugs=bugs)
    t["train"] = t["train"] + 5e-5
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.diagnosis_key == (bugs[0] if bugs else "dropout_misplaced")
    assert (result.parts[2].status == "pass") == graded, result.parts[2].message


def test_layer_training_is_not_graded_when_forward_is_wrong_or_skipped(layer_q):
    t = layer_answers(layer_q)
    shift_forward(t, 0.5)
    result = checks.check_layer(ok(t, layer_q), scorer())
    assert result.parts[2].message == ("training mode not graded: forward() is wrong in eval mode (and no single "
                                       "known bug)")
    assert result.diagnosis_key == "" and result.parts[2].points == 0.0
    values = {"parts": {"training": "error: skipped: no attention_dropout"}}
    result = checks.check_layer(ok(layer_answers(layer_q), layer_q, values), scorer())
    assert (result.parts[2].status, result.parts[2].message) == (
        "error", "training mode not graded: the residual dropouts could not be found by the course's names "
                 "(no attention_dropout)")
    assert result.diagnosis_key == "" and result.max_score == 14 and result.parts[2].points == 0.0
    assert result.score == 12
    result = checks.check_layer(ok(layer_answers(layer_q), layer_q, {"parts": {"training": "boom"}}), scorer())
    assert (result.parts[2].status, result.parts[2].message) == ("fail", "training mode: boom")


# ---- measured eps, GELU -------------------------------------------------------------------------------------------

def test_measured_eps_refuses_what_is_not_a_layer_norm(layer_q):
    x, gain, bias = layer_q["ln.input"], layer_q["out_layer_norm.weight"], layer_q["out_layer_norm.bias"]
    assert checks.measured_eps(None, x, gain, bias) is None
    assert checks.measured_eps(F.layer_norm(x, (D,), gain, bias, 0.05), x, gain, bias) is None  # past 1e-2
    assert checks.measured_eps(F.layer_norm(x, (D,), gain, bias, 1e-3), x, gain, bias) == pytest.approx(1e-3, 1e-3)
    y = F.layer_norm(x, (D,), gain, bias, 1e-5)
    assert checks.measured_eps(y + 2e-3, x, gain, bias) is None  # no eps reproduces it
    assert checks.measured_eps(y, x, gain, bias) == pytest.approx(1e-5, 1e-3)


def test_measured_eps_reads_each_row_on_its_own_scale(layer_q):
    """Rows of different scales (here one 30x smaller) are each measured on their own large entries."""
    x, gain, bias = layer_q["ln.input"].clone(), layer_q["out_layer_norm.weight"], layer_q["out_layer_norm.bias"]
    x[0] /= 30
    y = F.layer_norm(x, (D,), gain, bias, 1e-7)
    assert checks.measured_eps(y, x, gain, bias) == pytest.approx(1e-7, rel=1e-2)


def test_gelu_is_read_as_exact_or_tanh_or_neither(layer_q):
    x = layer_q["gelu.input"]
    assert checks.gelu_of(F.gelu(x), x) == "exact" and checks.gelu_of(F.gelu(x, approximate="tanh"), x) == "tanh"
    assert checks.gelu_of(None, x) is None and checks.gelu_of(F.relu(x), x) is None
    assert checks.gelu_of(F.gelu(x) + 2e-6, x) is None
    assert checks.gelu_of(F.gelu(x) + 5e-7, x) == "exact"  # within 1e-6: rounding of another formula


# ---- embed ----------------------------------------------------------------------------------------------------------

def embed_case(kind: str):
    g = questions.ask("embed", 3)
    ids = g["ids"].long()
    want = F.embedding(ids, g["word_embedding.weight"]) + g["pos_embedding.weight"][: ids.shape[1]]
    train = {"right": want * keep_mask(want.shape) / (1 - P), "never": want, "unscaled": want * keep_mask(want.shape),
             "rate": want / (1 - P), "nothing dropped": want / (1 - P),
             "off": (want / (1 - P) + 0.01) * keep_mask(want.shape), "missing": None}[kind]
    if kind == "rate":
        train[0, 0, 0] = 0.0  # one entry dropped of 672
    return g, {"embed": want} if train is None else {"embed": want, "embed.train": train}


def test_a_correct_embed_scores_full_marks():
    g, t = embed_case("right")
    result = checks.check_embed(ok(t, g), scorer())
    assert summary(result) == {"embed": ("pass", 6.0), "training": ("pass", 2.0)} and result.verdict == "pass"
    assert (result.diagnosis, result.messages, result.parts[0].message) == ("", [], "")


def test_embed_training_is_held_to_four_times_the_eval_error():
    """An embed() off by 5e-6 in eval mode (within exact) has its training output judged within 4x that (2e-5):
    kept entries off by 1.8e-5 pass, by 2.2e-5 do not."""
    g, t = embed_case("right")
    want, mask = t["embed"], keep_mask(t["embed"].shape)
    for off, status in ((1.8e-5, "pass"), (2.2e-5, "fail")):
        answers = {"embed": want + 5e-6, "embed.train": (want / (1 - P) + off) * mask}
        result = checks.check_embed(ok(answers, g), scorer())
        assert result.parts[0].status == "pass" and result.parts[1].status == status, (off, result.parts[1].message)
    assert result.parts[1].message == "training mode: embed() output is not the eval output dropped out once with p=0.5"


@pytest.mark.parametrize("kind, message", [
    ("never", "training mode: embed_dropout is never applied (output as in eval)"),
    ("unscaled", "training mode: embed() output is not the eval output dropped out once with p=0.5"),
    ("rate", "training mode: embed_dropout does not drop at rate p: 671 of 672 entries kept where dropout with p=0.5 "
             "keeps 336 +- 78 (6 standard deviations)"),
    ("nothing dropped", "training mode: embed() output is not the eval output dropped out once with p=0.5"),
    ("off", "training mode: embed() output is not the eval output dropped out once with p=0.5"),
    ("missing", "training mode: embed() gave no output of the expected shape")])
def test_embed_dropout_faults_are_named(kind, message):
    g, t = embed_case(kind)
    result = checks.check_embed(ok(t, g), scorer())
    assert (result.parts[1].status, result.parts[1].points, result.parts[1].message) == ("fail", 0.0, message)
    assert (result.verdict, result.score) == ("partial", 6.0)


def test_embed_without_positions_is_named_and_training_not_graded():
    g, t = embed_case("right")
    t["embed"] = F.embedding(g["ids"].long(), g["word_embedding.weight"])
    result = checks.check_embed(ok(t, g), scorer())
    assert (result.diagnosis_key, result.diagnosis) == ("no_positions", ref.BUGS["no_positions"])
    assert result.parts[0].message.startswith("embed() differs from the reference (max error ")
    assert (result.parts[1].status, result.parts[1].message) == (
        "fail", "training mode not graded: embed() is wrong in eval mode")
    assert (result.verdict, result.score) == ("fail", 0.0)


# ---- model ----------------------------------------------------------------------------------------------------------

def model_answers(g: dict, eps: float = 1e-5, act: str = "tanh") -> dict:
    """A correct model's answers where every LayerNorm uses `eps` and every layer the GELU `act`."""
    w = checks.weights_of(g)
    layers = [{"eps_attn": eps, "eps_mlp": eps} for _ in range(probes.L)]
    h, last = ref.f_model(g["ids"].long(), MASKS["right"], w, H, layers, eps, act)
    t = {"last_hidden_state": h, "last_token": last, "logits": F.linear(g["head.input"], w["word_embedding.weight"]),
         "logits.tied": F.linear(g["head.input"], g["head.word_embedding"])}
    norms = ["final_layer_norm"] + [f"gpt_layers.{i}.{n}" for i in range(probes.L)
                                    for n in ("attention_layer_norm", "out_layer_norm")]
    for name in norms:
        t[f"ln.{name}"] = F.layer_norm(g["ln.input"], (D,), w[f"{name}.weight"], w[f"{name}.bias"], eps)
    for i in range(probes.L):
        t[f"gelu.gpt_layers.{i}"] = F.gelu(g["gelu.input"], approximate="tanh" if act == "tanh" else "none")
    return t


@pytest.fixture(scope="module")
def model_case():
    g = questions.ask("model", 4)
    return g, model_answers(g)  # the stand-in layers' choices: eps 1e-5, tanh GELU


def test_a_correct_model_scores_full_marks(model_case):
    g, t = model_case
    for values in ({}, {"own_components": True}):
        result = checks.check_model(ok(dict(t), g, values), scorer())
        assert summary(result) == {"forward": ("pass", 10.0), "hidden_state_to_token": ("pass", 4.0)}, values
        assert (result.verdict, result.diagnosis_key, result.messages, result.info) == ("pass", "", [], [])


def test_an_untied_head_is_named(model_case):
    g, t = model_case
    t = {**t, "logits.tied": t["logits"]}
    result = checks.check_model(ok(t, g), scorer())
    head = result.parts[1]
    assert (head.status, head.points, head.message) == ("fail", 0.0, "the logits do not follow word_embedding: the "
                                                                      "head is not tied")
    assert (result.diagnosis_key, result.diagnosis) == ("untied_head", checks.BUGS["untied_head"])
    assert (result.verdict, result.score) == ("partial", 10.0)


def test_the_model_reference_is_transformers_where_the_measured_eps_are_one_value(model_case, monkeypatch):
    """Eps measured off a submission's outputs differ in their last digits (9.9999992e-06 for 1e-5): within 0.1% of
    each other they are one value, and the reference is transformers' GPT2Model (with the functional twin checked
    against it); a layer with its own eps gets the functional twin, which follows each layer's eps."""
    g, _ = model_case
    w, ids, mask = checks.weights_of(g), g["ids"].long(), MASKS["right"]
    real, built = ref.hf_model, []
    monkeypatch.setattr(ref, "hf_model", lambda *args: built.append(args[3]) or real(*args))
    one = [{"eps_attn": 1e-5 * (1 + 4e-4), "eps_mlp": 1e-5 * (1 - 3e-8)} for _ in range(probes.L)]
    h, last = checks.model_reference(g, one, 9.9999992e-06, "tanh")
    assert built == [9.9999992e-06]
    hf_h, hf_last = ref.model_forward(real(w, H, "tanh", 1e-5), ids, mask)
    torch.testing.assert_close(h, hf_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(last, hf_last, rtol=0, atol=1e-6)
    zero = [{"eps_attn": 0.0, "eps_mlp": 0.0} for _ in range(probes.L)]  # eps 0 everywhere: one value too
    checks.model_reference(g, zero, 0.0, "tanh")
    assert built == [9.9999992e-06, 0.0]
    del built[1]
    for own in (1e-5 * (1 + 2e-3), 1e-6):
        layers = [dict(one[0]), *one[1:]]
        layers[0]["eps_mlp"] = own
        h, last = checks.model_reference(g, layers, 1e-5, "tanh")
        assert len(built) == 1  # no transformers model: it takes one eps
        f_h, f_last = ref.f_model(ids, mask, w, H, layers, 1e-5, "tanh")
        assert torch.equal(h, f_h) and torch.equal(last, f_last)


@pytest.mark.parametrize("bug", ["no_final_ln", "no_positions", "last_position"])
def test_a_model_bug_is_named(model_case, bug):
    g, t = model_case
    layers = [dict(probes.STAND_IN) for _ in range(probes.L)]
    h, last = ref.f_model(g["ids"].long(), MASKS["right"], checks.weights_of(g), H, layers, 1e-5, "tanh", (bug,))
    result = checks.check_model(ok({**t, "last_hidden_state": h, "last_token": last}, g), scorer())
    assert result.diagnosis_key == bug and summary(result)["forward"] == ("fail", 0.0)
    assert result.parts[0].message.startswith("forward() (last_hidden_state and last_token, right padding) differs "
                                              "from the reference (max error ")


def test_a_head_with_wrong_logits_is_called_untied_only_where_its_logits_did_not_move(model_case):
    """Wrong logits that stay put when the grader swaps in a second word_embedding (a snapshot of the matrix) are
    an untied head; wrong logits that follow the swap (tied, computed wrongly) keep the score's own message."""
    g, t = model_case
    h = g["head.input"]
    wrong = F.linear(h, 2 * g["word_embedding.weight"])
    result = checks.check_model(ok({**t, "logits": wrong, "logits.tied": wrong.clone()}, g), scorer())
    head = result.parts[1]
    assert (head.status, head.points, head.message) == ("fail", 0.0, "the logits do not follow word_embedding: the "
                                                                      "head is not tied")
    assert result.diagnosis_key == "untied_head"
    moved = F.linear(h, 2 * g["head.word_embedding"])
    result = checks.check_model(ok({**t, "logits": wrong, "logits.tied": moved}, g), scorer())
    head = result.parts[1]
    assert (head.status, head.points) == ("fail", 0.0) and result.diagnosis_key != "untied_head"
    assert head.message.startswith("hidden_state_to_token() differs from the reference (max error ")
    barely = wrong + 1e-3  # moved, if only a little: not a snapshot
    result = checks.check_model(ok({**t, "logits": wrong, "logits.tied": barely}, g), scorer())
    assert result.parts[1].message.startswith("hidden_state_to_token() differs") and not result.diagnosis_key


def test_the_model_is_graded_on_the_real_positions_with_the_submissions_own_choices(model_case):
    """Hidden states at right padding are not graded; a submission that ran its own layers is graded with the GELU
    and eps its layers compute (here exact GELU and eps 1e-6, against the stand-in's tanh and 1e-5); a final norm
    that is not a LayerNorm on the grader's input is graded with eps 1e-5 and said so; the run's notes are kept."""
    g, t = model_case
    mask = MASKS["right"]
    h = t["last_hidden_state"].clone()
    h[mask == 0] = 123.0  # whatever a submission leaves at the padding
    run = ok({**t, "last_hidden_state": h}, g, notes=["a note"])
    run.findings = ["wrote /tmp/x"]
    result = checks.check_model(run, scorer())
    assert summary(result)["forward"] == ("pass", 10.0)
    assert result.messages == ["finding: wrote /tmp/x", "a note"]  # the findings, then the run's notes
    run = ok(dict(t), g)
    del run.info["notes"]  # a probe that left none
    assert checks.check_model(run, scorer()).messages == []

    own = model_answers(g, eps=1e-6, act="exact")
    result = checks.check_model(ok(own, g, {"own_components": True}), scorer())
    assert summary(result)["forward"] == ("pass", 10.0), result.parts[0].message
    tanh = model_answers(g, eps=1e-6, act="tanh")
    apart = max(checks.max_err(tanh["last_hidden_state"], own["last_hidden_state"], mask),
                checks.max_err(tanh["last_token"], own["last_token"]))
    assert apart > 1e-4 and result.info == [
        f"uses exact GELU (F.gelu, as the course's starter gives); transformers' GPT-2 uses the tanh approximation: "
        f"with it the outputs differ by up to {apart:.2g} (no points lost)"]
    unread = {k: x for k, x in own.items() if not k.startswith("gelu.")}  # its GELU cannot be read off a layer
    result = checks.check_model(ok(unread, g, {"own_components": True}), scorer())
    assert summary(result)["forward"] == ("pass", 10.0) and result.info == []
    assert result.messages == ["interm_af not found as exact or tanh GELU; graded with the closer one (exact)"]

    one_read = {k: x for k, x in own.items() if k != "gelu.gpt_layers.1"}  # read off the first layer
    result = checks.check_model(ok(one_read, g, {"own_components": True}), scorer())
    assert summary(result)["forward"] == ("pass", 10.0) and result.messages == [] and len(result.info) == 1

    not_ln = {**t, "ln.final_layer_norm": torch.zeros_like(t["ln.final_layer_norm"])}
    result = checks.check_model(ok(not_ln, g), scorer())
    assert "final_layer_norm does not act as a LayerNorm on the grader's input; graded with eps 1e-5" in result.messages
    unread = {**t, **{f"ln.gpt_layers.{i}.{n}": torch.zeros_like(t["ln.final_layer_norm"])
                      for i, n in ((0, "attention_layer_norm"), (probes.L - 1, "out_layer_norm"))}}
    result = checks.check_model(ok(unread, g, {"own_components": True}), scorer())
    assert summary(result)["forward"] == ("pass", 10.0) and result.messages == [
        f"gpt_layers.{i}.{n} does not act as a LayerNorm on the grader's input; graded with eps 1e-5"
        for i, n in ((0, "attention_layer_norm"), (probes.L - 1, "out_layer_norm"))]


def test_an_exact_gelu_in_the_submissions_layers_is_noted_when_the_stand_ins_ran(model_case):
    """With the reference layers standing in (tanh GELU) the model is graded with theirs, and a submission whose
    own layers compute the exact GELU is told how far apart the two GELUs put the outputs."""
    g, t = model_case
    exact = {**t, **{f"gelu.gpt_layers.{i}": F.gelu(g["gelu.input"]) for i in range(probes.L)}}
    result = checks.check_model(ok(exact, g), scorer())
    assert summary(result)["forward"] == ("pass", 10.0) and result.messages == []
    other = model_answers(g, act="exact")
    apart = max(checks.max_err(other["last_hidden_state"], t["last_hidden_state"], MASKS["right"]),
                checks.max_err(other["last_token"], t["last_token"]))
    assert apart > 1e-4 and result.info == [
        f"uses exact GELU (F.gelu, as the course's starter gives); transformers' GPT-2 uses the tanh approximation: "
        f"with it the outputs differ by up to {apart:.2g} (no points lost)"]


def test_the_model_references_self_check_compares_real_positions_and_names_the_model(model_case, monkeypatch):
    """The functional twin is checked against transformers' model on the real positions only; where it differs
    the grader stops with its own bug, naming the model."""
    g, _ = model_case
    layers = [dict(probes.STAND_IN) for _ in range(probes.L)]
    real = ref.f_model

    def padding_differs(*args):
        h, last = real(*args)
        return h.masked_fill(~MASKS["right"].bool()[..., None], 123.0), last

    monkeypatch.setattr(ref, "f_model", padding_differs)
    checks.model_reference(g, layers, 1e-5, "tanh")  # no error
    monkeypatch.setattr(ref, "f_model", lambda *args: (real(*args)[0] + 1e-3, real(*args)[1]))
    with pytest.raises(RuntimeError, match=r"^grader bug: the functional model reference differs from the module "
                                           r"reference by 0\.001$"):
        checks.model_reference(g, layers, 1e-5, "tanh")


def test_the_runs_findings_then_its_notes_head_the_messages(attention_q, layer_q):
    """What the sandbox found, then what the probe noted, for the attention and layer checks (the model's and
    from_pretrained's have their own tests); a probe that wrote no notes leaves none."""
    for check, t, g in ((checks.check_attention, attention_answers(attention_q), attention_q),
                        (checks.check_layer, layer_answers(layer_q), layer_q)):
        run = ok(dict(t), g, notes=["a note", "another"])
        run.findings = ["wrote /tmp/x"]
        result = check(run, scorer())
        assert result.messages == ["finding: wrote /tmp/x", "a note", "another"] and result.verdict == "pass", check
        run = ok(dict(t), g)
        del run.info["notes"]
        assert check(run, scorer()).messages == [], check


def test_a_forward_exactly_at_the_exact_tolerance_passes_with_no_diagnosis(attention_q, layer_q, model_case):
    """The rubric's exact tolerance is inclusive (Scorer.score) and so is the diagnosis's: a forward() whose error is
    the tolerance itself passes and no bug is looked for. The tolerance is set to the error a first grading
    measured."""
    def forward_of(result):
        return {p.name: p for p in result.parts}["forward"]

    g_model, t_model = model_case
    for check, t, g in ((checks.check_attention, attention_answers(attention_q), attention_q),
                        (checks.check_layer, layer_answers(layer_q), layer_q),
                        (checks.check_model, dict(t_model), g_model)):
        err = forward_of(check(ok(dict(t), g), scorer())).error
        rubric = load_rubric()
        rubric["tolerance"]["exact"] = err
        result = check(ok(dict(t), g), checks.Scorer(rubric))
        forward = forward_of(result)
        assert (forward.status, forward.error, result.diagnosis, result.verdict) == ("pass", err, "", "pass"), check


def test_a_head_that_failed_in_the_probe_is_not_graded_again(model_case):
    g, t = model_case
    values = {"parts": {"hidden_state_to_token": "not implemented: TODO"}}
    result = checks.check_model(ok(dict(t), g, values), scorer())
    assert summary(result) == {"forward": ("pass", 10.0), "hidden_state_to_token": ("not implemented", 0.0)}
    assert result.parts[1].message == "hidden_state_to_token: not implemented: TODO"


def test_a_model_part_that_failed_in_the_probe_scores_zero(model_case):
    g, t = model_case
    values = {"parts": {"forward": "not implemented: TODO"}}
    result = checks.check_model(ok(dict(t), g, values), scorer())
    assert summary(result) == {"forward": ("not implemented", 0.0), "hidden_state_to_token": ("pass", 4.0)}
    assert result.verdict == "partial"


# ---- from_pretrained ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pretrained_case():
    """The checkpoint's weights (this project's names) and the ids the loaded model runs on."""
    return checks.weights_of(questions.ask("model", 5)), {"ids": questions.ask("embed", 5)["ids"]}


def test_from_pretrained_is_graded_by_the_weights_it_loads(pretrained_case):
    hub, g = pretrained_case
    result = checks.check_from_pretrained(ok(dict(hub), g), scorer(), hub, "the hub note")
    assert summary(result) == {"from_pretrained": ("pass", 18.0)} and result.info == ["the hub note"]
    assert result.messages == ["graded by the weights it loads (the model's outputs depend on components graded in "
                               "their own checks)"]
    for bug in ("conv1d_not_transposed", "qkv_swapped"):
        result = checks.check_from_pretrained(ok(ref.mis_loaded(hub, bug, probes.L), g), scorer(), hub, "note")
        assert (result.diagnosis_key, result.score) == (bug, 0.0)
        assert result.messages[-1].startswith(("8 loaded tensor(s)", "4 loaded tensor(s)")), result.messages
    h, last = ref.model_forward(ref.hf_model(hub, H, "tanh", 1e-5), g["ids"].long(), MASKS["right"])
    result = checks.check_from_pretrained(ok({**hub, "last_hidden_state": h, "last_token": last}, g), scorer(), hub,
                                          "note")
    assert result.info == ["note", "the loaded model's outputs differ from transformers' GPT-2 (eps 1e-5, tanh GELU) "
                                   "by up to 0 (its attention and layers as graded in their checks; no points)"]
    values = {"parts": {"outputs": "ValueError: x"}}
    result = checks.check_from_pretrained(ok(dict(hub), g, values), scorer(), hub, "note")
    assert result.info[-1] == "running the loaded model: ValueError: x (no points: graded by its weights)"
    run = ok(dict(hub), g)
    del run.info["notes"]  # a probe that left none
    assert checks.check_from_pretrained(run, scorer(), hub, "note").messages == [
        "graded by the weights it loads (the model's outputs depend on components graded in their own checks)"]
    values = {"parts": {"outputs": "E" * 600}}  # what the probe reports is cut at 500 characters
    result = checks.check_from_pretrained(ok(dict(hub), g, values), scorer(), hub, "note")
    assert result.info[-1] == f"running the loaded model: {'E' * 500} (no points: graded by its weights)"


@pytest.mark.parametrize("n_wrong", [1, 6, 7])
def test_from_pretrained_names_the_tensors_it_loaded_wrong_up_to_six(pretrained_case, n_wrong):
    """The loaded tensors that differ from the checkpoint, by name, six at most (then "..."); the part's message
    names the loaded weights; the run's findings and notes come first; a tensor it was not asked for is said."""
    hub, g = pretrained_case
    names = list(hub)[:n_wrong]
    loaded = {k: x + 0.5 if k in names else x for k, x in hub.items()}
    run = ok({**loaded, "extra": torch.zeros(2)}, g, notes=["a note"])
    run.findings = ["wrote /tmp/x"]
    result = checks.check_from_pretrained(run, scorer(), hub, "note")
    assert summary(result) == {"from_pretrained": ("fail", 0.0)} and result.diagnosis_key == ""
    assert result.parts[0].message == "the loaded weights differs from the reference (max error 0.5)"
    assert result.messages == [
        "finding: wrote /tmp/x",
        "finding: the check returned 1 tensor(s) the grader did not ask for or of the wrong shape, ignored: extra (2,)",
        "a note",
        "graded by the weights it loads (the model's outputs depend on components graded in their own checks)",
        f"{n_wrong} loaded tensor(s) differ from the checkpoint: {', '.join(names[:6])}" + (" ..." if n_wrong > 6 else "")]


def test_from_pretrained_exactly_at_the_exact_tolerance_passes_and_names_no_tensor(pretrained_case):
    hub, g = pretrained_case
    first = next(iter(hub))
    loaded = {**hub, first: hub[first] + 3e-6}
    rubric = load_rubric()
    rubric["tolerance"]["exact"] = checks.max_err(loaded[first], hub[first])
    result = checks.check_from_pretrained(ok(loaded, g), checks.Scorer(rubric), hub, "note")
    assert summary(result) == {"from_pretrained": ("pass", 18.0)}
    assert result.messages == ["graded by the weights it loads (the model's outputs depend on components graded in "
                               "their own checks)"]



# ---- forbidden calls ------------------------------------------------------------------------------------------------

SDPA = "torch.nn.functional.scaled_dot_product_attention"


def graded_attention(records, unwatched=None, through_forward=False) -> checks.CheckResult:
    """A full-marks attention result, then the forbidden calls the check's process recorded."""
    result = checks.CheckResult("attention", scorer().parts("attention"))
    for p in result.parts:
        p.points, p.status = p.max, "pass"
    if through_forward:
        result.parts[1].message = checks.THROUGH_FORWARD
    result.verdict = "pass"
    values = {} if records is None else {"forbidden_calls": records}
    if unwatched is not None:
        values["forbidden_unwatched"] = unwatched
    checks.forbidden_findings(result, ok({}, {}, values), [SDPA, "torch.nn.*"])
    return result


def record(part="forward", call=SDPA, where="attention.py:12"):
    return {"call": call, "part": part, "where": where}


def test_a_forbidden_call_costs_the_part_it_was_made_in():
    result = graded_attention([record(), record("training", "math.sqrt")])
    assert summary(result) == {"forward": ("fail", 0.0), "attention": ("pass", 4.0), "training": ("pass", 4.0)}
    assert result.parts[0].message == f"forbidden call {SDPA} at attention.py:12 (the rubric's forbidden_calls)"
    assert result.messages == [f"finding: forbidden call {SDPA} at attention.py:12, while grading forward (the "
                               f"rubric's forbidden_calls): forward scores 0"]
    assert result.verdict == "partial"


def test_a_forbidden_call_in_forward_costs_a_part_graded_through_it_and_a_module_pattern_matches():
    result = graded_attention([record(call="torch.nn.Linear")], through_forward=True)
    assert summary(result) == {"forward": ("fail", 0.0), "attention": ("fail", 0.0), "training": ("pass", 4.0)}
    result = graded_attention([record(part="nowhere")])
    assert result.score == 16 and result.messages == [] and result.verdict == "pass"


def test_a_removed_watch_costs_the_whole_check():
    result = graded_attention([record(part="*")])
    assert result.score == 0 and result.verdict == "fail"
    assert {p.message for p in result.parts} == {f"the submission removed the grader's watch on {SDPA} (the "
                                                 f"rubric's forbidden_calls)"}
    assert result.messages == [f"finding: the submission removed the grader's watch on {SDPA} (the rubric's "
                               f"forbidden_calls): the whole check scores 0"]


@pytest.mark.parametrize("records", [None, "x", [record()] * 101, [{"call": SDPA, "part": "forward"}],
                                     [record(where=3)], [record(where="x" * 501)], [[SDPA, "forward", "x"]]])
def test_a_missing_or_malformed_record_of_forbidden_calls_scores_zero(records):
    result = graded_attention(records)
    assert result.score == 0 and result.verdict == "error" and {p.status for p in result.parts} == {"error"}
    assert {p.message for p in result.parts} == {"the check's record of forbidden calls is missing or malformed "
                                                 "(the rubric's forbidden_calls)"}
    assert result.messages[0] == ("finding: the check's output was malformed: its record of the forbidden calls (the "
                                  "rubric's forbidden_calls) is missing or not a list of {call, part, where}")


def test_a_missing_record_costs_a_check_that_scored_any_points_and_its_finding_comes_first():
    result = checks.CheckResult("attention", scorer().parts("attention"), verdict="partial",
                                messages=["how it was graded"])
    result.parts[2].points, result.parts[2].status = 0.5, "close"
    checks.forbidden_findings(result, ok({}, {}), [SDPA])
    assert (result.score, result.verdict) == (0.0, "error")
    assert result.messages[0].startswith("finding: the check's output was malformed") and \
        result.messages[1:] == ["how it was graded"]


@pytest.mark.parametrize("left, verdict", [(0.0, "fail"), (0.5, "partial")])
def test_the_verdict_after_a_forbidden_call_follows_the_points_left(left, verdict):
    """A partial check whose forward() made a forbidden call is partial while any points are left (half a point
    included), else it fails."""
    result = checks.CheckResult("attention", scorer().parts("attention"), verdict="partial")
    forward, attention, training = result.parts
    forward.points, forward.status = forward.max, "pass"
    attention.points, attention.status = left, "close" if left else "fail"
    checks.forbidden_findings(result, ok({}, {}, {"forbidden_calls": [record()]}), [SDPA])
    assert (result.score, result.verdict) == (left, verdict)


def test_each_recorded_call_is_weighed_past_ones_not_watched():
    result = graded_attention([record("training", "math.sqrt"), record()])
    assert summary(result) == {"forward": ("fail", 0.0), "attention": ("pass", 4.0), "training": ("pass", 4.0)}


def test_no_record_is_needed_when_nothing_is_watched_or_nothing_scored():
    result = checks.CheckResult("attention", scorer().parts("attention"), verdict="fail")
    checks.forbidden_findings(result, ok({}, {}), [SDPA])
    assert (result.verdict, result.messages) == ("fail", [])
    assert checks.forbidden_records({"forbidden_calls": [record()] * 100}) == [record()] * 100
    assert checks.forbidden_records({"forbidden_calls": [record(where="x" * 500)]}) == [record(where="x" * 500)]
    result = graded_attention([])
    result2 = checks.CheckResult("attention", scorer().parts("attention"))
    checks.forbidden_findings(result2, ok({}, {}), [])
    assert result.score == 16 and result2.messages == []


def test_calls_the_process_could_not_watch_are_reported():
    result = graded_attention([], unwatched=[f"u{i}" for i in range(7)])
    assert result.messages == ["the check's process reports forbidden calls it could not watch: u0; u1; u2; u3; u4"]
    result = graded_attention([], unwatched=["x" * 400])  # each cut at 300 characters
    assert result.messages == [f"the check's process reports forbidden calls it could not watch: {'x' * 300}"]
    assert result.score == 16


# ---- AdamW ----------------------------------------------------------------------------------------------------------

def test_the_adamw_reference_is_torchs_adamw_on_the_questions_net_and_each_form_and_bug_its_own():
    """torch_adamw_run against a run written here: the question's net and its two groups (each with its own lr and
    weight decay), torch.optim.AdamW with betas (0.9, 0.99) and eps 1e-8 on each batch's mean squared error. The
    handout's correct form stays within the course's tolerance of it and is not the same computation; each bug
    variant lands far from both."""
    given = questions.ask("adamw", 7)
    net = probes.adamw_net(given)
    opt = torch.optim.AdamW(probes.adamw_groups(net), betas=(0.9, 0.99), eps=1e-8)
    for x, y in zip(given["x"], given["y"]):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    want = {n: p.detach() for n, p in net.named_parameters()}
    got = checks.torch_adamw_run(given)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    handout = checks.torch_adamw_run(given, form="handout")
    assert all(torch.allclose(handout[n], want[n], atol=1e-6, rtol=1e-4) for n in want)
    assert not all(torch.equal(handout[n], want[n]) for n in want)
    for bug in ref.ADAMW_BUGS:
        wrong = checks.torch_adamw_run(given, bug)
        assert max(checks.max_err(wrong[n], want[n]) for n in want) > 1e-3, bug


@pytest.fixture(scope="module")
def adamw_case():
    """A question and a correct run's trained parameters on it (torch.optim.AdamW's)."""
    given = questions.ask("adamw", 3)
    return given, checks.torch_adamw_run(given)


def graded_adamw(given: dict, params: dict, course_answer: torch.Tensor, course_reference: torch.Tensor | None,
                 course_path: str = "data/optimizer_test.npy") -> checks.CheckResult:
    """check_adamw on the answers of a run whose trained parameters are `params` and whose course test gave
    `course_answer`."""
    answers = {**{f"torch.{n}": x for n, x in params.items()}, "course.weight": course_answer}
    return checks.check_adamw(ok(answers, given), scorer(), course_reference, course_path)


def test_the_course_part_takes_the_courses_tolerances_and_is_skipped_without_its_reference(adamw_case):
    """optimizer_test.py's allclose(atol=1e-6, rtol=1e-4): an answer within them passes, one past either fails; with
    the course's reference file absent the part is skipped and says which file."""
    given, correct = adamw_case
    course = torch.tensor([[0.0, 1.0, 2.0], [-1.0, 0.5, 3.0]])  # the shape of optimizer_test.npy

    def course_part(answer, reference=course):
        result = graded_adamw(given, correct, answer, reference)
        assert result.output == "printed" and summary(result)["torch_adamw"][0] == "pass"
        return result.parts[0]

    assert course_part(course + torch.tensor([[9e-7, 5e-5, 1e-4], [-5e-5, 0.0, 0.0]])).status == "pass"
    assert course_part(course + torch.tensor([[2e-6, 0.0, 0.0], [0.0, 0.0, 0.0]])).status != "pass"  # past atol at 0
    assert course_part(course + torch.tensor([[0.0, 2e-4, 0.0], [0.0, 0.0, 0.0]])).status != "pass"  # past rtol at 1
    skipped = course_part(course, reference=None)
    assert (skipped.status, skipped.points) == ("skipped", 0.0)
    assert skipped.message == "skipped: the course's reference data/optimizer_test.npy is absent"


def test_the_torch_part_passes_a_correct_run_and_names_each_bug_and_the_course_part_its_error(adamw_case):
    (given, correct), course = adamw_case, torch.zeros(2, 3)
    result = graded_adamw(given, correct, course, course)
    assert [(p.status, p.points == p.max) for p in result.parts] == [("pass", True), ("pass", True)]
    assert (result.verdict, result.diagnosis_key) == ("pass", "")
    for bug in ref.ADAMW_BUGS:
        wrong = checks.torch_adamw_run(given, bug)
        result = graded_adamw(given, wrong, course, course)
        torch_part = result.parts[1]
        assert (torch_part.status, torch_part.points) == ("fail", 0.0) and result.diagnosis_key == bug
        assert torch_part.message.startswith("200 steps against torch.optim.AdamW (two groups, weight decay) differs "
                                             "from the reference (max error ")
    assert result.parts[1].error == max(checks.max_err(wrong[n], correct[n]) for n in correct)
    assert graded_adamw(given, {}, course, course).parts[1].status == "fail"  # no answers
    course_part = graded_adamw(given, correct, course + 0.5, course).parts[0]
    assert (course_part.status, course_part.error) == ("fail", 0.5)
    assert course_part.message.startswith("1000 steps of the course's optimizer_test differs from the reference (max "
                                          "error 0.5")


def test_the_torch_part_takes_the_courses_tolerances_and_a_failed_allclose_is_never_exact(adamw_case):
    """Within allclose(atol=1e-6, rtol=1e-4) of the reference passes even where the largest difference is past the
    rubric's exact tolerance (1e-5); off by 3e-6 everywhere, past atol on the parameters near 0, is not a pass
    though no difference reaches 1e-5 (it is scored just past exact)."""
    (given, correct), course = adamw_case, torch.zeros(2, 3)
    scaled = {n: x * (1 + 9e-5) for n, x in correct.items()}
    assert max(checks.max_err(scaled[n], correct[n]) for n in correct) > 1e-5
    assert graded_adamw(given, scaled, course, course).parts[1].status == "pass"
    shifted = {n: x + 3e-6 for n, x in correct.items()}
    part = graded_adamw(given, shifted, course, course).parts[1]
    assert part.status == "close" and part.error == 1e-5 + 1e-12


def test_the_adamw_variants_refuse_a_form_or_bug_they_do_not_know(adamw_case):
    given, _ = adamw_case
    with pytest.raises(ValueError, match="form must be 'torch' or 'handout', got 'Torch'"):
        checks.torch_adamw_run(given, form="Torch")
    with pytest.raises(ValueError, match="unknown bug 'no_decay'"):
        checks.torch_adamw_run(given, "no_decay")
