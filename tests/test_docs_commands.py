"""Every command in README.md and docs/*.md still works, and every relative link there resolves.

Commands: the fenced ```bash blocks are collected; `\\` continuations are joined, `&&` / `;` / `|` chains split, env
var prefixes (`HF_HUB_OFFLINE=1 python ...`) and `torchrun` options skipped. A command that names a project entry
point (`python run_*.py`, `python -m <project module>`, `python bench/*.py`, `torchrun ... run_*.py`, `bash
bench/*.sh`) must exist, and every `--flag` it passes must exist in the entry point's argparse parser (exact spelling,
no abbreviations; a bare `--` ends the check: what follows goes to another program). The parser is captured in this
process: the entry point runs as `__main__` with argparse's `parse_known_args` patched to raise before anything
runs, once per entry point (cached), so the ~15 entry points cost one import each, not a subprocess each.
`pip`, `ruff`, `python -m pytest`, `python -c` and other programs are skipped.

Marker: a command whose last line ends with `# quick` is also run for real (its project commands, not its `pip`
part), from a scratch folder that mirrors the project with symlinks (the bundled data/ included; $GPT2_SHARED_DIR
unset, so the commands read what a clone has), so outputs land there, never in the checkout. Mark only commands that
take seconds on 2 cores. A `data/...` path the command names must exist.

Links: every `[text](target)` outside code blocks in those files whose target is not a URL must name an existing
file or folder, relative to the page; a `#anchor` must match one of the target page's headings (GitHub's slugs).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICK = re.compile(r"#\s*quick\s*$")
QUICK_TIMEOUT = 300  # s: generous for a loaded 2-core machine; quick commands take seconds
OUTPUT_DIRS = {"checkpoints", "predictions", "runs", "out", ".git", "__pycache__", ".pytest_cache", ".hypothesis"}


# ---- collecting commands -------------------------------------------------------------------------------------------

def bash_commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) for each command of the page's ```bash blocks, continuations joined."""
    commands, in_bash, pending, start = [], False, "", 0
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command, pending = (pending + line).strip(), ""
        if command and not command.startswith("#"):
            commands.append((start, command))
    return commands


def segments(command: str) -> list[list[str]]:
    """The simple commands of a chain (`a && b; c | d`), comments dropped, each as its words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    parts, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    parts.append(current)
    return [p for p in parts if p]


def entry_point(words: list[str]) -> tuple[tuple[str, str], list[str]] | None:
    """((kind, target), arguments) for a project entry point, or None for anything else (pip, ruff, pytest, ...).
    kind is "script" (a path under the project), "module" (python -m) or "shell" (bash script)."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    program, rest = words[0], words[1:]
    if program == "torchrun":  # its own options first, then the script and the script's arguments
        for i, word in enumerate(rest):
            if word.endswith(".py"):
                return ("script", word), rest[i + 1:]
        return None
    if program == "bash" and rest and rest[0].endswith(".sh"):
        return ("shell", rest[0]), rest[1:]
    if not re.fullmatch(r"python(3(\.\d+)?)?", program) or not rest:
        return None
    if rest[0] == "-m":
        module = rest[1]
        if module.split(".")[0] in ("pytest", "pip", "ruff", "torch", "transformers"):
            return None
        return ("module", module), rest[2:]
    if rest[0].endswith(".py") and not rest[0].startswith("-"):
        return ("script", rest[0]), rest[1:]
    return None


def all_commands() -> list[tuple[str, int, str]]:
    return [(page.relative_to(ROOT).as_posix(), number, command)
            for page in PAGES for number, command in bash_commands(page)]


COMMANDS = all_commands()
ENTRY_COMMANDS = [c for c in COMMANDS if any(entry_point(w) for w in segments(c[2]))]
QUICK_COMMANDS = [c for c in COMMANDS if QUICK.search(c[2])]


