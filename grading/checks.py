"""Each check: the probe's tensors from the sandbox against the reference, scored by the rubric, with a diagnosis.

A check is a list of rubric parts; a part scores full points at max error <= tolerance.exact, the rubric's
partial fraction at <= tolerance.close (with a hint), else 0. A part the submission's interface does not allow is
graded through the next method up (e.g. attention() through forward()) and says so.

The references are computed from the grader's own inputs and weights (`run.given`, grading/questions.py); what the
check's process returns is used as outputs only, each checked against the shape the grader expects
(questions.ANSWERS). LayerNorm eps and the GELU are read off outputs on the grader's inputs, never taken from the
check's word; what it says (notes, which route it took) picks between references or words a message, and a part it
says failed scores 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grading import questions
from grading import reference as ref
from grading.reference import BUGS
from grading.sandbox import Run
from grading.sandboxed import forbidden, probes

BUGS = {**BUGS,
        "dropout_before_softmax": "dropout before the softmax (masked positions get probability in training mode)",
        "no_attention_dropout": "no dropout on the attention probabilities (visible in training mode only)",
        "dropout_misplaced": "residual dropout misplaced (not applied to the dense layer's output, training mode)",
        "untied_head": "LM head not tied to word_embedding (hidden_state_to_token ignores it)",
        "heads_unmerged": "heads returned unmerged: (B, h, T, hd) where the course's interface is (B, T, C)"}
MASKS = {k: torch.tensor(v) for k, v in probes.MASKS.items()}
H = probes.H
MATCH = 1e-4  # a variant within this of the submission "is" its bug
PROBS_BUGS = ("no_scale", "no_causal", "pad_ignored", "pad_inverted", "softmax_axis")  # bugs of the probabilities


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
    # outputs that break the course's interface (questions.CONTRACTS): part -> what; finish() scores those parts 0
    broken: dict = field(default_factory=dict, repr=False)

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


def max_err(a: torch.Tensor | None, b: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """Largest absolute difference (over real tokens when rows (B, T) is given); inf when a is missing, on a shape
    mismatch or NaN."""
    if a is None or a.shape != b.shape:
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


def answers(run: Run, result: CheckResult, shapes: dict | None = None) -> dict:
    """The outputs the grader asked for, each with its expected shape (float32 already); anything else is dropped
    and said, so a part whose output is missing or malformed scores 0. A graded output of another shape than the
    course's interface fixes breaks the contract (questions.CONTRACTS): recorded in result.broken, for finish() to
    score its part 0 and name the shape; attention's heads returned unmerged are merged here (so their values can
    still be diagnosed) and recorded all the same."""
    shapes = shapes if shapes is not None else questions.ANSWERS[result.name]
    unmerged = questions.UNMERGED.get(result.name, {})
    kept, dropped = {}, []
    for name, x in run.tensors.items():
        want = shapes.get(name)
        got = tuple(x.shape)
        c = questions.contract(result.name, name) if want is not None else None
        if want is not None and got == tuple(want):
            kept[name] = x
        elif c is not None:
            part, fn, symbols = c
            if got == unmerged.get(name):
                kept[name] = x.transpose(1, 2).reshape(want)
                what = f"the heads unmerged, (B, h, T, hd) = {got}"
            else:
                what = f"shape {got}"
            result.broken.setdefault(part, f"{fn} returns {what}, not the course's {symbols} = {tuple(want)}")
        else:
            dropped.append(f"{name} {got}" + (f" (expected {tuple(want)})" if want else ""))
    if dropped:
        result.messages.append(f"finding: the check returned {len(dropped)} tensor(s) the grader did not ask for or "
                               f"of the wrong shape, ignored: {', '.join(dropped[:5])}" + (" ..." if len(dropped) > 5 else ""))
    return kept


def values_of(run: Run) -> dict:
    v = run.info.get("values")
    return v if isinstance(v, dict) else {}


def part_failures(result: CheckResult, values: dict) -> set:
    """Parts the probe could not run (a TODO, an error in that part only): 0 with the reason; returns their names."""
    failed = values.get("parts") if isinstance(values.get("parts"), dict) else {}
    for p in result.parts:
        if p.name in failed:
            msg = str(failed[p.name])
            p.status = "not implemented" if msg.startswith("not implemented") else "error"
            p.points, p.message = 0.0, f"{p.name}: {msg}"
    return {p.name for p in result.parts if p.name in failed}


THROUGH_FORWARD = "graded through forward()"  # the grader's words for a part scored on forward()'s output
RECORD_FIELDS = ("call", "part", "where")


def forbidden_records(values: dict) -> list[dict] | None:
    """The check's record of forbidden calls, as the probe writes it: a list of {call, part, where} strings, at most
    forbidden.MAX_RECORDS plus one per watch; None when it is missing or has any other shape (malformed)."""
    records = values.get("forbidden_calls")
    if not isinstance(records, list) or len(records) > 2 * forbidden.MAX_RECORDS:
        return None
    for r in records:
        if not (isinstance(r, dict) and set(r) == set(RECORD_FIELDS)
                and all(isinstance(r[k], str) and len(r[k]) <= 500 for k in RECORD_FIELDS)):
            return None
    return records


def forbidden_findings(result: CheckResult, run: Run, asked: list[str]) -> None:
    """The rubric's forbidden calls (`asked`, off when empty) that the check's process recorded: each costs the part it
    was made in, with a finding naming the call and the submission's line; a part graded through forward() shares
    forward()'s; a removed watch costs the whole check. The probe always writes the record when calls are watched, so
    a check that scored without one, or with a malformed one, scores 0 (the grader, not the check, decides)."""
    if not asked:
        return
    values = values_of(run)
    records = forbidden_records(values)
    parts = {p.name: p for p in result.parts}
    if records is None:
        if result.score > 0:
            for p in result.parts:
                p.points, p.status = 0.0, "error"
                p.message = "the check's record of forbidden calls is missing or malformed (the rubric's forbidden_calls)"
            result.messages.insert(0, "finding: the check's output was malformed: its record of the forbidden calls "
                                      "(the rubric's forbidden_calls) is missing or not a list of {call, part, where}")
            result.verdict = "error"
        return
    hit: dict[str, list[dict]] = {}
    for r in records:
        if not forbidden.matches(r["call"], asked):
            continue  # not one the grader asked to watch
        names = list(parts) if r["part"] == "*" else [r["part"]] if r["part"] in parts else []
        for name in names:
            hit.setdefault(name, []).append(r)
        if r["part"] == "*":
            result.messages.append(f"finding: the submission removed the grader's watch on {r['call']} (the rubric's "
                                   f"forbidden_calls): the whole check scores 0")
        elif names:
            result.messages.append(f"finding: forbidden call {r['call']} at {r['where']}, while grading {r['part']} "
                                   f"(the rubric's forbidden_calls): {r['part']} scores 0")
    for p in result.parts:  # a part scored on forward()'s output used what forward() called
        if p.name != "forward" and THROUGH_FORWARD in p.message and hit.get("forward"):
            hit.setdefault(p.name, []).extend(hit["forward"])
    for name, rs in hit.items():
        p = parts[name]
        first = rs[0]
        p.points, p.status = 0.0, "fail"
        p.message = (f"the submission removed the grader's watch on {first['call']}" if first["part"] == "*" else
                     f"forbidden call {first['call']} at {first['where']}") + " (the rubric's forbidden_calls)"
    if hit and result.verdict in ("pass", "partial"):
        result.verdict = "partial" if result.score > 0 else "fail"
    if isinstance(values.get("forbidden_unwatched"), list):
        result.messages.append("the check's process reports forbidden calls it could not watch: "
                               + "; ".join(str(u)[:300] for u in values["forbidden_unwatched"][:5]))


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


def contract_findings(result: CheckResult) -> None:
    """Each part whose output breaks the course's interface (result.broken) scores 0, with a finding naming the
    shape; a part graded through forward() shares forward()'s."""
    broken = dict(result.broken)
    if "forward" in broken:
        for p in result.parts:
            if p.name != "forward" and THROUGH_FORWARD in p.message:
                broken.setdefault(p.name, broken["forward"])
    for p in result.parts:
        if p.name in broken and p.status not in ("skipped", "not implemented", "error"):
            p.points, p.status = 0.0, "fail"
            p.message = f"{broken[p.name]} (the interface contract)"
            result.messages.append(f"finding: the interface contract: {broken[p.name]}: {p.name} scores 0")


