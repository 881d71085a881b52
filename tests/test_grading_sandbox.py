"""Hostile submissions are contained (0 on the affected checks, a clear message, the grader goes on), and the CLI
writes Gradescope's results.json and the batch CSV whatever the submissions do."""
from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from grading.example import write_submission
from grading.grader import Grader
from grading.sandbox import Limits

ROOT = Path(__file__).resolve().parents[1]
ATTN_INIT = "        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)\n"


@pytest.fixture(scope="module")
def grader():
    with Grader(limits=Limits(timeout=4)) as g:
        yield g


def hostile(tmp_path, code: str, where: str = "attention"):
    """The correct submission with `code` run when the attention module is imported (or in its constructor)."""
    if where == "init":
        return write_submission(tmp_path / "sub", attention=[(ATTN_INIT, ATTN_INIT + code)])
    return write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n" + code + "\n")])


def sandbox_processes(grader) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and p.stat().st_uid == grader.sandbox.uid:
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


CASES = {  # name -> (code, where, words the message must contain)
    "hang_at_import": ("while True:\n    pass", "import", "timed out"),
    "sys_exit": ("import sys\nsys.exit(3)", "import", "sys.exit(3)"),
    "os_exit": ("import os\nos._exit(0)", "import", "without writing a result"),
    "allocate_30GB": ("        self.buf = torch.zeros(30 * 2**30 // 4)", "init", "memory"),
    "fork_loop": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "import",
                  "timed out"),
    "print_100MB": ("print('x' * 100_000_000)", "import", "output limit"),
    "raise_in_constructor": ("        raise ValueError('boom in the constructor')", "init", "boom in the constructor"),
    "syntax_error": ("def broken(:\n    pass", "import", "SyntaxError"),
    "hard_coded_cuda": ("        torch.ones(1, device='cuda')", "init", "a hard-coded CUDA device"),
    # what the same line raises under a CUDA build of torch (PyPI's default wheel) on a machine without a GPU
    "hard_coded_cuda_on_a_cuda_build": ("        raise RuntimeError('Found no NVIDIA driver on your system. Please check "
                                        "that you have an NVIDIA GPU and installed a driver')", "init",
                                        "a hard-coded CUDA device"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_submission_is_contained(grader, tmp_path, name):
    code, where, words = CASES[name]
    report = grader.grade(hostile(tmp_path, code, "init" if where == "init" else "import"), ("attention", "adamw"))
    attention, adamw = report.checks
    assert attention.score == 0 and attention.verdict == "error", (attention.verdict, attention.messages)
    assert words in " ".join(attention.messages), attention.messages
    # the next check (which does not import the attention module) runs on a healthy sandbox
    assert adamw.score == adamw.max_score > 0, (adamw.verdict, adamw.messages)
    assert sandbox_processes(grader) == []  # nothing the submission started survives its check


def test_writes_outside_the_sandbox_are_refused_and_network_is_off(grader, tmp_path):
    target = tmp_path / "outside"
    target.mkdir(mode=0o755)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = ("open('/tmp/left-by-a-submission.txt', 'w').write('x')\n"
            f"for attempt in (lambda: open({str(target / 'pwned.txt')!r}, 'w'),\n"
            f"                lambda: __import__('socket').create_connection(('127.0.0.1', {port}), timeout=1)):\n"
            f"    try:\n        attempt()\n        print('ESCAPED')\n    except OSError as e:\n        print('refused:', e)")
    sub = hostile(tmp_path, code)
    with open(sub / "checkpoint.pt", "wb") as f:  # a checkpoint a student left in: not copied per check
        f.truncate(21 * 2**20)
    report = grader.grade(sub, ("attention",))
    if grader.sandbox.uid is None and not report.sandbox.get("read_only", "").startswith("everything read-only"):
        pytest.skip(f"without root, writes outside are refused by the read-only mounts, not held here: "
                    f"{report.sandbox.get('read_only')}")
    assert any("not copied into the sandbox: checkpoint.pt" in m for m in report.checks[0].messages)
    assert report.checks[0].score == 16, report.checks[0].messages  # refused side effects cost nothing
    assert not (target / "pwned.txt").exists()
    assert "ESCAPED" not in report.checks[0].output and report.checks[0].output.count("refused") == 2
    with pytest.raises(socket.timeout):
        server.accept()
    assert report.sandbox["network"] == "isolated"
    assert not Path("/tmp/left-by-a-submission.txt").exists()
    if not report.sandbox["tmpfs"].startswith("private"):  # the host's world-writable /tmp: reported, removed
        assert any("wrote outside its folder" in m and "left-by-a-submission" in m for m in report.checks[0].messages)
    server.close()


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """python -m grading ARGS, in this process (its warm fork server; the subprocess form is run by
    tests/test_grading_venv.py, _hostile.py, _package.py and _class.py): (exit code, stdout, stderr)."""
    from grading.__main__ import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_gradescope_results_for_a_good_and_a_broken_submission(tmp_path, capsys):
    good = write_submission(tmp_path / "good")
    broken = write_submission(tmp_path / "batch" / "broken", utils=[("import torch\n", "import os\nos._exit(1)\n")])
    write_submission(tmp_path / "batch" / "good")
    code, out, err = run_cli(capsys, good, "--checks", "attention,adamw", "--gradescope", tmp_path / "results.json",
                             "--json", tmp_path / "report.json")
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())
    # Gradescope's documented fields
    assert set(results) >= {"score", "execution_time", "tests"}
    assert isinstance(results["score"], float) and results["execution_time"] > 0
    for test in results["tests"]:
        assert set(test) == {"name", "score", "max_score", "output", "visibility"}
        assert test["visibility"] in ("visible", "hidden", "after_due_date", "after_published")
    # one test per graded function, named by it
    assert [t["name"] for t in results["tests"]] == [
        "attention: CausalSelfAttention.forward", "attention: CausalSelfAttention.attention",
        "attention: CausalSelfAttention.attention in training mode (attention dropout)",
        "adamw: AdamW: the course's optimizer_test", "adamw: AdamW: against torch.optim.AdamW"]
    assert results["score"] == sum(t["score"] for t in results["tests"])
    assert "attention" in out and "total" in out
    # batch: the broken submission is a row with its verdicts, never an abort
    code, out, err = run_cli(capsys, "--batch", tmp_path / "batch", "--csv", tmp_path / "scores.csv", "--jobs", "2",
                             "--checks", "attention,embed")
    assert code == 0, err
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "scores.csv"))}
    assert float(rows["good"]["score"]) == 24 and float(rows["broken"]["score"]) == 0
    assert "error" in rows["broken"]["notes"] and broken.is_dir()


