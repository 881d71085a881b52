"""Grade one submission: each check in its own sandboxed process, compared in this process, scored by the rubric.

    with Grader() as g:
        report = g.grade("submissions/alice", predictions="submissions/alice/predictions", gold="../shared/data/cs224n")
        report.total, report.checks
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grading import checks, questions
from grading.environment import COURSE_PACKAGES, environment_findings
from grading.sandbox import Limits, Run, Sandbox, copy_submission, sweep_leftovers
from grading.sandboxed import forbidden, probes
from models.hub import data_dir

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUBRIC = Path(__file__).with_name("rubric.json")
CHECKS = ("attention", "layer", "embed", "model", "from_pretrained", "adamw")
_MODEL = ("config", "utils", "modules.attention", "modules.gpt2_layer", "models.gpt2")
IMPORTS = {"attention": _MODEL[:3], "layer": _MODEL[:4], "embed": _MODEL, "model": _MODEL, "from_pretrained": _MODEL,
           "adamw": ("optimizer",)}  # the submission's modules each check imports
HUB_SIZE = dict(n_embd=probes.D, n_layer=probes.L, n_head=probes.H)
HUB_NOTE = ("the checkpoint loaded as 'gpt2' is a random-init GPT-2 (n_embd {n_embd}, {n_layer} layers, {n_head} heads, "
            "GPT-2's vocabulary) in a temporary offline Hugging Face cache: random weights test the name mapping as "
            "well as the official ones").format(**HUB_SIZE)


class RubricError(ValueError):
    """A rubric file that cannot be used; the message names the problem."""


def load_rubric(path: str | os.PathLike = DEFAULT_RUBRIC) -> dict:
    try:
        rubric = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RubricError(f"rubric file not found: {path}") from None
    except ValueError as e:
        raise RubricError(f"rubric file {path} is not valid JSON: {e}") from None
    default = json.loads(DEFAULT_RUBRIC.read_text())
    for key in ("tolerance", "partial_fraction", "checks"):
        if key not in rubric:
            raise RubricError(f"rubric {path} lacks {key!r} (see {DEFAULT_RUBRIC})")
    for check, parts in rubric["checks"].items():
        if check not in default["checks"]:
            raise RubricError(f"rubric {path}: unknown check {check!r}; known: {sorted(default['checks'])}")
        if set(parts) != set(default["checks"][check]):
            raise RubricError(f"rubric {path}: check {check!r} must have the parts {sorted(default['checks'][check])}, "
                              f"got {sorted(parts)}")
        for part, pts in parts.items():
            if not isinstance(pts, (int, float)) or pts < 0:
                raise RubricError(f"rubric {path}: {check}.{part} points must be a number >= 0, got {pts!r}")
    tol = rubric["tolerance"]
    if not (isinstance(tol, dict) and 0 < tol.get("exact", -1) <= tol.get("close", -1)):
        raise RubricError(f"rubric {path}: tolerance must be {{'exact': e, 'close': c}} with 0 < e <= c, got {tol!r}")
    allow = rubric.get("allow_packages", [])
    if not (isinstance(allow, list) and all(isinstance(a, str) and a.isidentifier() for a in allow)):
        raise RubricError(f"rubric {path}: allow_packages must be a list of module names, got {allow!r}")
    if not 0 <= rubric["partial_fraction"] <= 1:
        raise RubricError(f"rubric {path}: partial_fraction must be in [0, 1], got {rubric['partial_fraction']!r}")
    banned = rubric.get("forbidden_calls", {})
    if not isinstance(banned, dict):
        raise RubricError(f"rubric {path}: forbidden_calls must map a check (or '*' for every check) to a list of "
                          f"dotted names, got {banned!r}")
    for check, names in banned.items():
        if check != "*" and check not in default["checks"]:
            raise RubricError(f"rubric {path}: forbidden_calls names an unknown check {check!r}; known: "
                              f"{sorted(default['checks'])} or '*'")
        if not isinstance(names, list):
            raise RubricError(f"rubric {path}: forbidden_calls[{check!r}] must be a list of dotted names, got {names!r}")
        for name in names:
            try:
                forbidden.places(name)
            except ValueError as e:
                raise RubricError(f"rubric {path}: forbidden_calls[{check!r}]: {e}") from None
    return rubric


def forbidden_calls(rubric: dict, check: str) -> list[str]:
    """The rubric's forbidden calls for one check: its own list and the one for every check ('*')."""
    banned = rubric.get("forbidden_calls", {})
    return list(dict.fromkeys([*banned.get(check, []), *banned.get("*", [])]))


