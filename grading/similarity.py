"""Pairs of submissions whose own code is alike: copydetect's winnowing fingerprints (the MOSS method), with the
course's starter as boilerplate.

    pairs = similar_pairs({"alice": Path("subs/alice"), "bob": Path("subs/bob")}, starter=Path("starter"))

Each submission's .py files are tokenised by copydetect (names become V, F, O; strings S; comments and layout
dropped: renaming variables or rewording comments changes nothing) and cut into every run of `noise` characters of
that normalised code; runs the starter also holds are boilerplate and dropped, so what every student was given is
never evidence. A submission's *own code* is what is left. For a pair, each side's *matched* code is the part of its
own code that also occurs anywhere in the other's files (the order of functions and files does not matter), and the
pair's *share* is the larger of matched / own over the two sides: near 1 when one submission holds the other's code.
A pair is flagged when its share is at least `share` and its matched code is at least `chars` characters.

The defaults (share 0.8, 1000 characters, noise 25, copydetect's default) come from the real corpus
(bench/grading_class.py): there, pairs of independent submissions reach a share of 0.76 on fewer than 1000 matched
characters (two short submissions that write the same canonical attention and residual code) and at most 0.28 above
that; a disguised copy (locals renamed, functions reordered, comments rewritten: grading/disguise.py) of a
submission with 1,400 characters of its own code matches 93% of it. The limit that follows: a submission with less
than ~1000 characters of its own code cannot be told apart from independent work on this assignment, and is never
flagged. The flag is a pointer for a person to read both sides, not a verdict.
"""
from __future__ import annotations

import ast
import io
import itertools
import logging
import re
import tokenize
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from grading.sandbox import shown

SHARE = 0.8
CHARS = 1000
NOISE = 25  # copydetect's default noise threshold: runs of this many normalised characters are fingerprinted
MAX_FILE = 256 * 1024  # a .py file larger than this is not read (not a student's hand-written code)
MAX_FILES = 300  # .py files read per submission, at most
BUDGET = 256 * 1024  # bytes of .py source fingerprinted per submission: the course's layout first, then the smallest
# files (two students with a dozen 255 KiB files each once cost 51.5 s and 1.65 GiB; the real submissions' code is far
# below this)
LAYOUT = ("models/gpt2.py", "modules/attention.py", "modules/gpt2_layer.py", "optimizer.py", "models/base_gpt.py",
          "config.py", "utils.py")
SKIP = {".git", ".hg", ".svn", "__pycache__", ".ipynb_checkpoints", "venv", ".venv", "env", "site-packages",
        "node_modules"}


@dataclass
class FileMatch:
    file_a: str
    file_b: str
    chars: int  # matched characters of normalised code between these two files
    html_a: str = ""  # the file with the matched code marked (escaped HTML)
    html_b: str = ""


@dataclass
class Pair:
    a: str
    b: str
    own_a: int  # characters of own (non-starter) normalised code
    own_b: int
    matched_a: int  # of which found in the other submission
    matched_b: int
    flagged: bool = False
    skipped_a: int = 0  # .py files of each side not read (over MAX_FILE or past BUDGET)
    skipped_b: int = 0
    files: list[FileMatch] = field(default_factory=list)

    @property
    def share(self) -> float:
        return max(self.matched_a / max(self.own_a, 1), self.matched_b / max(self.own_b, 1))

    @property
    def chars(self) -> int:
        return min(self.matched_a, self.matched_b)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "share": round(self.share, 3), "chars": self.chars, "own_a": self.own_a,
                "own_b": self.own_b, "matched_a": self.matched_a, "matched_b": self.matched_b, "flagged": self.flagged,
                "skipped_a": self.skipped_a, "skipped_b": self.skipped_b, "files": [{"file_a": f.file_a, "file_b": f.file_b, "chars": f.chars} for f in self.files]}


COMMENT_LINES = re.compile(r"^[ \t]*#[^\n]*\n?", re.M)


def read_source(path: Path) -> str | None:
    """A .py file's text as Python reads it (its coding cookie or BOM, else UTF-8); None when it is not text."""
    try:
        data = path.read_bytes()
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (OSError, SyntaxError, LookupError, UnicodeDecodeError, ValueError):
        return None