def test_cli_refuses_bad_arguments(tmp_path, capsys):
    bad_rubric = tmp_path / "rubric.json"
    bad_rubric.write_text(json.dumps({"tolerance": {"exact": 1e-5, "close": 1e-2}, "partial_fraction": 0.5,
                                      "checks": {"attention": {"forward": 8}}}))
    write_submission(tmp_path / "sub")
    code, _, err = run_cli(capsys, tmp_path / "sub", "--rubric", bad_rubric)
    assert code == 2 and "check 'attention' must have the parts" in err
    code, _, err = run_cli(capsys, tmp_path / "missing")
    assert code == 2 and "submission folder not found" in err


def test_the_next_sandbox_of_this_process_takes_the_warm_fork_server_and_a_forked_process_never_does(tmp_path):
    """Sandbox.release parks an idle fork server for this process's next Sandbox (no second interpreter start); one
    mid-request, or released with keep_warm=False, is killed; a forked process (a batch worker) starts its own."""
    from grading import sandbox

    sub = write_submission(tmp_path / "sub")
    with sandbox.Sandbox(Limits(timeout=30)) as a:  # an idle server of this process, or a new one
        assert a.run("imports", sub).problem == ""
        first = a._proc
    with sandbox.Sandbox() as b:  # its own scratch folder (and uid claim), the same server
        assert b.scratch != a.scratch
        b.warm()
        assert b._proc is first and b.run("imports", sub).problem == ""
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # a forked process: the parent's idle list is not its own
            os._exit(0 if sandbox._take_idle() is None else 1)
        b.release()  # parked while the child looks
        assert os.waitpid(child, 0)[1] == 0
    assert any(proc is first for _, proc, _ in sandbox._IDLE)
    for mid_request in (True, False):  # a stand-in server: stopped between a request and its answer, or let go
        c = sandbox.Sandbox()
        c._proc, c._home = subprocess.Popen(["sleep", "60"], start_new_session=True), sandbox.temp_folder("zygote")
        stand_in, home = c._proc, c._home
        c._asking = mid_request
        c.release(keep_warm=mid_request)  # asked to keep it, but mid-request; or keep_warm=False (a pool worker)
        assert stand_in.poll() is not None and not Path(home).exists()
        assert all(proc is not stand_in for _, proc, _ in sandbox._IDLE)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def test_the_fork_servers_killer_outlives_the_checks_and_a_killed_killer_costs_no_check(grader, tmp_path):
    """The fork server forks its killer (kill_all_of's helper, cheap to fork) before importing torch: its one child
    between checks. Killed from outside, the server forks the helper itself: the checks grade as before and no
    process of the sandbox's is left."""
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("/proc/PID/task/TID/children is absent (a kernel without CONFIG_PROC_CHILDREN): no killer")
    grader.sandbox.warm()
    server = grader.sandbox._proc.pid
    (killer,) = _children(server)
    rss = {pid: int(Path(f"/proc/{pid}/statm").read_text().split()[1]) for pid in (server, killer)}
    assert rss[killer] * 10 < rss[server], rss  # forked before torch: a fork of it copies little
    sub = write_submission(tmp_path / "sub")
    first = grader.grade(sub, ("attention",))
    assert _children(server) == [killer]
    os.kill(killer, 9)
    second = grader.grade(sub, ("attention",))
    assert first.total == second.total == first.max_total > 0, (first.checks, second.checks)
    assert grader.sandbox._proc.pid == server and _children(server) == []  # the same server; the killer reaped
    if grader.sandbox.uid is not None:
        assert sandbox_processes(grader) == []


