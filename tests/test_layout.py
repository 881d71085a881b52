"""The layout's promises: no import circle between the project's modules (imports inside functions included), and
models/ and modules/ never import tasks/."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "modules", "tasks", "grading")


def project_modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in PACKAGES:
        for p in (ROOT / package).glob("*.py") if (ROOT / package).is_dir() else ():
            found[f"{package}.{p.stem}" if p.stem != "__init__" else package] = p
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports anywhere in it (module level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n in modules}
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    edges = graph()
    assert {"models.gpt2", "models.generation", "tasks.classifier", "tasks.evaluate"} <= set(edges)
    assert "models.generation" in edges["models.gpt2"]  # the walk sees real imports
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_models_and_modules_do_not_import_tasks():
    wrong = {name: sorted(i for i in deps if i.startswith("tasks"))
             for name, deps in graph().items() if name.startswith(("models", "modules"))}
    assert not {k: v for k, v in wrong.items() if v}


def test_what_the_documented_commands_write_in_the_root_is_ignored_by_git():
    """Issue 37: `python -m grading package autograder.zip` left an untracked zip in the repository's root."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = ["autograder.zip", "checkpoints/sonnet/best/config.json", "predictions/para-dev-output.csv",
               "runs/x/metrics.jsonl", "results.json", "scores.csv",  # the README's grading commands
               "venv/bin/python", ".venv/bin/python"]  # a venv made in the clone, as newcomers do
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == sorted(written)
