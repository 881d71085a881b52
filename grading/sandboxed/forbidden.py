"""Forbidden calls: the rubric's `forbidden_calls` (off by default), callables a course rules out of a component.

    "forbidden_calls": {
        "attention": ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.MultiheadAttention"],
        "*": ["transformers.models.gpt2.modeling_gpt2.*"]
    }

Keys are checks (`*`: every check); each entry names a callable by its dotted path, or `module.*` for every public
class and function defined in that module. The grader resolves every entry when it loads the rubric (a name that
does not resolve, or cannot be watched, is refused, naming it). In the check's process, before the submission's
code is imported (grading/sandboxed/zygote.py), each listed callable is wrapped where it lives: a function wherever its
package's modules hold it (F.scaled_dot_product_attention is also torch._C._nn's), a method on the class the entry
names, an nn.Module class at its `forward`, another class at its constructor. A call made while the probe runs a
graded part, from the submission's code, is recorded with that part and the submission's file and line that made it
(calls inside another forbidden call, and calls while the component is built or run for information only, are
not); the grader decides what it costs (grading/checks.py). A watch the submission removes or replaces is recorded
too.

This watches a course's rule; it is not a sandbox layer: a submission that sets out to hide a call (an alias outside
the package, torch.ops, the original taken from the wrapper) is not caught, and everything in the check's process,
this record included, is the submission's to change. Loaded by the zygote by file path and imported by the grader;
nothing here imports the project.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
import threading

NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?$")
MAX_RECORDS = 50  # distinct (call, part, where) records a check keeps


def _module_prefix(name: str):
    """(module, the attribute path after it) for the longest importable prefix of a dotted name."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    raise ValueError(f"{name!r}: no importable module {parts[0]!r}")


def resolve(name: str) -> list[tuple[str, object, object, str]]:
    """[(label, callable, the object holding it, its attribute there)] for one rubric entry: the callable itself, or
    for `module.*` every public class and function defined in that module, each labelled by its dotted name.
    ValueError, naming the problem, when it does not resolve to a callable."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"{name!r} is not a dotted name (module.attribute, or module.* for all of a module)")
    if name.endswith(".*"):
        module = name[:-2]
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{name!r}: module {module!r} cannot be imported ({e})") from None
        found = [(f"{module}.{attr}", obj, mod, attr) for attr, obj in sorted(vars(mod).items())
                 if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                 and getattr(obj, "__module__", None) == mod.__name__]
        if not found:
            raise ValueError(f"{name!r}: module {module!r} defines no public class or function")
        return found
    obj, rest = _module_prefix(name)
    if not rest:
        raise ValueError(f"{name!r} is a module, not a callable (module.* watches all of it)")
    for attr in rest:
        if not hasattr(obj, attr):
            raise ValueError(f"{name!r}: {getattr(obj, '__name__', obj)!s} has no attribute {attr!r}")
        parent, obj = obj, getattr(obj, attr)
    if not callable(obj) or inspect.ismodule(obj):
        raise ValueError(f"{name!r} is not callable")
    return [(name, obj, parent, rest[-1])]


def matches(label: str, patterns) -> bool:
    """Whether a recorded call's label is one the rubric lists (exactly, or inside a `module.*`)."""
    return any(label == p or (p.endswith(".*") and label.startswith(p[:-1])) for p in patterns)


IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a built-in type whose attributes cannot be set


def places(name: str) -> list[tuple[str, object, str]]:
    """Where one rubric entry is watched: [(label, owner, attribute)], the attribute to wrap. A function or method:
    where the entry names it, and in every module of its package (and of the package the entry names) that holds it;
    an nn.Module class: its forward; another class: its constructor; `module.*`: those of each public class and
    function defined there (a class's inherited forward is watched where it is defined). ValueError, naming the
    problem, for an entry that does not resolve or cannot be watched (an attribute of a built-in type)."""
    found = []
    for label, obj, parent, name_there in resolve(name):
        if inspect.isclass(obj):
            torch = sys.modules.get("torch")
            attr = "forward" if torch is not None and issubclass(obj, torch.nn.Module) else "__init__"
            if not (name.endswith(".*") and attr not in vars(obj)):
                found.append((label, obj, attr))
            continue
        found.append((label, parent, name_there))  # where the rubric names it (a class's method: on that class)
        tops = {name.split(".")[0], str(getattr(obj, "__module__", "") or "").split(".")[0]} - {""}
        holders = [mod for key, mod in list(sys.modules.items()) if mod is not None and mod is not parent
                   and key.split(".")[0] in tops and hasattr(mod, "__dict__")]
        found += [(label, mod, attr) for mod in holders for attr, value in list(vars(mod).items()) if value is obj]
    for label, owner, attr in found:
        if inspect.isclass(owner) and owner.__flags__ & IMMUTABLE_TYPE:
            raise ValueError(f"{name!r}: {label} cannot be watched ({owner.__name__} is a built-in type whose "
                             f"attributes cannot be replaced)")
    return found


class Recorder:
    """The watch in one check's process: wraps the listed callables and records the forbidden calls the submission's
    code makes during a graded part (`part`, set by the probe)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root) + os.sep  # the submission's folder: calls from its files are its own
        self.part = None  # the graded part the probe runs now; None while building or for information
        self.records, self.unwatched = [], []
        self.placed = []  # (owner, attribute, wrapper, label): to see that each watch is still in place
        self._local = threading.local()

    def install(self, names) -> "Recorder":
        seen = set()  # (owner, attribute) already watched: a callable listed twice is wrapped once
        for name in names:
            try:
                found = places(name)
            except ValueError as e:
                self.unwatched.append(str(e)[:300])
                continue
            for label, owner, attr in found:
                if (id(owner), attr) not in seen:
                    seen.add((id(owner), attr))
                    self._place(owner, attr, getattr(owner, attr), label)
        return self

    def _place(self, owner, attr: str, original, label: str) -> None:
        recorder = self

        @functools.wraps(original)
        def watched(*args, **kwargs):
            recorder._saw(label)
            recorder._local.depth = getattr(recorder._local, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                recorder._local.depth -= 1
        try:
            setattr(owner, attr, watched)
        except (AttributeError, TypeError) as e:
            self.unwatched.append(f"{label}: cannot be watched at {getattr(owner, '__name__', owner)}.{attr} ({e})"[:300])
            return
        self.placed.append((owner, attr, watched, label))

    def _saw(self, label: str) -> None:
        if self.part is None or getattr(self._local, "depth", 0) or len(self.records) >= MAX_RECORDS:
            return
        frame = sys._getframe(2)
        while frame is not None:
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(self.root):
                record = {"call": label, "part": self.part,
                          "where": f"{path[len(self.root):]}:{frame.f_lineno} in {frame.f_code.co_name}()"}
                if record not in self.records:
                    self.records.append(record)
                return
            frame = frame.f_back
        # no frame of the submission's on the stack: the grader's own code made the call, not the student

    def report(self) -> list[dict]:
        """The records, plus one per watch that is no longer in place (part "*": the whole check)."""
        removed = sorted({label for owner, attr, watched, label in self.placed if vars(owner).get(attr) is not watched})
        return self.records + [{"call": label, "part": "*", "where": "its watch was removed or replaced by the "
                                                                     "submission"} for label in removed]
