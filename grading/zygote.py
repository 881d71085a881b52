"""The sandbox's fork server: a process that imports torch and transformers once, then forks one child per check.

Started by grading/sandbox.py as `python zygote.py` (never imported by the grader). It reads one JSON request per
line on stdin, forks a child that drops into the sandbox and runs one probe of grading/probes.py on the submission,
waits for it with a wall-clock deadline, kills whatever the child left behind, and answers one JSON line on stdout.
Forking a warm interpreter makes a check cost milliseconds of start-up instead of seconds of imports.

Nothing here imports this project (its module names collide with the submission's).
"""
import ctypes
import importlib.util
import json
import os
import resource
import signal
import sys
import time

GRADING_DIR = os.path.dirname(os.path.abspath(__file__))
# Our own directory must not be on the submission's import path.
sys.path[:] = [p for p in sys.path if p not in ("", GRADING_DIR, os.getcwd())]

import numpy  # noqa: E402,F401  (warm imports shared by every child)
import safetensors.torch  # noqa: E402,F401
import torch  # noqa: E402,F401
import transformers  # noqa: E402
from transformers import GPT2Model as _HFGPT2Model  # noqa: E402,F401  (resolve the lazy import now)

_spec = importlib.util.spec_from_file_location("_grading_probes", os.path.join(GRADING_DIR, "probes.py"))
probes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probes)

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# Names a submission defines at top level; a warm import of any of them would shadow the submission's.
SUBMISSION_NAMES = ("config", "models", "modules", "optimizer", "utils")


def isolate_network() -> str:
    """A new, empty network namespace (loopback down, no routes): 'isolated', or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "isolated"
    return f"not isolated: unshare(CLONE_NEWNET) failed with {os.strerror(ctypes.get_errno())}"


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def expose_python(scratch: str) -> str:
    """Let the sandbox user read the Python installation where it lives in a folder others cannot enter (e.g.
    /root/.pyenv): in a private mount namespace, an empty tmpfs covers that folder (hiding the rest of it, a home
    directory's secrets included) and only the installation is bind-mounted back."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p}
    blocked = None
    for p in sorted(paths):
        parts = p.split(os.sep)
        for i in range(2, len(parts)):
            folder = os.sep.join(parts[:i])
            if os.path.isdir(folder) and not os.stat(folder).st_mode & 0o001:
                blocked = blocked or folder
                break
    if blocked is None:
        return "readable"
    tops = sorted({os.path.join(blocked, os.path.relpath(p, blocked).split(os.sep)[0])
                   for p in paths if p.startswith(blocked + os.sep)})
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    stages = []
    for i, top in enumerate(tops):
        stage = os.path.join(scratch, f"stage{i}")
        os.mkdir(stage)
        _check(libc.mount(top.encode(), stage.encode(), None, MS_BIND | MS_REC, None), f"bind {top}")
        stages.append(stage)
    _check(libc.mount(b"tmpfs", blocked.encode(), b"tmpfs", 0, b"mode=0755,size=1m"), f"tmpfs on {blocked}")
    for stage, top in zip(stages, tops):
        os.makedirs(top, exist_ok=True)
        _check(libc.mount(stage.encode(), top.encode(), None, MS_BIND | MS_REC, None), f"bind back {top}")
    return f"{blocked} hidden except {', '.join(tops)}"


def child(req: dict) -> None:
    """Runs in the forked child; never returns."""
    code = 70
    try:
        os.setsid()  # own process group: the zygote kills the whole group on timeout
        info = {"network": isolate_network() if req.get("isolate_network", True) else "not isolated: disabled"}
        out = os.open(os.path.join(req["outdir"], "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, 65536)  # the zygote's pipes and anything else inherited
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")  # address space already mapped (torch)
        limits = {
            resource.RLIMIT_AS: base + req["mem_mb"] * 2**20,
            resource.RLIMIT_CPU: req["cpu_s"],
            resource.RLIMIT_FSIZE: req["max_file_mb"] * 2**20,
            resource.RLIMIT_CORE: 0,
            resource.RLIMIT_NPROC: req["max_procs"],
        }
        for which, value in limits.items():
            resource.setrlimit(which, (value, value))
        uid = req.get("uid")
        if uid is not None:
            try:
                info["python"] = expose_python(req["outdir"])
            except OSError as e:  # the sandbox user could not import anything new: keep the grader's uid
                info["python"] = f"not readable by a sandbox user ({e}); the check runs as the grader's user"
                uid = None
        if uid is not None:  # root: become a throw-away user, so writes outside the sandbox are refused
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        info["uid"] = os.getuid()
        with open(os.path.join(req["resultdir"], "sandbox.json"), "w") as f:
            json.dump(info, f)
        os.chdir(req["workdir"])
        os.environ.clear()
        os.environ.update(req["env"])
        for name in list(sys.modules):
            if name.split(".")[0] in SUBMISSION_NAMES:
                del sys.modules[name]
        sys.path.insert(0, req["workdir"])
        torch.set_num_threads(1)
        code = probes.main(req["probe"], req["resultdir"], req.get("args", {}))
    except BaseException as e:  # noqa: BLE001  (the child must always reach os._exit)
        try:
            print(f"sandbox setup failed: {type(e).__name__}: {e}", file=sys.stderr)
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def kill_all_of(uid: int) -> None:
    """Kill every process of the sandbox user (grandchildren that left the process group included): a helper
    process takes that uid and sends SIGKILL to -1, which reaches exactly the processes it may signal."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(3):  # a fork loop may spawn between passes
                os.kill(-1, signal.SIGKILL)
        except BaseException:  # noqa: BLE001
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def remove_strays(uid: int) -> list[str]:
    """Files and folders the sandbox user left in the world-writable folders (the only places outside its own
    folder it can write to): listed for the report, then removed."""
    import shutil

    found = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                found.append(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
    return found


def run(req: dict) -> dict:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(req)
    deadline = start + req["timeout"]
    timed_out, status, usage = False, None, None
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    wall = time.monotonic() - start
    try:
        os.killpg(pid, signal.SIGKILL)  # leftovers in the child's group
    except (ProcessLookupError, PermissionError):
        pass
    strays = []
    if req.get("uid") is not None:
        kill_all_of(req["uid"])
        strays = remove_strays(req["uid"])
    reap()
    reply = {"wall": wall, "timed_out": timed_out, "max_rss_mb": usage.ru_maxrss / 1024 if usage else None,
             "strays": strays}
    if os.WIFSIGNALED(status):
        reply["signal"] = signal.Signals(os.WTERMSIG(status)).name
    else:
        reply["exit"] = os.WEXITSTATUS(status)
    return reply


def reap() -> None:
    """Collect every finished descendant: as a subreaper the zygote inherits the orphans of a fork loop."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    PR_SET_CHILD_SUBREAPER = 36  # orphans of a check are reparented here (and reaped), not to the container's init
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    print(json.dumps({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__}), flush=True)
    for line in sys.stdin:
        reply = run(json.loads(line))
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
