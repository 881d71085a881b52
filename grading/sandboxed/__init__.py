"""The code that runs inside the sandbox, in the check's process, beside the student's code.

**The trust boundary of the grader.** Everything in this folder runs (or is also run) in a process whose import
path starts at a copy of a student's submission, after that code has been imported: the student's code can read,
patch or replace any object here (the probe's outputs, the forbidden-call record, the stand-ins). So this code must
not trust anything it reads (the submission's objects, files, environment), and the grader must not trust anything
it says: the grader (the rest of `grading/`) reads back only outputs, checked against the shapes and caps it expects
(grading/sandbox.py, grading/checks.py), and computes every reference from its own inputs.

- zygote.py: the fork server, `python zygote.py` (never imported by the grader); forks one child per check.
- isolation.py: what the child applies to itself before the submission's code runs (namespaces, cgroup, tmpfs,
  rlimits, uid, seccomp, the grader's checkout hidden).
- probes.py: imports the submission and drives one component on the grader's inputs; writes outputs only.
- standins.py: the reference components a check grades the others with (only those it needs are compiled there).
- forbidden.py: the rubric's forbidden-call watches, installed before the submission is imported.

The zygote loads these files by path (never as this package: the submission's module names collide with the
project's). The grader imports probes.py and forbidden.py for their constants and helpers (sizes, masks, rubric
resolution); that copy never meets a submission. Nothing here imports the rest of the project. See docs/grading.md,
"Threat model".
"""
