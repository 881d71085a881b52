"""Attacks from issue 29 as hostile submissions, each with the outcome it must get: limits that hold for all of a
check's processes together, nothing left behind, nothing of other checks or the host visible, and prediction files
that cannot point at the gold file or leak what they point at."""
from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from grading.example import write_submission
from grading.grader import Grader
from grading.predictions import score_predictions
from grading.sandbox import Limits, Sandbox
from grading.sandboxed.isolation import closed_folders, python_paths

ROOT = Path(__file__).resolve().parents[1]
MEM_MB, DISK_MB = 512, 64  # small limits, so that each attack needs only a few hundred MB
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own per check needs a grader running as root")


@pytest.fixture(scope="module")
def grader():
    with Grader(limits=Limits(timeout=12, mem_mb=MEM_MB, disk_mb=DISK_MB)) as g:
        yield g


def attack(tmp_path, code: str, name: str = "sub") -> Path:
    """The correct submission, with `code` run when its attention module is imported."""
    return write_submission(tmp_path / name, attention=[("import math\n", "import math\n" + code + "\n")])


def grade_attention(grader, sub):
    (check,) = grader.grade(sub, ("attention",)).checks
    return check


def test_memory_is_bounded_for_all_forked_processes_together(grader, tmp_path):
    # Three processes of 300 MB each stay under the per-process address-space limit, not under the check's.
    code = ("import os, time\npids = []\nfor _ in range(2):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = b'1' * (300 << 20)\n        time.sleep(2)\n        os._exit(0)\n    pids.append(pid)\n"
            "x = b'1' * (300 << 20)\nfor pid in pids:\n    os.waitpid(pid, 0)\nprint('HELD 900 MB')")
    report = grader.grade(attack(tmp_path, code), ("attention",))
    check, sandbox = report.checks[0], report.sandbox
    if sandbox.get("cgroup", "").startswith("none"):
        pytest.skip(f"no cgroup for the checks here: {sandbox['cgroup']}")
    assert check.score == 0 and check.verdict == "error", (check.messages, check.output)
    assert "memory limit" in " ".join(check.messages) and f"{MEM_MB} MiB" in " ".join(check.messages)


def test_writes_in_its_own_folder_stop_at_the_disk_quota(grader, tmp_path):
    # 15 MiB files (under the per-file limit) until the disk refuses: at most the quota, not 1.9 GB.
    code = ("written = 0\nfor i in range(40):\n    try:\n        with open(f'fill{i}.bin', 'wb') as f:\n"
            "            f.write(b'0' * (15 << 20))\n        written += 15\n    except OSError as e:\n"
            "        print('REFUSED', e.strerror)\n        break\nprint('WROTE', written, 'MiB')")
    check = grade_attention(grader, attack(tmp_path, code))
    written = int(check.output.split("WROTE ")[1].split()[0])
    assert written <= DISK_MB and "REFUSED No space left on device" in check.output, check.output
    assert check.score == check.max_score, check.messages  # a contained write costs nothing


def test_no_file_can_be_added_beside_the_checks_result(grader, tmp_path):
    """Issue 36: 70 x 15 MiB written into the result folder landed 1050 MiB on the grader's disk (the folder was
    outside the quota). Now the check may write only its two result files (each under the file-size limit)."""
    code = ("for i in range(3):\n    try:\n        open(f'../result/extra-{i}', 'wb').write(b'x' * 2**20)\n"
            "        print('WROTE')\n    except OSError as e:\n        print('REFUSED', e.strerror)")
    check = grade_attention(grader, attack(tmp_path, code))
    assert "WROTE" not in check.output and check.output.count("REFUSED") >= 3, check.output
    assert check.score == check.max_score, check.messages


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the syscall numbers below are x86_64's")
def test_the_kernel_keyrings_are_no_channel_between_checks(grader, tmp_path):
    """Issue 36: submission A's add_key("user", ...) on the user keyring was read by submission B, and outlived the
    grader. The key syscalls are refused in the check."""
    name = f"grading-test-{uuid.uuid4().hex}"
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"r = libc.syscall(248, b'user', {name.encode()!r}, b'secret', 6, -4)\n"  # add_key, KEY_SPEC_USER_KEYRING
            "print('ADDED' if r >= 0 else f'REFUSED {ctypes.get_errno()}')")
    check = grade_attention(grader, attack(tmp_path, code))
    assert "ADDED" not in check.output and "REFUSED 1" in check.output, check.output  # EPERM
    assert check.score == check.max_score, check.messages


