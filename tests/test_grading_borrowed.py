"""Issue 36, "links and borrowed code": the check's process cannot reach the grader's own classes, and the rubric's
forbidden calls (off by default) are caught while the submission's code runs.

A submission whose attention, layer and embed() delegate to the grader's in-process stand-ins (found through
sys.modules, the probe's frame, the garbage collector or the grader's files) scored 60/100 on the untouched starter
(28/100) before: the stand-ins a check grades with are now loaded only into the checks that need them (the layer's
reference attention, the model's reference layers and embed()), and the grader's checkout is hidden from the check.
"""
from __future__ import annotations

import pytest
from test_grading import STARTER, sharing_server

from bench.grading_payloads import FIND
from grading.example import write_submission
from grading.grader import Grader
from grading.sandbox import Limits

STARTER_EARNS = 28  # the course gives GPT2Model.forward (10) and from_pretrained (18)

# Every way a student has found to the grader's objects (the fork server's modules, the probe's frames, the garbage
# collector, the grader's own files): the payload the bench's matrix uses, bench/grading_payloads.py's FIND.
ATTENTION_BORROWED = '''
    def attention(self, key, query, value, attention_mask):
        B, h, T, hd = query.shape
        D = h * hd
        x = torch.cat([t.transpose(1, 2).reshape(B, T, D) for t in (query, key, value)], -1)
        pick = [torch.cat([torch.eye(D) if j == i else torch.zeros(D, D) for j in range(3)], 1) for i in range(3)]
        w = {"query.weight": pick[0], "key.weight": pick[1], "value.weight": pick[2]}
        w.update({f"{n}.bias": torch.zeros(D) for n in ("query", "key", "value")})
        return _grader_object("RefAttention")(w)(x, attention_mask)

    def forward(self, hidden_states, attention_mask):
        w = {f"{n}.{p}": getattr(getattr(self, n), p) for n in ("query", "key", "value") for p in ("weight", "bias")}
        return _grader_object("RefAttention")(w)(hidden_states, attention_mask)

    def course_attention(self, key, query, value, attention_mask):
'''
LAYER_BORROWED = '''
    def forward(self, hidden_states, attention_mask):
        names = ("attention_dense", "interm_dense", "out_dense", "attention_layer_norm", "out_layer_norm")
        w = {f"{n}.{p}": getattr(getattr(self, n), p) for n in names for p in ("weight", "bias")}
        w.update({f"self_attention.{n}.{p}": getattr(getattr(self.__dict__["own_attention"], n), p)
                  for n in ("query", "key", "value") for p in ("weight", "bias")})
        return _grader_object("RefLayer")(w, {"eps_attn": 1e-5, "eps_mlp": 1e-5, "activation": "exact"})(
            hidden_states, attention_mask)

    def course_forward(self, hidden_states, attention_mask):
'''
EMBED_BORROWED = '''
    def embed(self, input_ids):
        return self.embed_dropout(_grader_object("ref_embed")(self)(input_ids))

    def course_embed(self, input_ids):
'''


def borrowing_starter(folder):
    """The untouched starter whose TODOs (attention, the layer, embed) call the grader's own classes instead."""
    return write_submission(
        folder,
        utils=[("import torch\n", "import torch\n" + FIND)],
        attention=[("from torch import nn\n", "from torch import nn\n\nfrom utils import _grader_object\n"),
                   ("    def attention(self, key, query, value, attention_mask):\n", ATTENTION_BORROWED)],
        layer=[("from torch import nn\n", "from torch import nn\n\nfrom utils import _grader_object\n"),
               ("    def add(self, input, output, dense_layer, dropout):\n        return input + dropout(dense_layer(output))\n", ""),
               ("    def forward(self, hidden_states, attention_mask):\n", LAYER_BORROWED),
               # its own attention kept aside (not a submodule): the grader puts its weights in place, then swaps it
               ("        self.out_dropout = nn.Dropout(config.hidden_dropout_prob)\n",
                "        self.out_dropout = nn.Dropout(config.hidden_dropout_prob)\n"
                "        self.__dict__[\"own_attention\"] = self.self_attention\n")],
        model=[("from utils import get_extended_attention_mask\n",
                "from utils import _grader_object, get_extended_attention_mask\n"),
               ("    def embed(self, input_ids):\n", EMBED_BORROWED), *STARTER["model"][1:]],
        optimizer=STARTER["optimizer"])