def _imported(rel: str, code: str) -> list[str]:
    """The submission's files a module's imports may name (`a.b` -> a/b.py, a/b/__init__.py; relative ones too)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    base, out = list(Path(rel).parent.parts), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = [(mod, node.level)] + [(f"{mod}.{a.name}" if mod else a.name, node.level) for a in node.names]
        else:
            continue
        for name, level in names:
            parts = (base[:len(base) - level + 1] if level else []) + [p for p in name.split(".") if p]
            if parts:
                out += ["/".join(parts) + ".py", "/".join(parts + ["__init__.py"])]
    return out


def python_sources(folder: Path, budget: int = BUDGET) -> tuple[dict[str, str], list[str]]:
    """(read, skipped): {relative name: code} of the submission's .py files as the sandbox copies them
    (grading.sandbox.plan_copy), each read as Python reads it (any source encoding), in this order while they fit in
    `budget` characters: the course's layout, then the files its code imports (breadth first, wherever they are),
    then the smallest others (not in caches or environments); a file over MAX_FILE is read without its comment lines
    (a long comment is no way to hide code). `skipped`: the names of the files not read."""
    from collections import deque

    from grading.sandbox import plan_copy

    sizes = {rel: size for rel, size, link in plan_copy(folder).files if rel.endswith(".py") and link is None}
    read, skipped, total = {}, [], 0

    def take(rel: str) -> str | None:
        nonlocal total
        code = read_source(Path(folder, rel)) if sizes[rel] <= 64 * MAX_FILE else None
        if code is None:
            skipped.append(rel)
            return None
        if len(code) > MAX_FILE:
            code = COMMENT_LINES.sub("", code)
        if len(code) > MAX_FILE or total + len(code) > budget or len(read) >= MAX_FILES:
            skipped.append(rel)
            return None
        read[rel] = code
        total += len(code)
        return code

    queue, seen = deque(r for r in LAYOUT if r in sizes), set()
    while queue:
        rel = queue.popleft()
        if rel in seen:
            continue
        seen.add(rel)
        code = take(rel)
        if code is not None:
            queue.extend(r for r in _imported(rel, code) if r in sizes and r not in seen)
    for rel in sorted((r for r in sizes if r not in seen and not SKIP.intersection(Path(r).parts[:-1])),
                      key=lambda r: (sizes[r], r)):
        take(rel)
    return read, skipped


def python_files(folder: Path, budget: int = BUDGET) -> tuple[list[Path], list[str]]:
    """(read, skipped) of python_sources, as paths."""
    read, skipped = python_sources(folder, budget)
    return [Path(folder, rel) for rel in read], skipped


DYNAMIC = {"exec", "eval", "compile"}  # builtins that run code the fingerprints never see
DYNAMIC_ATTRS = {"exec_module", "run_path", "run_module"}  # importlib's loaders, runpy (and builtins.exec & co.)


def dynamic_code(folder: Path) -> list[str]:
    """Where the submission's read .py files run code made at run time (exec, eval, compile of a string or a file;
    importlib's exec_module, runpy): code the similarity check cannot see, named for a person to read."""
    import warnings

    found = []
    for rel, code in python_sources(Path(folder))[0].items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) and f.id in DYNAMIC else \
                f.attr if isinstance(f, ast.Attribute) and (f.attr in DYNAMIC_ATTRS or f.attr in DYNAMIC and isinstance(
                    f.value, ast.Name) and f.value.id in ("builtins", "__builtins__")) else None
            if name:
                found.append(f"{name}() at {shown(rel)}:{node.lineno}")
    return found


def _fingerprint(code: str, boilerplate: np.ndarray | None, noise: int):
    from copydetect.detector import CodeFingerprint

    try:
        return CodeFingerprint("code.py", noise, 1, boilerplate, language="python", fp=io.StringIO(code))
    except (UnicodeDecodeError, OSError, ValueError):
        return None  # not code a person reads


def boilerplate_hashes(starter: Path | None, noise: int = NOISE) -> np.ndarray:
    hashes = []
    for code in python_sources(starter)[0].values() if starter else []:
        fp = _fingerprint(code, None, noise)
        if fp is not None:
            hashes.extend(fp.hashes)
    return np.unique(np.array(hashes, dtype=np.int64))


def _covered(fp, hashes: set | None) -> np.ndarray:
    """Slices (2, n) of fp's normalised code covered by its fingerprints that are in `hashes` (all when None)."""
    from copydetect.utils import get_copied_slices

    keep = fp.hashes if hashes is None else fp.hashes & hashes
    if not keep:
        return np.zeros((2, 0), dtype=np.int64)
    idx = np.concatenate([np.asarray(fp.hash_idx[h]) for h in keep])
    return get_copied_slices(idx, fp.k)


def _chars(slices: np.ndarray) -> int:
    return int(np.sum(slices[1] - slices[0])) if slices.size else 0


class Submission:
    def __init__(self, name: str, folder: Path, boilerplate: np.ndarray, noise: int):
        self.name = name
        self.files = {}
        read, self.skipped = python_sources(Path(folder))
        for rel, code in read.items():
            fp = _fingerprint(code, boilerplate, noise)
            if fp is not None and fp.hashes:
                self.files[shown(rel)] = fp
        self.hashes = set().union(*(fp.hashes for fp in self.files.values())) if self.files else set()
        self.own = self._own()

    def _own(self) -> int:
        """Characters of normalised code its fingerprints cover (what is left after the boilerplate)."""
        return sum(_chars(_covered(fp, None)) for fp in self.files.values())

    def drop(self, common: set) -> None:
        """Treat `common` fingerprints as boilerplate too (code most of the class holds)."""
        for fp in self.files.values():
            gone = fp.hashes & common
            fp.hashes -= gone
            for h in gone:
                del fp.hash_idx[h]
        self.hashes -= common
        self.own = self._own()

    def matched(self, other: "Submission") -> int:
        common = self.hashes & other.hashes
        if not common:
            return 0
        return sum(_chars(_covered(fp, common)) for fp in self.files.values() if fp.hashes & common)


