"""Issue 24 item 3: each component graded on its own (the reference standing in for the others), outputs captured
by value, forward and the LM head as separate parts, every dropout checked in training mode.

Each case is a synthetic submission (grading/example.py) whose one defect must cost exactly its own points.
"""
from __future__ import annotations

import pytest
from test_grading import sharing_server

from grading.example import write_submission
from grading.grader import Grader

FULL = {"attention": 16, "layer": 14, "embed": 8, "model": 14, "from_pretrained": 18}
MODEL_CHECKS = tuple(FULL)


@pytest.fixture(scope="module")
def grader():
    with Grader() as g:
        yield g


def points(grader, tmp_path, **replace):
    report = grader.grade(write_submission(tmp_path / "sub", **replace), MODEL_CHECKS)
    return report, {(c.name, p.name): p for c in report.checks for p in c.parts}


def lost(parts):
    return {k for k, p in parts.items() if p.points < p.max}


NO_CAUSAL = [('scores = scores.masked_fill(~causal, float("-inf"))', "")]
CASES = {
    # a correct add() that adds the residual in place after the dropout: nothing lost
    "inplace_residual": (dict(layer=[("        return input + dropout(dense_layer(output))",
                                      "        output = dropout(dense_layer(output))\n        output += input\n"
                                      "        return output")]), set()),
    # a wrong attention costs the attention check only: layer, model and from_pretrained are graded without it
    "attention_wrong_only": (dict(attention=NO_CAUSAL), {("attention", "forward"), ("attention", "attention"),
                                                         ("attention", "training")}),
    # hidden_state_to_token missing: the model's forward keeps its points
    "head_missing": (dict(model=[("        return hidden_state @ self.word_embedding.weight.t()",
                                  "        raise NotImplementedError")]), {("model", "hidden_state_to_token")}),
    # forward broken: the head keeps its points
    "forward_missing": (dict(model=[("        hidden = self.encode(self.embed(input_ids), attention_mask)\n",
                                     "        raise NotImplementedError\n")]), {("model", "forward")}),
    # embed() without embed_dropout: right in eval, wrong in training
    "embed_no_dropout": (dict(model=[("return self.embed_dropout(self.word_embedding(input_ids) + self.pos_embedding(pos_ids))",
                                      "return self.word_embedding(input_ids) + self.pos_embedding(pos_ids)")]),
                         {("embed", "training")}),
    # the feed-forward branch applies out_dropout twice
    "out_dropout_twice": (dict(layer=[("return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)",
                                       "return self.add(hidden_states, mlp, lambda y: self.out_dropout(self.out_dense(y)),"
                                       " self.out_dropout)")]), {("layer", "training")}),
    # a wrong layer costs the layer check only; a wrong embed() the embed check only
    "layer_and_embed_wrong": (dict(layer=[("self.interm_dense(self.out_layer_norm(hidden_states))",
                                           "self.interm_dense(hidden_states)")],
                                   model=[("self.word_embedding(input_ids) + self.pos_embedding(pos_ids)",
                                           "self.word_embedding(input_ids)")]),
                              {("layer", "forward"), ("embed", "embed"), ("embed", "training")}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_defect_costs_its_own_points(grader, tmp_path, case):
    replace, want = CASES[case]
    report, parts = points(grader, tmp_path, **replace)
    got = lost(parts)
    assert got == want, {k: (p.points, p.status, p.message) for k, p in parts.items()}
    for k in want:
        assert parts[k].message, k  # a lost part says why


def test_isolation_is_said_in_the_report(grader, tmp_path):
    report, _ = points(grader, tmp_path)
    said = {c.name: " ".join(c.messages) for c in report.checks}
    assert "reference attention" in said["layer"]
    assert "reference layers" in said["model"]
    assert "weights it loads" in said["from_pretrained"]


def test_missing_head_says_not_implemented(grader, tmp_path):
    _, parts = points(grader, tmp_path, **CASES["head_missing"][0])
    head = parts[("model", "hidden_state_to_token")]
    assert head.status == "not implemented" and "not implemented" in head.message
    assert parts[("model", "forward")].status == "pass"


def probes_run(grader, monkeypatch):
    ran = []
    real = grader.sandbox.run

    def run(probe, *a, **k):
        ran.append(probe)
        return real(probe, *a, **k)
    monkeypatch.setattr(grader.sandbox, "run", run)
    return ran


def test_import_hang_is_found_once(grader, tmp_path, monkeypatch):
    ran = probes_run(grader, monkeypatch)
    sub = write_submission(tmp_path / "sub", model=[("import torch\n", "import torch\nwhile True:\n    pass\n")])
    report = grader.grade(sub, ("attention", "embed", "model", "from_pretrained"), timeout=3)
    assert ran == ["imports", "attention"]  # the checks that import models.gpt2 never wait again
    by = {c.name: c for c in report.checks}
    assert by["attention"].score == FULL["attention"]
    for name in ("embed", "model", "from_pretrained"):
        assert by[name].score == 0 and "importing models.gpt2: timed out" in by[name].messages[0], by[name].messages


def test_import_error_is_found_once_and_named_for_every_check(grader, tmp_path, monkeypatch):
    ran = probes_run(grader, monkeypatch)
    sub = write_submission(tmp_path / "sub", utils=[("import torch\n", "import torch\nimport loralib\n")])
    report = grader.grade(sub, ("attention", "layer", "model"))
    assert ran == ["imports"]
    for c in report.checks:
        assert c.score == 0 and "No module named 'loralib'" in " ".join(c.messages), c.messages
    assert any("loralib" in f for f in report.environment), report.environment


FORGE = '''
import inspect as _inspect
import json as _json
import os as _os


def _forge(payload):
    for f in _inspect.stack():
        if f.function == "main" and "resultdir" in f.frame.f_locals and any(
                g.function == "probe_attention" for g in _inspect.stack()):
            rd = f.frame.f_locals["resultdir"]
            with open(_os.path.join(rd, "info.json"), "w") as fh:
                _json.dump({"status": "ok", "message": "", "notes": [], "values": {"dropout_p": 0.5}}, fh)
            with open(_os.path.join(rd, "tensors.safetensors"), "wb") as fh:
                fh.write(payload)
            _os._exit(0)
'''


@pytest.mark.parametrize("payload,said", [("b'garbage' * 1000", "unreadable"),
                                          ("b'x' * (13 * 2**20)", "oversized")])
def test_corrupt_or_oversized_result_costs_one_check(grader, tmp_path, payload, said):
    """Issue 29: a garbage or oversized tensors file (written by the submission itself) aborted the whole grade."""
    sub = write_submission(tmp_path / "sub", utils=[
        ("import torch\n", "import torch\n" + FORGE),
        ("    extended = attention_mask", f"    _forge({payload})\n    extended = attention_mask")])
    report = grader.grade(sub, ("attention", "embed"))
    by = {c.name: c for c in report.checks}
    assert by["attention"].score == 0 and said in by["attention"].messages[0], by["attention"].messages
    assert by["embed"].score == FULL["embed"]


FORGE_IMPORTS = '''
import inspect as _inspect
import json as _json
import os as _os

if any(f.function == "probe_imports" for f in _inspect.stack()):  # only while the imports probe runs
    with open("../result/info.json", "w") as _fh:
        _json.dump({"status": "ok", "message": "", "notes": [], "values": {"imports": "x"}}, _fh)
    _os._exit(0)
'''


def test_a_malformed_imports_result_costs_no_crash_and_no_other_check(grader, tmp_path):
    """Issue 36: the imports probe's result rewritten by the submission (values.imports = "x", then os._exit) made
    the grader raise AttributeError; now the result is ignored and each check imports for itself."""
    sub = write_submission(tmp_path / "sub", utils=[("import torch\n", "import torch\n" + FORGE_IMPORTS)])
    report = grader.grade(sub, ("attention", "embed"))
    assert {c.name: c.score for c in report.checks} == {"attention": FULL["attention"], "embed": FULL["embed"]}


def test_a_hang_in_a_module_imported_by_another_names_the_module_that_hung(grader, tmp_path):
    """Issue 36: config importing utils, utils looping forever at its end, was reported as "importing config"."""
    sub = write_submission(tmp_path / "sub", config=[("from transformers import PretrainedConfig\n",
                                                      "from transformers import PretrainedConfig\nimport utils\n")],
                           utils=[("import torch\n", "import torch\nwhile True:\n    pass\n")])
    report = grader.grade(sub, ("attention",), timeout=3)
    (check,) = report.checks
    assert check.score == 0 and "importing utils: timed out" in check.messages[0], check.messages


def test_a_check_cannot_take_a_part_out_of_the_maximum(grader, tmp_path):
    """Issue 36: the probe's word that the layer's dropouts could not be found made the training part "skipped",
    which took it out of the maximum (a layer with a dropout bug then scored 98 of 98). Now it scores 0 of its
    points with the reason, and the layer's maximum stays the rubric's."""
    renamed = [("self.attention_dropout = nn.Dropout", "self.attn_drop = nn.Dropout"),
               ("self.attention_dense, self.attention_dropout)", "self.attention_dense, self.attn_drop)")]
    report, parts = points(grader, tmp_path, layer=renamed)
    layer = next(c for c in report.checks if c.name == "layer")
    assert layer.max_score == FULL["layer"], layer.messages
    training = parts[("layer", "training")]
    assert training.points == 0 and "not graded" in training.message and "attention_dropout" in training.message


@pytest.mark.parametrize("replace, check", [
    # issue 36: training-mode probabilities x 0, and embeddings x 0, got full marks for both training parts
    (dict(attention=[("        probs = self.dropout(probs)\n",
                      "        probs = self.dropout(probs) * (0.0 if self.training else 1.0)\n")]), "attention"),
    (dict(model=[("        return self.embed_dropout(self.word_embedding(input_ids) + self.pos_embedding(pos_ids))",
                  "        out = self.embed_dropout(self.word_embedding(input_ids) + self.pos_embedding(pos_ids))\n"
                  "        return out * (0.0 if self.training else 1.0)")]), "embed"),
])
def test_a_dropout_that_drops_everything_fails_its_training_part(grader, tmp_path, replace, check):
    report = grader.grade(write_submission(tmp_path / "sub", **replace), (check,))
    (result,) = report.checks
    training = next(p for p in result.parts if p.name == "training")
    assert training.points == 0 and "entries kept where dropout with p=" in training.message, training.message
    assert all(p.points == p.max for p in result.parts if p.name != "training"), result.messages


def test_the_kept_fraction_bound_passes_real_dropout_and_fails_all_or_nothing():
    import torch

    from grading.checks import kept_fraction_problem

    g = torch.Generator().manual_seed(0)
    for n in (64, 512, 4096):
        for _ in range(200):  # real masks at p=0.5 are never refused
            kept = int(torch.bernoulli(torch.full((n,), 0.5), generator=g).sum())
            assert kept_fraction_problem(kept, n, 0.5) == ""
        assert kept_fraction_problem(0, n, 0.5) and kept_fraction_problem(n, n, 0.5)
    assert kept_fraction_problem(0, 0, 0.5)  # nothing to judge on is a problem, not a pass


def test_a_hang_in_attention_costs_the_attention_check_only(grader, tmp_path):
    """Issue 36: one infinite loop in attention() cost attention, layer and from_pretrained (48 points, 185 s): the
    layer probe ran the submission's attention to learn its layout, and from_pretrained ran the model for
    information. Both runs are capped now and grade nothing: the hang costs the attention check alone."""
    sub = write_submission(tmp_path / "sub", attention=[(
        "        scores = torch.matmul(query, key.transpose(-1, -2))  # (B, h, T, T)\n",
        "        while True:\n            pass\n")])
    report = grader.grade(sub, ("attention", "layer", "from_pretrained"), timeout=8)
    by = {c.name: c for c in report.checks}
    assert by["attention"].score == 0
    assert by["layer"].score == FULL["layer"], by["layer"].messages
    assert by["from_pretrained"].score == FULL["from_pretrained"], by["from_pretrained"].messages


def test_an_error_inside_a_library_call_names_the_submissions_line(grader, tmp_path):
    """Issue 36: a garbage .pt loaded in from_pretrained read only "IndexError: pop from empty list"."""
    sub = write_submission(tmp_path / "sub", model=[("import torch\n", "import torch\n")])
    (sub / "weights.pt").write_bytes(b"\x80\x02garbage")
    gpt2 = (sub / "models" / "gpt2.py").read_text()
    marker = "    def from_pretrained("
    assert gpt2.count(marker) == 1
    at = gpt2.index(marker)
    body = gpt2.index("\n", gpt2.index("):", at)) + 1  # the first line of its body
    (sub / "models" / "gpt2.py").write_text(gpt2[:body] + "        torch.load('weights.pt', weights_only=False)\n"
                                            + gpt2[body:])
    report = grader.grade(sub, ("from_pretrained",))
    (check,) = report.checks
    said = " ".join(check.messages + [p.message for p in check.parts])
    assert "at models/gpt2.py:" in said and "torch.load('weights.pt'" in said, said


def test_the_whole_submission_has_a_deadline_besides_each_checks(grader, tmp_path):
    """Issue 36: a deadline for all of a submission's checks together; the checks left when it is spent score 0
    and say why (the per-check deadline alone let seven slow checks take seven times it)."""
    from grading.sandbox import Limits

    sub = write_submission(tmp_path / "sub", attention=[(
        "        scores = torch.matmul(query, key.transpose(-1, -2))  # (B, h, T, T)\n",
        "        while True:\n            pass\n")])
    with Grader(limits=Limits(timeout=5, submission_timeout=6)) as g:
        report = sharing_server(grader, g).grade(sub, ("attention", "layer"))
    by = {c.name: c for c in report.checks}
    assert by["attention"].score == 0 and "timed out" in " ".join(by["attention"].messages)
    assert by["layer"].score == 0 and "not run: the submission's 6 s" in " ".join(by["layer"].messages)
    assert report.seconds < 30


def test_the_graders_own_start_is_not_the_submissions_time(tmp_path, monkeypatch):
    """The fork server's cold start (seconds on a busy machine: torch and transformers imported) and the hub checkpoint
    are the grader's set-up: a submission whose checks fit its deadline gets them all, however slow that start."""
    import time

    from grading import sandbox
    from grading.sandbox import Limits

    # A start that takes 4 s: the server is this worker's idle one where it has one (a real start is seconds of
    # imports: 6 s of a core on a 2-core Xeon), waited for 4 s more as if it were starting; else a real start.
    ready = sandbox._await_server
    idle = sandbox._take_idle()
    server = idle if idle is not None else sandbox._spawn_server()

    def slow_start(proc, home):
        time.sleep(4)
        return (proc, home) if idle is not None else ready(proc, home)
    monkeypatch.setattr(sandbox, "_await_server", slow_start)
    monkeypatch.setattr(sandbox, "_spawn_server", lambda: server)
    monkeypatch.setattr(sandbox, "_take_idle", lambda: None)  # the grader starts "its own": the one above
    with Grader(limits=Limits(timeout=10, submission_timeout=4)) as g:
        report = g.grade(write_submission(tmp_path / "sub"), ("attention",))
    (check,) = report.checks
    assert check.score == 16, check.messages