@pytest.fixture(scope="module")
def grader():
    with Grader(limits=Limits(timeout=30)) as g:
        yield g


def test_a_starter_that_calls_the_graders_own_classes_earns_nothing_by_them(grader, tmp_path):
    report = grader.grade(borrowing_starter(tmp_path / "sub"))
    outputs = {c.name: c.output for c in report.checks}
    borrowed = {name: [line for line in out.splitlines() if line.startswith("BORROWED")]
                for name, out in outputs.items()}
    assert report.total == STARTER_EARNS and report.max_total == 100, \
        {c.name: (c.score, [p.message for p in c.parts], borrowed[c.name]) for c in report.checks}
    for name in ("attention", "embed"):  # no stand-in at all in these checks
        assert not borrowed[name] and "NOT FOUND" in outputs[name], (name, outputs[name])
    # the layer check holds the reference attention (it grades the layer with it), never the reference layer
    assert not any("RefLayer" in line for line in borrowed["layer"]), outputs["layer"]
    assert "NOT FOUND RefLayer" in outputs["layer"], outputs["layer"]
    if report.sandbox.get("mount") == "isolated":
        assert report.sandbox.get("grader_code", "").startswith("hidden"), report.sandbox


# ---- the rubric's forbidden calls --------------------------------------------------------------------------------

FORBIDDEN = {"attention": ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.MultiheadAttention"],
             "*": ["transformers.models.gpt2.modeling_gpt2.*"]}
SDPA = [("        probs = F.softmax(scores, dim=-1)\n        probs = self.dropout(probs)\n"
         "        out = torch.matmul(probs, value)  # (B, h, T, hd)\n",
         "        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask + torch.zeros(T, T)"
         ".masked_fill(~causal, float('-inf')),\n"
         "                                             dropout_p=self.dropout.p if self.training else 0.0)\n")]
HF_ATTENTION = [
    ("from torch import nn\n", "from torch import nn\nfrom transformers import GPT2Config as HFConfig\n"
                               "from transformers.models.gpt2.modeling_gpt2 import GPT2Attention\n"),
    ("    def forward(self, hidden_states, attention_mask):\n", '''    def forward(self, hidden_states, attention_mask):
        D, T = self.all_head_size, hidden_states.shape[1]
        cfg = HFConfig(n_embd=D, n_head=self.num_attention_heads, attn_pdrop=0.0, resid_pdrop=0.0)
        cfg._attn_implementation = "eager"
        hf = GPT2Attention(cfg).eval()
        with torch.no_grad():
            hf.c_attn.weight.copy_(torch.cat([self.query.weight, self.key.weight, self.value.weight], 0).t())
            hf.c_attn.bias.copy_(torch.cat([self.query.bias, self.key.bias, self.value.bias]))
            hf.c_proj.weight.copy_(torch.eye(D))
            hf.c_proj.bias.zero_()
        causal = torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return hf(hidden_states, attention_mask=attention_mask + causal)[0]

    def course_forward(self, hidden_states, attention_mask):
''')]


@pytest.fixture(scope="module")
def forbidding(grader, tmp_path_factory):
    """A grader whose rubric forbids SDPA and MultiheadAttention in attention, and transformers' GPT-2 everywhere."""
    import json

    from grading.grader import DEFAULT_RUBRIC, load_rubric

    rubric = json.loads(DEFAULT_RUBRIC.read_text())
    rubric["forbidden_calls"] = FORBIDDEN
    path = tmp_path_factory.mktemp("rubric") / "rubric.json"
    path.write_text(json.dumps(rubric))
    with Grader(rubric=load_rubric(path), limits=Limits(timeout=30)) as g:
        yield sharing_server(grader, g)


def forbidden_findings(check):
    return [m for m in check.messages if "forbidden" in m]