@dataclass
class Report:
    submission: str
    checks: list = field(default_factory=list)  # CheckResult
    leaderboard: list = field(default_factory=list)  # {'name', 'value'}
    predictions: list = field(default_factory=list)  # messages about prediction files
    sandbox: dict = field(default_factory=dict)
    environment: list = field(default_factory=list)  # findings on imports outside the course's environment
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return sum(c.score for c in self.checks)

    @property
    def max_total(self) -> float:
        return sum(c.max_score for c in self.checks)

    def to_dict(self) -> dict:
        return {"submission": self.submission, "score": self.total, "max_score": self.max_total,
                "seconds": self.seconds, "checks": [c.to_dict() for c in self.checks],
                "leaderboard": self.leaderboard, "predictions": self.predictions, "sandbox": self.sandbox,
                "environment": self.environment}


class Grader:
    def __init__(self, rubric: dict | None = None, limits: Limits | None = None, shared_dir: str | None = None):
        self.rubric = rubric or load_rubric()
        self.scorer = checks.Scorer(self.rubric)
        self.sandbox = Sandbox(limits)
        self.sandbox.packages = sorted({*COURSE_PACKAGES, *self.rubric.get("allow_packages", ())})
        # shared_dir: a folder laid out as ../shared (data/cs224n/...); else the data resolver's (data/ in the project)
        data = Path(shared_dir) / "data" if shared_dir else data_dir()
        self.course_npy = data / "cs224n" / "optimizer_test.npy"
        self._hub: tuple[str, dict] | None = None
        sweep_leftovers()  # what graders killed here before left in the temporary folder
        self._tmp = tempfile.TemporaryDirectory(prefix=f"grading-hub-{os.getpid()}-")

    def close(self, keep_warm: bool = True) -> None:
        """Remove the grader's temporary files and give back its sandbox (keep_warm: Sandbox.release's)."""
        self.sandbox.release(keep_warm)
        self._tmp.cleanup()

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hub(self) -> tuple[str, dict]:
        """An HF_HOME whose hub cache holds a random-init GPT-2 as 'gpt2' (the hub's real layout), and its weights
        under this project's names."""
        if self._hub is None:
            import transformers

            from models.loading import hf_to_ours

            cfg = transformers.GPT2Config(**HUB_SIZE)
            with torch.random.fork_rng():  # a secret seed: the checkpoint cannot be known before it is loaded
                torch.manual_seed(secrets.randbits(63))
                model = transformers.GPT2Model(cfg)
                with torch.no_grad():
                    for name, p in model.named_parameters():  # no bias or LayerNorm left at 0 / 1
                        if name.endswith("bias") or ".ln_" in name:
                            p.add_(torch.randn_like(p) * 0.1)
            transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar is noise here
            home = Path(self._tmp.name) / "hf"
            commit = "0123456789abcdef0123456789abcdef01234567"
            repo = home / "hub" / "models--gpt2"
            model.save_pretrained(repo / "snapshots" / commit)
            (repo / "refs").mkdir(parents=True)
            (repo / "refs" / "main").write_text(commit)
            self._hub = (str(home), hf_to_ours(model.state_dict(), cfg.n_layer))
        return self._hub

    def grade(self, submission: str | os.PathLike, only: tuple[str, ...] = CHECKS, predictions=None, gold=None,
              timeout: float | None = None) -> Report:
        submission = Path(submission)
        if not submission.is_dir():
            raise NotADirectoryError(f"submission folder not found: {submission}")
        # The grader's own set-up (the fork server's cold start, the hub checkpoint) before the submission's clock
        # starts: on a busy machine it takes seconds the submission's deadline must not pay for.
        self.sandbox.warm(wait=False)  # the fork server starts while the hub checkpoint is made (both seconds)
        if "from_pretrained" in only:
            self.hub()
        self.sandbox.warm()
        start = time.monotonic()
        report = Report(str(submission))
        # One pruned copy for all checks (caps on files and bytes, links that leave it dropped): each check then
        # copies that, so a folder of 30,000 files is looked at once, not once per check.
        staged = Path(tempfile.mkdtemp(prefix="submission-", dir=self._tmp.name))
        try:
            found = copy_submission(submission, staged, self.sandbox.limits.max_files,
                                     self.sandbox.limits.max_submission_mb)
            self._grade_staged(report, staged, only, timeout, start + self.sandbox.limits.submission_timeout)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        if report.checks and found:
            report.checks[0].messages[:0] = [f"finding: {f}" for f in found]
        report.environment = environment_findings(report, self.rubric.get("allow_packages", ()))
        if predictions is not None:
            from grading.predictions import score_predictions

            report.leaderboard, report.predictions = score_predictions(predictions, gold)
        report.seconds = time.monotonic() - start
        return report

    def _grade_staged(self, report: Report, submission: Path, only: tuple[str, ...], timeout: float | None,
                      deadline: float) -> None:
        """Every check of `only`, none past `deadline` (the whole submission's, besides each check's own)."""
        per_check = timeout or self.sandbox.limits.timeout
        broken = self._imports(submission, min(per_check, max(1.0, deadline - time.monotonic()))) if only else {}
        for name in only:
            left = deadline - time.monotonic()
            if left < 1.0:  # the whole submission's time is spent: the checks left score 0 and say why
                run = Run(problem=f"not run: the submission's {self.sandbox.limits.submission_timeout:g} s for all its "
                                  f"checks were spent (Limits.submission_timeout, --submission-timeout)")
                report.checks.append(self._compare(name, run))
                continue
            timeout = min(per_check, left)
            hf_home = self.hub()[0] if name == "from_pretrained" else None
            bad = next((broken[m] for m in IMPORTS[name] if m in broken), None)
            # an import found failing or hanging once is reported for every check that needs it, without waiting again
            # the question: inputs and weights from a fresh secret seed, made here; the reference is computed from them
            run = bad if bad is not None else self.sandbox.run(name, submission, hf_home=hf_home, timeout=timeout,
                                                               given=questions.ask(name),
                                                               forbidden=forbidden_calls(self.rubric, name))
            report.sandbox = report.sandbox or run.sandbox
            report.checks.append(self._compare(name, run))

    def _imports(self, submission: Path, timeout: float | None) -> dict:
        """module -> a Run carrying its import's failure, for each graded module whose import fails or hangs."""
        run = self.sandbox.run("imports", submission, timeout=timeout)
        broken = {}
        if run.problem:  # hung or died while importing: the last module it started is the culprit
            started = [line.split("grading: importing ", 1)[1].strip() for line in run.output.splitlines()
                       if line.startswith("grading: importing ")]
            if started and started[-1] in probes.IMPORT_ORDER:
                broken[started[-1]] = Run(problem=f"importing {started[-1]}: {run.problem}", sandbox=run.sandbox,
                                          output=run.output)
            return broken
        imports = run.info.get("values", {}).get("imports")
        if not isinstance(imports, dict):  # malformed (the submission wrote it): each check imports for itself
            return broken
        for mod, state in imports.items():
            if mod in probes.IMPORT_ORDER and state != "ok":
                status, _, message = str(state).partition(": ")
                broken[mod] = Run(info={"status": status if status == "not_implemented" else "error",
                                        "message": message, "notes": [], "values": {}},
                                  sandbox=run.sandbox, output=run.output)
        return broken

    def _compare(self, name: str, run: Run):
        # The references are tiny: one thread avoids waking a thread pool for each small op (10x on a busy host).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            result = self._compare_checks(name, run)
        finally:
            torch.set_num_threads(threads)
        checks.forbidden_findings(result, run, forbidden_calls(self.rubric, name))
        return result

    def _compare_checks(self, name: str, run: Run):
        s = self.scorer
        try:
            if name == "from_pretrained":
                return checks.check_from_pretrained(run, s, self.hub()[1], HUB_NOTE)
            if name == "adamw":
                npy = torch.tensor(np.load(self.course_npy)) if self.course_npy.is_file() else None
                return checks.check_adamw(run, s, npy, str(self.course_npy))
            return getattr(checks, f"check_{name}")(run, s)
        except Exception as e:  # noqa: BLE001
            # The probe's result lacks what the comparison needs (a submission that fooled the probe, a shape the
            # reference refuses, or a grader bug, named as such): a zero with the reason, never a grader crash.
            result = checks.CheckResult(name, s.parts(name), verdict="error", output=run.output)
            for p in result.parts:
                p.status, p.message = "error", f"could not compare: {type(e).__name__}: {e}"
            result.messages.append(f"the check's result could not be compared with the reference ({type(e).__name__}: {e})")
            return result
