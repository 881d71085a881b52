"""The grader run from a virtual environment made in /tmp (as a course's staff may make one: `python -m venv
/tmp/grader`), where the check's private tmpfs on /tmp would otherwise hide the packages the submission imports.
Found on real submissions: every check but AdamW failed with "No module named 'requests'" in a fresh /tmp venv."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grading.example import write_submission

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's private mounts are Linux's")
def test_a_venv_in_tmp_stays_importable_and_read_only_in_the_check():
    tmp = Path(tempfile.mkdtemp(prefix="grading-venv-", dir="/tmp"))
    try:
        venv = tmp / "venv"
        # The packages of the Python running the tests (torch, transformers: a venv's, a pyenv's, the system's) seen
        # through the new venv by a .pth file, plus one only the new venv holds. (--system-site-packages would give
        # the base installation's, which need not hold torch when the tests themselves run in a venv.)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        out = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True, check=True)
        packages = Path(out.stdout.strip())
        (packages / "outer.pth").write_text("".join(p + "\n" for p in site.getsitepackages()))
        (packages / "course_extra_pkg.py").write_text("VALUE = 1\n")
        (tmp / "beside-the-venv.txt").write_text("not the check's to see\n")
        poisoned = packages / "poisoned_by_a_submission.py"
        code = ("import course_extra_pkg\nassert course_extra_pkg.VALUE == 1\n"
                "try:\n"
                f"    open({str(poisoned)!r}, 'w').write('x = 1')\n"
                "except OSError:\n"
                "    pass\n"
                f"print('BESIDE', sorted(os.listdir({str(tmp)!r})))\n")
        sub = write_submission(tmp / "sub", attention=[("import math\n", "import math\nimport os\n" + code)])
        subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        run = subprocess.run([str(venv / "bin" / "python"), "-m", "grading", str(sub), "--checks", "attention",
                              "--gradescope", str(tmp / "report.json")], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads((tmp / "report.json").read_text())
        check = report["tests"][0]  # attention's first part: the output of its code goes there when all pass
        assert [t["name"] for t in report["tests"]] == [f"attention: {f}" for f in (
            "CausalSelfAttention.forward", "CausalSelfAttention.attention",
            "CausalSelfAttention.attention in training mode (attention dropout)")]
        assert "course_extra_pkg" not in json.dumps(report), report  # imported fine: no finding names it
        assert report["score"] == sum(t["max_score"] for t in report["tests"]) == 16, report["tests"]
        assert not poisoned.exists()
        assert "BESIDE ['venv']" in check["output"], check["output"]  # the venv alone, not what lives beside it
    finally:
        subprocess.run(["rm", "-rf", str(tmp)])