def finish(result: CheckResult) -> CheckResult:
    contract_findings(result)
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
    t, g = answers(run, result), run.given
    result.messages += run.info.get("notes", [])
    if "attention" in result.broken and "forward" not in result.broken and "attention.left" in t:
        # attention() returns the heads unmerged and forward() merges them: the module keeps the course's interface
        del result.broken["attention"]
        result.messages.append("attention() returns the heads unmerged (B, h, T, hd) and forward() merges them, so "
                               "forward() keeps the course's (B, T, C): attention() graded merged")
    w = {k: v for k, v in g.items() if k.split(".")[0] in ("query", "key", "value")}
    refs = {case: ref.attention(w, g["x"], m, H) for case, m in MASKS.items()}
    _self_check(ref.f_attention(g["x"], w, MASKS["left"], H), refs["left"], MASKS["left"], "attention")
    parts = {p.name: p for p in result.parts}
    fwd = max(max_err(t.get(f"forward.{c}"), refs[c], MASKS[c]) for c in MASKS)
    scorer.score(parts["forward"], fwd, what="forward() (no padding, right and left padding)")
    if "attention.left" in t:
        scorer.score(parts["attention"], max_err(t["attention.left"], refs["left"], MASKS["left"]), what="attention()")
    else:
        scorer.score(parts["attention"], fwd, what="attention() (through forward())")
        parts["attention"].message = (parts["attention"].message + " " if parts["attention"].message else "") + \
            THROUGH_FORWARD
    if fwd > scorer.exact:
        student = [(t.get(f"forward.{c}"), MASKS[c]) for c in MASKS]
        diagnose(result, student, {b: [ref.f_attention(g["x"], w, MASKS[c], H, (b,)) for c in MASKS]
                                   for b in ref.ATTENTION_BUGS})
    elif "forward" in result.broken:  # right values, merged by the grader: the layout is the bug
        result.diagnosis, result.diagnosis_key = BUGS["heads_unmerged"], "heads_unmerged"
    training_properties(result, parts["training"], t, g, values_of(run))
    return finish(result)