def test_the_before_and_after_snapshot_of_a_submission_holds_any_depth_and_sees_any_change(tmp_path):
    """grading/sandbox.py's _snapshot (a check's "the original submission folder changed" finding): 1,200 folders deep
    (Path.rglob raised RecursionError past about 1,000), and a changed byte, a new file or a file swapped for a link
    anywhere in the tree changes it."""
    from bench.grading_batch_attacks import deep
    from grading.sandbox import _snapshot

    top = tmp_path / "sub"
    (top / "models").mkdir(parents=True)
    (top / "models" / "gpt2.py").write_text("x = 1\n")
    try:
        deep(top, 1200)
        bottom = top.joinpath(*["d"] * 1200)
        (bottom / "deep.txt").write_text("a")
        first = _snapshot(top)
        assert str(bottom / "deep.txt") in first and str(top / "models" / "gpt2.py") in first and len(first) == 2
        assert _snapshot(top) == first
        (bottom / "deep.txt").write_text("ab")
        assert _snapshot(top) != first
        (bottom / "deep.txt").write_text("a")
        os.utime(bottom / "deep.txt", ns=(0, first[str(bottom / "deep.txt")][2]))
        assert _snapshot(top) == first
        (bottom / "new.py").write_text("")
        assert _snapshot(top) != first
        (bottom / "new.py").unlink()
        gpt2 = top / "models" / "gpt2.py"
        mtime = first[str(gpt2)][2]
        gpt2.unlink()
        gpt2.symlink_to("x = 2\n")  # a link whose target's name is as long as the file was
        os.utime(gpt2, ns=(0, mtime), follow_symlinks=False)
        assert _snapshot(top) != first
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)  # shutil.rmtree recurses
