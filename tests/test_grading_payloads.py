"""Issue 36, "Done when": the untouched starter carrying each of the issue's payloads (bench/grading_payloads.py)
scores what it earns, the grader's files, its venv and another student's submission are unchanged (sha256 before and
after), and no run fails: as root in one warm grader, and as an unprivileged user in a user namespace (a `--batch` of
all of them, from a copy of the checkout and a venv in /tmp that the user owns, as a course's staff would run it).

bench/grading_payloads.py prints the same matrix from one `python -m grading` run per payload (docs/grading.md).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import marshal
import os
import pwd
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_grading import sharing_server

from bench.grading_payloads import (
    PAYLOADS,
    changed,
    faithful_bytecode,
    forbidden_rubric,
    grader_files,
    make,
    other_submission,
    synthetic_starter,
    tree_state,
)
from grading.grader import Grader, load_rubric
from grading.sandbox import Limits

ROOT = Path(__file__).resolve().parents[1]
STARTER_EARNS = 28  # the course gives GPT2Model.forward (10) and from_pretrained (18)
TIMEOUT = 8  # per check: the hanging attention costs this once
SMALL = dict(spinners=8, spin_s=1.0)  # the CPU hog, smaller than the bench's 58 spinners
# Left to the root-mode test here (bench/grading_payloads.py runs every payload in both modes): deadlines and CPU,
# which hold the same in both modes, and the rubric's forbidden calls.
ROOT_MODE_ONLY = ("hang_attention", "many_files", "cpu_hog", "hf_blocks_forbidden")
# caches left out of the grader's files where this process itself may write them (its lazy imports)
GRADER_SKIP = () if sys.dont_write_bytecode else ("__pycache__",)


# pytest rewrites the asserts of its plugins' modules (every module of hypothesis, which registers one) at their first
# import in a process and caches each in the __pycache__ beside it: in a fresh venv another xdist worker's hypothesis
# test writes them into this venv while this module watches it (the CI replica, 2026-11-29: conjecture/optimiser).
PYTEST_CACHE = re.compile(r"/__pycache__/[^/]+\.cpython-\d+-pytest-[^/]+\.pyc$")


def venv_state() -> dict:
    """This Python's venv as tree_state(content=False) sees it, less the test run's own assertion-rewrite caches."""
    return {k: v for k, v in tree_state([sys.prefix], content=False).items() if not PYTEST_CACHE.search(k)}


def test_bytecode_an_import_writes_into_a_venv_without_it_is_no_change_and_planted_bytecode_is(tmp_path):
    """A venv installed without .pyc files (pip --no-compile, uv) gets them from whichever process imports first (the
    GPU machine's image, 2026-12-04: 1,001 of them failed the two venv checks below): those are no change; a cache
    file with other code under the source's header, a stale one, one without its source and a changed source are."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "honest.py").write_text("def f(x):\n    assert x\n    return [x * 2 for _ in range(3)]\n")  # -O drops it
    (pkg / "edited.py").write_text("VALUE = 1\n")
    before = tree_state([pkg], content=False)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(pkg)}
    subprocess.run([sys.executable, "-c", "import honest, edited"], env=env, check=True)
    subprocess.run([sys.executable, "-O", "-c", "import honest"], env=env, check=True)
    written = changed(before, tree_state([pkg], content=False))
    assert len(written) == 3 and all(faithful_bytecode(p) for p in written)  # the -O one (opt-1) too
    assert changed(before, tree_state([pkg], content=False), bytecode_ok=True) == []
    assert changed(before, tree_state([pkg], content=False)) == written  # only where asked

    source = pkg / "honest.py"
    cached = Path(importlib.util.cache_from_source(str(source)))
    header, text = cached.read_bytes()[:16], source.read_bytes()
    planted = marshal.dumps(compile("def f(x):\n    return [x * 3 for _ in range(3)]\n", str(source), "exec"))
    cached.write_bytes(header + planted)  # other code under the right header
    assert not faithful_bytecode(str(cached))
    assert changed(before, tree_state([pkg], content=False), bytecode_ok=True) == [str(cached)]
    honest = marshal.dumps(compile(text, str(source), "exec", dont_inherit=True))
    cached.write_bytes(header + honest)
    assert faithful_bytecode(str(cached))
    cached.write_bytes(header[:8] + bytes(8) + honest)  # a stale stamp
    assert not faithful_bytecode(str(cached))
    unchecked = header[:4] + (1).to_bytes(4, "little") + importlib.util.source_hash(text)  # hash-based, unchecked
    cached.write_bytes(unchecked + planted)
    assert not faithful_bytecode(str(cached))
    cached.write_bytes(unchecked + honest)
    assert faithful_bytecode(str(cached))
    cached.write_bytes(header[:4] + (2).to_bytes(4, "little") + unchecked[8:] + honest)  # flags Python refuses
    assert not faithful_bytecode(str(cached))
    orphan = cached.with_name("gone" + cached.name[len("honest"):])
    orphan.write_bytes(header + honest)
    assert not faithful_bytecode(str(orphan))  # no source beside it
    (pkg / "edited.py").write_text("VALUE = 2\n")
    assert str(pkg / "edited.py") in changed(before, tree_state([pkg], content=False), bytecode_ok=True)
    assert not faithful_bytecode(str(pkg / "edited.py"))


def expected(name):
    return STARTER_EARNS + PAYLOADS[name].gain


