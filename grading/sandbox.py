"""Run one probe on an untrusted submission: a fresh forked process per check, limits, a throw-away copy.

    with Sandbox() as sb:
        run = sb.run("attention", "path/to/submission", timeout=60)
        run.info, run.tensors, run.output, run.problem

Per check the sandbox makes a temporary folder holding a copy of the submission (the working directory and the
first entry of the import path), a HOME/TMPDIR, and the result folder; the folder is closed to every other uid. A fork
of the warm zygote (grading/sandboxed/zygote.py) then drops into it through grading/sandboxed/isolation.py: its own session and cgroup
(memory of all its processes together, tmpfs included, and their number), network, IPC, PID and mount namespaces,
private size-capped tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock, a disk quota on its folders, its own /proc, a
seccomp filter (no AF_UNIX sockets), rlimits, and, when the grader runs as root, a uid of its own (without root, a
user namespace where the kernel allows one). Each layer that the kernel or container refuses is reported in the
run's `sandbox` dict instead (sent by the child before the submission's code runs, on a pipe closed before it starts).
Output goes to a file capped by RLIMIT_FSIZE and is read back truncated. The grader's inputs go in as a read-only
safetensors file; results come back as safetensors + JSON, never pickles, read with a byte cap and a header checked
before any tensor is made, so a corrupt or oversized result costs its check only. See docs/grading.md.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

ZYGOTE = Path(__file__).with_name("sandboxed") / "zygote.py"  # what runs in the sandbox: grading/sandboxed/
OUTPUT_KEEP = 3000  # characters of captured output kept from each end
SKIP_NAMES = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".ipynb_checkpoints")
RESULT_BYTES = 12 * 2**20  # largest tensors file read back (from_pretrained's, with GPT-2's vocabulary, is ~7 MiB)
RESULT_TENSORS = 256  # most tensors a result may hold (from_pretrained's has 4 + 16 per layer)
RESULT_HEADER_BYTES = 64 * 2**10  # largest safetensors header parsed (from_pretrained's is about 4 KiB)
INFO_BYTES = 256 * 2**10  # largest info.json read back (JSON parses into a few times its size in objects)
LARGE_FILE = 20 * 2**20  # checkpoints and data a submission carries: no check reads them, and copying is per check
SCAN_LIMIT = 20000  # files and folders of a submission looked at, at most (30,000 tiny files took 562 s to grade)


@dataclass
class Limits:
    timeout: float = 60.0  # wall-clock seconds per check
    submission_timeout: float = 300.0  # wall-clock seconds for all of a submission's checks together
    mem_mb: int = 3072  # per process: address space beyond the warm interpreter; all processes together: the cgroup
    max_file_mb: int = 16  # largest file (captured output included) a check may write
    max_procs: int = 64  # processes + threads: the check's cgroup, and RLIMIT_NPROC of a sandbox uid
    disk_mb: int = 512  # what the check may write in its folders (a tmpfs under them, counted as memory too)
    max_files: int = 2000  # files of a submission copied into a check (its Python files first)
    cpus: float = 1.0  # cores all of a check's processes may use together (the cgroup's CPU quota), where one exists
    max_submission_mb: int = 100  # bytes of a submission copied into a check (files over LARGE_FILE never are)


@dataclass
class Run:
    """What one check's process left: the probe's info and tensors, its output, and what went wrong."""
    info: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    output: str = ""
    problem: str = ""  # set when the process did not finish normally (timeout, signal, limits, no result)
    sandbox: dict = field(default_factory=dict)
    wall: float = 0.0
    findings: list = field(default_factory=list)  # side effects outside the check's folder
    given: dict = field(default_factory=dict)  # the grader's inputs and weights for this check (never read back)


MAX_DEPTH = 32  # folder levels below the submission's top that are looked at (a walk 1100 deep raised RecursionError)


def shown(name: str) -> str:
    """A file name as text that any writer takes: bytes that are not UTF-8 (os.fsdecode's surrogates) as \\xNN."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


@dataclass
class CopyPlan:
    """What copy_submission copies: the kept entries in order, what it leaves out and why (counts and bytes)."""
    files: list = field(default_factory=list)  # (rel, size, link): link is the target relative to the top, else None
    findings: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # reason -> [count, bytes] (part of the batch's record key)


def plan_copy(src: str | os.PathLike, max_files: int = 2000, max_mb: int = 100) -> CopyPlan:
    """Decide what copy_submission copies, without copying: VCS folders and caches, files over LARGE_FILE, links that
    leave the submission (another student's files are not this one's code), anything but files, folders and links,
    folders deeper than MAX_DEPTH and what lies past the caps on files and bytes (its Python files first) are left
    out; at most SCAN_LIMIT entries are looked at, and no more than max_files in one folder. The walk is iterative (a
    folder of any depth) and names may be any bytes."""
    src = os.fspath(src)
    root = os.path.realpath(src)
    files, large, outside, other, unreadable = [], [], [], [], []
    scanned = unlisted = deep = 0
    stack = [("", 0)]  # folders to look at (relative to the top) and their depth: preorder, as os.walk's
    while stack:
        rel_dir, depth = stack.pop()
        folder = os.path.join(src, rel_dir) if rel_dir else src
        try:
            with os.scandir(folder) as it:
                listed = {e.name: e for e in it}
        except OSError:
            unreadable.append(rel_dir)
            continue
        skip = set(SKIP_NAMES(folder, list(listed)))
        kinds = {}
        for name, e in listed.items():
            try:
                kinds[name] = "link" if e.is_symlink() else "dir" if e.is_dir(follow_symlinks=False) else \
                    "file" if e.is_file(follow_symlinks=False) else "other"
            except OSError:
                kinds[name] = "other"
        # folders first (the course's layout lives in them), then Python files; no more than max_files looked at in
        # one folder and SCAN_LIMIT in all, so a folder of 30,000 files neither hides the code nor costs minutes
        folders = {n for n in listed if n not in skip and (kinds[n] == "dir" or kinds[n] == "link"
                                                           and os.path.isdir(os.path.join(folder, n)))}
        dirs = sorted(folders)  # links to folders among them: `models -> v1` is the layout too
        rest = sorted((n for n in listed if n not in skip and n not in folders),
                      key=lambda n: (not n.endswith(".py"), n))
        entries = dirs + rest
        descend = []
        for i, name in enumerate(entries):
            if i >= max_files or scanned >= SCAN_LIMIT:
                unlisted += len(entries) - i
                break
            scanned += 1
            rel = os.path.join(rel_dir, name) if rel_dir else name
            path = os.path.join(src, rel)
            kind = kinds[name]
            if kind == "link":
                target = os.path.realpath(path)
                if target != root and not target.startswith(root + os.sep):
                    outside.append(f"{shown(rel)} -> {shown(os.readlink(path))}")
                else:
                    files.append((rel, 0, os.path.relpath(target, root)))
            elif kind == "dir":
                if depth + 1 >= MAX_DEPTH:
                    deep += 1
                else:
                    descend.append((rel, depth + 1))
            elif kind == "file":
                try:
                    size = listed[name].stat(follow_symlinks=False).st_size
                except OSError:
                    unreadable.append(rel)
                    continue
                if size > LARGE_FILE:
                    large.append((rel, size))
                else:
                    files.append((rel, size, None))
            else:
                other.append(rel)
        stack.extend(reversed(descend))
    files.sort(key=lambda f: (not (f[0].endswith(".py") or f[2] is not None), f[0]))  # code and links first
    plan, total = CopyPlan(), 0
    for rel, size, link in files:
        if len(plan.files) >= max_files or total + size > max_mb * 2**20:
            break
        plan.files.append((rel, size, link))
        total += size
    over = files[len(plan.files):]
    plan.skipped = {"large": [len(large), sum(s for _, s in large)], "outside": [len(outside), 0],
                    "over_caps": [len(over), sum(f[1] for f in over)], "unlisted": [unlisted, 0], "deep": [deep, 0],
                    "other": [len(other), 0], "unreadable": [len(unreadable), 0]}
    findings = plan.findings
    if large:
        findings.append(f"files over {LARGE_FILE >> 20} MiB not copied into the sandbox: "
                        f"{', '.join(shown(r) for r, _ in large[:5])}")
    if outside:
        findings.append(f"links that leave the submission not copied (not graded as its code): "
                        f"{', '.join(outside[:5])}" + (f" and {len(outside) - 5} more" if len(outside) > 5 else ""))
    if over:
        findings.append(f"the submission holds more than {max_files} files or {max_mb} MiB (the grader's limits): "
                        f"{len(over)} files not copied into the sandbox (its Python files first)")
    if unlisted:
        findings.append(f"{unlisted} files and folders of the submission were not looked at (the grader looks at no more "
                        f"than {max_files} in one folder and {SCAN_LIMIT} in all)")
    if deep:
        findings.append(f"{deep} folders deeper than {MAX_DEPTH} levels not looked at (not copied into the sandbox)")
    if other or unreadable:
        findings.append(f"{len(other) + len(unreadable)} entries that are not plain files, folders or links, or could "
                        f"not be read, not copied: {', '.join(shown(r) for r in (other + unreadable)[:5])}")
    return plan


def copy_submission(src: Path, dst: Path, max_files: int = 2000, max_mb: int = 100) -> list[str]:
    """Copy what plan_copy keeps (links inside the submission as relative links to their resolved target, so the copy
    runs what the record key hashed); returns the findings, each naming what was left out."""
    plan = plan_copy(src, max_files, max_mb)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    failed = []
    for rel, _size, link in plan.files:
        source, target = os.path.join(src, rel), dst / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if link is not None:
                os.symlink(os.path.relpath(link, os.path.dirname(rel) or "."), target)
            else:
                shutil.copyfile(source, target, follow_symlinks=False)
                shutil.copystat(source, target, follow_symlinks=False)
        except OSError:
            failed.append(rel)
    if failed:
        plan.findings.append(f"{len(failed)} files could not be copied: {', '.join(shown(r) for r in failed[:5])}")
    return plan.findings


def _snapshot(folder: Path) -> dict:
    """Every entry under `folder` but its folders (files, links, anything else; links not followed) -> (its kind, size
    and mtime): what a check could change in the submission it was given. Walked with a stack, so any depth holds
    (Path.rglob recursed: RecursionError past about 1,000 levels)."""
    found, stack = {}, [os.fspath(folder)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                entries = list(it)
        except OSError:  # a folder gone or unreadable: what is left is compared
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            else:
                found[entry.path] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return found


def _read_output(path: Path) -> tuple[str, int]:
    if not path.is_file():
        return "", 0
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(OUTPUT_KEEP)
        if size > 2 * OUTPUT_KEEP:
            f.seek(size - OUTPUT_KEEP)
            text = head.decode(errors="replace") + f"\n[... {size - 2 * OUTPUT_KEEP} bytes cut ...]\n" + \
                f.read().decode(errors="replace")
        else:
            text = (head + f.read()).decode(errors="replace")
    return text, size


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, uid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _close_folders(tmp: Path, private: tuple, uid: int | None) -> None:
    """Nobody else enters a check's folder: its top is root's and only the check's group may pass through
    (root), or ours alone (no root); the folders it works in are its own, 0700."""
    if uid is not None:
        os.chown(tmp, 0, uid)
        os.chmod(tmp, 0o710)
    else:
        os.chmod(tmp, 0o700)
    for folder in private:
        os.chmod(folder, 0o700)


UID_BASE, UID_SPAN = 200000, 1 << 20  # sandbox uids: unused by any account, below the 32-bit user namespaces' limit
UID_LOCKS = ("/run/grading-uids", os.path.join(tempfile.gettempdir(), "grading-uids"))


def claim_uid(first: int) -> tuple[int, int]:
    """A sandbox uid no other grader on this machine holds: (uid, the fd of its lock, held while the uid is in
    use). `first` is tried first, then random ones; the locks live in a folder only root may enter."""
    import fcntl
    import random

    for folder in UID_LOCKS:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            st = os.lstat(folder)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o077:
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no folder for the sandbox uids' locks: tried {', '.join(UID_LOCKS)}")
    rng = random.SystemRandom()
    for uid in [first] + [rng.randrange(UID_BASE, UID_BASE + UID_SPAN) for _ in range(100)]:
        fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except OSError:
            os.close(fd)
    raise RuntimeError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_SPAN} after 100 tries")


LEFTOVER = re.compile(r"grading-(?:(?:hub|zygote|batch|predictions)-)?(\d+)-")  # the temporary folders a grader makes


def temp_folder(kind: str = "") -> str:
    """A new private temporary folder named grading-[KIND-]PID-...: the pid lets a later grader tell a folder whose
    grader was killed (SIGKILL runs no cleanup) from one in use (sweep_leftovers)."""
    return tempfile.mkdtemp(prefix=f"grading-{kind + '-' if kind else ''}{os.getpid()}-")


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, killed and not yet reaped, does not: it will clean nothing up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_leftovers(folder: str | None = None) -> list[str]:
    """Remove this user's grading temporary folders whose grader process is gone (a grader or batch worker killed
    with SIGKILL leaves its scratch, hub cache and unpacked export behind); returns what was removed. A folder whose
    pid is alive (or reused by another live process) is left alone."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = LEFTOVER.match(name)
        if not match:
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or _alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _spawn_server() -> tuple[subprocess.Popen, str]:
    """Start a fork server (grading/sandboxed/zygote.py) without waiting for it: (the process, its HOME)."""
    # huggingface_hub reads HF_HOME once, at import in the zygote; every child sees it through this link, which
    # each check points at its own copy of the cache.
    home = temp_folder("zygote")
    os.chmod(home, 0o755)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": os.path.join(home, "hf"), "HOME": home, "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}
    # -B: -I ignores PYTHONDONTWRITEBYTECODE, and the fork server writes nothing into the grader's checkout
    proc = subprocess.Popen([sys.executable, "-I", "-B", str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=home, env=env, start_new_session=True, text=True)
    return proc, home


def _await_server(proc: subprocess.Popen, home: str) -> tuple[subprocess.Popen, str]:
    """The server once it says it is ready; killed, and RuntimeError, if it does not within 300 s."""
    line = _readline(proc, 300)
    if not line or not json.loads(line).get("ready"):
        _kill_server(proc, home)
        raise RuntimeError("the grading sandbox could not start (python grading/sandboxed/zygote.py failed)")
    return proc, home


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


# Fork servers this process started that no Sandbox holds now. A Sandbox takes one of these before it starts its own
# (a start imports torch and transformers: about 9 s of a core on a 2-core Zen 3), so the graders a process makes one
# after another (a notebook, a test module each, the CLI's) share one warm interpreter. A fork server keeps nothing of
# a check (each runs in a child it forks) and gets every setting with each request: the uid, the folders, the limits.
# Only the process that started one talks to it (a forked batch worker never takes its parent's); a server that died,
# or whose Sandbox stopped between a request and its answer, is never kept; the rest are killed at exit.
_IDLE: list[tuple[int, subprocess.Popen, str]] = []  # (the pid that started it, the process, its HOME)
_IDLE_LOCK = threading.Lock()
IDLE_MAX = 2  # fork servers kept waiting per process (each holds about 400 MB, mostly shared with its children)


def _kill_server(proc: subprocess.Popen, home: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if home:
        shutil.rmtree(home, ignore_errors=True)


def _take_idle() -> tuple[subprocess.Popen, str] | None:
    with _IDLE_LOCK:
        while _IDLE:
            owner, proc, home = _IDLE.pop()
            if owner == os.getpid() and proc.poll() is None:
                return proc, home
            if owner == os.getpid():
                _kill_server(proc, home)
    return None


def _park(proc: subprocess.Popen, home: str) -> bool:
    with _IDLE_LOCK:
        if len(_IDLE) >= IDLE_MAX or proc.poll() is not None:
            return False
        _IDLE.append((os.getpid(), proc, home))
        return True


def drop_idle() -> None:
    """Kill the fork servers this process keeps waiting (at exit; also when a caller wants the memory back)."""
    with _IDLE_LOCK:
        mine = [(proc, home) for owner, proc, home in _IDLE if owner == os.getpid()]
        _IDLE[:] = [entry for entry in _IDLE if entry[0] != os.getpid()]
    for proc, home in mine:
        _kill_server(proc, home)


atexit.register(drop_idle)  # once per process (it was registered again each time the idle list refilled)


def lend(n: int) -> list[tuple[subprocess.Popen, str]]:
    """n fork servers of this process (its idle ones first, the rest started side by side) for n workers it is about
    to fork: worker i borrows server i (Sandbox.borrow), so a batch's workers start no interpreter of their own.
    Give them back with take_back once the workers are gone."""
    servers = []
    while len(servers) < n and (idle := _take_idle()) is not None:
        servers.append(idle)
    started = [_spawn_server() for _ in range(n - len(servers))]
    try:
        for proc, home in started:
            servers.append(_await_server(proc, home))
    except BaseException:
        take_back(servers + started, keep=False)
        raise
    return servers


def take_back(servers: list[tuple[subprocess.Popen, str]], keep: bool) -> None:
    """The servers lend gave, after the workers that borrowed them are gone: kept idle for this process's next
    Sandbox when `keep` (the workers ended cleanly: no request left unanswered), else killed."""
    for proc, home in servers:
        if not (keep and _park(proc, home)):
            _kill_server(proc, home)


class Sandbox:
    def __init__(self, limits: Limits | None = None, isolate_network: bool = True):
        self.limits = limits or Limits()
        self.isolate_network = isolate_network
        # A uid of our own (unused by any account, and by any other grader here) makes "kill everything it left"
        # and "refuse writes" exact.
        self.uid, self._uid_lock = claim_uid(UID_BASE + os.getpid()) if os.geteuid() == 0 else (None, -1)
        # This sandbox's checks get their folders in a folder of its own: another grader's never sit beside them.
        self.scratch = temp_folder()
        os.chmod(self.scratch, 0o711)
        self._forget_scratch = weakref.finalize(self, shutil.rmtree, self.scratch, True)  # also at exit
        self._proc: subprocess.Popen | None = None
        self._home = ""
        self._asking = False  # a request written and its answer not read: the server is not handed on
        self._borrowed = False  # the server is another process's (borrow)
        self._starting: tuple[subprocess.Popen, str] | None = None  # warm(wait=False)'s server, not yet ready
        self.packages: list[str] = []  # looked up in each check's sandbox before the submission runs (Run.sandbox)

    # ---- the warm fork server ----------------------------------------------------------------------------------
    def warm(self, wait: bool = True) -> None:
        """Start the fork server unless it runs (each check also does, if it died since); one this process has
        waiting (see _IDLE) is taken instead of starting another. wait=False only starts it: the caller does its own
        set-up meanwhile (the server's start is seconds of imports) and a later warm() waits for it."""
        if self._starting is not None:
            if not wait:
                return
            started, self._starting = self._starting, None
            self._proc, self._home = _await_server(*started)
            return
        if self._borrowed and self._proc is not None and _alive(self._proc.pid):
            return  # (poll() waits for a child, and a borrowed server is not this process's child)
        if self._proc is None or self._borrowed or self._proc.poll() is not None:
            self.close()
            idle = _take_idle()
            if idle is not None:
                self._proc, self._home = idle
            elif wait:
                self._start()
            else:
                self._starting = _spawn_server()

    def _start(self) -> None:
        self._proc, self._home = _await_server(*_spawn_server())

    def borrow(self, proc: subprocess.Popen, home: str) -> None:
        """Use a fork server another process started and lent (a batch's, in its forked worker): used while it
        lives, forgotten (not killed) by release(), killed by close() as a broken one is."""
        self.close()
        self._proc, self._home, self._borrowed = proc, home, True

    def close(self) -> None:
        """Kill the fork server (the next check starts or takes another)."""
        if self._proc is not None:
            _kill_server(self._proc, self._home)
        if self._starting is not None:
            _kill_server(*self._starting)
        self._proc, self._home, self._asking, self._borrowed, self._starting = None, "", False, False, None

    def release(self, keep_warm: bool = True) -> None:
        """Give back the scratch folder and the uid (the sandbox cannot run checks after this), and the fork server:
        kept for this process's next Sandbox when `keep_warm` and it is idle and well, else killed. A process that
        leaves without running atexit (a pool worker's os._exit) passes keep_warm=False."""
        if self._proc is not None and not self._asking and (
                self._borrowed or (keep_warm and _park(self._proc, self._home))):
            self._proc, self._home, self._borrowed = None, "", False  # parked, or back to its lender
        self.close()
        self._forget_scratch()
        if self._uid_lock >= 0:
            os.close(self._uid_lock)
            self._uid_lock = -1

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- one check ---------------------------------------------------------------------------------------------
    def run(self, probe: str, submission: str | os.PathLike, hf_home: str | os.PathLike | None = None,
            timeout: float | None = None, given: dict | None = None, forbidden: list[str] | None = None) -> Run:
        """Run one probe; `given` (name -> tensor) is handed to it read-only and kept on the Run for the comparison;
        `forbidden` (the rubric's forbidden calls, grading/sandboxed/forbidden.py) are watched while the submission runs."""
        self.warm()
        submission = Path(submission)
        timeout = timeout or self.limits.timeout
        before = _snapshot(submission)
        tmp = Path(tempfile.mkdtemp(prefix="check-", dir=self.scratch))
        try:
            work, result, home = tmp / "submission", tmp / "result", tmp / "home"
            copied = copy_submission(submission, work, self.limits.max_files, self.limits.max_submission_mb)
            result.mkdir()
            home.mkdir()
            env = {"HOME": str(home), "TMPDIR": str(home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home / "hf"), "PYTHONDONTWRITEBYTECODE": "1",
                   "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
            if hf_home is not None:
                shutil.copytree(hf_home, home / "hf", symlinks=True)
            else:
                (home / "hf").mkdir()
            link = Path(self._home) / "hf"
            link.unlink(missing_ok=True)
            link.symlink_to(home / "hf")
            env["HF_HOME"] = str(link)
            # The result: two files made here, the only ones the check may write outside its quota'd folders (the
            # folder is ours, and read-only in the check's mount namespace), each capped by the file-size limit.
            result_files = [result / "info.json", result / "tensors.safetensors"]
            for f in result_files:
                f.touch(mode=0o644)
            if self.uid is not None:
                for folder in (work, home):
                    _chown_tree(folder, self.uid)
                for f in result_files:
                    os.chown(f, self.uid, self.uid)
            _close_folders(tmp, (work, home), self.uid)
            given_path = tmp / "given.safetensors"  # ours, in the folder only the check's group may pass: read-only
            safetensors.torch.save_file(dict(given or {}), str(given_path))
            os.chmod(given_path, 0o644)
            req = {"given": str(given_path), "probe": probe, "workdir": str(work), "outdir": str(tmp), "resultdir": str(result), "env": env,
                   "timeout": timeout, "cpu_s": int(timeout) + 5, "mem_mb": self.limits.mem_mb,
                   "max_file_mb": self.limits.max_file_mb, "max_procs": self.limits.max_procs, "uid": self.uid,
                   "isolate_network": self.isolate_network, "disk_mb": self.limits.disk_mb,
                   "writable": [str(work), str(home)], "result_files": [str(f) for f in result_files],
                   "packages": list(self.packages), "cpus": self.limits.cpus, "forbidden": list(forbidden or [])}
            run = self._ask(req, timeout)
            run.given = dict(given or {})
            run.findings += copied
            run.output, size = _read_output(tmp / "output.txt")
            if size >= self.limits.max_file_mb * 2**20 and not run.problem.startswith("timed out"):
                run.problem = (f"output limit: the check wrote {self.limits.max_file_mb} MiB or more and was stopped "
                               f"({run.problem or 'no result'})")
            self._collect(run, result)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if _snapshot(submission) != before:
            run.findings.append("the original submission folder changed during the check")
        return run

    def _ask(self, req: dict, timeout: float) -> Run:
        run = Run()
        try:
            self._asking = True
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = _readline(self._proc, timeout + 60)
        except (BrokenPipeError, OSError):
            line = None
        self._asking = not line
        if not line:  # the fork server itself died or hung: start a fresh one for the next check
            self.close()
            run.problem = "the sandbox's worker process died during the check"
            return run
        reply = json.loads(line)
        run.wall = reply["wall"]
        run.sandbox = reply.get("sandbox") or {}
        if reply.get("strays"):
            run.findings.append(f"wrote outside its folder (removed after the check): {', '.join(reply['strays'][:5])}")
        if reply.get("pids_limit_hits"):
            run.findings.append(f"hit the limit of {self.limits.max_procs} processes and threads")
        if reply.get("oom_kills"):
            run.problem = (f"memory limit: the check's processes together used more than {self.limits.mem_mb} MiB "
                           f"(files in its folders and shared memory included) and were killed")
        elif reply["timed_out"]:
            run.problem = f"timed out after {timeout:.0f} s (wall clock); the check's processes were killed"
        elif "signal" in reply:
            sig = reply["signal"]
            why = {"SIGXCPU": "CPU-time limit", "SIGXFSZ": "file-size limit (too much output?)",
                   "SIGKILL": "killed (memory?)", "SIGSEGV": "segmentation fault"}.get(sig, "")
            run.problem = f"the check's process died with {sig}" + (f" ({why})" if why else "")
        elif reply.get("exit") != 0:
            run.problem = f"the check's process exited with status {reply.get('exit')} before reporting (os._exit?)"
        return run

    def _collect(self, run: Run, result: Path) -> None:
        """The probe's info.json and tensors, each read with a byte cap and checked before use; a problem with
        either costs this check only (run.problem), never the grade."""
        info, why = read_info(result / "info.json")
        if info is None:
            run.problem = run.problem or why
            return
        if run.problem:  # e.g. a process that wrote its result and then hung: the result is not trusted
            return
        tensors_path = result / "tensors.safetensors"
        if tensors_path.is_symlink() or (tensors_path.is_file() and tensors_path.stat().st_size > 0):
            tensors, why = read_tensors(tensors_path)
            if tensors is None:
                run.problem = why
                return
            run.tensors = tensors
        run.info = info


def _read_capped(path: Path, cap: int) -> bytes | None:
    """At most cap + 1 bytes of a regular file (never following a link); None if it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(cap + 1)
    finally:
        os.close(fd)


def read_info(path: Path) -> tuple[dict | None, str]:
    """(info, "") or (None, why): a JSON object with a status, message, notes and values of the expected types."""
    if (not path.exists() or (path.is_file() and path.stat().st_size == 0)) and not path.is_symlink():
        return None, "the check's process ended without writing a result (os._exit or killed)"
    data = _read_capped(path, INFO_BYTES)
    if data is None:
        return None, "the check's result file is not a regular file"
    if len(data) > INFO_BYTES:
        return None, "the check's result file is oversized"
    try:
        info = json.loads(data)
    except (ValueError, RecursionError) as e:  # deep nesting raises RecursionError, not ValueError
        return None, f"the check's result file is unreadable: {type(e).__name__}: {str(e)[:200]}"
    if not isinstance(info, dict) or not isinstance(info.get("values", {}), dict):
        return None, "the check's result file is unreadable: not a JSON object with a 'values' object"
    notes = info.get("notes") if isinstance(info.get("notes"), list) else []
    clean = {"status": str(info.get("status", "")), "message": str(info.get("message", ""))[:4000],
             "notes": [str(n)[:2000] for n in notes[:50]], "values": info.get("values", {})}
    if isinstance(info.get("device"), str):
        clean["device"] = info["device"][:500]
    return clean, ""


def read_tensors(path: Path) -> tuple[dict | None, str]:
    """(name -> float32 tensor, "") or (None, why). The header is checked before any tensor is made: F32 only, at
    most RESULT_TENSORS entries, each tensor's bytes inside the file, so memory stays a small multiple of the file."""
    data = _read_capped(path, RESULT_BYTES)
    if data is None:
        return None, "the check's result tensors are unreadable (not a regular file)"
    if len(data) > RESULT_BYTES:
        return None, f"the check's result is oversized (over {RESULT_BYTES >> 20} MiB)"
    bad = "the check's result tensors are unreadable"
    if len(data) < 8:
        return None, f"{bad} (truncated)"
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        return None, f"{bad} (a header of {n} bytes in a file of {len(data)})"
    if n > RESULT_HEADER_BYTES:
        return None, f"the check's result is oversized (a header of {n} bytes; no probe's exceeds {RESULT_HEADER_BYTES})"
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError) as e:
        return None, f"{bad} (header: {type(e).__name__})"
    if not isinstance(header, dict):
        return None, f"{bad} (header is not an object)"
    header.pop("__metadata__", None)
    if len(header) > RESULT_TENSORS:
        return None, f"the check's result is oversized ({len(header)} tensors; no probe returns more than {RESULT_TENSORS})"
    body, tensors = memoryview(data)[8 + n:], {}
    for name, entry in header.items():
        try:
            shape, (start, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
            ok = entry["dtype"] == "F32" and len(shape) <= 4 and min(shape, default=0) >= 0 and \
                isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= len(body) and \
                end - start == 4 * math.prod(shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            return None, f"{bad} (tensor {str(name)[:80]!r}: not a float32 tensor inside the file)"[:500]
        tensors[name] = torch.frombuffer(bytearray(body[start:end]), dtype=torch.float32).reshape(shape) if end > start \
            else torch.zeros(shape)
    return tensors, ""
