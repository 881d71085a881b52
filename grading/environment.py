"""The course's Python environment: what a submission may import, the grader's start-up check, and whose fault a
submission's `ModuleNotFoundError` is.

The CS224N "Build GPT-2" starter's `utils.py` imports `importlib_metadata`, `requests`, `filelock` and `tqdm`; its
`env.yml` installs torch (+ torchvision, torchaudio), tqdm, requests, importlib-metadata, filelock, sklearn,
tokenizers, explainaboard_client, einops, transformers, sacrebleu (and wandb in some years). The grader installs the
ones a submission's graded files can need (requirements.txt pins them); a missing one is the grader's fault, reported
as such, never a student's zero.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"
EXIT_ENVIRONMENT = 3  # the grader's own environment lacks a course package: nothing was graded

# import name -> pip distribution, for every course package the grader installs (requirements.txt pins each one)
COURSE_PACKAGES = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "einops": "einops",
    "sacrebleu": "sacrebleu", "sklearn": "scikit-learn", "tqdm": "tqdm", "requests": "requests",
    "filelock": "filelock", "importlib_metadata": "importlib-metadata", "numpy": "numpy",
}
# in the course's env.yml, not installed for grading (large, or services the graded files never need)
COURSE_NOT_INSTALLED = {"torchvision": "torchvision", "torchaudio": "torchaudio",
                        "explainaboard_client": "explainaboard_client", "wandb": "wandb"}
# the submission's own top-level modules: a missing one of these is a missing file, not a package
SUBMISSION_MODULES = {"config", "utils", "optimizer", "models", "modules", "datasets", "evaluation", "classifier",
                      "paraphrase_detection", "sonnet_generation"}
# what the grader itself imports beyond the course's packages
GRADER_PACKAGES = {"safetensors": "safetensors", "huggingface_hub": "huggingface-hub", "yaml": "pyyaml"}
_MISSING = re.compile(r"No module named '([^']+)'")


class GraderEnvironmentError(RuntimeError):
    """The grader's Python lacks course packages; the message names them and the command that installs them."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        pins = [pinned({**COURSE_PACKAGES, **GRADER_PACKAGES}[m]) for m in missing]
        super().__init__(
            f"the grading environment lacks the course package(s) {', '.join(missing)} (a submission's code imports "
            f"them through the course's starter); install them with: pip install {' '.join(pins)} "
            f"(or pip install -r {REQUIREMENTS.name}). Nothing was graded.")


def pinned(dist: str) -> str:
    """`dist==version` as requirements.txt pins it (the bare name when it is not pinned there)."""
    if REQUIREMENTS.is_file():
        for line in REQUIREMENTS.read_text().splitlines():
            if re.split(r"[=<>!~\s\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-") == dist.lower():
                return line.split("#")[0].strip()
    return dist


def missing_course_packages(packages=COURSE_PACKAGES) -> list[str]:
    """Course packages this Python cannot import (found without importing them: the check costs milliseconds)."""
    return [name for name in packages if not _findable(name)]


def check_environment() -> None:
    """Raise GraderEnvironmentError naming every course package (or package of the grader's own) this Python lacks."""
    missing = missing_course_packages({**COURSE_PACKAGES, **GRADER_PACKAGES})
    if missing:
        raise GraderEnvironmentError(missing)


def classify_missing(module: str, allowed=(), sandbox_missing=None) -> str:
    """The finding for a submission whose import of `module` failed with ModuleNotFoundError. `sandbox_missing`: the
    course packages the check's sandbox could not find, looked up before the submission ran (None: not known, the
    grader's own Python stands in); a package the sandbox has is never called the grader's gap on the check's word."""
    top = module.split(".")[0]
    if top in SUBMISSION_MODULES:
        return f"imports {module}, which is not in the submission (a file of the course's layout is missing)"
    if top in COURSE_PACKAGES or top in allowed:
        have = top not in sandbox_missing if sandbox_missing is not None else _findable(top)
        if have:
            return (f"reports that {top} could not be imported, but the grader's sandbox has it (looked up before "
                    f"the submission ran): not a grader-side gap; the submission's own code or output says so")
    if top in allowed:
        return (f"imports {top}, which the staff allowed, but the grader does not have it: grader-side gap, "
                f"install it where the grader runs (pip install {top})")
    if top in COURSE_PACKAGES:
        return (f"imports {top}, which is part of the course's environment but missing where the grader runs: "
                f"grader-side gap (pip install {pinned(COURSE_PACKAGES[top])})")
    if top in COURSE_NOT_INSTALLED:
        return (f"imports {top}, which the course's env.yml installs but the grader does not: grader-side gap "
                f"(pip install {COURSE_NOT_INSTALLED[top]}, or --allow-package {top} once installed)")
    return (f"imports {top}, which is not part of the course's environment (the student's dependency; staff can "
            f"allow it with --allow-package {top} or the rubric's allow_packages once it is installed)")


def missing_modules(texts) -> list[str]:
    """Module names of every `No module named 'X'` in texts, in order of first appearance."""
    found = []
    for text in texts:
        found += _MISSING.findall(text or "")
    return list(dict.fromkeys(found))


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def environment_findings(report, allowed=()) -> list[str]:
    """One finding per module a submission failed to import, said once: in the report and in the first check it
    broke (the other checks' "No module named" errors then need no second explanation). Whether a course package
    is missing is the sandbox's own report (Report.sandbox['packages_missing']), not the check's output."""
    findings = {}
    missing = report.sandbox.get("packages_missing") if isinstance(report.sandbox, dict) else None
    missing = set(missing) if isinstance(missing, list) else None
    for c in report.checks:
        texts = [c.output, *c.messages, *(p.message for p in c.parts)]
        for module in missing_modules(texts):
            finding = f"environment: {classify_missing(module, allowed, missing)}"
            if finding not in findings:
                findings[finding] = None
                c.messages.insert(0, finding)
    return list(findings)


def main(argv=None) -> int:
    """`python -m grading.environment [--quiet]`: exit 0 when every package imports, EXIT_ENVIRONMENT otherwise."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m grading.environment", description=main.__doc__)
    p.add_argument("--quiet", action="store_true", help="print nothing, only set the exit code")
    args = p.parse_args(argv)
    try:
        check_environment()
    except GraderEnvironmentError as e:
        if not args.quiet:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if not args.quiet:
        print(f"ok: {len(COURSE_PACKAGES) + len(GRADER_PACKAGES)} packages importable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