def reference_probs(g: dict, route: str, bugs=()) -> torch.Tensor:
    """The eval-mode probabilities (B, h, T, T) for the grader's training-mode inputs, on the route the probe took
    (with one known bug of the scores or the softmax, if given)."""
    if route == "forward()":
        x = g["train.x"]
        q, k = (F.linear(x, g[f"{n}.weight"], g[f"{n}.bias"]).view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)
                for n in ("query", "key"))
    else:
        q, k = g["train.q"], g["train.k"]
    return ref.f_probs(q, k, MASKS["right"], bugs)


KEPT_Z = 6.0  # standard deviations of the binomial kept count allowed (a false alarm about once in 10^9 checks)


def kept_fraction_problem(kept: int, n: int, p: float) -> str:
    """"" when `kept` of `n` entries surviving dropout with probability p is consistent with Binomial(n, 1 - p) (within
    KEPT_Z standard deviations), else what is wrong: dropping everything (or a scale of 0) passes every check of the
    values alone."""
    if n == 0:
        return "no entry to judge the dropout on"
    sd = math.sqrt(n * p * (1 - p))
    if abs(kept - n * (1 - p)) <= KEPT_Z * sd:
        return ""
    return (f"{kept} of {n} entries kept where dropout with p={p} keeps {n * (1 - p):.0f} +- {KEPT_Z * sd:.0f} "
            f"({KEPT_Z:g} standard deviations)")