def test_links_that_leave_the_submission_are_not_graded_as_its_code(grader, tmp_path):
    """Issue 36: a starter whose model files were absolute links into another student's folder scored 100/100."""
    other = write_submission(tmp_path / "another-student")
    sub = write_submission(tmp_path / "sub")
    (sub / "modules" / "attention.py").unlink()
    (sub / "modules" / "attention.py").symlink_to(other / "modules" / "attention.py")
    (sub / "notes.txt").symlink_to("config.py")  # a link inside the submission stays
    report = grader.grade(sub, ("attention",))
    (check,) = report.checks
    assert check.score == 0, check.messages
    assert any("links that leave the submission not copied" in m and "modules/attention.py" in m
               for m in check.messages), check.messages


def test_a_submission_of_many_files_is_copied_up_to_the_cap_its_code_first(tmp_path, monkeypatch):
    """Issue 36: 30,000 one-byte files made a correct submission take 562 s (each check copied and scanned them).
    Now one pruned copy serves every check: no more than max_files looked at in one folder and SCAN_LIMIT in all
    (a big folder sorted before models/ must not hide the code), past the caps files are left out, the Python
    files first, and the findings say so."""
    import grading.sandbox

    monkeypatch.setattr(grading.sandbox, "SCAN_LIMIT", 60)
    sub = write_submission(tmp_path / "sub")
    (sub / "aaa").mkdir()  # listed before models/ and modules/
    for i in range(60):
        (sub / "aaa" / f"f{i:03d}.txt").write_text("x")
    with Grader(limits=Limits(timeout=30, max_files=40)) as small:
        report = small.grade(sub, ("attention",))
    (check,) = report.checks
    assert check.score == check.max_score, check.messages
    assert any("more than 40 files" in m and "not copied" in m for m in check.messages), check.messages
    assert any("20 files and folders of the submission were not looked at" in m for m in check.messages)


def test_a_checks_processes_together_get_at_most_one_core(grader, tmp_path):
    """Issue 36: 58 spinning processes in one check of a --jobs 2 batch slowed the other student's check (78 s
    instead of 31-47 s). The check's cgroup has a CPU quota of one core (Limits.cpus) where the controller exists."""
    code = ("import os, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            "        end = time.time() + 1.5\n        while time.time() < end:\n            pass\n"
            "        os._exit(0)\n    pids.append(pid)\nfor pid in pids:\n    os.waitpid(pid, 0)\n"
            "t = os.times()\nprint('CHILD_CPU', round(t.children_user + t.children_system, 2))")
    report = grader.grade(attack(tmp_path, code), ("attention",))
    (check,) = report.checks
    if "cpu 1 core" not in report.sandbox.get("cgroup", ""):
        pytest.skip(f"no CPU quota for the checks here: {report.sandbox.get('cgroup')}")
    spent = [float(line.split()[1]) for line in check.output.splitlines() if line.startswith("CHILD_CPU")]
    # three spinners for 1.5 s of wall time: 4.5 s of CPU unbounded, at most ~1.5 s on one core
    assert spent and max(spent) <= 1.9, check.output
    assert check.score == check.max_score, check.messages


