"""The course's environment: declared in requirements.txt, checked when the grader starts (a grader-side failure with
its own exit code, never a student's 0), and a submission's import outside it named once, with staff allow-listing."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grading import environment
from grading.__main__ import main
from grading.example import write_submission
from grading.grader import Grader, RubricError, load_rubric

ROOT = Path(__file__).resolve().parents[1]
# the import block of the course's starter utils.py (its env.yml installs these), as a real submission carries it
STARTER_IMPORTS = """from typing import Dict, List, Optional, Union, Tuple, BinaryIO
import os
import sys
import json
import tempfile
import copy
from tqdm.auto import tqdm
from functools import partial
from urllib.parse import urlparse
from pathlib import Path
import requests
from hashlib import sha256
from filelock import FileLock
import importlib_metadata
import torch
import torch.nn as nn
from torch import Tensor
import fnmatch

__version__ = "4.0.0"
_torch_version = importlib_metadata.version("torch")
"""


@pytest.fixture(scope="module")
def grader():
    with Grader() as g:
        yield g


def test_requirements_pin_every_course_package():
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    wanted = {**environment.COURSE_PACKAGES, **environment.GRADER_PACKAGES}
    missing = sorted(d for d in wanted.values() if d.lower() not in pins)
    assert not missing, f"requirements.txt does not pin the course's {missing}"
    assert environment.missing_course_packages(wanted) == []  # the README's set-up installs them all


def test_missing_package_stops_the_grader_with_its_own_exit_code(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(environment.COURSE_PACKAGES, "importlib_metadata_gone", "importlib-metadata")
    monkeypatch.setitem(environment.COURSE_PACKAGES, "requests_gone", "requests")
    sub = write_submission(tmp_path / "sub")
    results = tmp_path / "results.json"
    assert main([str(sub), "--gradescope", str(results)]) == environment.EXIT_ENVIRONMENT == 3
    err = capsys.readouterr().err
    assert err.count("error:") == 1  # one message naming every missing package and the install command
    assert "importlib_metadata_gone, requests_gone" in err
    assert "pip install importlib-metadata==" in err and "requests==" in err
    data = json.loads(results.read_text())
    assert data["tests"] == [] and "not a grade" in data["output"]


def test_environment_cli(monkeypatch, capsys):
    assert environment.main([]) == 0
    monkeypatch.setitem(environment.GRADER_PACKAGES, "no_such_module_xyz", "no-such-module-xyz")
    assert environment.main(["--quiet"]) == 3
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("module, says", [
    ("loralib", "imports loralib, which is not part of the course's environment"),
    ("peft.tuners", "imports peft, which is not part of the course's environment"),
    ("torchvision", "grader-side gap"),
    ("modules.rotary", "a file of the course's layout is missing"),
])
def test_a_missing_module_is_classified(module, says):
    assert says in environment.classify_missing(module)


def test_a_course_package_is_the_graders_gap_only_where_the_sandbox_lacks_it():
    said = environment.classify_missing("importlib_metadata", sandbox_missing={"importlib_metadata"})
    assert "grader-side gap (pip install importlib-metadata==" in said
    for sandbox_missing in (set(), None):  # the sandbox has it; not known (the grader's own Python has it)
        said = environment.classify_missing("importlib_metadata", sandbox_missing=sandbox_missing)
        assert "not a grader-side gap" in said and "pip install" not in said


def test_a_printed_missing_module_line_does_not_blame_the_grader(grader, tmp_path):
    """Issue 36: printing "No module named 'transformers'" made the report blame the grader's environment."""
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n"
                                                         "print(\"No module named 'transformers'\")\n")])
    report = grader.grade(sub, ("attention",))
    assert report.total == report.max_total, report.checks[0].messages
    assert "transformers" not in report.sandbox["packages_missing"]
    assert all("grader-side gap (pip" not in f for f in report.environment), report.environment


def test_allowed_package_is_the_graders_gap():
    assert "staff allowed" in environment.classify_missing("loralib", allowed=("loralib",))


def test_starter_import_list_grades_in_full(grader, tmp_path):
    # the course's utils.py imports importlib_metadata, requests, filelock and tqdm: a correct submission that carries
    # it must not lose a point to the grader's environment
    report = grader.grade(write_submission(tmp_path / "sub", utils=[("import torch\n", STARTER_IMPORTS)]),
                          ("attention", "layer"))
    assert report.total == report.max_total, [c.messages for c in report.checks]
    assert report.environment == []


def test_an_import_outside_the_course_is_one_finding(grader, tmp_path):
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n\nimport loralib\n")])
    report = grader.grade(sub, ("attention", "layer"))
    assert report.total == 0
    assert report.environment == ["environment: imports loralib, which is not part of the course's environment (the "
                                  "student's dependency; staff can allow it with --allow-package loralib or the "
                                  "rubric's allow_packages once it is installed)"]
    said = [m for c in report.checks for m in c.messages if m.startswith("environment:")]
    assert said == report.environment  # once, not once per check


def test_allow_package_flag_and_rubric(tmp_path, capsys):
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n\nimport loralib\n")])
    out = tmp_path / "report.json"
    assert main([str(sub), "--checks", "attention", "--allow-package", "loralib", "--json", str(out)]) == 0
    env = json.loads(out.read_text())["environment"]
    assert len(env) == 1 and "staff allowed" in env[0] and "grader-side gap" in env[0]
    assert "grader-side gap" in capsys.readouterr().out  # the terminal table says it too
    rubric = json.loads((ROOT / "grading" / "rubric.json").read_text())
    rubric["allow_packages"] = "loralib"  # a string, not a list
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    with pytest.raises(RubricError, match="allow_packages must be a list"):
        load_rubric(path)
    with pytest.raises(SystemExit):
        main([str(sub), "--allow-package", "not a module"])