def what_it_achieved(name, checks):
    """The payload's own output where it says it got what it tried, less what the check it ran in is meant to hold
    (the layer check grades with the reference attention: it may find that one)."""
    lines = {f"{c['name']}: {line.strip()}" for c in checks for line in c.get("output", "").splitlines()
             if line.startswith(PAYLOADS[name].leaks)}
    return sorted(line for line in lines if not line.startswith("layer: BORROWED RefAttention"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("payloads")
    starter = synthetic_starter(base / "starter")
    other = other_submission(base / "other")
    return {"base": base, "starter": starter, "other": other, "rubric": forbidden_rubric(base / "forbidden.json"),
            "venv": venv_state()}


@pytest.fixture(scope="module")
def graders(world):
    with Grader(limits=Limits(timeout=TIMEOUT)) as default, \
            Grader(rubric=load_rubric(world["rubric"]), limits=Limits(timeout=TIMEOUT)) as forbidding:
        yield {"default": default, "forbidden": sharing_server(default, forbidding)}


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_root_mode_the_starter_with_each_payload_scores_what_it_earns_and_changes_nothing(world, graders, name):
    sub = make(name, world["starter"], world["base"] / name, world["other"], **SMALL)
    grader_before, other_before = tree_state(grader_files(ROOT), skip=GRADER_SKIP), tree_state([world["other"]])
    report = graders[PAYLOADS[name].rubric].grade(sub)  # raising here would be the CLI's non-zero exit
    data = report.to_dict()
    assert (report.total, report.max_total) == (expected(name), 100), \
        {c.name: (c.score, c.max_score, [p.message for p in c.parts][:3]) for c in report.checks}
    assert tree_state(grader_files(ROOT), skip=GRADER_SKIP) == grader_before, "the grader's files changed"
    assert tree_state([world["other"]]) == other_before, "another student's submission changed"
    assert what_it_achieved(name, data["checks"]) == [], what_it_achieved(name, data["checks"])
    assert not any("grader-side gap (pip install" in e for e in report.environment), report.environment
    if name == "hf_blocks_forbidden":
        assert any("forbidden call transformers.models.gpt2.modeling_gpt2.GPT2Attention" in m
                   for c in report.checks for m in c.messages), [c.messages for c in report.checks]


def test_root_mode_the_venv_is_unchanged_after_every_payload(world, graders):
    """Every file of this Python's venv (size, mtime, ctime: any write, chmod or utime shows) as before the payloads
    of this module ran (run after them, in file order)."""
    # paths (two 45,000-entry dicts: 450,000 lines of diff); bytecode this run compiled from unchanged sources is no
    # change
    assert changed(world["venv"], venv_state(), bytecode_ok=True) == []


def grading_user():
    for name in ("cloudsdk", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming an unprivileged user needs a root test run")
def test_nonroot_mode_a_batch_of_every_payload_scores_what_each_earns_and_changes_nothing():
    from test_grading_hostile import exposing_python

    from bench.grading_payloads import nonroot_setup

    user = grading_user()
    if user is None or not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs an unprivileged user (cloudsdk or nobody), setpriv and unshare")
    base = Path(tempfile.mkdtemp(prefix="grading-payloads-"))
    try:
        os.chmod(base, 0o711)
        checkout, python = nonroot_setup(base / "env", base / "checkout", user)
        names = [n for n in PAYLOADS if n not in ROOT_MODE_ONLY]
        subs = base / "subs"
        starter = synthetic_starter(base / "starter")
        other = other_submission(subs / "other")
        for name in names:
            make(name, starter, subs / name, other, **SMALL)
        subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(subs)], check=True)
        (base / "out").mkdir()
        os.chown(base / "out", user.pw_uid, user.pw_gid)
        owned = [*grader_files(checkout), python.parent.parent]  # the user's own: writable by the grader's uid
        before = {"grader": tree_state(owned), "other": tree_state([other]), "outer": venv_state()}
        stage = base / "stage"
        stage.mkdir()
        prefix = exposing_python(stage, f"setpriv --reuid={user.pw_uid} --regid={user.pw_gid} --clear-groups "
                                        f"--inh-caps=-all --bounding-set=-all")
        csv_path = base / "out" / "scores.csv"
        run = subprocess.run([*prefix, str(python), "-m", "grading", "--batch", str(subs), "--csv", str(csv_path),
                              "--jobs", "1", "--timeout", str(TIMEOUT)], cwd=checkout, capture_output=True, text=True,
                             timeout=900, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base / "out"),
                                               "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        after = {"grader": tree_state(owned), "other": tree_state([other]), "outer": venv_state()}
        rows = {Path(r["submission"]).name: r for r in csv.DictReader(csv_path.open())}
        reports = {}
        for f in (base / "out" / "scores-reports").glob("*.json"):
            record = json.loads(f.read_text())
            if isinstance(record, dict) and record.get("report"):
                reports[Path(record["report"]["submission"]).name] = record["report"]
    finally:
        subprocess.run(["rm", "-rf", str(base)])
    assert {k: changed(before[k], after[k], bytecode_ok=k == "outer") for k in before} == {"grader": [], "other": [],
                                                                                             "outer": []}
    assert float(rows["other"]["score"]) == float(rows["other"]["max_score"]) > 0, rows["other"]  # graded as usual
    for name in names:
        row = rows[name]
        assert row["error"] == "" and float(row["score"]) == expected(name) and float(row["max_score"]) == 100, \
            (name, row)
        assert what_it_achieved(name, reports[name]["checks"]) == [], (name, what_it_achieved(name, reports[name]["checks"]))
    sandbox = reports["none"]["sandbox"]
    assert sandbox["uid"] == user.pw_uid, sandbox
    if sandbox.get("user_namespace") == "isolated":
        assert sandbox["read_only"].startswith("everything read-only") and sandbox["grader_code"].startswith("hidden")
