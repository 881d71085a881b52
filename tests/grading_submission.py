"""Temporary: the submission writer lives in grading/example.py. Only test_grading_hostile.py, test_grading_package.py
and test_grading_venv.py still import it from here (another engineer's work in progress); delete this file once their
import reads `from grading.example import write_submission`."""
from grading.example import write_submission  # noqa: F401