def test_sdpa_in_attention_loses_the_attention_points_with_the_option_on(grader, forbidding, tmp_path):
    sub = write_submission(tmp_path / "sub", attention=SDPA)
    (off,) = grader.grade(sub, ("attention",)).checks
    assert off.score == 16 and not forbidden_findings(off), (off.messages, [vars(p) for p in off.parts])  # as before
    (on,) = forbidding.grade(sub, ("attention",)).checks
    assert on.score == 0 and on.verdict == "fail", [vars(p) for p in on.parts]
    findings = forbidden_findings(on)
    for part in ("forward", "attention", "training"):  # each part ran attention(), which called it
        assert any("torch.nn.functional.scaled_dot_product_attention at modules/attention.py:" in m
                   and f"while grading {part}" in m for m in findings), findings
    line = 1 + next(i for i, text in enumerate((sub / "modules" / "attention.py").read_text().splitlines())
                    if "scaled_dot_product_attention" in text)
    assert f"modules/attention.py:{line} in attention()" in findings[0], (line, findings)
    assert all("forbidden call torch.nn.functional.scaled_dot_product_attention" in p.message for p in on.parts)


def test_transformers_gpt2_attention_is_flagged_and_other_checks_keep_their_points(grader, forbidding, tmp_path):
    sub = write_submission(tmp_path / "sub", attention=HF_ATTENTION)
    checks = ("attention", "layer", "from_pretrained")
    assert {c.name: c.score for c in grader.grade(sub, checks).checks} == \
        {"attention": 16, "layer": 14, "from_pretrained": 18}  # off: graded as before
    report = forbidding.grade(sub, checks)
    attention = report.checks[0]
    parts = {p.name: p for p in attention.parts}
    findings = forbidden_findings(attention)
    assert any("transformers.models.gpt2.modeling_gpt2.GPT2Attention at modules/attention.py:" in m
               and "in forward()" in m and "while grading forward" in m for m in findings), findings
    assert parts["forward"].points == 0 and "GPT2Attention" in parts["forward"].message, vars(parts["forward"])
    # attention() is the student's own (forward() delegates, attention() does not): its points stay
    assert parts["attention"].points == 4, vars(parts["attention"])
    # the layer check grades the layer with the reference attention; from_pretrained builds transformers' GPT-2 to
    # load its checkpoint (construction, no forward): neither uses a forbidden call
    assert {c.name: c.score for c in report.checks[1:]} == {"layer": 14, "from_pretrained": 18}, \
        {c.name: forbidden_findings(c) for c in report.checks}


def test_a_correct_submission_loses_nothing_with_the_option_on(forbidding, tmp_path):
    report = forbidding.grade(write_submission(tmp_path / "sub"), ("attention", "layer", "embed", "model",
                                                                   "from_pretrained"))
    assert report.total == report.max_total == 70, {c.name: forbidden_findings(c) for c in report.checks}
    assert not any(forbidden_findings(c) for c in report.checks)


def test_a_removed_watch_costs_the_whole_check(forbidding, tmp_path):
    """The watch lives in the submission's process: putting the original back is itself recorded."""
    code = ("import torch.nn.functional as _F\n_F.scaled_dot_product_attention = getattr("
            "_F.scaled_dot_product_attention, '__wrapped__', _F.scaled_dot_product_attention)\n")
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n" + code), *SDPA])
    (check,) = forbidding.grade(sub, ("attention",)).checks
    assert check.score == 0, [vars(p) for p in check.parts]
    assert any("removed the grader's watch on torch.nn.functional.scaled_dot_product_attention" in m
               for m in check.messages), check.messages


@pytest.mark.parametrize("entry, problem", [
    ({"attention": ["torch.nn.functional.scaled_dot_prod_attention"]}, "has no attribute 'scaled_dot_prod_attention'"),
    ({"attention": ["no_such_package.thing"]}, "no importable module 'no_such_package'"),
    ({"attentoin": ["torch.nn.MultiheadAttention"]}, "unknown check 'attentoin'"),
    ({"*": "torch.nn.MultiheadAttention"}, "must be a list of dotted names"),
    ({"*": ["torch.Tensor.softmax x"]}, "is not a dotted name"),
    ({"*": ["torch._C.TensorBase.softmax"]}, "built-in type whose attributes cannot be replaced"),
])
def test_a_forbidden_calls_entry_that_cannot_be_watched_is_refused_by_name(tmp_path, entry, problem):
    import json

    from grading.grader import DEFAULT_RUBRIC, RubricError, load_rubric

    rubric = json.loads(DEFAULT_RUBRIC.read_text())
    rubric["forbidden_calls"] = entry
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    with pytest.raises(RubricError, match="forbidden_calls") as e:
        load_rubric(path)
    assert problem in str(e.value), str(e.value)
