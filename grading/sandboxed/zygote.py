"""The sandbox's fork server: a process that imports torch and transformers once, then forks one child per check.

Started by grading/sandbox.py as `python grading/sandboxed/zygote.py` (never imported by the grader). It reads one JSON
request per line on stdin, forks a child that drops into the sandbox and runs one probe of probes.py on the submission,
waits for it with a wall-clock deadline, kills whatever the child left behind, and answers one JSON line on stdout.
Forking a warm interpreter makes a check cost milliseconds of start-up instead of seconds of imports.

Nothing here imports this project (its module names collide with the submission's).
"""
import ast
import ctypes
import importlib.util
import itertools
import json
import os
import select
import signal
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))  # grading/sandboxed: the files this process loads by path
GRADING_DIR = os.path.dirname(HERE)
PROJECT_DIR = os.path.dirname(GRADING_DIR)
# Our own directories and the project's (on the path when it is installed in editable mode) must not be on the
# submission's import path: its config/models/modules/optimizer would stand in for a file the submission lacks.
_OURS = {os.path.realpath(p) for p in (HERE, GRADING_DIR, PROJECT_DIR, os.getcwd())}
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) not in _OURS]


def _start_killer() -> tuple[int, int, int] | None:
    """The killer: a small process forked now, before the heavy imports, that kills a sandbox user's processes on
    request (kill_all_of). Forking it for each check costs about 1 ms; forking this process once torch is loaded
    costs tens (its page tables are copied, then torn down). (pid, request fd, reply fd), or None where this
    process's children cannot be listed (reap() must tell the killer from a check's leftovers)."""
    try:
        _children()
    except OSError:
        return None
    (req_r, req_w), (rep_r, rep_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid:
        os.close(req_r)
        os.close(rep_w)
        return pid, req_w, rep_r
    try:  # the killer: nothing of the zygote's but its two pipes; gone when the zygote is
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, min(req_r, rep_w))
        os.closerange(min(req_r, rep_w) + 1, max(req_r, rep_w))
        os.closerange(max(req_r, rep_w) + 1, 65536)
        with os.fdopen(req_r, "rb", buffering=0) as requests:
            while line := requests.readline():
                _kill_as(int(line))
                os.write(rep_w, b"\n")
    except BaseException:  # noqa: BLE001  (the killer must always reach os._exit)
        pass
    os._exit(0)


def _kill_as(uid: int) -> None:
    """SIGKILL to every process `uid` may signal, sent by a forked helper that takes that uid."""
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