def test_shared_memory_and_run_lock_do_not_outlive_the_check(grader, tmp_path):
    key = int(uuid.uuid4().int % 2**30) + 1
    lock = Path("/run/lock") / f"left-by-a-submission-{key}"
    code = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('SHM', libc.shmget({key}, 1 << 20, 0o1000 | 0o666))\n"  # IPC_CREAT
            f"try:\n    open({str(lock)!r}, 'w').write('x')\nexcept OSError as e:\n    print('LOCK', e)")
    check = grade_attention(grader, attack(tmp_path, code))
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(key, 0, 0)
    left = [what for what, there in (("shm", shmid >= 0), ("lock", lock.exists())) if there]
    if shmid >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID: leave the host as it was
    lock.unlink(missing_ok=True)
    assert "SHM -1" not in check.output, check.output  # the segment was made, in the check's own IPC namespace
    assert left == [], f"{left} outlived the check"
    assert check.score == check.max_score, check.messages


def test_filesystem_and_abstract_unix_sockets_outside_cannot_be_reached(grader, tmp_path):
    if not os.access("/run", os.W_OK):
        pytest.skip("/run is not writable here (the socket must sit outside the check's private folders)")
    folder = Path(tempfile.mkdtemp(dir="/run", prefix="grading-test-"))
    os.chmod(folder, 0o755)
    path, abstract = folder / "service.sock", f"grading-test-{uuid.uuid4().hex}"
    servers = []
    try:
        for address in (str(path), "\0" + abstract):
            server = socket.socket(socket.AF_UNIX)
            server.bind(address)
            server.listen()
            server.settimeout(0.5)
            servers.append(server)
        os.chmod(path, 0o777)  # like a world-writable service socket: file permissions do not protect it
        code = (f"import socket\nfor address in ({str(path)!r}, '\\0' + {abstract!r}):\n    try:\n"
                f"        s = socket.socket(socket.AF_UNIX)\n        s.connect(address)\n        print('CONNECTED')\n"
                f"    except OSError as e:\n        print('REFUSED', e)")
        check = grade_attention(grader, attack(tmp_path, code))
        assert "CONNECTED" not in check.output and check.output.count("REFUSED") == 2, check.output
        for server in servers:
            with pytest.raises(socket.timeout):
                server.accept()
        assert check.score == check.max_score, check.messages
    finally:
        for server in servers:
            server.close()
        path.unlink(missing_ok=True)
        folder.rmdir()


def test_other_processes_and_their_command_lines_are_invisible(grader, tmp_path):
    marker = f"secret-token-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        code = (f"import os\nseen = []\nfor pid in os.listdir('/proc'):\n    try:\n"
                f"        if pid.isdigit() and {marker!r}.encode() in open(f'/proc/{{pid}}/cmdline', 'rb').read():\n"
                f"            seen.append(pid)\n    except OSError:\n        pass\n"
                f"print('PROCESSES', len([p for p in os.listdir('/proc') if p.isdigit()]), 'SAW', len(seen))\n"
                f"print('PID', os.getpid(), os.getppid())")
        report = grader.grade(attack(tmp_path, code), ("attention",))
    finally:
        other.kill()
        other.wait()
    (check,) = report.checks
    assert "SAW 0" in check.output, check.output
    if report.sandbox["pid"] == "isolated":  # its own PID namespace, whose init it is (no parent there)
        assert "PID 1 0" in check.output, check.output
    assert check.score == check.max_score, check.messages


