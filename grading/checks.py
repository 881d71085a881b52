"""Each check: the probe's tensors from the sandbox against the reference, scored by the rubric, with a diagnosis.

A check is a list of rubric parts; a part scores full points at max error <= tolerance.exact, the rubric's
partial fraction at <= tolerance.close (with a hint), else 0. A part the submission's interface does not allow is
graded through the next method up (e.g. attention() through forward()) and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grading import probes
from grading import reference as ref
from grading.reference import BUGS
from grading.sandbox import Run

BUGS = {**BUGS,
        "dropout_before_softmax": "dropout before the softmax (masked positions get probability in training mode)",
        "no_attention_dropout": "no dropout on the attention probabilities (visible in training mode only)",
        "dropout_misplaced": "residual dropout misplaced (not applied to the dense layer's output, training mode)",
        "untied_head": "LM head not tied to word_embedding (hidden_state_to_token ignores it)"}
MASKS = {k: torch.tensor(v) for k, v in probes.MASKS.items()}
H = probes.H
MATCH = 1e-4  # a variant within this of the submission "is" its bug


@dataclass
class Part:
    name: str
    max: float
    points: float = 0.0
    status: str = "fail"  # pass | close | fail | skipped | not implemented | error
    error: float | None = None
    message: str = ""


@dataclass
class CheckResult:
    name: str
    parts: list[Part]
    verdict: str = ""
    diagnosis: str = ""
    diagnosis_key: str = ""  # the BUGS key the diagnosis names ("" when none)
    messages: list[str] = field(default_factory=list)  # findings and how the check was graded
    info: list[str] = field(default_factory=list)  # differences to transformers' GPT-2 that cost no points
    output: str = ""  # the submission's captured output (truncated)

    @property
    def score(self) -> float:
        return sum(p.points for p in self.parts)

    @property
    def max_score(self) -> float:
        return sum(p.max for p in self.parts if p.status != "skipped")

    def to_dict(self) -> dict:
        return {"name": self.name, "score": self.score, "max_score": self.max_score, "verdict": self.verdict,
                "diagnosis": self.diagnosis, "diagnosis_key": self.diagnosis_key, "messages": self.messages,
                "info": self.info, "parts": [vars(p) for p in self.parts], "output": self.output}


def max_err(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """Largest absolute difference (over real tokens when rows (B, T) is given); inf on a shape mismatch or NaN."""
    if a.shape != b.shape:
        return float("inf")
    if rows is not None:
        a, b = a[rows.bool()], b[rows.bool()]
    d = (a.float() - b.float()).abs()
    return float("inf") if not torch.isfinite(d).all() else float(d.max()) if d.numel() else 0.0


class Scorer:
    def __init__(self, rubric: dict):
        self.rubric = rubric
        self.exact, self.close = rubric["tolerance"]["exact"], rubric["tolerance"]["close"]
        self.partial = rubric["partial_fraction"]

    def parts(self, check: str) -> list[Part]:
        return [Part(name, float(pts)) for name, pts in self.rubric["checks"][check].items()]

    def score(self, part: Part, err: float, exact: float | None = None, what: str = "") -> None:
        exact = self.exact if exact is None else exact
        part.error = err
        if err <= exact:
            part.points, part.status = part.max, "pass"
        elif err <= self.close:
            part.points, part.status = part.max * self.partial, "close"
            part.message = (f"{what} close but not exact (max error {err:.2g} > {exact:g}): look for a small "
                            f"deviation (a constant, an eps, an approximation, a dtype)")
        else:
            part.points, part.status = 0.0, "fail"
            part.message = f"{what} differs from the reference (max error {err:.3g})" if err != float("inf") else \
                f"{what} has the wrong shape or non-finite values"


def failed_run(result: CheckResult, run: Run) -> bool:
    """Fill the result for a run that produced nothing to compare; True if so."""
    result.messages += [f"finding: {f}" for f in run.findings]
    info = run.info
    if run.problem:
        status, message = "error", run.problem
    elif info.get("status") == "not_implemented":
        status, message = "not implemented", f"not implemented: {info.get('message', '')}"
    elif info.get("status") == "error":
        status, message = "error", f"the submission raised {info.get('message', '')}"
        if info.get("device"):
            result.messages.append(f"finding: {info['device']}")
    elif info.get("status") != "ok":
        status, message = "error", "the check produced no result"
    else:
        return False
    for p in result.parts:
        p.status, p.points, p.message = status, 0.0, message
    result.verdict = status
    result.messages.insert(0, message)
    return True


def part_failures(result: CheckResult, values: dict) -> set:
    """Parts the probe could not run (a TODO, an error in that part only): 0 with the reason; returns their names."""
    failed = values.get("parts") or {}
    for p in result.parts:
        if p.name in failed:
            msg = str(failed[p.name])
            p.status = "not implemented" if msg.startswith("not implemented") else "error"
            p.points, p.message = 0.0, f"{p.name}: {msg}"
    return {p.name for p in result.parts if p.name in failed}


def diagnose(result: CheckResult, student: list, variants: dict) -> None:
    """Name the one-bug variant closest to the submission. student: [(tensor, rows)]; variants: bug -> [tensors]."""
    errs = {}
    for bug, outs in variants.items():
        errs[bug] = max(max_err(s, v, rows) for (s, rows), v in zip(student, outs))
    if not errs:
        return
    best = min(errs, key=errs.get)
    if errs[best] <= MATCH:
        result.diagnosis, result.diagnosis_key = BUGS[best], best
    elif errs[best] != float("inf"):
        result.diagnosis = f"no typical bug matches exactly (closest: {BUGS[best]}, max error {errs[best]:.2g})"


def finish(result: CheckResult) -> CheckResult:
    if result.diagnosis_key:  # "close" because of a known bug is not a rounding difference
        for p in result.parts:
            if p.status == "close":
                p.points, p.status = 0.0, "fail"
                p.message = f"{p.message.split(' close but')[0]} matches a typical bug (max error {p.error:.2g})"
    statuses = {p.status for p in result.parts if p.status != "skipped"}
    if not result.verdict:
        result.verdict = "pass" if statuses <= {"pass"} else "partial" if result.score > 0 else "fail"
    return result


# ---- attention ------------------------------------------------------------------------------------------------------

def check_attention(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("attention", scorer.parts("attention"), output=run.output)
    if failed_run(result, run):
        return result
    t = run.tensors
    result.messages += run.info.get("notes", [])
    w = {k: v for k, v in t.items() if k.split(".")[0] in ("query", "key", "value")}
    refs = {case: ref.attention(w, t["x"], m, H) for case, m in MASKS.items()}
    _self_check(ref.f_attention(t["x"], w, MASKS["left"], H), refs["left"], MASKS["left"], "attention")
    parts = {p.name: p for p in result.parts}
    fwd = max(max_err(t[f"forward.{c}"], refs[c], MASKS[c]) for c in MASKS)
    scorer.score(parts["forward"], fwd, what="forward() (no padding, right and left padding)")
    if "attention.left" in t:
        scorer.score(parts["attention"], max_err(t["attention.left"], refs["left"], MASKS["left"]), what="attention()")
    else:
        scorer.score(parts["attention"], fwd, what="attention() (through forward())")
        parts["attention"].message = (parts["attention"].message + " " if parts["attention"].message else "") + \
            "graded through forward()"
    if fwd > scorer.exact:
        student = [(t[f"forward.{c}"], MASKS[c]) for c in MASKS]
        diagnose(result, student, {b: [ref.f_attention(t["x"], w, MASKS[c], H, (b,)) for c in MASKS]
                                   for b in ref.ATTENTION_BUGS})
    training_properties(result, parts["training"], t, run.info["values"])
    return finish(result)


def training_properties(result: CheckResult, part: Part, t: dict, values: dict) -> None:
    """Dropout on: no masked key gets probability, and each probability is dropped (0) or scaled by 1/(1-p)."""
    p = values["dropout_p"]
    pe, pt = t["probs.eval"], t["probs.train"]  # (B, h, T, T)
    if pe.shape != pt.shape or pe.dim() != 4:
        part.status, part.message = "fail", f"training-mode probe gave shape {tuple(pt.shape)}"
        return
    allowed = ref.bool_mask(MASKS["right"]).expand_as(pt)
    real_q = MASKS["right"].bool()[:, None, :, None].expand_as(pt)
    pt = torch.nan_to_num(pt, nan=float("inf"))  # e.g. dropout on -inf scores: NaN counts as a leak
    leak = float(pt[real_q & ~allowed].abs().max())
    kept = real_q & allowed
    off_pattern = float(torch.minimum(pt[kept].abs(), (pt[kept] - pe[kept] / (1 - p)).abs()).max())
    dropped = bool((pt[kept] != pe[kept]).any())
    route = values.get("probs_route", "attention()")
    problems = []
    if leak > 1e-6:
        problems.append(f"in training mode masked positions get probability (up to {leak:.2g})")
    if not dropped:
        problems.append("in training mode the attention probabilities are not dropped out")
        result.diagnosis, result.diagnosis_key = result.diagnosis or BUGS["no_attention_dropout"], \
            result.diagnosis_key or "no_attention_dropout"
    elif off_pattern > 1e-5:
        problems.append("dropout is not applied to the probabilities after the softmax (kept entries are not p/(1-p))")
    if leak > 1e-6 and off_pattern > 1e-5 and not result.diagnosis_key:
        result.diagnosis, result.diagnosis_key = BUGS["dropout_before_softmax"], "dropout_before_softmax"
    if problems:
        part.points, part.status = 0.0, "fail"
        part.message = "; ".join(problems) + f" (probed through {route}, dropout p={p})"
    else:
        part.points, part.status = part.max, "pass"
        part.message = f"training mode: no masked position gets probability; dropout acts on the probabilities ({route})"


def _self_check(functional, reference, rows, what):
    err = max_err(functional, reference, rows)
    if err > 1e-5:
        raise RuntimeError(f"grader bug: the functional {what} reference differs from the module reference by {err:.2g}")


# ---- layer, embeddings, model -------------------------------------------------------------------------------------

def pick_activation(values, candidates_fn, result):
    """The submission's GELU (as its given interm_af says); where it cannot be read, the closer of the two."""
    act = values.get("activation")
    if act in ref.ACTIVATIONS:
        return act
    errs = {a: candidates_fn(a) for a in ref.ACTIVATIONS}
    act = min(errs, key=errs.get)
    result.messages.append(f"interm_af not found as exact or tanh GELU; graded with the closer one ({act})")
    return act


