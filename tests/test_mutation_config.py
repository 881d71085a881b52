"""Issue 40: the mutation score is a measured figure (bench/mutation.py with mutmut 3). The tool is pinned, its config
names the modules that make decisions, and the per-module runner knows a test file for each of them."""
import re
import tomllib

import pytest
from conftest import ROOT

from bench.mutation import MODULE_TESTS, status_of


def mutmut_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def test_requirements_dev_pins_mutmut_3_exactly_on_top_of_the_project_requirements():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-dev.txt").read_text().splitlines()]
    assert "-r requirements.txt" in lines
    assert [line for line in lines if re.fullmatch(r"mutmut==3\.\d+\.\d+", line)], lines


def test_the_config_mutates_exactly_the_modules_of_the_runner_and_each_exists_with_its_tests():
    config = mutmut_config()
    assert set(config["only_mutate"]) == set(MODULE_TESTS)
    for module, tests in MODULE_TESTS.items():
        assert (ROOT / module).is_file(), module
        assert any(module == p or module.startswith(p.rstrip("/") + "/") for p in config["source_paths"]), module
        assert tests and all((ROOT / t).is_file() for t in tests), (module, tests)
    # a plain `mutmut run` selects the same test files as the runner, all together
    assert set(config["pytest_add_cli_args_test_selection"]) == {t for ts in MODULE_TESTS.values() for t in ts}
    assert config["process_isolation"] == "forkserver"  # torch's thread pools do not survive a fork from a user


def test_mutmut_s_scratch_folder_is_ignored_by_git():
    assert "mutants/" in (ROOT / ".gitignore").read_text().splitlines()


def test_each_equivalent_mutant_names_its_module_a_line_still_there_and_a_reason():
    from bench.mutation import equivalents

    for entry in equivalents():
        module = entry["module"]
        assert module in MODULE_TESTS, entry
        assert entry["mutant"].startswith(module.removesuffix(".py").replace("/", ".") + "."), entry
        assert "__mutmut_" not in entry["mutant"], f"name the function without the mutant's number: {entry}"
        old, sep, new = entry["diff"].partition(" / +")
        assert old.startswith("-") and sep, f"the diff is '-old / +new' as bench/mutation.py prints it: {entry}"
        assert old[1:].strip() in (ROOT / module).read_text(), f"the mutated line is no longer in {module}: {entry}"
        assert len(entry["reason"].split()) >= 5, f"say why the mutant cannot change behaviour: {entry}"


def test_a_test_process_killed_by_any_signal_counts_as_a_crash():
    """mutmut's table names SIGSEGV and SIGKILL; SIGABRT (glibc's heap check after a kernel wrote past a buffer),
    SIGBUS, SIGFPE and SIGILL are crashes too, caught like a segfault, never "suspicious"."""
    pytest.importorskip("mutmut", reason="mutmut is a development package (pip install -r requirements-dev.txt)")
    assert [status_of(c) for c in (-6, -7, -8, -4, -11, -9)] == ["segfault"] * 6
    assert [status_of(c) for c in (1, 0, -24, None, 35)] == ["killed", "survived", "timeout", "not checked",
                                                             "suspicious"]