@ROOT_ONLY
def test_another_students_live_copy_cannot_be_read(grader, tmp_path):
    """--batch: two checks at once, under two uids; the second knows where the first's copy lives."""
    token = uuid.uuid4().hex
    marker = f"VICTIM-{token}"  # never spelled out in the attacker's own file, which it can read
    victim = write_submission(tmp_path / "victim", attention=[("import math\n", f"import math\nimport time\n"
                                                                                f"# {marker}\ntime.sleep(4)\n")])
    other = Sandbox(Limits(timeout=6))  # as a second batch worker would have: its own uid and folder
    assert other.uid != grader.sandbox.uid and other.scratch != grader.sandbox.scratch
    thread = threading.Thread(target=other.run, args=("attention", victim))
    thread.start()
    try:
        copy = None
        for _ in range(1000):  # until the victim's check has its copy, closed (the zygote starts first)
            new = list(Path(other.scratch).glob("check-*"))  # its own folder: another grader's checks never match
            # given.safetensors is written after the folders are closed: waiting for the copy alone raced the chmod
            # under load (pytest -n 2: the mode read 0700 before it became 0710)
            if new and (new[0] / "submission" / "modules" / "attention.py").exists() \
                    and (new[0] / "given.safetensors").exists():
                copy = new[0]
                break
            time.sleep(0.05)
        assert copy is not None, "the victim's check never started"
        # closed even where no private /tmp hides it: only the victim's group may pass, only its uid may read
        assert (copy.stat().st_mode & 0o777, copy.stat().st_gid) == (0o710, other.uid)
        assert (copy / "submission").stat().st_mode & 0o777 == 0o700
        target = copy / "submission" / "modules" / "attention.py"
        code = (f"import glob\nfound = glob.glob('/tmp/grading-*/check-*/submission/modules/attention.py')\n"
                f"for path in found + [{str(target)!r}]:\n    try:\n"
                f"        print('STOLEN' if 'VICTIM-' + {token!r} in open(path).read() else 'other', path)\n"
                f"    except OSError as e:\n        print('REFUSED', e.strerror)")
        check = grade_attention(grader, attack(tmp_path, code))
    finally:
        thread.join()
        other.release()
    assert "STOLEN" not in check.output and "REFUSED" in check.output, check.output
    assert check.score == check.max_score, check.messages


@ROOT_ONLY
def test_two_graders_on_one_machine_never_share_a_uid_or_a_check_folder():
    from grading.sandbox import claim_uid

    first, second = Sandbox(), Sandbox()  # as two graders (or two batch workers) started side by side would
    try:
        assert first.uid != second.uid and first.scratch != second.scratch
        for sb in (first, second):  # root's, passable (the check's own folder inside), not listable
            st = os.stat(sb.scratch)
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o711)
        uid = first.uid
    finally:
        first.release()
        second.release()
    assert not os.path.exists(first.scratch) and not os.path.exists(second.scratch)
    again, lock = claim_uid(uid)  # given back: free for the next grader
    os.close(lock)
    assert again == uid


# ---- prediction files (no sandbox) ---------------------------------------------------------------------------

SONNETS = ("\n1\nShall I compare thee to a summer's day?\nThou art more lovely and more temperate\n\n"
           "2\nWhen forty winters shall besiege thy brow,\nAnd dig deep trenches in thy beauty's field\n")


@pytest.fixture
def folders(tmp_path):
    gold, pred = tmp_path / "gold", tmp_path / "pred"
    gold.mkdir()
    pred.mkdir(mode=0o755)
    (gold / "TRUE_sonnets_held_out_dev.txt").write_text(SONNETS)
    return gold, pred


def sonnet_result(pred, gold):
    board, messages = score_predictions(pred, gold)
    return board, [m for m in messages if m.startswith("Sonnet")][0]


def test_a_link_to_the_gold_sonnets_is_not_read(folders):
    gold, pred = folders
    (pred / "generated_sonnets_dev.txt").symlink_to(gold / "TRUE_sonnets_held_out_dev.txt")
    board, message = sonnet_result(pred, gold)
    assert board == [] and "generated_sonnets_dev.txt not read: it is a symbolic link" in message
    (pred / "generated_sonnets_dev.txt").unlink()
    os.link(gold / "TRUE_sonnets_held_out_dev.txt", pred / "generated_sonnets_dev.txt")  # a hard link too
    board, message = sonnet_result(pred, gold)
    assert board == [] and "has other hard links" in message
    (pred / "generated_sonnets_dev.txt").unlink()
    (pred / "generated_sonnets_dev.txt").write_text(SONNETS)  # the student's own file is scored
    assert sonnet_result(pred, gold)[0] == [{"name": "Sonnet dev chrF", "value": 100.0}]


