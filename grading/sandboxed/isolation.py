"""Process isolation for one check, applied in the zygote's forked child before the submission's code runs.

Loaded by grading/sandboxed/zygote.py by file path (never imported by the grader). Each layer is tried on its own and reported
in one line, so a kernel or container that refuses one (Docker without CAP_SYS_ADMIN refuses every namespace) still
gets the others, and the report says which held:

- cgroup (v2, or v1 memory + pids (+ cpu)): one group per check bounds the memory of all its processes together
  (tmpfs and shared memory pages included), their number and the cores they use together; the zygote kills the group
  and reads its OOM count afterwards.
- namespaces: network (no interfaces), IPC (SysV shared memory dies with the check), PID (the check sees only its
  own processes; its first process is the namespace's init, so everything it starts dies with it), mount.
- mounts, in the private mount namespace: size-capped tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock (nothing there
  outlives the check, nothing of the host's is visible), a fresh /proc (hidepid), the check's writable folders as
  overlays on a size-capped tmpfs (a disk quota: writes beyond it fail with ENOSPC and cost memory, not disk), the
  Python installation visible wherever it lives (only its own folders, read-only), the grader's checkout hidden
  under an empty tmpfs (its references and stand-ins are not the submission's to run), and then every mount read-only
  but the check's own (the seal: without root the check runs as the grader's uid, so permissions alone protect
  nothing of the grader's).
- seccomp (pyseccomp, when libseccomp is installed): no AF_UNIX sockets (no connecting to the host's filesystem
  sockets), no io_uring, no new namespaces or mounts, no kernel keyrings.
- rlimits and, when the grader runs as root, a uid of its own.
"""
import ctypes
import errno
import os
import resource
import signal
import site
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
ST_RELATIME = 4096  # statvfs's bit for relatime (MS_BIND's value among the mount flags)
PR_SET_PDEATHSIG = 1
TMPFS_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
TMPFS_MB = 64  # each private tmpfs; the check's own temporary folder is its HOME, under the disk quota

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data, what):
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), what)


def _unshare(flag: int, name: str) -> str:
    if libc.unshare(flag) == 0:
        return "isolated"
    return f"not isolated: unshare({name}) failed with {os.strerror(ctypes.get_errno())}"


# ---- cgroups (created and removed by the zygote, joined by the child) ----------------------------------------------

def _mounts() -> list[tuple[str, str, set]]:
    """(mount point, fstype, super options) of every cgroup filesystem."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _, opts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(opts.split(","))))
    return found


def _own_paths() -> dict:
    """{controller or '' for v2: this process's cgroup path} from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in (controllers.split(",") if controllers else [""]):
                paths[c] = path
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_keyed(path: str) -> dict:
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2)}
    except (OSError, ValueError):
        return {}


