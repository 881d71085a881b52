"""The grader's outputs: a terminal table, the full JSON report, Gradescope's results.json, a batch CSV row."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from grading.checks import BUGS
from grading.grader import Report


def table(report: Report) -> str:
    rows = [("check", "points", "max", "verdict", "diagnosis")]
    for c in report.checks:
        rows.append((c.name, f"{c.score:g}", f"{c.max_score:g}", c.verdict, c.diagnosis or "-"))
    rows.append(("total", f"{report.total:g}", f"{report.max_total:g}", "", ""))
    widths = [max(len(r[i]) for r in rows[:-1] + [rows[-1]]) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.insert(1, "-" * min(120, sum(widths) + 30))
    details = []
    for c in report.checks:
        notes = [p.message for p in c.parts if p.message and p.status != "pass"] + c.messages + \
            [f"info: {i}" for i in c.info]
        details += [f"  {c.name}: {n}" for n in dict.fromkeys(notes)]
    details += [f"  {finding}" for finding in report.environment]
    if report.leaderboard or report.predictions:
        details += [f"  predictions: {m}" for m in report.predictions]
    return "\n".join(lines + ([""] + details if details else []))


# What each rubric part grades, as Gradescope names its test: one test per graded function (a part of another rubric
# is named by its check and part)
FUNCTIONS = {
    ("attention", "forward"): "CausalSelfAttention.forward",
    ("attention", "attention"): "CausalSelfAttention.attention",
    ("attention", "training"): "CausalSelfAttention.attention in training mode (attention dropout)",
    ("layer", "add"): "GPT2Layer.add",
    ("layer", "forward"): "GPT2Layer.forward",
    ("layer", "training"): "GPT2Layer.forward in training mode (residual dropouts)",
    ("embed", "embed"): "GPT2Model.embed",
    ("embed", "training"): "GPT2Model.embed in training mode (embedding dropout)",
    ("model", "forward"): "GPT2Model.forward",
    ("model", "hidden_state_to_token"): "GPT2Model.hidden_state_to_token",
    ("from_pretrained", "from_pretrained"): "GPT2Model.from_pretrained",
    ("adamw", "course_test"): "AdamW: the course's optimizer_test",
    ("adamw", "torch_adamw"): "AdamW: against torch.optim.AdamW",
}


def part_test_name(check: str, part: str) -> str:
    return f"{check}: {FUNCTIONS.get((check, part), part)}"


def part_tests(c) -> list[dict]:
    """Gradescope's tests for one check: one per rubric part (a function, or a function in training mode), so a
    failing part never shows inside a passing one's test; each says its own points, then the check's diagnosis and
    findings; the output of the student's code goes with the check's first test that lost points (else its first).
    The scores and maxima add up to the check's."""
    lost = [i for i, p in enumerate(c.parts) if p.status not in ("pass", "skipped")]
    with_output = lost[0] if lost else 0
    tests = []
    for i, p in enumerate(c.parts):
        err = f", max error {p.error:.3g}" if p.error is not None and p.error != float("inf") else ""
        lines = [f"{p.status}: {p.points:g} / {p.max if p.status != 'skipped' else 0:g}{err}"
                 + (f" {p.message}" if p.message else "")]
        if c.diagnosis:
            lines.append(f"Diagnosis ({c.name}): {c.diagnosis}")
        lines += list(dict.fromkeys(c.messages)) + [f"Info (no points): {x}" for x in c.info]
        if i == with_output and c.output.strip():
            lines.append("Output of your code (truncated):\n" + c.output[-2000:])
        tests.append({"name": part_test_name(c.name, p.name), "score": round(p.points, 4),
                      "max_score": 0.0 if p.status == "skipped" else p.max, "output": "\n".join(lines),
                      "visibility": "visible"})
    return tests


def stable_diagnosis(check: dict) -> str:
    """A check's diagnosis as the CSV and the class report's bug ranking give it: what every run on the same
    submission says, the named bug's own text. The measured error and, where no bug matches exactly, the closest
    one change with the grader's fresh inputs on each run (the student pages keep both), so a rerun's CSV equals the
    first."""
    if check.get("diagnosis_key"):
        return BUGS.get(check["diagnosis_key"], check["diagnosis"])
    if check.get("diagnosis"):
        return f"{check['verdict']}, no typical bug matches exactly"
    return check["verdict"]


def gradescope(report: Report) -> dict:
    """Gradescope's results.json: score, execution_time, tests (name, score, max_score, output, visibility; one test
    per rubric part, named by the function it grades: part_tests), leaderboard."""
    out = {
        "score": round(report.total, 4),
        "execution_time": round(report.seconds, 2),
        "output": f"Graded against the reference GPT-2: {report.total:g} / {report.max_total:g}",
        "tests": [t for c in report.checks for t in part_tests(c)],
    }
    if report.environment:  # said once for the submission, not on every check it broke
        out["output"] += "\n" + "\n".join(report.environment)
    if report.leaderboard:
        out["leaderboard"] = report.leaderboard
    if report.predictions:
        out["output"] += "\nPredictions: " + "; ".join(report.predictions)
    return out


@contextmanager
def atomic_open(path: str | os.PathLike, newline: str | None = None, private: bool = False):
    """A text file written through a temporary name and renamed at the end, so a reader never sees half a file;
    `private`: readable and writable by this user only (0600), from its first byte."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    if private:
        os.fchmod(fd, 0o600)  # a .tmp left by a crash keeps its mode otherwise
    with open(fd, "w", newline=newline, encoding="utf-8", errors="backslashreplace") as f:
        yield f
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, data: dict, private: bool = False) -> None:
    with atomic_open(path, private=private) as f:
        f.write(json.dumps(data, indent=1, default=str) + "\n")