def gelu_info(result, act, err_other):
    if act == "exact":
        result.info.append(f"uses exact GELU (F.gelu, as the course's starter gives); transformers' GPT-2 uses the "
                           f"tanh approximation: with it the outputs differ by up to {err_other:.2g} (no points lost)")


def check_layer(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("layer", scorer.parts("layer"), output=run.output)
    if failed_run(result, run):
        return result
    t, v = run.tensors, run.info["values"]
    result.messages += run.info.get("notes", [])
    w = {k: x for k, x in t.items() if not k.startswith(("x", "forward", "add"))}
    eps = (v["eps_attn"], v["eps_mlp"])

    def fwd_err(act):
        return max(max_err(t[f"forward.{c}"], ref.layer(w, t["x"], m, H, act, *eps), m) for c, m in MASKS.items())

    act = pick_activation(v, fwd_err, result)
    _self_check(ref.f_layer(t["x"], w, MASKS["left"], H, act, *eps), ref.layer(w, t["x"], MASKS["left"], H, act, *eps),
                MASKS["left"], "layer")
    parts = {p.name: p for p in result.parts}
    err = fwd_err(act)
    scorer.score(parts["forward"], err, what="forward()")
    gelu_info(result, act, fwd_err("tanh" if act == "exact" else "exact"))
    if "add" in t:
        want = t["add.input"] + F.linear(t["add.output"], w["attention_dense.weight"], w["attention_dense.bias"])
        scorer.score(parts["add"], max_err(t["add"], want), what="add()")
    else:
        scorer.score(parts["add"], err, what="add() (through forward())")
        parts["add"].message += " graded through forward()"
    if err > scorer.exact:
        student = [(t[f"forward.{c}"], m) for c, m in MASKS.items()]
        diagnose(result, student, {b: [ref.f_layer(t["x"], w, m, H, act, *eps, (b,)) for m in MASKS.values()]
                                   for b in ref.LAYER_BUGS})
    placement = v.get("dropout_placement") or {}
    training = parts["training"]
    if not placement:
        training.status, training.message = "skipped", "skipped: the dropout modules could not be found by name"
    elif all(p == "ok" for p in placement.values()):
        training.points, training.status = training.max, "pass"
    else:
        training.status = "fail"
        training.message = "training mode: " + "; ".join(f"{k} {p}" for k, p in placement.items() if p != "ok")
        if not result.diagnosis_key:
            result.diagnosis, result.diagnosis_key = BUGS["dropout_misplaced"], "dropout_misplaced"
    return finish(result)


def check_embed(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("embed", scorer.parts("embed"), output=run.output)
    if failed_run(result, run):
        return result
    t = run.tensors
    ids = t["ids"].long()
    want = F.embedding(ids, t["word_embedding.weight"]) + t["pos_embedding.weight"][: ids.shape[1]]
    scorer.score(result.parts[0], max_err(t["embed"], want), what="embed()")
    if result.parts[0].status != "pass":
        diagnose(result, [(t["embed"], None)], {"no_positions": [F.embedding(ids, t["word_embedding.weight"])]})
    training = {p.name: p for p in result.parts}["training"]
    p = run.info["values"]["dropout_p"]
    pe, pt = t["embed.eval"], t["embed.train"]
    if result.parts[0].status != "pass":  # dropout placement is judged on a right embedding only
        training.status, training.message = "fail", "training mode not graded: embed() is wrong in eval mode"
    elif pe.shape != pt.shape:
        training.status, training.message = "fail", f"training-mode embed() gave shape {tuple(pt.shape)}"
    elif torch.equal(pe, pt):
        training.status, training.message = "fail", "training mode: embed_dropout is never applied (output as in eval)"
    elif float(torch.minimum(pt.abs(), (pt - pe / (1 - p)).abs()).max()) > 1e-5 or not bool((pt == 0).any()):
        training.status = "fail"
        training.message = f"training mode: embed() output is not the eval output dropped out once with p={p}"
    else:
        training.points, training.status = training.max, "pass"
    return finish(result)


def model_inputs(t):
    return t["ids"].long(), t["mask"].long()


def model_reference(t, v, act, result, weights=None):
    """(last_hidden_state, last_token) of transformers' GPT2Model on the weights, with the submission's eps/GELU."""
    w = weights if weights is not None else {k: x for k, x in t.items() if k not in ("ids", "mask", "logits", "head.input") and
                                              not k.startswith("last_")}
    eps_all = {v["eps_final"]} | {e for info in v["layers"] for e in (info["eps_attn"], info["eps_mlp"])}
    ids, mask = model_inputs(t)
    if len(eps_all) > 1:  # transformers takes one eps; the functional twin takes each
        result.messages.append(f"LayerNorm eps differ between layers ({sorted(eps_all)}); the functional reference used")
        return ref.f_model(ids, mask, w, H, v["layers"], v["eps_final"], act), w
    h, last = ref.model_forward(ref.hf_model(w, H, act, v["eps_final"]), ids, mask)
    _self_check(ref.f_model(ids, mask, w, H, v["layers"], v["eps_final"], act)[0], h, mask, "model")
    return (h, last), w


def model_errors(t, h_last):
    ids, mask = model_inputs(t)
    return max(max_err(t["last_hidden_state"], h_last[0], mask), max_err(t["last_token"], h_last[1]))


def check_model(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("model", scorer.parts("model"), output=run.output)
    if failed_run(result, run):
        return result
    t, v = run.tensors, run.info["values"]
    result.messages += run.info.get("notes", [])
    failed = part_failures(result, v)
    parts = {p.name: p for p in result.parts}
    if "hidden_state_to_token" not in failed:
        head(parts["hidden_state_to_token"], t, v, scorer, result)
    if "forward" in failed:
        return finish(result)
    act = pick_activation(v["layers"][0], lambda a: model_errors(t, model_reference(t, v, a, result)[0]), result)
    (h, last), w = model_reference(t, v, act, result)
    err = model_errors(t, (h, last))
    scorer.score(parts["forward"], err, what="forward() (last_hidden_state and last_token, right padding)")
    other = "tanh" if act == "exact" else "exact"
    gelu_info(result, act, model_errors(t, model_reference(t, v, other, result)[0]))
    ids, mask = model_inputs(t)
    if err > scorer.exact:
        variants = {b: ref.f_model(ids, mask, w, H, v["layers"], v["eps_final"], act, (b,)) for b in ref.MODEL_BUGS}
        diagnose(result, [(t["last_hidden_state"], mask), (t["last_token"], None)], variants)
    return finish(result)


def head(part: Part, t: dict, v: dict, scorer: Scorer, result: CheckResult) -> None:
    """hidden_state_to_token on the grader's own hidden states: logits = h @ word_embedding^T, tied."""
    want = F.linear(t["head.input"], t["word_embedding.weight"])
    scorer.score(part, max_err(t["logits"], want), what="hidden_state_to_token()")
    if not v.get("head_follows_word_embedding", True):
        part.points, part.status = 0.0, "fail"
        part.message = "the logits do not change with word_embedding: the head is not tied"
        if not result.diagnosis_key:
            result.diagnosis, result.diagnosis_key = BUGS["untied_head"], "untied_head"


def check_from_pretrained(run: Run, scorer: Scorer, hub_weights: dict, hub_note: str) -> CheckResult:
    """Graded by the weights it loads (effective maps, this project's names) against the checkpoint's: the model's
    outputs depend on the attention, layer and model code, which their own checks grade."""
    result = CheckResult("from_pretrained", scorer.parts("from_pretrained"), output=run.output)
    result.info.append(hub_note)
    if failed_run(result, run):
        return result
    t, v = run.tensors, run.info["values"]
    result.messages += run.info.get("notes", [])
    result.messages.append("graded by the weights it loads (the model's outputs depend on components graded in "
                           "their own checks)")
    loaded = {k: x for k, x in t.items() if k in hub_weights}
    errs = {k: max_err(loaded[k], x) if k in loaded else float("inf") for k, x in hub_weights.items()}
    err = max(errs.values())
    scorer.score(result.parts[0], err, what="the loaded weights")
    wrong = [k for k, e in errs.items() if e > scorer.exact]
    if wrong:
        result.messages.append(f"{len(wrong)} loaded tensor(s) differ from the checkpoint: {', '.join(wrong[:6])}"
                               + (" ..." if len(wrong) > 6 else ""))
        for bug in ("conv1d_not_transposed", "qkv_swapped"):
            mis = ref.mis_loaded(hub_weights, bug, v["n_layer"])
            if all(k in loaded and max_err(loaded[k], mis[k]) <= 1e-6 for k in mis):
                result.diagnosis, result.diagnosis_key = BUGS[bug], bug
    outputs = (v.get("parts") or {}).get("outputs")
    if outputs:
        result.info.append(f"running the loaded model: {outputs} (no points: graded by its weights)")
    elif not wrong and "last_hidden_state" in t:
        act = v["layers"][0].get("activation") if v["layers"][0].get("activation") in ref.ACTIVATIONS else "exact"
        gpt2 = ref.model_forward(ref.hf_model(hub_weights, H, "tanh", 1e-5), *model_inputs(t))
        result.info.append(f"the loaded model's outputs differ from transformers' GPT-2 (eps 1e-5, tanh GELU) by up "
                           f"to {model_errors(t, gpt2):.2g} (the submission's eps {v['eps_final']:g}, {act} GELU; "
                           f"its attention and layers as graded in their checks; no points)")
    return finish(result)


# ---- AdamW -------------------------------------------------------------------------------------------------------

def check_adamw(run: Run, scorer: Scorer, course_reference: torch.Tensor | None, course_path: str) -> CheckResult:
    result = CheckResult("adamw", scorer.parts("adamw"), output=run.output)
    if failed_run(result, run):
        return result
    t = run.tensors
    parts = {p.name: p for p in result.parts}
    tol = dict(atol=1e-6, rtol=1e-4)  # the course's optimizer_test.py
    course = parts["course_test"]
    if course_reference is None:
        course.status, course.message = "skipped", f"skipped: the course's reference {course_path} is absent"
    else:
        got = t["course.weight"]
        ok = got.shape == course_reference.shape and torch.allclose(got, course_reference, **tol)
        scorer.score(course, 0.0 if ok else max(max_err(got, course_reference), 1e-5 + 1e-12),
                     what="1000 steps of the course's optimizer_test")
    want = torch_adamw_run()
    got = {k[len("torch."):]: x for k, x in t.items() if k.startswith("torch.")}
    ok = all(k in got and got[k].shape == x.shape and torch.allclose(got[k], x, **tol) for k, x in want.items())
    err = max((max_err(got[k], x) if k in got else float("inf")) for k, x in want.items())
    scorer.score(parts["torch_adamw"], 0.0 if ok else max(err, 1e-5 + 1e-12),
                 what="200 steps against torch.optim.AdamW (two groups, weight decay)")
    if not ok:
        diagnose(result, [(got.get(k, torch.empty(0)), None) for k in want],
                 {b: list(torch_adamw_run(b).values()) for b in ref.ADAMW_BUGS})
    return finish(result)


def torch_adamw_run(bug: str | None = None) -> dict:
    net = probes.adamw_net()
    groups = probes.adamw_groups(net)
    data = list(probes.adamw_batches())
    if bug is None:
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
        for x, y in data:
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
    else:
        for g in groups:
            g.setdefault("lr", 1e-3)
        it = iter(data)

        def grads():
            x, y = next(it)
            net.zero_grad()
            ((net(x) - y) ** 2).mean().backward()

        ref.adamw_variant(list(net.parameters()), grads, groups, len(data), bug)
    return {n: p.detach().clone() for n, p in net.named_parameters()}