def _sweep(parent: str) -> None:
    """Remove the empty groups a killed zygote left (named grading-check-<its pid>-<n>)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith("grading-check-")]
    except OSError:
        return
    for name in names:
        try:
            os.kill(int(name.split("-")[2]), 0)
        except ProcessLookupError:
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass
        except (ValueError, IndexError, PermissionError):
            pass


class Cgroup:
    """One check's cgroup: a v2 group, or a v1 memory group and a v1 pids group."""

    def __init__(self, version: int, dirs: dict, status: str):
        self.version, self.dirs, self.status = version, dirs, status  # dirs: {'memory': path, 'pids': path}

    @classmethod
    def create(cls, name: str, mem_bytes: int, max_pids: int, mounts=None, own=None) -> "tuple[Cgroup | None, str]":
        """The check's group, under ours when it is delegated to us (v2) or the hierarchy's root; (None, why) when
        neither can be made. `mounts` and `own` default to this process's (/proc/self/mountinfo, /proc/self/cgroup)."""
        errors = []
        mounts = _mounts() if mounts is None else mounts
        own = _own_paths() if own is None else own
        for point, fstype, _ in mounts:  # v2: under our own group when delegated to us, else the hierarchy's root
            if fstype != "cgroup2":
                continue
            for parent in dict.fromkeys([point + own.get("", "/").rstrip("/"), point]):
                try:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        enabled = set(f.read().split())
                    for c in {"memory", "pids"} - enabled:
                        _write(os.path.join(parent, "cgroup.subtree_control"), f"+{c}")
                    _sweep(parent)
                    path = os.path.join(parent, name)
                    os.mkdir(path)
                except OSError as e:
                    errors.append(f"v2 {parent}: {e.strerror}")
                    continue
                try:
                    _write(os.path.join(path, "memory.max"), str(mem_bytes))
                    if os.path.exists(os.path.join(path, "memory.swap.max")):
                        _write(os.path.join(path, "memory.swap.max"), "0")
                    _write(os.path.join(path, "pids.max"), str(max_pids))
                except OSError as e:
                    os.rmdir(path)
                    errors.append(f"v2 {path}: {e.strerror}")
                    continue
                return cls(2, {"memory": path, "pids": path}, f"v2 {path} (memory.max {mem_bytes >> 20} MiB, "
                                                               f"pids.max {max_pids})"), ""
        v1 = {c: point for point, fstype, opts in mounts if fstype == "cgroup" for c in ("memory", "pids") if c in opts}
        if set(v1) == {"memory", "pids"}:
            dirs = {}
            try:
                for c in ("memory", "pids"):
                    _sweep(v1[c] + own.get(c, "/").rstrip("/"))
                    dirs[c] = os.path.join(v1[c] + own.get(c, "/").rstrip("/"), name)
                    os.mkdir(dirs[c])
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(mem_bytes))
                if os.path.exists(os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes"), str(mem_bytes))
                _write(os.path.join(dirs["pids"], "pids.max"), str(max_pids))
                return cls(1, dirs, f"v1 {dirs['memory']} (memory {mem_bytes >> 20} MiB, pids {max_pids})"), ""
            except OSError as e:
                for d in dirs.values():
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
                errors.append(f"v1: {e.strerror} ({e.filename})")
        if not mounts:
            errors.append("no cgroup filesystem mounted")
        return None, "; ".join(errors) or "no cgroup hierarchy with the memory and pids controllers"

    def limit_cpu(self, cpus: float, mounts=None, own=None) -> str:
        """At most `cpus` cores for all the check's processes together (a fork of spinning processes then slows its
        own check, not its neighbours'): cpu.max (v2) or the CFS quota of a v1 cpu group. Says what held."""
        period, quota = 100000, max(1000, int(cpus * 100000))
        try:
            if self.version == 2:
                path = self.dirs["memory"]
                parent = os.path.dirname(path)
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "cpu" not in f.read().split():
                        _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
                _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
            else:
                mounts = _mounts() if mounts is None else mounts
                own = _own_paths() if own is None else own
                point = next((p for p, fstype, opts in mounts if fstype == "cgroup" and "cpu" in opts), None)
                if point is None:
                    return "no cpu limit: no v1 cpu controller mounted"
                path = os.path.join(point + own.get("cpu", "/").rstrip("/"), os.path.basename(self.dirs["memory"]))
                os.mkdir(path)
                self.dirs["cpu"] = path
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        except OSError as e:
            return f"no cpu limit: {e.strerror} ({e.filename})"
        return f"cpu {quota / period:g} core(s)"

    def finish(self) -> dict:
        """Kill what is left in the group, remove it, and say whether a limit was hit."""
        import time

        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.version == 2:
            oom = _read_keyed(os.path.join(mem, "memory.events")).get("oom_kill", 0)
            peak_path = os.path.join(mem, "memory.peak")
        else:
            oom = _read_keyed(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
            peak_path = os.path.join(mem, "memory.max_usage_in_bytes")
        try:
            with open(peak_path) as f:
                peak = int(f.read().split()[0]) >> 20
        except (OSError, ValueError, IndexError):
            peak = None
        pids_hit = _read_keyed(os.path.join(pids, "pids.events")).get("max", 0)
        deadline = time.monotonic() + 5
        for path in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    if os.path.exists(os.path.join(path, "cgroup.kill")):
                        _write(os.path.join(path, "cgroup.kill"), "1")
                    else:
                        with open(os.path.join(path, "cgroup.procs")) as f:
                            for pid in f.read().split():
                                try:
                                    os.kill(int(pid), signal.SIGKILL)
                                except ProcessLookupError:
                                    pass
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY until the killed processes are reaped
                    if time.monotonic() > deadline:
                        break
                    try:
                        while os.waitpid(-1, os.WNOHANG)[0]:
                            pass
                    except ChildProcessError:
                        pass
                    time.sleep(0.01)
        return {"oom_kills": oom, "peak_mb": peak, "pids_limit_hits": pids_hit}


# ---- the child's own setup ---------------------------------------------------------------------------------------

def _enter_user_namespace() -> str:
    """Without root: a user namespace (mapping our uid to itself) gives the capabilities to make the other
    namespaces and mounts, where the kernel allows unprivileged user namespaces."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) != 0:
        return f"not available: unshare(CLONE_NEWUSER) failed with {os.strerror(ctypes.get_errno())}"
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as e:
        return f"failed: {e}"
    return "isolated"


def _drop_capabilities() -> None:
    """Capabilities held inside our own user namespace: dropped before the submission runs."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


class PidNamespaces:
    """The zygote's forks straight into a new PID namespace (as root): unshare(CLONE_NEWPID) makes the next fork the
    init of a new namespace, and setns back to the zygote's own keeps its later forks in its own. The check's process
    is then the namespace's init itself; without this it unshares after the fork and forks once more (enter), and a
    fork of the warm interpreter costs tens of milliseconds. Off (None from before_fork) without root, or where the
    round trip fails at start."""

    def __init__(self):
        self.fd = None
        if os.geteuid() != 0:
            return
        try:
            fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        if libc.unshare(CLONE_NEWPID) == 0 and libc.setns(fd, CLONE_NEWPID) == 0:
            self.fd = fd
        else:
            os.close(fd)

    def before_fork(self) -> str | None:
        """"isolated" when the next fork makes a new PID namespace's init; then after_fork() must follow it."""
        if self.fd is None or libc.unshare(CLONE_NEWPID) != 0:
            return None
        return "isolated"

    def after_fork(self) -> None:
        _check(libc.setns(self.fd, CLONE_NEWPID), "setns back to the zygote's PID namespace")


def _wait_and_relay(pid: int) -> None:
    """Outside the new PID namespace: wait for its init (the check) and leave with the same status; never returns."""
    try:
        os.closerange(0, 65536)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        code = os.WEXITSTATUS(status)
    except BaseException:  # noqa: BLE001
        code = 70
    os._exit(code)


def _private_mounts(req: dict, keep: list[str], info: dict) -> None:
    """In our own mount namespace: disk quota overlays, private tmpfs, a fresh /proc."""
    _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None, "mount --make-rprivate /")
    uid = req.get("uid")
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    disk_mb = req.get("disk_mb")
    writable = [d for d in req.get("writable", []) if os.path.isdir(d)]
    if disk_mb and writable:
        quota = os.path.join(req["outdir"], ".quota")
        os.mkdir(quota, 0o700)
        try:
            _mount("tmpfs", quota, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=0700{owner}", "quota tmpfs")
            for i, d in enumerate(writable):
                upper, work = os.path.join(quota, f"u{i}"), os.path.join(quota, f"w{i}")
                os.mkdir(upper, 0o700)
                os.mkdir(work, 0o700)
                st = os.stat(d)  # the overlay's top folder takes the upper folder's owner and mode
                os.chown(upper, st.st_uid, st.st_gid)
                os.chmod(upper, st.st_mode & 0o7777)
                extra = ",userxattr" if req.get("_userns") == "isolated" else ""  # no trusted.* xattrs in a userns
                _mount("overlay", d, "overlay", MS_NOSUID | MS_NODEV,
                       f"lowerdir={d},upperdir={upper},workdir={work}{extra}", f"overlay on {d}")
            info["disk"] = f"quota {disk_mb} MiB (overlay on tmpfs) on {', '.join(os.path.basename(d) for d in writable)}"
        except OSError as e:
            info["disk"] = f"no quota: {e}"
    else:
        info["disk"] = "no quota: disabled"
    # Each folder the check may write and each of its two result files is a mount of its own (the overlay, or a
    # bind on itself), so that _seal leaves exactly these writable; carried along when /tmp is covered below.
    result_files = [f for f in req.get("result_files", []) if os.path.isfile(f)]
    for path in [d for d in writable if not os.path.ismount(d)] + result_files:
        _mount(path, path, None, MS_BIND, None, f"bind {path}")
    # The check's own folder and the zygote's HOME (HF_HOME's link) live in /tmp: carried into the new tmpfs,
    # writable. A Python installation under one of them (a venv in /tmp) comes back read-only, and only its own
    # folders: the submission imports from it and must not change it for the checks after it, nor see what else
    # lives beside it (the grader's checkout, another student's batch copy).
    python = python_paths()
    done = []
    for folder in TMPFS_DIRS:
        if not os.path.isdir(folder) or os.path.islink(folder):
            continue
        try:
            bound = _cover(folder, f"size={TMPFS_MB}m,mode=1777", MS_NOSUID | MS_NODEV, writable=keep,
                           read_only=python)
            done.append(folder)
            info.setdefault("python_read_only", []).extend(bound)
        except OSError as e:
            info.setdefault("tmpfs_errors", []).append(str(e))
    info["tmpfs"] = f"private {TMPFS_MB} MiB tmpfs on {', '.join(done)}" if done else "none"
    try:
        info["grader_code"] = hide_grader(req.get("grader_dir"), keep, python)
    except OSError as e:
        info["grader_code"] = f"not hidden: {e}"
    # What stays writable once everything else is made read-only (_seal): the private tmpfs themselves (not what
    # is bound back into them), the check's quota'd folders and its two result files.
    req["_writable_mounts"] = [(folder, False) for folder in done] + [(d, True) for d in writable] + \
        [(f, False) for f in result_files]
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2", "mount proc")
        info["proc"] = "private /proc" + (" (own PID namespace)" if info.get("pid") == "isolated" else " (hidepid=2)")
    except OSError as e:
        info["proc"] = f"host /proc: {e}"


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # the same number on every arch


def _mount_setattr(path: str, recursive: bool, set_: int = 0, clear: int = 0) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                        ctypes.byref(attr), ctypes.sizeof(attr)), f"mount_setattr {path}")