def test_a_link_to_a_secret_file_is_not_read_and_never_echoed(folders, tmp_path):
    gold, pred = folders
    secret = tmp_path / "secret.txt"
    secret.write_text("1\nTOP-SECRET-LINE\n")
    secret.chmod(0o600)
    (pred / "generated_sonnets_dev.txt").symlink_to(secret)
    (pred / "para-dev-output.csv").write_text("id \t Predicted_Is_Paraphrase \nCONTENT-OF-THE-FILE\n")
    (gold / "quora-dev.csv").write_text("id\tsentence1\tsentence2\tis_duplicate\n1 x-1\ta?\tb?\t1.0\n")
    board, messages = score_predictions(pred, gold)
    text = " ".join(messages)
    assert board == [] and "TOP-SECRET" not in text and "CONTENT-OF-THE-FILE" not in text, text
    assert "para-dev-output.csv could not be scored: line 2: expected `<id>, <label>`" in text
    if os.geteuid() == 0:  # read as a uid of its own: a root-only file in the folder is unreadable
        (pred / "generated_sonnets_dev.txt").unlink()
        (pred / "generated_sonnets_dev.txt").write_text(SONNETS)
        (pred / "generated_sonnets_dev.txt").chmod(0o600)
        board, message = sonnet_result(pred, gold)
        assert board == [] and "not read: it cannot be opened: Permission denied" in message


def test_a_linked_folder_or_a_fifo_is_not_read(folders, tmp_path):
    gold, pred = folders
    os.mkfifo(pred / "generated_sonnets_dev.txt")
    board, message = sonnet_result(pred, gold)  # returns at once: a FIFO is never opened for a blocking read
    assert board == [] and "is not a regular file" in message
    (tmp_path / "linked").symlink_to(pred)
    board, messages = score_predictions(tmp_path / "linked", gold)
    assert board == [] and "has a symbolic link (linked)" in messages[0]


# ---- where the grader has less power: no root, or a container without CAP_SYS_ADMIN ------------------------------