def training_properties(result: CheckResult, part: Part, t: dict, g: dict, values: dict) -> None:
    """Dropout on: no masked key gets probability, and each probability is dropped (0) or scaled by 1/(1-p) of the
    reference's (the eval-mode probabilities must be the reference's, on the grader's inputs)."""
    p = probes.DROPOUT_P
    route = "forward()" if values.get("probs_route") == "forward()" else "attention()"
    pt, pe_own = t.get("probs.train"), t.get("probs.eval")
    # a forward() with one known bug of the probabilities has its dropout judged on that bug's: it costs forward only
    bug = result.diagnosis_key if result.diagnosis_key in PROBS_BUGS else None
    pe = reference_probs(g, route, (bug,) if bug else ())
    real_q = MASKS["right"].bool()[:, None, :, None].expand_as(pe)
    if pt is None or pe_own is None or not float((pe_own - pe)[real_q].abs().max()) <= (MATCH if bug else 1e-5):
        part.points, part.status = 0.0, "fail"
        part.message = (f"training mode not graded: the eval-mode attention probabilities (probed through {route}) "
                        f"are not the reference's")
        return
    pe = pe_own  # the submission's own, now known to be computed from the grader's inputs
    allowed = ref.bool_mask(MASKS["right"]).expand_as(pt)
    pt = torch.nan_to_num(pt, nan=float("inf"))  # e.g. dropout on -inf scores: NaN counts as a leak
    leak = float(pt[real_q & ~allowed].abs().max())
    kept = real_q & allowed
    off_pattern = float(torch.minimum(pt[kept].abs(), (pt[kept] - pe[kept] / (1 - p)).abs()).max())
    dropped = bool(((pt[kept] - pe[kept]).abs() > 1e-6).any())
    problems = []
    if leak > 1e-6:
        problems.append(f"in training mode masked positions get probability (up to {leak:.2g})")
    if not dropped:
        problems.append("in training mode the attention probabilities are not dropped out")
        result.diagnosis, result.diagnosis_key = result.diagnosis or BUGS["no_attention_dropout"], \
            result.diagnosis_key or "no_attention_dropout"
    elif off_pattern > 1e-5:
        problems.append("dropout is not applied to the probabilities after the softmax (kept entries are not p/(1-p))")
    else:
        live = kept & (pe.abs() > 1e-12)
        if why := kept_fraction_problem(int((pt[live] != 0).sum()), int(live.sum()), p):
            problems.append(f"in training mode the attention probabilities are not dropped out at rate p: {why}")
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


# ---- what the submission chose, read off its outputs on the grader's inputs ----------------------------------------

def measured_eps(y: torch.Tensor | None, x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor) -> float | None:
    """A LayerNorm's eps from its output y on the grader's small-variance input x (gain, bias the grader's): per
    row y - bias = gain * (x - mean) / sqrt(var + eps). None when y is not a LayerNorm's output of x."""
    if y is None:
        return None
    x64, y64 = x.double(), y.double()
    xc = x64 - x64.mean(-1, keepdim=True)
    var = (xc ** 2).mean(-1)
    den = gain.double() * xc
    use = den.abs() > 0.1 * den.abs().amax(-1, keepdim=True)
    ratio = (y64 - bias.double()) / den
    scale = torch.stack([ratio[i][use[i]].median() for i in range(x.shape[0])])  # 1 / sqrt(var + eps)
    eps = float((1 / scale ** 2 - var).median())
    if not (math.isfinite(eps) and -1e-9 <= eps <= 1e-2):
        return None
    eps = max(eps, 0.0)
    if max_err(y, F.layer_norm(x, x.shape[-1:], gain, bias, eps)) > 1e-3:
        return None
    return eps


def layer_eps(t: dict, g: dict, prefix: str, name: str, result: CheckResult) -> float:
    eps = measured_eps(t.get(f"ln.{prefix}{name}"), g["ln.input"], g[f"{prefix}{name}.weight"], g[f"{prefix}{name}.bias"])
    if eps is None:
        result.messages.append(f"{prefix}{name} does not act as a LayerNorm on the grader's input; graded with eps 1e-5")
        return 1e-5
    return eps


