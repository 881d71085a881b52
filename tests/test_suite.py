"""The suite's own settings (tests/conftest.py, pyproject.toml): what makes the README's test command quick."""
from pathlib import Path

from conftest import SLOW_FILES


def test_the_files_of_long_tests_exist_and_lead_the_collection(request):
    """conftest.py's SLOW_FILES name files that exist (a renamed file would silently fall back to the end), and the
    collection of this run, whatever part of the suite it holds, starts with those of them it holds, in their order."""
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert set(SLOW_FILES) <= here, sorted(set(SLOW_FILES) - here)
    assert len(set(SLOW_FILES)) == len(SLOW_FILES)
    order = list(dict.fromkeys(item.path.name for item in request.session.items))
    held = [name for name in SLOW_FILES if name in order]
    assert order[:len(held)] == held, order[:len(held) + 3]