def _file_matches(a: Submission, b: Submission, limit: int = 8) -> list[FileMatch]:
    """The file pairs that carry the match, largest first, with both sides' matched code marked."""
    from copydetect.detector import compare_files
    from copydetect.utils import highlight_overlap

    found = []
    shared = sorted(((len(pa.hashes & pb.hashes), fa, fb) for (fa, pa), (fb, pb)
                     in itertools.product(a.files.items(), b.files.items())), key=lambda t: (-t[0], t[1], t[2]))
    for n, fa, fb in shared[:limit]:  # only the file pairs that share the most fingerprints are compared and marked
        if not n:
            break
        pa, pb = a.files[fa], b.files[fb]
        chars, _, (sa, sb) = compare_files(pa, pb)
        if chars:
            found.append((int(chars), fa, fb, pa, pb, sa, sb))
    found.sort(key=lambda m: -m[0])
    out = []
    mark = ("<mark>", "</mark>")
    for chars, fa, fb, pa, pb, sa, sb in found[:limit]:
        ha = highlight_overlap(pa.raw_code, sa, *mark, truncate=3, escape_html=True)[0]
        hb = highlight_overlap(pb.raw_code, sb, *mark, truncate=3, escape_html=True)[0]
        out.append(FileMatch(fa, fb, chars, ha, hb))
    return out


def similar_pairs(folders: dict[str, Path], starter: Path | None = None, share: float = SHARE, chars: int = CHARS,
                  noise: int = NOISE, keep: int = 20, common: float | None = None,
                  progress: bool = False) -> tuple[list[Pair], dict[str, int], str]:
    """(pairs, own, given): every flagged pair and at least the `keep` closest others, closest first, with the
    matched files of the flagged ones; each submission's own code in characters; and what was taken as given code.

    `common`: code held by more than this fraction of the submissions (at least 4 of them) is boilerplate too, as
    MOSS's -m; the default is 0.5 without a starter (the starter is then what most of the class holds) and off with
    one (a canonical solution many students wrote alike still counts, and is weighed by the thresholds)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))  # copydetect warns on the root logger for each odd file
    try:
        return _similar_pairs(folders, starter, share, chars, noise, keep, common, progress)
    finally:
        root.setLevel(level)


def _similar_pairs(folders, starter, share, chars, noise, keep, common, progress):
    from tqdm import tqdm

    boiler = boilerplate_hashes(starter, noise)
    subs = []
    for name, folder in tqdm(sorted(folders.items()), desc="similarity: fingerprints", unit="submission",
                             disable=not progress):
        try:
            subs.append(Submission(name, folder, boiler, noise))
        except Exception as e:  # noqa: BLE001  (one submission that cannot be read is left out, never an abort)
            logging.getLogger(__name__).error("similarity: %s left out (%s: %s)", name, type(e).__name__, e)
    if common is None and starter is None:
        common = 0.5
    given = f"the starter's code ({starter})" if starter else "nothing (no starter given)"
    if common is not None and len(subs) >= 4:
        counts = Counter(h for s in subs for h in s.hashes)
        held = {h for h, n in counts.items() if n > common * len(subs)}
        for s in subs:
            s.drop(held)
        given = (given if starter else "no starter given") + f"; and code more than {common:.0%} of the class holds"
    elif common is not None:
        given += f" (code most of the class holds is taken as given from 4 submissions on; there are {len(subs)})"
    pairs = []
    total = len(subs) * (len(subs) - 1) // 2
    for a, b in tqdm(itertools.combinations(subs, 2), total=total, desc="similarity: pairs", unit="pair",
                     disable=not progress, mininterval=1.0):
        if not a.hashes & b.hashes:
            continue
        pair = Pair(a.name, b.name, a.own, b.own, a.matched(b), b.matched(a), skipped_a=len(a.skipped),
                    skipped_b=len(b.skipped))
        pair.flagged = pair.share >= share and pair.chars >= chars
        pairs.append(pair)
    pairs.sort(key=lambda p: (not p.flagged, -p.share, -p.chars))
    flagged = sum(p.flagged for p in pairs)
    pairs = pairs[:max(keep, flagged)]
    by_name = {s.name: s for s in subs}
    for p in pairs:
        if p.flagged:
            p.files = _file_matches(by_name[p.a], by_name[p.b])
    return pairs, {s.name: s.own for s in subs}, given