def _children() -> set[int]:
    """This process's living and unreaped children (every thread's: an orphan is reparented to one of them)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            found.update(int(p) for p in f.read().split())
    return found


KILLER = _start_killer()

import numpy  # noqa: E402,F401  (warm imports shared by every child)
import safetensors.torch  # noqa: E402,F401
import torch  # noqa: E402,F401
import transformers  # noqa: E402
from transformers import GPT2Model as _HFGPT2Model  # noqa: E402,F401  (resolve the lazy import now)

try:  # the seccomp bindings isolation._seccomp loads in each check (tens of ms there, once here)
    import pyseccomp  # noqa: E402,F401
except Exception:  # noqa: BLE001  (missing module or libseccomp.so: the check reports it)
    pass

_spec = importlib.util.spec_from_file_location("_grading_probes", os.path.join(HERE, "probes.py"))
probes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probes)

_spec = importlib.util.spec_from_file_location("_grading_isolation", os.path.join(HERE, "isolation.py"))
isolation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(isolation)

_spec = importlib.util.spec_from_file_location("_grading_forbidden", os.path.join(HERE, "forbidden.py"))
forbidden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forbidden)

PID_NAMESPACES = isolation.PidNamespaces()
# Names a submission defines at top level; a warm import of any of them would shadow the submission's.
SUBMISSION_NAMES = ("config", "models", "modules", "optimizer", "utils")
COUNTER = itertools.count()
# The stand-ins each check grades with (grading/sandboxed/standins.py); a check not named here gets none.
STANDINS = {"layer": ("RefAttention",), "model": ("RefAttention", "RefLayer", "ref_embed")}
# The grader's checkout: hidden from the check by an empty tmpfs (isolation.hide_grader), so its files (the
# references, the stand-ins of other checks, this project's own GPT-2) cannot be read and executed there.
CHECKOUT = os.path.realpath(PROJECT_DIR if PROJECT_DIR != os.sep else GRADING_DIR)


def standins(probe: str):
    """Just the stand-ins `probe` grades with, compiled from grading/sandboxed/standins.py in the check's process before the
    sandbox hides the file: the others' code is never compiled there, so the submission cannot find or call them
    (the layer check has the reference attention, never the reference layer). None for the other checks."""
    names = STANDINS.get(probe)
    if not names:
        return None
    path = os.path.join(HERE, "standins.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    tree.body = [node for node in tree.body
                 if not isinstance(node, (ast.ClassDef, ast.FunctionDef)) or node.name in names]
    namespace = {"__name__": "_grading_standins"}
    exec(compile(tree, path, "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in names})


def child(req: dict, report_fd: int, ack_fd: int) -> None:
    """Runs in the forked child; never returns. What isolation held goes to the zygote on `report_fd`, and the child
    waits on `ack_fd` until the zygote has read it: the report's `sandbox` field is read before any of the
    submission's code runs, on pipes closed before it starts, so it is not the submission's to write."""
    code = 70
    try:
        os.setsid()  # own process group: the zygote kills the whole group on timeout
        out = os.open(os.path.join(req["outdir"], "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(report_fd, 3)
        os.dup2(ack_fd, 4)
        os.closerange(5, 65536)  # the zygote's pipes and anything else inherited
        probes.STANDINS = standins(req["probe"])  # read now: the sandbox hides the grader's checkout
        req["grader_dir"] = CHECKOUT
        info = isolation.enter(req, req.get("cgroup_dirs"))  # namespaces, mounts, cgroup, limits, uid, seccomp
        # Which of the course's packages this sandbox cannot find, looked up before any of the submission's code
        # runs (its folder is not on the path yet): the grader's evidence for a grader-side gap, not the check's words.
        info["packages_missing"] = [name for name in req.get("packages", []) if not _findable(name)]
        os.write(3, (json.dumps(info) + "\n").encode())
        os.close(3)
        os.read(4, 1)  # the zygote has the report
        os.close(4)
        os.chdir(req["workdir"])
        os.environ.clear()
        os.environ.update(req["env"])
        for name in list(sys.modules):
            if name.split(".")[0] in SUBMISSION_NAMES:
                del sys.modules[name]
        if req.get("forbidden"):  # the rubric's forbidden calls, watched before any of the submission's code runs
            probes.FORBIDDEN = forbidden.Recorder(req["workdir"]).install(req["forbidden"])
        sys.path.insert(0, req["workdir"])
        torch.set_num_threads(1)
        code = probes.main(req["probe"], req["resultdir"], req.get("args", {}), req.get("given"))
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


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def kill_all_of(uid: int) -> None:
    """Kill every process of the sandbox user (grandchildren that left the process group included): a helper
    process takes that uid and sends SIGKILL to -1, which reaches exactly the processes it may signal. The helper is
    forked by the killer (small, cheap to fork); by this process itself if there is no killer or it is gone."""
    global KILLER
    if KILLER is not None:
        _, req_w, rep_r = KILLER
        old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a killer gone is an error here, not this process's end
        try:
            os.write(req_w, f"{uid}\n".encode())
            if os.read(rep_r, 1) == b"\n":
                return
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGPIPE, old)
        for fd in (req_w, rep_r):
            os.close(fd)
        KILLER = None  # died (it never runs a submission's code: a bug or an outside kill); reap() collects it
    _kill_as(uid)


def remove_strays(uid: int) -> list[str]:
    """Files and folders the sandbox user left in the world-writable folders (the only places outside its own
    folder it can write to): listed for the report, then removed."""
    import shutil

    found = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
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


def remove_ipc(uid: int) -> list[str]:
    """SysV shared memory the sandbox user left (only possible without an IPC namespace): listed, then removed by a
    process under that uid (its owner; root without CAP_SYS_ADMIN, as in a container, may not)."""
    try:
        with open("/proc/sysvipc/shm") as f:
            header = f.readline().split()
            rows = [dict(zip(header, line.split())) for line in f]
    except OSError:
        return []
    rows = [r for r in rows if uid in (int(r.get("uid", -1)), int(r.get("cuid", -1)))]
    if rows:
        pid = os.fork()
        if pid == 0:
            try:
                os.setresuid(uid, uid, uid)
                libc = ctypes.CDLL(None, use_errno=True)
                for row in rows:
                    libc.shmctl(int(row["shmid"]), 0, None)  # IPC_RMID
            except BaseException:  # noqa: BLE001
                pass
            os._exit(0)
        os.waitpid(pid, 0)
    return [f"SysV shared memory segment {r['shmid']} ({int(r['size']) >> 10} KiB)" for r in rows]


def run(req: dict) -> dict:
    start = time.monotonic()
    name = f"grading-check-{os.getpid()}-{next(COUNTER)}"
    cgroup, why = isolation.Cgroup.create(name, req["mem_mb"] * 2**20, req["max_procs"])
    if cgroup is not None and req.get("cpus"):
        cgroup.status += f"; {cgroup.limit_cpu(req['cpus'])}"
    req["cgroup_dirs"], req["cgroup_status"] = (cgroup.dirs, cgroup.status) if cgroup else (None, why)
    (report_r, report_w), (ack_r, ack_w) = os.pipe(), os.pipe()
    req["pid_namespace"] = PID_NAMESPACES.before_fork()  # as root: the child is a new PID namespace's init
    try:
        pid = os.fork()
    except BaseException:
        if req["pid_namespace"]:  # this process's later forks stay in its own namespace
            PID_NAMESPACES.after_fork()
        raise
    if pid == 0:
        os.close(report_r)
        os.close(ack_w)
        child(req, report_w, ack_r)
    if req["pid_namespace"]:
        PID_NAMESPACES.after_fork()
    os.close(report_w)
    os.close(ack_r)
    report = IsolationReport(report_r, ack_w)
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
        if report.pending():
            report.poll(0.01)
        else:
            time.sleep(0.01)
    report.close()
    wall = time.monotonic() - start
    try:
        os.killpg(pid, signal.SIGKILL)  # leftovers in the child's group
    except (ProcessLookupError, PermissionError):
        pass
    limits_hit = cgroup.finish() if cgroup else {}
    strays = []
    if req.get("uid") is not None:
        kill_all_of(req["uid"])
        strays = remove_strays(req["uid"]) + remove_ipc(req["uid"])
    reap()
    reply = {"wall": wall, "timed_out": timed_out, "max_rss_mb": usage.ru_maxrss / 1024 if usage else None,
             "strays": strays, "sandbox": report.info, **limits_hit}
    if os.WIFSIGNALED(status):
        reply["signal"] = signal.Signals(os.WTERMSIG(status)).name
    else:
        reply["exit"] = os.WEXITSTATUS(status)
    return reply


class IsolationReport:
    """The child's one line on what isolation held, read while the child waits, then acknowledged."""

    def __init__(self, fd: int, ack_fd: int):
        self.fd, self.ack_fd, self.data, self.info = fd, ack_fd, b"", None
        os.set_blocking(fd, False)

    def pending(self) -> bool:
        return self.info is None

    def poll(self, timeout: float) -> None:
        if not select.select([self.fd], [], [], timeout)[0]:
            return
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        self.data += chunk
        if b"\n" in self.data or not chunk or len(self.data) > 65536:  # a line, or the child died before one
            try:
                info = json.loads(self.data.split(b"\n", 1)[0]) if b"\n" in self.data else None
            except ValueError:
                info = None
            self.info = info if isinstance(info, dict) else \
                {"isolation": "not reported: the check's process died while entering the sandbox"}
            self.close()

    def close(self) -> None:
        if self.fd >= 0 and self.info is None:
            self.poll(0)  # a line written just before the child was stopped
        if self.fd >= 0:
            if self.info is not None:  # the child waits for this; SIGPIPE ignored in case it has just died
                old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
                try:
                    os.write(self.ack_fd, b"1")
                except OSError:
                    pass
                finally:
                    signal.signal(signal.SIGPIPE, old)
            os.close(self.fd)
            os.close(self.ack_fd)
            self.fd = -1
        if self.info is None:
            self.info = {"isolation": "not reported: the check's process died while entering the sandbox"}


def reap() -> None:
    """Collect every finished descendant: as a subreaper the zygote inherits the orphans of a fork loop. Waits (up to
    2 s) while a child other than the killer is alive."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if KILLER is not None and _children() <= {KILLER[0]}:
                return
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
