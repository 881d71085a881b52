"""The layout's promises: no import circle between the project's modules (imports inside functions included), and
imports go down the floors, never up: CLI (run_*.py) -> tasks/ -> training/ -> models/ -> modules/ (models/ and
modules/ never import tasks/ or training/; training/ never imports tasks/)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "modules", "training", "tasks", "grading", "grading.sandboxed")


def project_modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in PACKAGES:
        folder = ROOT / package.replace(".", "/")
        for p in folder.glob("*.py") if folder.is_dir() else ():
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


def imports_up(edges: dict[str, set[str]], floors: tuple[str, ...], above: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules on `floors` (top-level packages) that import anything in `above`, with what they import there."""
    wrong = {name: sorted(i for i in deps if i.split(".")[0] in above)
             for name, deps in edges.items() if name.split(".")[0] in floors}
    return {k: v for k, v in wrong.items() if v}


def test_the_floor_check_sees_an_import_up():
    edges = {"training.engine": {"tasks.data", "training.steps"}, "tasks.data": {"training.steps"}, "tasks": set()}
    assert imports_up(edges, ("training",), ("tasks",)) == {"training.engine": ["tasks.data"]}


def test_models_and_modules_do_not_import_tasks_or_training():
    assert not imports_up(graph(), ("models", "modules"), ("tasks", "training"))


def test_training_does_not_import_tasks():
    """Issue 41: the engine is a floor below the tasks; what a task adds (data, model, loss, LoRA flags) it passes in."""
    edges = graph()
    assert {"training", "training.engine", "training.runfolder"} <= set(edges)  # the walk sees the package
    assert "training.checkpoint" in edges["training.runfolder"]
    assert not imports_up(edges, ("training",), ("tasks",))


def test_the_code_that_runs_in_the_sandbox_sits_apart_and_imports_nothing_of_the_project():
    """Issue 55 item 7: grading/sandboxed/ holds every file the fork server runs in a check's process (beside the
    submission, whose module names collide with the project's); the grader's side (the rest of grading/) loads
    nothing into the check by path."""
    import re

    from grading import sandbox

    here = ROOT / "grading" / "sandboxed"
    assert sandbox.ZYGOTE == here / "zygote.py"
    loaded = re.findall(r'os\.path\.join\(HERE, "(\w+\.py)"\)', (here / "zygote.py").read_text())
    assert sorted(loaded) == ["forbidden.py", "isolation.py", "probes.py", "standins.py"]
    assert sorted(p.name for p in here.glob("*.py")) == sorted(loaded + ["__init__.py", "zygote.py"])
    assert (here / "README.md").is_file()
    edges = graph()
    assert {"grading.sandboxed.probes", "grading.sandboxed.zygote"} <= set(edges)
    for name, deps in edges.items():  # nothing of the project (the submission's names would shadow it)
        if name.startswith("grading.sandboxed"):
            assert not deps, (name, deps)
    for path in (ROOT / "grading").glob("*.py"):
        assert "spec_from_file_location" not in path.read_text(), path


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
