"""A disguised copy of a submission: what a student who copies and hides it does, to check the similarity report.

    python -m grading.disguise submissions/alice /tmp/alice-copy      # then grade a batch holding both

Each .py file is rewritten where its syntax tree says: the names a function binds (locals, loop and with targets;
not its arguments, which callers may pass by keyword) are renamed consistently, the functions of each module and the
methods of each class are put in reverse order and every comment is replaced; the rest of the text is left as it
was, so what the course's starter gave stays the starter's. Behaviour is unchanged (the names a module or class
exports, and attribute names, are kept). Files that do not parse are
copied as they are. The staff's use: `--report` on a batch holding a submission and its disguised copy must flag
the pair (tests/test_grading_class.py does this on a small class; bench/grading_class.py on the real corpus).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import io
import shutil
import sys
import tokenize
from pathlib import Path

_KEEP = {"self", "cls", "__class__"} | set(dir(builtins))


def _functions(node: ast.AST):
    """The functions not inside another function (module functions, methods): each is renamed as one unit."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        else:
            yield from _functions(child)


def _renames(tree: ast.AST) -> list[tuple[int, int, int, str]]:
    """(line, start column, end column, new name) for each use of a name a function binds, renamed consistently
    inside that function and the functions and lambdas nested in it. The function's own arguments keep their
    names: callers may pass them by keyword (the course's starter calls self.embed(input_ids=...))."""
    edits, count = [], 0
    for fn in _functions(tree):
        args = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        args |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
        bound, shared = set(), set()
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                bound.add(sub.id)
            elif isinstance(sub, ast.arg) and sub.arg not in args:  # a nested function's or lambda's argument
                bound.add(sub.arg)
            elif isinstance(sub, (ast.Global, ast.Nonlocal)):
                shared |= set(sub.names)
        names = {}
        for name in sorted(bound - args - shared - _KEEP):
            count += 1
            names[name] = f"v{count}_"
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Name) and sub.id in names:
                edits.append((sub.lineno, sub.col_offset, sub.end_col_offset, names[sub.id]))
            elif isinstance(sub, ast.arg) and sub.arg in names:
                edits.append((sub.lineno, sub.col_offset, sub.col_offset + len(sub.arg.encode()), names[sub.arg]))
    return edits


def _comments(source: str) -> list[tuple[int, int, int, str]]:
    """(line, start column, end column, new text) replacing each comment."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    return [(t.start[0], t.start[1], t.end[1], "# see the notes") for t in tokens if t.type == tokenize.COMMENT]


def _blocks(body: list) -> list[tuple[int, int]]:
    """1-based inclusive line ranges of the functions in a body, decorators included."""
    return [(min([f.lineno] + [d.lineno for d in f.decorator_list]), f.end_lineno) for f in body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _reverse_blocks(lines: list[str], blocks: list[tuple[int, int]]) -> list[str]:
    """The blocks (same parent, in order, not overlapping) in reverse order; what lies between them stays."""
    if len(blocks) < 2:
        return lines
    first, last = blocks[0][0] - 1, blocks[-1][1]
    pieces = [lines[s - 1:e] for s, e in blocks]
    gaps = [lines[blocks[i][1]:blocks[i + 1][0] - 1] for i in range(len(blocks) - 1)]
    middle = []
    for i, piece in enumerate(reversed(pieces)):
        middle += piece + (gaps[i] if i < len(gaps) else [])
    return lines[:first] + middle + lines[last:]


def disguise_source(source: str) -> str:
    """The source with its locals renamed, its comments replaced and its functions and methods in reverse order;
    the rest of the text (layout, strings, what the starter gave) is left as it was."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = sorted(_renames(tree) + _comments(source), key=lambda e: (e[0], -e[1]))
    for line, start, end, text in edits:  # right to left within a line: earlier columns stay valid
        row = lines[line - 1].encode()  # ast's columns are UTF-8 byte offsets
        lines[line - 1] = (row[:start] + text.encode() + row[end:]).decode()
    lines = [line.rstrip("\n") for line in lines]
    for node in tree.body:  # methods first (inside their class), then the module's functions
        if isinstance(node, ast.ClassDef):
            lines = _reverse_blocks(lines, _blocks(node.body))
    lines = _reverse_blocks(lines, _blocks(tree.body))
    return "\n".join(lines) + "\n"


def disguise(src: str | Path, dest: str | Path) -> list[Path]:
    """Copy the folder src to dest (new), each .py file disguised; returns the files rewritten."""
    src, dest = Path(src), Path(dest)
    shutil.copytree(src, dest, symlinks=True)
    done = []
    for path in sorted(dest.rglob("*.py")):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            path.write_text(disguise_source(path.read_text()))
            done.append(path)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grading.disguise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a submission folder")
    p.add_argument("dest", help="where the disguised copy goes (must not exist)")
    args = p.parse_args(argv)
    if not Path(args.src).is_dir():
        p.error(f"not a folder: {args.src}")
    if Path(args.dest).exists():
        p.error(f"{args.dest} exists: give a new folder")
    done = disguise(args.src, args.dest)
    print(f"wrote {args.dest}: {len(done)} .py files disguised (names bound in functions renamed, functions reordered, "
          "comments replaced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
