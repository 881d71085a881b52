"""Gradescope: the autograder zip is built, unpacked into a temporary root (AUTOGRADER_ROOT), its setup.sh run offline
(the packages are importable, so pip is skipped) and run_autograder run on a correct and a broken submission; every
path leaves results.json, a grader-side failure included."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grading import environment, gradescope
from grading.__main__ import main
from grading.example import write_submission
from grading.report import FUNCTIONS
from models.hub import data_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    """The zip, unpacked the way Gradescope does: its contents in ROOT/source."""
    tmp = tmp_path_factory.mktemp("gradescope")
    rubric = json.loads((ROOT / "grading" / "rubric.json").read_text())
    rubric["checks"]["adamw"] = {"course_test": 10, "torch_adamw": 20}  # a course's own rubric travels in the zip
    (tmp / "rubric.json").write_text(json.dumps(rubric))
    zip_path = tmp / "autograder.zip"
    assert main(["package", str(zip_path), "--rubric", str(tmp / "rubric.json"), "--allow-package", "loralib"]) == 0
    root = tmp / "autograder"
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
        z.extractall(root / "source")
        for info in z.infolist():  # zipfile does not restore modes: apply them as unzip does
            mode = info.external_attr >> 16
            if mode:
                os.chmod(root / "source" / info.filename, mode)
    assert {"setup.sh", "run_autograder", "requirements.txt", "rubric.json", "grading/gradescope.py",
            "models/gpt2.py", "modules/attention.py", "config.py", "tasks/evaluate.py", "training/engine.py"} <= set(names)
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)
    packed = json.loads((root / "source" / "rubric.json").read_text())
    assert packed["checks"]["adamw"] == {"course_test": 10, "torch_adamw": 20}
    assert packed["allow_packages"] == ["loralib"]
    return root


def run_autograder(root: Path, submission: Path | None, python: str | None = sys.executable) -> tuple[int, dict]:
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    if submission is not None:
        shutil.copytree(submission, root / "submission")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update({"AUTOGRADER_ROOT": str(root)}, **({"PYTHON": python} if python else {}))
    proc = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, json.loads((root / "results" / "results.json").read_text())


def test_setup_sh_skips_pip_when_the_packages_are_importable(autograder):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(autograder / "source" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipping pip" in proc.stdout


def test_correct_submission_gets_full_marks_from_run_autograder(autograder, tmp_path):
    # uploaded as a zip of its folder: the course's layout sits one folder down
    rc, results = run_autograder(autograder, write_submission(tmp_path / "upload" / "cs224n_gpt"))
    assert rc == 0
    # The course's optimizer_test.npy (data/cs224n, bundled) travels in the zip; without it (a data override lacking it)
    # that part is skipped (it leaves the maximum) and says why: 90 of 90.
    has_npy = (data_dir() / "cs224n" / "optimizer_test.npy").exists()
    # one test per graded function (each rubric part), named by its check and the function
    names = [t["name"] for t in results["tests"]]
    assert names == [f"{check}: {function}" for (check, _), function in FUNCTIONS.items()], names
    adamw = [t for t in results["tests"] if t["name"].startswith("adamw: ")]
    assert results["score"] == sum(t["max_score"] for t in results["tests"]) == (100 if has_npy else 90), adamw
    assert sum(t["max_score"] for t in adamw) == (30 if has_npy else 20)  # the packed rubric's split
    assert has_npy or "optimizer_test.npy" in adamw[0]["output"], adamw[0]["output"]
    sandbox = results["extra_data"]["sandbox"]
    assert set(sandbox) >= {"network_isolated", "network", "own_uid", "limits", "grader_code"}
    assert "Sandbox: network" in results["output"]
    assert (autograder / "source").stat().st_mode & 0o777 == 0o700  # closed to the checks' uids (issue 36)


def test_broken_submissions_get_a_results_file_with_the_reason(autograder, tmp_path):
    rc, results = run_autograder(autograder, write_submission(
        tmp_path / "sub", attention=[("import math\n", "import math\nimport loralib\n")],
        optimizer=[("import math\n", "import math\nthis line is not Python\n")]))
    assert rc == 0 and results["score"] < 100
    assert "loralib" in results["output"] and "staff allowed" in results["output"]  # the packed allow-list
    (tmp_path / "empty").mkdir()
    (autograder / "venv" / "bin").mkdir(parents=True, exist_ok=True)  # where setup.sh puts its venv
    venv_python = autograder / "venv" / "bin" / "python"
    venv_python.write_text(f"#!/bin/sh\ntouch {shlex.quote(str(tmp_path / 'venv-used'))}\n"
                           f"exec {shlex.quote(sys.executable)} \"$@\"\n")  # a clone's path may hold spaces
    venv_python.chmod(0o755)
    rc, results = run_autograder(autograder, tmp_path / "empty", python=None)
    assert (tmp_path / "venv-used").exists()  # run_autograder runs setup.sh's venv when no PYTHON is given
    assert rc == 0 and results["score"] == 0 and "No models/gpt2.py" in results["output"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("capsh"), reason="needs root and capsh to drop CAP_SYS_ADMIN")
def test_namespaces_forbidden_degrades_and_says_so(autograder, tmp_path):
    # Docker's default: root without CAP_SYS_ADMIN, so no network or mount namespace; grading goes on, and the
    # results say which protections did not hold
    shutil.rmtree(autograder / "results", ignore_errors=True)
    shutil.rmtree(autograder / "submission", ignore_errors=True)
    write_submission(autograder / "submission", optimizer=[("import math\n", "import math\nthis is not Python\n")])
    env = {**os.environ, "AUTOGRADER_ROOT": str(autograder), "PYTHON": sys.executable}
    proc = subprocess.run(["capsh", "--drop=cap_sys_admin", "--", "-c", str(autograder / "source" / "run_autograder")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((autograder / "results" / "results.json").read_text())
    assert 0 < results["score"] < 100  # graded: everything but the broken optimizer passes
    held = results["extra_data"]["sandbox"]
    assert held["network_isolated"] is False and "Operation not permitted" in held["network"]
    # the uid of its own needs only root's setuid, but without a private mount namespace the sandbox user must be
    # able to read the interpreter where it is: a venv made from /usr/bin/python3 is, one under /root/.pyenv is not
    readable = "not readable by a sandbox user" not in held["python"]
    assert held["own_uid"] is readable and (held["uid"] != 0) is readable, held
    assert held["grader_code"].startswith("not hidden: no private mount namespace"), held  # said, not claimed
    assert "NOT isolated" in results["output"]


def test_grader_side_failures_write_results_too(autograder, tmp_path, monkeypatch):
    monkeypatch.setitem(environment.COURSE_PACKAGES, "importlib_metadata_gone", "importlib-metadata")
    root = tmp_path / "root"
    assert gradescope.run(root) == environment.EXIT_ENVIRONMENT
    results = json.loads((root / "results" / "results.json").read_text())
    assert "importlib_metadata_gone" in results["output"] and "not a grade" in results["output"]
    # an interpreter that cannot start at all: the shell script still leaves a results file
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_SOURCE": str(autograder / "source"),
           "PYTHON": "/nonexistent/python3"}
    (root / "results" / "results.json").unlink()
    proc = subprocess.run([str(autograder / "source" / "run_autograder")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "failed to start" in json.loads((root / "results" / "results.json").read_text())["output"]


def test_protections_say_what_held():
    # Docker without CAP_SYS_ADMIN: no namespaces, and the check fell back to the grader's own uid
    held = gradescope.protections({"network": "not isolated: unshare(CLONE_NEWNET) failed with Operation not "
                                              "permitted", "uid": os.getuid()})
    assert held["network_isolated"] is False and held["own_uid"] is False
    held = gradescope.protections({"network": "isolated", "uid": os.getuid() + 12345})
    assert held["network_isolated"] is True and held["own_uid"] is True
    assert gradescope.protections({})["network_isolated"] is False  # nothing reported: nothing claimed


def test_package_refuses_a_bad_rubric(tmp_path, capsys):
    (tmp_path / "r.json").write_text("{not json")
    assert main(["package", str(tmp_path / "a.zip"), "--rubric", str(tmp_path / "r.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "a.zip").exists()