# ---- capturing an entry point's parser -----------------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def parser_of(kind: str, target: str) -> argparse.ArgumentParser:
    """The parser the entry point builds, captured when it parses: nothing after that runs."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        if not self.add_help:  # a pre-parser (e.g. tasks.ladder reads --preset first): let it parse, wait for the real one
            return original(self, args, namespace)
        raise _Captured(self)

    saved_env, saved_path, saved_argv = dict(os.environ), list(sys.path), list(sys.argv)
    sys.path.insert(0, str(ROOT))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "parse_known_args", capture)
            try:
                if kind == "module":
                    sys.argv = [target]
                    with warnings.catch_warnings():  # "found in sys.modules": expected, the module ran before
                        warnings.simplefilter("ignore", RuntimeWarning)
                        runpy.run_module(target, run_name="__main__", alter_sys=False)
                else:
                    sys.argv = [str(ROOT / target)]
                    sys.path.insert(0, str((ROOT / target).parent))
                    runpy.run_path(str(ROOT / target), run_name="__main__")
            except _Captured as captured:
                return captured.parser
    finally:  # entry points set env vars and sys.path at start-up; the rest of the test session must not see them
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:], sys.argv[:] = saved_path, saved_argv
    raise AssertionError(f"{target} finished without parsing its arguments with argparse")


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    known = set(parser._option_string_actions)  # every spelling, --no-x of BooleanOptionalAction included
    unknown = []
    for arg in args:
        if arg == "--":  # what follows is passed on to another program
            break
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            if flag not in known:
                unknown.append(flag)
    return unknown


@pytest.mark.parametrize("page,line,command", ENTRY_COMMANDS, ids=[f"{p}:{n}" for p, n, _ in ENTRY_COMMANDS])
def test_command_entry_point_and_flags_exist(page, line, command):
    for words in segments(command):
        found = entry_point(words)
        if found is None:
            continue
        (kind, target), args = found
        if kind == "module":
            assert module_path(target) is not None, f"{page}:{line}: no project module {target!r} in: {command}"
        else:
            assert (ROOT / target).is_file(), f"{page}:{line}: no file {target!r} in: {command}"
        if kind == "shell":
            continue
        unknown = unknown_flags(parser_of(kind, target), args)
        assert not unknown, f"{page}:{line}: {target} has no flag(s) {', '.join(unknown)} (command: {command})"


def test_the_pages_hold_project_commands():
    """The collector itself works: the README's main job is found, with its flags."""
    assert len(ENTRY_COMMANDS) >= 20
    main_job = [c for p, _, c in ENTRY_COMMANDS if p == "README.md" and "--output_dir checkpoints/shakespeare-char" in c]
    assert main_job, "the README's main job command was not collected"
    (kind, target), args = next(filter(None, map(entry_point, segments(main_job[0]))))
    assert (kind, target) == ("script", "run_pretrain.py") and "--overwrite" in args
    assert QUICK_COMMANDS, "no command is marked '# quick'"


def test_unknown_flag_is_caught():
    """A renamed flag fails: run_pretrain.py has --max_iters, not --max_steps_total."""
    parser = parser_of("script", "run_pretrain.py")
    assert unknown_flags(parser, ["--max_iters", "5", "--max_steps_total", "5", "--", "--anything"]) == [
        "--max_steps_total"]


# ---- running the quick commands ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scratch_project(tmp_path_factory):
    """A folder laid out like the project's (symlinks to its files and folders, data/ too); outputs stay here."""
    base = tmp_path_factory.mktemp("docs-commands")
    project = base / "project"
    project.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in OUTPUT_DIRS:
            (project / entry.name).symlink_to(entry)
    return project


@pytest.mark.parametrize("page,line,command", QUICK_COMMANDS, ids=[f"{p}:{n}" for p, n, _ in QUICK_COMMANDS])
def test_quick_command_runs(page, line, command, scratch_project):
    missing = [w for w in re.findall(r"(?<![\w./-])data/\S+", command) if not (scratch_project / w).exists()]
    assert not missing, f"{page}:{line}: names {', '.join(missing)}, which the project's data/ does not hold"
    for words in segments(command):
        found = entry_point(words)
        if found is None:
            continue  # pip install: the environment is already installed
        prefix = [w for w in words if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
        words = words[len(prefix):]
        argv = ["bash", *words[1:]] if words[0] == "bash" else [sys.executable, *words[1:]]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1",
               **dict(w.split("=", 1) for w in prefix)}
        with contextlib.suppress(KeyError):
            del env["GPT2_SHARED_DIR"]  # the bundled data/, as a clone has it
        result = subprocess.run(argv, cwd=scratch_project, env=env, capture_output=True, text=True,
                                timeout=QUICK_TIMEOUT)
        assert result.returncode == 0, (f"{page}:{line}: exit {result.returncode}: {command}\n"
                                        f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


# ---- links ---------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())  # GitHub drops punctuation, keeps - and _
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def relative_links() -> list[tuple[str, str]]:
    links = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is not a link
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in LINK.findall(text):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append((page.relative_to(ROOT).as_posix(), target))
    return links


LINKS = relative_links()


@pytest.mark.parametrize("page,target", LINKS, ids=[f"{p}->{t}" for p, t in LINKS])
def test_relative_link_resolves(page, target):
    path_part, _, anchor = target.partition("#")
    destination = (ROOT / page).parent / path_part if path_part else ROOT / page
    assert destination.exists(), f"{page}: link {target!r} names {destination.relative_to(ROOT)}, which does not exist"
    if anchor and destination.suffix == ".md":
        assert anchor in anchors(destination), (
            f"{page}: link {target!r}: no heading #{anchor} in {destination.relative_to(ROOT)}")


def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


# ---- the machine header every benchmark prints (so a pasted table carries its machine) ----------------------------

def test_machine_header_names_the_cpu_its_flags_and_the_date():
    sys.path.insert(0, str(ROOT))
    from bench.machine import machine_header

    zen3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\n"
    header = machine_header(zen3)
    assert header.startswith("machine: AMD EPYC 7B13, ")
    assert "avx2, no avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile" in header
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", header) and "load average" in header
    zen4 = "model name : AMD EPYC 9B14\nflags : avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert "avx2 avx512f avx512_bf16 avx512_vnni, no amx_bf16 amx_tile" in machine_header(zen4)
    assert "flags unknown" in machine_header("")


BENCH_LIBRARIES = {"machine.py", "results.py", "report.py"}  # what the benchmarks use, not benchmarks


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in BENCH_LIBRARIES))
def test_every_bench_script_prints_the_machine_header_and_records_its_results(script):
    text = (ROOT / "bench" / script).read_text(encoding="utf-8")
    assert "print_machine_header()" in text, (
        f"bench/{script} does not print the machine header (bench/machine.py) before its figures")
    assert "Recorder(" in text, f"bench/{script} does not record its results (bench/results.py: Recorder)"