def _seal(writable: list) -> str:
    """In our own mount namespace: every mount read-only, then the check's own ones (`writable`: (path, with the
    mounts under it)) writable again. Without root the check runs as the grader's own uid, so file permissions
    alone would leave the grader's checkout, its venv and other students' copies writable; with root this closes
    the world-writable folders outside the private tmpfs. Our stdout (output.txt) was opened before the mount
    namespace was made, on the host's mount, so it stays writable and does not hold this one busy."""
    _mount_setattr("/", True, set_=MOUNT_ATTR_RDONLY)
    for path, recursive in writable:
        _mount_setattr(path, recursive, clear=MOUNT_ATTR_RDONLY)
    return "everything read-only but " + ", ".join(path for path, _ in writable)


def outermost(paths) -> list[str]:
    """The existing real paths among `paths`, none inside another (an outer one stands for what it holds)."""
    kept = []
    for p in sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)}):
        if not any(p == k or p.startswith(k.rstrip(os.sep) + os.sep) for k in kept):
            kept.append(p)
    return kept


def python_paths() -> list[str]:
    """The folders this Python imports from: the installation (a venv's and its base's), site-packages and every
    other entry of sys.path, as real paths, none inside another."""
    return outermost([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages(),
                      *sys.path])


def closed_ancestor(path: str) -> str | None:
    """The outermost folder above `path` that other users cannot pass through (e.g. /root for a pyenv Python, or a
    0700 folder from `mktemp -d` holding a venv); None when every folder on the way is open."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        if os.path.isdir(folder) and not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _cover(folder: str, options: str, flags: int, writable=(), read_only=()) -> list[str]:
    """Mount a fresh tmpfs on `folder`, then bind back the given paths inside it at the same places (the folders
    above them made anew, 0755): `writable` as they are, `read_only` read-only. Returns the read-only ones."""
    inside = [(p, False) for p in writable] + [(p, True) for p in read_only]
    inside = [(p, ro) for p, ro in inside if p.startswith(folder.rstrip(os.sep) + os.sep)]
    held = [(os.open(p, os.O_PATH), p, ro) for p, ro in inside]  # reachable once the tmpfs covers them
    try:
        _mount("tmpfs", folder, "tmpfs", flags, options, f"tmpfs on {folder}")
        for fd, path, ro in held:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "a").close()
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, f"bind back {path}")
            if ro:
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked_flags(path), None,
                       f"read-only {path}")
    finally:
        for fd, _, _ in held:
            os.close(fd)
    return [p for _, p, ro in held if ro]


def _locked_flags(path: str) -> int:
    """The flags a remount of `path` must keep: in a user namespace the kernel refuses to clear the nosuid, nodev,
    noexec and atime flags of a mount that came from outside (statvfs's ST_* bits, translated to MS_*)."""
    st = os.statvfs(path).f_flag
    flags = st & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # the same bits in both
    return flags | (MS_RELATIME if st & ST_RELATIME else 0)


def hide_grader(folder: str | None, keep: list[str], python: list[str]) -> str:
    """Cover the grader's checkout with an empty tmpfs in our mount namespace (only the Python installation and the
    check's own folders bound back where they live inside it): the grader's references, the stand-ins of other
    checks and this project's own GPT-2 are not there to be read and executed by the submission. Says what held."""
    if not folder:
        return "not hidden: no checkout given"
    folder = os.path.realpath(folder)
    if not os.path.isdir(folder):  # under a private tmpfs already (a clone in /tmp): only Python came back there
        return f"hidden: {folder} is under the check's private tmpfs"
    holding = [p for p in python if folder == p or folder.startswith(p.rstrip(os.sep) + os.sep)]
    if holding:
        return f"not hidden: {folder} lies inside the Python installation ({holding[0]})"
    bound = _cover(folder, "mode=0755,size=1m", MS_NOSUID | MS_NODEV, writable=keep, read_only=python)
    return f"hidden: an empty tmpfs on {folder}" + (f", only {', '.join(bound)} bound back" if bound else "")


def closed_folders(paths) -> dict[str, list[str]]:
    """{outermost folder closed to others: the paths (outermost() of them) it holds} for the paths under one."""
    closed = {}
    for path in outermost(paths):
        folder = closed_ancestor(path)
        if folder is not None:
            closed.setdefault(folder, []).append(path)
    return closed


def expose_python(private_mounts: bool) -> str:
    """Let the sandbox user read the Python installation where it lives under folders others cannot enter (a pyenv
    in /root, a venv in a `mktemp -d` folder): an empty tmpfs covers each such folder (hiding the rest of it, a home
    directory's secrets included) and only the installation's own folders are bound back, read-only. Needs the
    private mount namespace."""
    closed = closed_folders(python_paths())
    if not closed:
        return "readable"
    if not private_mounts:
        raise OSError(errno.EPERM, f"{', '.join(sorted(closed))} closed to other users and there is no private "
                                   f"mount namespace")
    for folder, paths in sorted(closed.items()):
        _cover(folder, "mode=0755,size=1m", 0, read_only=paths)
    return "; ".join(f"{folder} hidden except {', '.join(paths)}" for folder, paths in sorted(closed.items()))


def _seccomp() -> str:
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(sc.ALLOW)
    except Exception as e:  # noqa: BLE001  (missing module or libseccomp.so)
        return f"no seccomp filter: {type(e).__name__}: {e}"
    import socket

    deny = sc.ERRNO(errno.EPERM)
    f.add_rule(deny, "socket", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    for kind in (socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):  # a datagram pair can still connect() elsewhere
        f.add_rule(deny, "socketpair", sc.Arg(0, sc.EQ, socket.AF_UNIX), sc.Arg(1, sc.MASKED_EQ, 0xF, kind))
    for call in ("io_uring_setup", "io_uring_enter", "io_uring_register", "unshare", "setns", "mount", "umount2",
                 "pivot_root", "open_tree", "move_mount", "fsopen", "fsmount", "mount_setattr",
                 "add_key", "request_key", "keyctl"):  # the kernel's keyrings outlive the check: a channel
        try:
            f.add_rule(deny, call)
        except Exception:  # noqa: BLE001  (a libseccomp older than the call: capabilities are dropped anyway)
            pass
    f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory seccomp cannot read; libc falls back
    f.load()
    return "seccomp: no AF_UNIX sockets, io_uring, namespaces, mounts or keyrings"


def enter(req: dict, cgroup_dirs: dict | None) -> dict:
    """Everything between the fork and the submission's code, in the child (setsid done). Returns what held.
    With a new PID namespace this forks once more: the caller goes on in the namespace's init, while the process
    that called it waits outside and leaves with the same status."""
    info = {}
    if cgroup_dirs:
        try:
            for path in dict.fromkeys(cgroup_dirs.values()):
                _write(os.path.join(path, "cgroup.procs"), "0")  # "0": the writing process itself
            info["cgroup"] = req.get("cgroup_status", "joined")
        except OSError as e:
            info["cgroup"] = f"not joined: {e}"
    else:
        info["cgroup"] = f"none: {req.get('cgroup_status', 'not requested')}"
    root = os.geteuid() == 0
    if not root:
        req["_userns"] = info["user_namespace"] = _enter_user_namespace()
    if not req.get("isolate_network", True):
        info["network"] = "not isolated: disabled"
    else:
        info["network"] = _unshare(CLONE_NEWNET, "CLONE_NEWNET")
    info["ipc"] = _unshare(CLONE_NEWIPC, "CLONE_NEWIPC")
    info["mount"] = _unshare(CLONE_NEWNS, "CLONE_NEWNS")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if req.get("pid_namespace") == "isolated":  # forked into a new one by the zygote: this process is its init
        info["pid"] = "isolated"
    else:
        info["pid"] = _unshare(CLONE_NEWPID, "CLONE_NEWPID")
        if info["pid"] == "isolated":
            pid = os.fork()
            if pid:
                _wait_and_relay(pid)
    keep = [req["outdir"]] + ([os.environ["HOME"]] if os.path.isdir(os.environ.get("HOME", "")) else [])
    if info["mount"] == "isolated":
        try:
            _private_mounts(req, keep, info)
        except OSError as e:
            info["tmpfs"] = f"failed: {e}"
        info.setdefault("grader_code", "not hidden: the private mounts failed")
    else:
        info["disk"] = info["tmpfs"] = info["proc"] = "none: no private mount namespace"
        info["grader_code"] = "not hidden: no private mount namespace (the grader's files are readable where their modes allow)"
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")  # address space already mapped (torch)
    limits = {
        resource.RLIMIT_AS: base + req["mem_mb"] * 2**20,
        resource.RLIMIT_CPU: req["cpu_s"],
        resource.RLIMIT_FSIZE: req["max_file_mb"] * 2**20,
        resource.RLIMIT_NPROC: req["max_procs"],
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    uid = req.get("uid")
    if uid is not None:
        try:
            info["python"] = expose_python(info["mount"] == "isolated")
        except OSError as e:  # the sandbox user could not import anything new: keep the grader's uid
            info["python"] = f"not readable by a sandbox user ({e}); the check runs as the grader's user"
            uid = None
    if info["mount"] == "isolated" and "_writable_mounts" in req:
        try:
            info["read_only"] = _seal(req["_writable_mounts"])
        except OSError as e:
            info["read_only"] = f"not sealed: {e}"
    else:
        info["read_only"] = "not sealed: no private mount namespace"
    if uid is not None:  # root: become a throw-away user, so writes outside the sandbox are refused
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif not root:
        _drop_capabilities()  # those of the user namespace, if one was made
    if info.get("grader_code", "").startswith("not hidden") and req.get("grader_dir"):  # then permissions decide
        info["grader_code"] += ("; readable by the check's uid" if os.access(req["grader_dir"], os.R_OK | os.X_OK)
                                else "; closed to the check's uid")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the waiter killed at the deadline takes us along
    info["uid"] = os.getuid()
    info["unix_sockets"] = _seccomp()
    return info
