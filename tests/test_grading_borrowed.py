"""Issue 36, "links and borrowed code": the check's process cannot reach the grader's own classes.

A submission whose attention, layer and embed() delegate to the grader's in-process stand-ins (found through
sys.modules, the probe's frame, the garbage collector or the grader's files) scored 60/100 on the untouched starter
(28/100) before: the stand-ins a check grades with are now loaded only into the checks that need them (the layer's
reference attention, the model's reference layers and embed()), and the grader's checkout is hidden from the check.
"""
from __future__ import annotations

import pytest
from test_grading import STARTER

from grading.example import write_submission
from grading.grader import Grader
from grading.sandbox import Limits

STARTER_EARNS = 28  # the course gives GPT2Model.forward (10) and from_pretrained (18)

# Every way a student has found to the grader's objects: the fork server's modules (sys.modules['__main__'] holds
# the probe module), the frames of the probe that calls the submission, the garbage collector, and the grader's own
# files (the fork server's __file__ names its folder).
FIND = '''

def _grader_object(name):
    import gc, os, sys

    def in_modules():
        for mod in list(vars(sys.modules["__main__"]).values()) + list(sys.modules.values()):
            if name in getattr(mod, "__dict__", {}):
                return mod.__dict__[name]

    def in_frames():
        f = sys._getframe(1)
        while f is not None:
            if name in f.f_globals:
                return f.f_globals[name]
            f = f.f_back

    def in_gc():
        for o in gc.get_objects():
            try:
                if getattr(o, "__name__", None) == name and callable(o):
                    return o
                if isinstance(o, dict) and callable(o.get(name)):
                    return o[name]
            except Exception:  # objects whose attributes raise
                pass

    def in_files():
        here = os.path.dirname(os.path.abspath(sys.modules["__main__"].__file__))
        for folder in (here, os.path.join(os.path.dirname(here), "grading")):
            for f in sorted(os.listdir(folder)):
                text = open(os.path.join(folder, f)).read() if f.endswith(".py") else ""
                if f"class {name}(" in text or f"def {name}(" in text:
                    ns = {"__name__": "borrowed_" + f[:-3]}
                    exec(compile(text, f, "exec"), ns)
                    return ns[name]

    for way, look in (("sys.modules", in_modules), ("the probe's frames", in_frames), ("gc", in_gc),
                      ("the grader's files", in_files)):
        try:
            found = look()
        except Exception as e:
            print("LOOKED", name, "in", way, type(e).__name__, e, flush=True)
            found = None
        if found is not None:
            print("BORROWED", name, "via", way, flush=True)
            return found
    print("NOT FOUND", name, flush=True)
    raise NotImplementedError(f"{name}: not reachable")
'''
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