def gelu_of(y: torch.Tensor | None, x: torch.Tensor) -> str | None:
    """Which GELU the layer's interm_af computes on the grader's points: 'exact', 'tanh', or None."""
    for name, approx in (("exact", "none"), ("tanh", "tanh")):
        if y is not None and torch.allclose(y, F.gelu(x, approximate=approx), atol=1e-6):
            return name
    return None


def pick_activation(act, candidates_fn, result):
    """The submission's GELU (as its interm_af computes it); where it cannot be read, the closer of the two."""
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


# ---- layer, embeddings, model -------------------------------------------------------------------------------------

INPUTS = ("x", "add.", "train.", "ln.input", "gelu.input", "ids", "head.")  # given tensors that are not weights


def weights_of(g: dict) -> dict:
    return {k: x for k, x in g.items() if not k.startswith(INPUTS)}


def check_layer(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("layer", scorer.parts("layer"), output=run.output)
    if failed_run(result, run):
        return result
    t, g, v = answers(run, result), run.given, values_of(run)
    result.messages += run.info.get("notes", [])
    w, x = weights_of(g), g["x"]
    eps = (layer_eps(t, g, "", "attention_layer_norm", result), layer_eps(t, g, "", "out_layer_norm", result))

    def fwd_err(act):
        return max(max_err(t.get(f"forward.{c}"), ref.layer(w, x, m, H, act, *eps), m) for c, m in MASKS.items())

    act = pick_activation(gelu_of(t.get("gelu"), g["gelu.input"]), fwd_err, result)
    _self_check(ref.f_layer(x, w, MASKS["left"], H, act, *eps), ref.layer(w, x, MASKS["left"], H, act, *eps),
                MASKS["left"], "layer")
    parts = {p.name: p for p in result.parts}
    err = fwd_err(act)
    scorer.score(parts["forward"], err, what="forward()")
    gelu_info(result, act, fwd_err("tanh" if act == "exact" else "exact"))
    if "add" in t:
        want = g["add.input"] + F.linear(g["add.output"], w["attention_dense.weight"], w["attention_dense.bias"])
        scorer.score(parts["add"], max_err(t["add"], want), what="add()")
    else:
        scorer.score(parts["add"], err, what="add() (through forward())")
        parts["add"].message += " " + THROUGH_FORWARD
    if err > scorer.exact:
        student = [(t.get(f"forward.{c}"), m) for c, m in MASKS.items()]
        diagnose(result, student, {b: [ref.f_layer(x, w, m, H, act, *eps, (b,)) for m in MASKS.values()]
                                   for b in ref.LAYER_BUGS})
    # a forward() with one known bug has its dropouts judged on that bug's reference: the bug costs forward only
    bug = result.diagnosis_key if result.diagnosis_key in ref.LAYER_BUGS else None
    layer_training(result, parts["training"], t, g, v, act, eps, err <= scorer.exact or bug is not None,
                   (bug,) if bug else ())
    return finish(result)


def layer_training(result, training, t, g, v, act, eps, forward_ok, bugs=()) -> None:
    """Training mode with the grader's dropout masks in the two residual dropouts: the output is the grader's to
    compute (with forward()'s known bug, if it has one), and right only where each dropout acts on its dense
    layer's output, once."""
    failed = str((v.get("parts") if isinstance(v.get("parts"), dict) else {}).get("training", ""))
    mask = MASKS["nopad"]
    if failed.startswith("error: skipped:"):  # the part stays in the maximum: a check never decides what is graded
        training.status, training.points = "error", 0.0
        training.message = ("training mode not graded: the residual dropouts could not be found by the course's "
                            f"names ({failed[len('error: skipped: '):]})")
        return
    training.status = "fail"
    if failed:
        training.message = f"training mode: {failed}"
    elif not forward_ok:
        training.message = "training mode not graded: forward() is wrong in eval mode (and no single known bug)"
        return
    else:
        drop = (g["train.mask_attention"], g["train.mask_out"], probes.DROPOUT_P)
        want = ref.f_layer(g["x"], weights_of(g), mask, H, act, *eps, bugs, drop=drop)
        if max_err(t.get("train"), want) <= (MATCH if bugs else 1e-5):
            training.points, training.status = training.max, "pass"
            return
        eval_out = ref.f_layer(g["x"], weights_of(g), mask, H, act, *eps, bugs)
        never = max_err(t.get("train"), eval_out) <= 1e-5
        training.message = ("training mode: the residual dropouts are never applied" if never else
                            "training mode: the residual dropouts are not applied (once each) to the outputs of "
                            "attention_dense and out_dense")
    if not result.diagnosis_key:
        result.diagnosis, result.diagnosis_key = BUGS["dropout_misplaced"], "dropout_misplaced"


def check_embed(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("embed", scorer.parts("embed"), output=run.output)
    if failed_run(result, run):
        return result
    t, g = answers(run, result), run.given
    ids = g["ids"].long()
    want = F.embedding(ids, g["word_embedding.weight"]) + g["pos_embedding.weight"][: ids.shape[1]]
    err = max_err(t.get("embed"), want)
    scorer.score(result.parts[0], err, what="embed()")
    if result.parts[0].status != "pass":
        diagnose(result, [(t.get("embed"), None)], {"no_positions": [F.embedding(ids, g["word_embedding.weight"])]})
    training = {p.name: p for p in result.parts}["training"]
    p = probes.DROPOUT_P
    pt = t.get("embed.train")
    tol = max(1e-5, 4 * err)
    if result.parts[0].status != "pass":  # dropout placement is judged on a right embedding only
        training.status, training.message = "fail", "training mode not graded: embed() is wrong in eval mode"
    elif pt is None:
        training.status, training.message = "fail", "training mode: embed() gave no output of the expected shape"
    elif max_err(pt, want) <= tol:
        training.status, training.message = "fail", "training mode: embed_dropout is never applied (output as in eval)"
    elif float(torch.minimum(pt.abs(), (pt - want / (1 - p)).abs()).max()) > tol or not bool((pt == 0).any()):
        training.status = "fail"
        training.message = f"training mode: embed() output is not the eval output dropped out once with p={p}"
    elif why := kept_fraction_problem(int((pt[want != 0] != 0).sum()), int((want != 0).sum()), p):
        training.status = "fail"
        training.message = f"training mode: embed_dropout does not drop at rate p: {why}"
    else:
        training.points, training.status = training.max, "pass"
    return finish(result)


def model_reference(g, layers, eps_final, act):
    """(last_hidden_state, last_token) of transformers' GPT2Model on the grader's weights, with the given eps/GELU;
    the functional twin where the LayerNorm eps differ (transformers takes one). Eps measured off a submission's
    outputs (measured_eps) differ in their last digits where the submission uses one value: within 0.1% of each
    other they are that one value."""
    w = weights_of(g)
    ids, mask = g["ids"].long(), MASKS["right"]
    eps_all = [eps_final] + [e for info in layers for e in (info["eps_attn"], info["eps_mlp"])]
    if max(eps_all) - min(eps_all) > 1e-3 * max(eps_all):
        return ref.f_model(ids, mask, w, H, layers, eps_final, act)
    h, last = ref.model_forward(ref.hf_model(w, H, act, eps_final), ids, mask)
    _self_check(ref.f_model(ids, mask, w, H, layers, eps_final, act)[0], h, mask, "model")
    return h, last


def model_errors(t, h_last):
    return max(max_err(t.get("last_hidden_state"), h_last[0], MASKS["right"]), max_err(t.get("last_token"), h_last[1]))


def check_model(run: Run, scorer: Scorer) -> CheckResult:
    result = CheckResult("model", scorer.parts("model"), output=run.output)
    if failed_run(result, run):
        return result
    t, g, v = answers(run, result), run.given, values_of(run)
    result.messages += run.info.get("notes", [])
    failed = part_failures(result, v)
    parts = {p.name: p for p in result.parts}
    if "hidden_state_to_token" not in failed:
        head(parts["hidden_state_to_token"], t, g, scorer, result)
    if "forward" in failed:
        return finish(result)
    eps_final = layer_eps(t, g, "", "final_layer_norm", result)
    gelus = [gelu_of(t.get(f"gelu.gpt_layers.{i}"), g["gelu.input"]) for i in range(probes.L)]
    if v.get("own_components") is True:  # its own layers ran (it said so): their eps and GELU, as measured
        layers = [{"eps_attn": layer_eps(t, g, f"gpt_layers.{i}.", "attention_layer_norm", result),
                   "eps_mlp": layer_eps(t, g, f"gpt_layers.{i}.", "out_layer_norm", result)} for i in range(probes.L)]
        act = pick_activation(gelus[0], lambda a: model_errors(t, model_reference(g, layers, eps_final, a)),
                              result)
    else:  # the reference layers stood in: their choices
        layers = [dict(probes.STAND_IN) for _ in range(probes.L)]
        act = probes.STAND_IN["activation"]
    h_last = model_reference(g, layers, eps_final, act)
    err = model_errors(t, h_last)
    scorer.score(parts["forward"], err, what="forward() (last_hidden_state and last_token, right padding)")
    if gelus[0] == "exact":
        other = model_reference(g, layers, eps_final, "tanh" if act == "exact" else "exact")
        gelu_info(result, "exact", model_errors({"last_hidden_state": other[0], "last_token": other[1]}, h_last))
    if err > scorer.exact:
        ids, w = g["ids"].long(), weights_of(g)
        variants = {b: ref.f_model(ids, MASKS["right"], w, H, layers, eps_final, act, (b,)) for b in ref.MODEL_BUGS}
        diagnose(result, [(t.get("last_hidden_state"), MASKS["right"]), (t.get("last_token"), None)], variants)
    return finish(result)


def head(part: Part, t: dict, g: dict, scorer: Scorer, result: CheckResult) -> None:
    """hidden_state_to_token on the grader's hidden states: logits = h @ word_embedding^T, and tied: with the
    grader's second word_embedding in place the logits follow it."""
    h = g["head.input"]
    logits, tied = t.get("logits"), t.get("logits.tied")
    scorer.score(part, max_err(logits, F.linear(h, g["word_embedding.weight"])), what="hidden_state_to_token()")
    follows = max_err(tied, F.linear(h, g["head.word_embedding"])) <= scorer.exact
    unmoved = logits is not None and max_err(tied, logits) <= 1e-6
    if (part.status == "pass" and not follows) or (part.status != "pass" and unmoved):
        part.points, part.status = 0.0, "fail"
        part.message = "the logits do not follow word_embedding: the head is not tied"
        if not result.diagnosis_key:
            result.diagnosis, result.diagnosis_key = BUGS["untied_head"], "untied_head"


def check_from_pretrained(run: Run, scorer: Scorer, hub_weights: dict, hub_note: str) -> CheckResult:
    """Graded by the weights it loads (effective maps, this project's names) against the checkpoint's: the model's
    outputs depend on the attention, layer and model code, which their own checks grade."""
    result = CheckResult("from_pretrained", scorer.parts("from_pretrained"), output=run.output)
    result.info.append(hub_note)
    if failed_run(result, run):
        return result
    shapes = {**{k: tuple(x.shape) for k, x in hub_weights.items()}, **questions.ANSWERS["from_pretrained"]}
    t, g, v = answers(run, result, shapes), run.given, values_of(run)
    result.messages += run.info.get("notes", [])
    result.messages.append("graded by the weights it loads (the model's outputs depend on components graded in "
                           "their own checks)")
    errs = {k: max_err(t.get(k), x) for k, x in hub_weights.items()}
    err = max(errs.values())
    scorer.score(result.parts[0], err, what="the loaded weights")
    wrong = [k for k, e in errs.items() if e > scorer.exact]
    if wrong:
        result.messages.append(f"{len(wrong)} loaded tensor(s) differ from the checkpoint: {', '.join(wrong[:6])}"
                               + (" ..." if len(wrong) > 6 else ""))
        for bug in ("conv1d_not_transposed", "qkv_swapped"):
            mis = ref.mis_loaded(hub_weights, bug, probes.L)
            if all(max_err(t.get(k), mis[k]) <= 1e-6 for k in mis):
                result.diagnosis, result.diagnosis_key = BUGS[bug], bug
    parts = v.get("parts") if isinstance(v.get("parts"), dict) else {}
    if parts.get("outputs"):
        result.info.append(f"running the loaded model: {str(parts['outputs'])[:500]} (no points: graded by its weights)")
    elif not wrong and "last_hidden_state" in t:
        gpt2 = ref.model_forward(ref.hf_model(hub_weights, H, "tanh", 1e-5), g["ids"].long(), MASKS["right"])
        result.info.append(f"the loaded model's outputs differ from transformers' GPT-2 (eps 1e-5, tanh GELU) by up "
                           f"to {model_errors(t, gpt2):.2g} (its attention and layers as graded in their checks; "
                           f"no points)")
    return finish(result)


# ---- AdamW -------------------------------------------------------------------------------------------------------

def check_adamw(run: Run, scorer: Scorer, course_reference: torch.Tensor | None, course_path: str) -> CheckResult:
    result = CheckResult("adamw", scorer.parts("adamw"), output=run.output)
    if failed_run(result, run):
        return result
    t = answers(run, result)
    parts = {p.name: p for p in result.parts}
    tol = dict(atol=1e-6, rtol=1e-4)  # the course's optimizer_test.py
    course = parts["course_test"]
    if course_reference is None:
        course.status, course.message = "skipped", f"skipped: the course's reference {course_path} is absent"
    else:
        got = t.get("course.weight")
        ok = got is not None and got.shape == course_reference.shape and torch.allclose(got, course_reference, **tol)
        scorer.score(course, 0.0 if ok else max(max_err(got, course_reference), 1e-5 + 1e-12),
                     what="1000 steps of the course's optimizer_test")
    got = {k[len("torch."):]: x for k, x in t.items() if k.startswith("torch.")}
    ok, err = False, float("inf")
    for form in ("torch", "handout"):  # both correct forms: each drifts from the other past the tolerance, rarely
        want = torch_adamw_run(run.given, form=form)
        ok = all(k in got and torch.allclose(got[k], x, **tol) for k, x in want.items())
        err = min(err, max(max_err(got.get(k), x) for k, x in want.items()))
        if ok:  # the other form's replay cannot change a full score
            break
    scorer.score(parts["torch_adamw"], 0.0 if ok else max(err, 1e-5 + 1e-12),
                 what="200 steps against torch.optim.AdamW (two groups, weight decay)")
    if not ok:
        diagnose(result, [(got.get(k), None) for k in want],
                 {b: list(torch_adamw_run(run.given, b).values()) for b in ref.ADAMW_BUGS})
    return finish(result)


def torch_adamw_run(given: dict, bug: str | None = None, form: str = "torch") -> dict:
    """The grader's net trained on the grader's batches: torch.optim.AdamW, the handout's correct form
    (form="handout"), or a variant with one bug."""
    net = probes.adamw_net(given)
    groups = probes.adamw_groups(net)
    data = list(zip(given["x"], given["y"]))
    if bug is None and form == "torch":
        opt = torch.optim.AdamW(groups, betas=(0.9, 0.99), eps=1e-8)  # each group sets its lr and weight decay
        for x, y in data:
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
    else:
        it = iter(data)

        def grads():
            x, y = next(it)
            net.zero_grad()
            ((net(x) - y) ** 2).mean().backward()

        ref.adamw_variant(list(net.parameters()), grads, groups, len(data), bug, form=form)
    return {n: p.detach().clone() for n, p in net.named_parameters()}