def run_grader_as(wrapper: list[str], tmp: Path, code: str = "") -> dict:
    import json

    sub = attack(tmp, code) if code else write_submission(tmp / "sub")
    subprocess.run(["chmod", "-R", "a+rwX", str(tmp)], check=True)
    out = subprocess.run([*wrapper, sys.executable, "-m", "grading", str(sub), "--checks", "attention", "--json",
                          str(tmp / "report.json")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HOME": str(tmp), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp / "report.json").read_text())


def exposing_python(tmp: Path, then: str, hide_cgroups: bool = False) -> list[str]:
    """A command prefix: a private mount namespace where each folder closed to others above the project or this
    Python (a pyenv in /root, the `mktemp -d` folder a clone and its venv live in) is covered by an empty tmpfs with
    only those bound back, then `then` (a setpriv line that takes the rest of the arguments). hide_cgroups: an empty
    read-only /sys/fs/cgroup, as in a container given no cgroups."""
    closed = closed_folders([str(ROOT), *python_paths()])
    stage, script = lambda i, j: shlex.quote(str(tmp / f"stage-{i}-{j}")), ["set -e"]
    if hide_cgroups and os.path.isdir("/sys/fs/cgroup"):
        script.append("mount -t tmpfs -o ro,size=1m tmpfs /sys/fs/cgroup")
    for i, (folder, paths) in enumerate(sorted(closed.items())):
        for j, path in enumerate(paths):
            script.append(f"mkdir {stage(i, j)}; mount --bind {shlex.quote(path)} {stage(i, j)}")
        script.append(f"mount -t tmpfs -o mode=0755,size=1m tmpfs {shlex.quote(folder)}")
        for j, path in enumerate(paths):
            script.append(f"mkdir -p {shlex.quote(path)}; mount --bind {stage(i, j)} {shlex.quote(path)}")
    script.append(f'exec {then} "$@"')
    return ["unshare", "-m", "sh", "-c", "; ".join(script), "sh"]


WRITE_OUTSIDE = ("import sys\nfor path in ({target!r}, sys.modules['__main__'].__file__):\n    try:\n"
                 "        open(path, 'a').write('forged')\n        print('WROTE', path)\n"
                 "    except OSError as e:\n        print('REFUSED', e.strerror)")


@contextlib.contextmanager
def open_to_all():
    """An empty file anyone may write, in a folder anyone may write, outside the check's private tmpfs (/run)."""
    if not os.access("/run", os.W_OK):
        pytest.skip("/run is not writable here (the file must sit outside the check's private folders)")
    folder = Path(tempfile.mkdtemp(dir="/run", prefix="grading-test-"))
    try:
        os.chmod(folder, 0o777)
        target = folder / "writable-by-all.txt"
        target.write_text("")
        os.chmod(target, 0o666)
        yield target
    finally:
        subprocess.run(["rm", "-rf", str(folder)])


def test_nothing_outside_the_checks_own_folder_is_writable(grader, tmp_path):
    """World-writable files outside the private tmpfs, and the grader's own code (found from the check's
    __main__), are refused: every mount but the check's own is read-only in its mount namespace."""
    with open_to_all() as target:
        report = grader.grade(attack(tmp_path, WRITE_OUTSIDE.format(target=str(target))), ("attention",))
        assert target.read_text() == ""
    (check,) = report.checks
    if not report.sandbox.get("read_only", "").startswith("everything read-only"):
        pytest.skip(f"no private mount namespace here: {report.sandbox.get('read_only')}")
    assert "WROTE" not in check.output and check.output.count("REFUSED") == 2, check.output
    assert check.score == check.max_score, check.messages


@ROOT_ONLY
def test_a_grader_without_root_isolates_the_check_in_a_user_namespace():
    if not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs setpriv and unshare (util-linux) to become an unprivileged user")
    tmp = Path(tempfile.mkdtemp(prefix="grading-nonroot-"))
    try:
        with open_to_all() as target:  # a file the grader's own uid may write, as its checkout and venv are
            report = run_grader_as(exposing_python(tmp, "setpriv --reuid=65534 --regid=65534 --clear-groups "
                                                        "--inh-caps=-all --bounding-set=-all"), tmp,
                                   WRITE_OUTSIDE.format(target=str(target)))
            assert target.read_text() == "", "the check wrote outside its folder"
    finally:
        subprocess.run(["rm", "-rf", str(tmp)])
    sandbox = report["sandbox"]
    assert report["score"] == 16 and sandbox["uid"] == 65534, report
    if sandbox["user_namespace"] != "isolated":
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {sandbox['user_namespace']}")
    assert sandbox["read_only"].startswith("everything read-only"), sandbox
    assert "WROTE" not in report["checks"][0]["output"], report["checks"][0]["output"]
    assert [sandbox[k] for k in ("network", "ipc", "mount", "pid")] == ["isolated"] * 4, sandbox
    assert sandbox["tmpfs"].startswith("private") and sandbox["disk"].startswith("quota"), sandbox
    assert sandbox["proc"].startswith("private") and sandbox["unix_sockets"].startswith("seccomp"), sandbox
    # hidden wherever the checkout lives: covered by an empty tmpfs (a venv inside it, as .ci/fresh-clone makes it,
    # comes back read-only and nothing else), or under /tmp, which the check's private tmpfs replaces
    root = str(ROOT.resolve())
    assert sandbox["grader_code"] in (f"hidden: an empty tmpfs on {root}",
                                      f"hidden: an empty tmpfs on {root}, only {Path(sys.prefix).resolve()} bound back",
                                      f"hidden: {root} is under the check's private tmpfs"), sandbox


@ROOT_ONLY
def test_a_container_without_namespaces_grades_says_what_did_not_hold_and_cleans_up():
    """Docker without CAP_SYS_ADMIN and without cgroups: no namespace, no cgroup; the uid of its own still holds where
    Python is readable (here made so), what it leaves in the shared /run/lock and SysV shared memory is reported and
    removed, and a process it started in a session of its own is killed (kill_all_of: nothing else reaches it)."""
    if not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs setpriv and unshare (util-linux) to drop CAP_SYS_ADMIN as Docker does")
    tmp = Path(tempfile.mkdtemp(prefix="grading-nosysadmin-"))
    key = int(uuid.uuid4().int % 2**30) + 1
    lock = Path("/run/lock") / f"left-by-a-submission-{key}"
    marker = f"left-running-{uuid.uuid4().hex}"  # a process in a session of its own: no process group reaches it
    code = (f"import ctypes\nprint('SHM', ctypes.CDLL(None).shmget({key}, 1 << 20, 0o1000 | 0o666))\n"
            f"open({str(lock)!r}, 'w').write('x')\nimport subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}], "
            f"start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        report = run_grader_as(exposing_python(tmp, "setpriv --bounding-set=-sys_admin --inh-caps=-sys_admin",
                                               hide_cgroups=True), tmp, code)
    finally:
        subprocess.run(["rm", "-rf", str(tmp)])
        shmid = libc.shmget(key, 0, 0)
        left = [what for what, there in (("shm", shmid >= 0), ("lock", lock.exists())) if there]
        if shmid >= 0:
            libc.shmctl(shmid, 0, None)
        lock.unlink(missing_ok=True)
    running = [pid for pid in os.listdir("/proc") if pid.isdigit() and marker.encode() in _cmdline(pid)]
    for pid in running:  # not left behind by a failing run either
        with contextlib.suppress(OSError):
            os.kill(int(pid), 9)
    sandbox, (check,) = report["sandbox"], report["checks"]
    assert running == [], "a process the check started outlived it (the zygote's kill_all_of)"
    assert report["score"] == 16, report
    assert sandbox["cgroup"].startswith("none"), sandbox
    for layer in ("network", "ipc", "mount", "pid"):
        assert sandbox[layer].startswith("not isolated: unshare(CLONE_NEW") and "not permitted" in sandbox[layer]
    assert sandbox["tmpfs"] == sandbox["disk"] == "none: no private mount namespace", sandbox
    assert sandbox["uid"] >= 200000 and sandbox["unix_sockets"].startswith("seccomp"), sandbox
    # no mount namespace to hide the grader's checkout: said, with whether the check's uid can read it
    assert sandbox["grader_code"].startswith("not hidden: no private mount namespace"), sandbox
    assert sandbox["grader_code"].endswith("; readable by the check's uid" if os.stat(ROOT).st_mode & 0o005 == 0o005
                                           else "; closed to the check's uid"), sandbox
    findings = " ".join(check["messages"])
    assert lock.name in findings and "SysV shared memory segment" in findings, check["messages"]
    assert left == [], f"{left} outlived the check"


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_cgroup_v2_group_goes_under_a_delegated_group_else_the_hierarchy_root(tmp_path):
    from grading.sandboxed.isolation import Cgroup

    root = tmp_path / "cgroup"
    own = root / "user.slice" / "grader"
    own.mkdir(parents=True)
    (root / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").mkdir()  # stands for a group not delegated to us: its controls are refused
    mounts, paths = [(str(root), "cgroup2", {"rw"})], {"": "/user.slice/grader"}
    group, why = Cgroup.create("check-1", 256 << 20, 32, mounts=mounts, own=paths)
    assert group is not None and group.version == 2, why
    assert group.dirs == {"memory": str(root / "check-1"), "pids": str(root / "check-1")}
    assert (root / "check-1" / "memory.max").read_text() == str(256 << 20)
    assert (root / "check-1" / "pids.max").read_text() == "32"
    (own / "cgroup.subtree_control").rmdir()
    (own / "cgroup.subtree_control").write_text("memory pids\n")  # delegated: the group goes under ours
    group, why = Cgroup.create("check-2", 256 << 20, 32, mounts=mounts, own=paths)
    assert group.dirs["memory"] == str(own / "check-2"), why
    group, why = Cgroup.create("check-3", 1, 1, mounts=[], own={})
    assert group is None and "no cgroup filesystem mounted" in why