# ---- the README's commands from a fresh clone ------------------------------------------------------------------------

INPUT_FLAGS = {"--model", "--data", "--nanogpt", "--tokenizer", "--batch", "--sonnet_path"}  # paths a command reads
OUTPUT_FLAGS = {"--output_dir", "--out_dir", "--example"}  # folders a command makes
TASK_CLIS = {"run_classifier.py", "run_paraphrase.py", "run_sonnet.py"}  # the official gpt2 unless --model
NEEDS = re.compile(r"#.*\b(needs|after|on a GPU machine)\b")


def in_clone(path: str) -> bool:
    """Whether `path` (relative to the project root) is inside this checkout and there: what lies beside the clone
    here (../nanoGPT, ../shared) is not beside a fresh clone."""
    full = (ROOT / path).resolve()
    return full.is_relative_to(ROOT.resolve()) and full.exists()


def fresh_clone_gaps(commands: list[tuple[int, str]]) -> list[str]:
    """The commands (in page order) that read a path a fresh clone lacks, made by no earlier command, or that need
    the hub, without saying so on their own line (a comment with 'needs', 'after' or 'on a GPU machine')."""
    made, gaps = set(), []
    for line, command in commands:
        says = bool(NEEDS.search(command))
        for words in segments(command):
            found = entry_point(words)
            if found is None:
                continue
            (kind, target), args = found
            pairs = list(zip(args, args[1:]))
            inputs = [value for flag, value in pairs if flag in INPUT_FLAGS]
            if target == "grading" and args and not args[0].startswith("-") and args[0] != "package":
                inputs.append(args[0])
            for path in inputs:
                if "/" not in path:  # a hub name
                    continue
                if in_clone(path) or any(path == m or path.startswith(m + "/") for m in made):
                    continue
                if not says:
                    gaps.append(f"line {line}: {path} (not in a fresh clone, made by no earlier command): {command}")
            if Path(target).name in TASK_CLIS and "--model" not in args and "--baseline" not in args and not says:
                gaps.append(f"line {line}: the official gpt2 weights (the hub): {command}")
            made |= {value.rstrip("/") for flag, value in pairs if flag in OUTPUT_FLAGS}
    return gaps


def test_readme_commands_run_from_a_fresh_clone_or_say_what_they_need():
    assert fresh_clone_gaps(bash_commands(ROOT / "README.md")) == []


def test_a_command_that_needs_what_a_fresh_clone_lacks_is_caught():
    commands = [(1, "python run_pretrain.py --data data/tinyshakespeare/input.txt --output_dir checkpoints/a"),
                (2, "python run_pretrain.py --sample --model checkpoints/a/best"),  # made above
                (3, "python bench/speedrun.py --nanogpt ../nanoGPT"),
                (4, "python -m grading path/to/submission"),
                (5, "python run_classifier.py --task sst"),
                (6, "python bench/speedrun.py --nanogpt ../nanoGPT   # needs nanoGPT's checkout"),
                (7, "python run_pretrain.py --data ../corpora/input.txt")]  # beside the project: not in a clone
    gaps = fresh_clone_gaps(commands)
    assert [g.split(":")[0] for g in gaps] == ["line 3", "line 4", "line 5", "line 7"], gaps
