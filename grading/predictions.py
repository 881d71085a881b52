"""Score a submission's prediction files (the course's file names) with tasks.evaluate, as leaderboard values.

The files are the student's: each is read without following a link anywhere on its path (a link to the gold file or
to a root-only file is refused), only if it is a regular file with no other hard link, and, when the grader runs as
root, by a process running under a uid of its own. What goes into the report names the file and the problem (line
numbers, counts), never a byte of its content.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path

from tasks.evaluate import SCORERS

# leaderboard name, task, prediction file names (first found wins), gold file names
FILES = [
    ("SST dev accuracy", "sst", ["full-model-sst-dev-out.csv", "last-linear-layer-sst-dev-out.csv"], ["ids-sst-dev.csv"]),
    ("CFIMDB dev accuracy", "cfimdb", ["full-model-cfimdb-dev-out.csv", "last-linear-layer-cfimdb-dev-out.csv"],
     ["ids-cfimdb-dev.csv"]),
    ("Quora dev accuracy", "para", ["para-dev-output.csv"], ["quora-dev.csv"]),
    ("Sonnet dev chrF", "sonnet", ["generated_sonnets_dev.txt", "generated_sonnets.txt"],
     ["TRUE_sonnets_held_out_dev.txt"]),
]
MAX_BYTES = 16 * 2**20  # dev-set prediction files are well under 1 MiB
READER_UID = 200000 + os.getpid()  # the sandbox's scheme: a uid no account uses


class UnsafeFile(Exception):
    """A prediction file that is not read (a link, not a regular file, unreadable, too large)."""


def open_folder(path: str | os.PathLike) -> int:
    """A descriptor of the folder `path`, no component of which may be a symbolic link."""
    path = os.path.abspath(path)
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in Path(path).parts[1:]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and \
                        stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise UnsafeFile(f"the predictions folder's path has a symbolic link ({part}); give the real "
                                     f"path ({os.path.realpath(path)})") from None
                raise UnsafeFile(f"the predictions folder cannot be opened ({part}: {os.strerror(e.errno)})") from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_at(folder_fd: int, name: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=folder_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise UnsafeFile("is a symbolic link (only regular files inside the submission are read)") from None
        raise UnsafeFile(f"cannot be opened: {os.strerror(e.errno)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile("is not a regular file")
        if st.st_nlink != 1:
            raise UnsafeFile("has other hard links (only a file of its own is read)")
        if st.st_size > MAX_BYTES:
            raise UnsafeFile(f"is larger than {MAX_BYTES >> 20} MiB")
        data = os.read(fd, MAX_BYTES + 1)
        chunks = [data]
        while data and sum(map(len, chunks)) <= MAX_BYTES:
            data = os.read(fd, MAX_BYTES + 1)
            chunks.append(data)
        data = b"".join(chunks)
        if len(data) > MAX_BYTES:
            raise UnsafeFile(f"is larger than {MAX_BYTES >> 20} MiB")
        return data
    finally:
        os.close(fd)


def read_untrusted(folder_fd: int, name: str, uid: int | None) -> bytes:
    """The bytes of the regular file `name` in the open folder; as `uid` in a forked process when one is given."""
    if uid is None:
        return _read_at(folder_fd, name)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # drops root before touching a path the submission controls
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                reply = b"\0" + _read_at(folder_fd, name)
            except UnsafeFile as e:
                reply = b"\1" + str(e).encode()
            with os.fdopen(w, "wb") as f:
                f.write(reply)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        reply = f.read(MAX_BYTES + 2)
    os.waitpid(pid, 0)
    if not reply:
        raise UnsafeFile("could not be read (the reading process failed)")
    if reply[:1] == b"\1":
        raise UnsafeFile(reply[1:].decode())
    return reply[1:]


# What a scorer's error says, without what it quotes from the file: (pattern in its message, report text).
PROBLEMS = [
    ("expected a header", "expected a header `id \\t Predicted_...`"),
    ("expected `<id>, <label>`", "expected `<id>, <label>`"),
    ("is not an integer", "a label is not an integer"),
    ("unknown label", "a label outside the allowed ones"),
    ("duplicate id", "a duplicate id"),
    ("no predictions after the header", "no predictions after the header"),
    ("have no prediction", "gold ids have no prediction"),
    ("are not in", "predicted ids are not in the gold file"),
    ("not UTF-8", "not UTF-8 text"),
    ("codec can't decode", "not UTF-8 text"),
    ("no numbered sonnets", "no numbered sonnets (each must follow a line holding only its number)"),
    ("is empty", "an empty sonnet"),
    ("sonnets but", "a different number of sonnets than the gold file"),
    ("generated sonnets but", "a different number of sonnets than the gold file"),
]


def describe(error: Exception) -> str:
    """The scorer's error as a fixed phrase plus the line number, never quoting the file."""
    text = str(error)
    what = next((phrase for pattern, phrase in PROBLEMS if pattern in text), "not in the expected format")
    line = re.search(r"line (\d+)", text)
    return f"line {line.group(1)}: {what}" if line else what


def score_predictions(pred_dir, gold_dir) -> tuple[list[dict], list[str]]:
    """({'name', 'value'} per scored file, messages); a missing, unsafe or malformed file is a message."""
    if gold_dir is None:
        return [], ["--predictions needs --gold (the folder with the course's dev files)"]
    gold_dir = Path(gold_dir)
    try:
        folder = open_folder(pred_dir)
    except UnsafeFile as e:
        return [], [f"predictions not read: {e}"]
    uid = READER_UID if os.geteuid() == 0 else None
    board, messages = [], []
    try:
        names = set(os.listdir(folder))
        with tempfile.TemporaryDirectory(prefix=f"grading-predictions-{os.getpid()}-") as private:
            for name, task, pred_names, gold_names in FILES:
                pred = next((n for n in pred_names if n in names), None)
                gold = next((gold_dir / n for n in gold_names if (gold_dir / n).is_file()), None)
                if pred is None:
                    messages.append(f"{name}: no {' or '.join(pred_names)} in {pred_dir}")
                    continue
                if gold is None:
                    messages.append(f"{name}: no gold file {' or '.join(gold_names)} in {gold_dir}")
                    continue
                try:
                    copy = Path(private) / pred
                    copy.write_bytes(read_untrusted(folder, pred, uid))
                except UnsafeFile as e:
                    messages.append(f"{name}: {pred} not read: it {e}")
                    continue
                try:
                    metrics = SCORERS[task].score(copy, gold)
                except (ValueError, OSError) as e:
                    messages.append(f"{name}: {pred} could not be scored: {describe(e)}")
                    continue
                value = metrics["chrf"] if task == "sonnet" else metrics["accuracy"]
                board.append({"name": name, "value": round(float(value), 4)})
                messages.append(f"{name}: {value:.4f} ({pred}, n={metrics['n']})")
    finally:
        os.close(folder)
    return board, messages
