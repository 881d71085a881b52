"""Issue 29: the score cannot be forged. Hostile submissions that walk the stack to the probe and write their own
results (all-zero weights whose reference is zero, outputs to match, a sandbox report of their choosing), a garbage
result and an oversized one: each forged check scores 0, and everything else is graded as before."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from test_grading import STARTER

from grading.example import write_submission
from grading.grader import Grader
from grading.sandbox import Limits

# What a student reads in grading/sandboxed/probes.py: where the probe keeps its result folder, and what the grader expects.
FORGE = '''
import json as _json, os as _os, sys as _sys
import torch as _torch


def _probe_frame():
    f = _sys._getframe(1)
    while f is not None and not isinstance(f.f_locals.get("resultdir"), str):
        f = f.f_back
    return f


def _zero_layer(t, p, D=32, I=128):
    for n, o, i in (("self_attention.query", D, D), ("self_attention.key", D, D), ("self_attention.value", D, D),
                    ("attention_dense", D, D), ("interm_dense", I, D), ("out_dense", D, I)):
        t[p + n + ".weight"], t[p + n + ".bias"] = _torch.zeros(o, i), _torch.zeros(o)
    for n in ("attention_layer_norm", "out_layer_norm"):
        t[p + n + ".weight"], t[p + n + ".bias"] = _torch.zeros(D), _torch.zeros(D)


def _forge():
    f = _probe_frame()
    if f is None:
        return
    probe, where = f.f_locals.get("name"), f.f_locals["resultdir"]
    print("FORGED", probe, flush=True)
    B, T, D, H, V, P = 3, 7, 32, 4, 97, 16
    z = _torch.zeros
    info = {"eps_attn": 1e-5, "eps_mlp": 1e-5, "activation": "exact"}
    t, v = {}, {}
    if probe == "imports":
        v["imports"] = {m: "ok" for m in ("config", "utils", "modules.attention", "modules.gpt2_layer",
                                          "models.gpt2", "optimizer")}
    elif probe == "attention":
        for n in ("query", "key", "value"):
            t[n + ".weight"], t[n + ".bias"] = z(D, D), z(D)
        t["x"] = z(B, T, D)
        for c in ("nopad", "right", "left"):
            t["forward." + c] = z(B, T, D)
        t["attention.left"] = z(B, T, D)
        m = _torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4]).bool()
        allowed = (_torch.ones(T, T).tril().bool() & m[:, None, None, :]).expand(B, H, T, T).float()
        pe = allowed / allowed.sum(-1, keepdim=True)  # zero weights: uniform over the allowed keys
        keep = (_torch.arange(T)[:, None] + _torch.arange(T)[None, :]) % 2 == 0
        t["probs.eval"], t["probs.train"] = pe, pe * 2 * keep
        v.update(probs_route="attention()", dropout_p=0.5)
    elif probe == "layer":
        _zero_layer(t, "")
        for k in ("x", "forward.nopad", "forward.right", "forward.left", "add.input", "add.output", "add"):
            t[k] = z(B, T, D)
        v.update(info, dropout_placement={"attention_dropout": "ok", "out_dropout": "ok"})
    elif probe == "embed":
        t["word_embedding.weight"], t["pos_embedding.weight"], t["ids"] = z(V, D), z(P, D), z(B, T)
        t["embed"], t["embed.eval"] = z(B, T, D), _torch.ones(B, T, D)
        t["embed.train"] = 2 * (_torch.arange(B * T * D).reshape(B, T, D) % 2).float()
        v["dropout_p"] = 0.5
    elif probe in ("model", "from_pretrained"):
        t["word_embedding.weight"], t["pos_embedding.weight"] = z(V, D), z(P, D)
        for i in range(2):
            _zero_layer(t, f"gpt_layers.{i}.")
        t["final_layer_norm.weight"], t["final_layer_norm.bias"] = z(D), z(D)
        t["ids"], t["mask"] = z(B, T), _torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4]).float()
        t["last_hidden_state"], t["last_token"], t["head.input"], t["logits"] = z(B, T, D), z(B, D), z(B, T, D), z(B, T, V)
        v.update(layers=[info, info], eps_final=1e-5, n_layer=2, head_follows_word_embedding=True)
    else:
        return
    if t:
        from safetensors.torch import save_file
        save_file(t, _os.path.join(where, "tensors.safetensors"))
    with open(_os.path.join(where, "info.json"), "w") as out:
        _json.dump({"status": "ok", "message": "", "notes": ["FORGED"], "values": v}, out)
    with open(_os.path.join(where, "sandbox.json"), "w") as out:
        _json.dump({"network": "FORGED isolated", "uid": 12345}, out)
    _os._exit(0)


_forge()
'''


@pytest.fixture(scope="module")
def grader():
    with Grader(limits=Limits(timeout=30)) as g:
        yield g


def scores(report):
    return {c.name: c.score for c in report.checks}


def details(report):
    return {c.name: (c.score, c.messages[:3], [p.message for p in c.parts]) for c in report.checks}


def test_stack_walking_forge_on_the_untouched_starter_scores_zero(grader, tmp_path):
    sub = write_submission(tmp_path / "sub", **STARTER, utils=[("import torch\n", "import torch\n" + FORGE)])
    report = grader.grade(sub)
    forged = [c.name for c in report.checks if "FORGED" in c.output]
    assert set(forged) == {"attention", "layer", "embed", "model", "from_pretrained"}, forged  # the forge ran
    assert report.total == 0, details(report)


def test_the_sandbox_field_cannot_be_set_by_the_submission(grader, tmp_path):
    """The same forge also writes sandbox.json ("network: FORGED isolated", another uid) where the child used to."""
    sub = write_submission(tmp_path / "sub", **STARTER, utils=[("import torch\n", "import torch\n" + FORGE)])
    report = grader.grade(sub, ("attention",))
    assert "FORGED" in report.checks[0].output, report.checks[0].output
    assert "FORGED" not in json.dumps(report.sandbox) and report.sandbox.get("network"), report.sandbox
    if grader.sandbox.uid is not None:
        assert report.sandbox["uid"] == grader.sandbox.uid, report.sandbox


ZERO_OUT = '''
    def _zero_the_probe(self, like):
        import sys
        f = sys._getframe(1)
        while f is not None and not isinstance(f.f_locals.get("out"), dict):
            f = f.f_back
        if f is not None:
            for k, x in f.f_locals["out"].items():
                if hasattr(x, "zero_"):
                    x.zero_()
            print("ZEROED", sorted(f.f_locals["out"]), flush=True)
        return like * 0

    def add(self, input, output, dense_layer, dropout):
        return self._zero_the_probe(input)

    def forward(self, hidden_states, attention_mask):
        return self._zero_the_probe(hidden_states)
'''


def test_zero_weights_and_zero_outputs_score_zero_on_that_check(grader, tmp_path):
    """A correct submission whose layer, when called, zeroes every tensor the probe holds and answers zeros."""
    last = "        return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)\n"
    sub = write_submission(tmp_path / "sub", layer=[(last, last + ZERO_OUT)])
    report = grader.grade(sub, ("attention", "layer"))
    layer = next(c for c in report.checks if c.name == "layer")
    assert "ZEROED" in layer.output, layer.output
    assert scores(report) == {"attention": 16, "layer": 0}, details(report)


def exits_with(code_for_attention: str) -> str:
    """Module code that, in the attention check only, writes an 'ok' result of its own and leaves."""
    return ("import os as _os, sys as _sys\n_f = _sys._getframe(0)\n"
            "while _f is not None and not isinstance(_f.f_locals.get('resultdir'), str):\n    _f = _f.f_back\n"
            "if _f is not None and _f.f_locals.get('name') == 'attention':\n"
            "    _where = _f.f_locals['resultdir']\n"
            "    open(_os.path.join(_where, 'info.json'), 'w').write('{\"status\": \"ok\", \"notes\": [], \"values\": {}}')\n"
            + "".join(f"    {line}\n" for line in code_for_attention.splitlines()) +
            "    _os._exit(0)\n")


GARBAGE = {
    "random bytes": "open(_os.path.join(_where, 'tensors.safetensors'), 'wb').write(_os.urandom(4096))",
    "header past the end": ("import json, struct\nh = json.dumps({'forward.nopad': {'dtype': 'F32', 'shape': [1 << 26], "
                            "'data_offsets': [0, 1 << 28]}}).encode()\n"
                            "open(_os.path.join(_where, 'tensors.safetensors'), 'wb').write(struct.pack('<Q', len(h)) + h)"),
    "nested info.json": "open(_os.path.join(_where, 'info.json'), 'w').write('[' * 200000)",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_garbage_result_costs_that_check_only(grader, tmp_path, kind):
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n" + exits_with(GARBAGE[kind]))])
    report = grader.grade(sub, ("attention", "layer", "embed"))
    assert scores(report) == {"attention": 0, "layer": 14, "embed": 8}, details(report)
    attention = report.checks[0]
    assert attention.verdict == "error" and "result" in attention.messages[0], attention.messages


# 150,000 empty tensors: under the byte cap, yet each becomes a tensor object in the grader (hundreds of MB, seconds)
MANY = ("import json, struct\nh = json.dumps({f't{i}': {'dtype': 'F32', 'shape': [0], 'data_offsets': [0, 0]} "
        "for i in range(150000)}).encode()\n"
        "open(_os.path.join(_where, 'tensors.safetensors'), 'wb').write(struct.pack('<Q', len(h)) + h)")
HUGE = "_f = open(_os.path.join(_where, 'tensors.safetensors'), 'wb')\n_f.write(b'x' * (15 << 20))\n_f.close()"


def peak_rss_mb(fn):
    """fn()'s result and the largest growth of this process's resident memory while it ran (sampled)."""
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10

    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.005)
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        return fn(), peak[0]
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("kind", ["many tensors", "over the byte cap"])
def test_an_oversized_result_costs_that_check_only_and_bounds_the_graders_memory(grader, tmp_path, kind):
    code = MANY if kind == "many tensors" else HUGE
    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\n" + exits_with(code))])
    report, grown = peak_rss_mb(lambda: grader.grade(sub, ("attention", "layer")))
    assert scores(report) == {"attention": 0, "layer": 14}, details(report)
    assert report.checks[0].verdict == "error" and "result" in report.checks[0].messages[0], report.checks[0].messages
    assert grown < 100, f"the grader's memory grew by {grown} MB reading one result"


def test_layer_norm_eps_and_gelu_are_measured_from_outputs(grader, tmp_path):
    """Nothing the probe reports picks the reference's eps or GELU: a layer with eps 1e-3 and tanh GELU, whatever its
    config says, is graded with those, read off its outputs on the grader's inputs."""
    sub = write_submission(tmp_path / "sub", layer=[
        ("self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)",
         "self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-3)"),
        ("self.out_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)",
         "self.out_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-3)"),
        ("self.interm_af = F.gelu", "self.interm_af = lambda x: F.gelu(x, approximate='tanh')")])
    (layer,) = grader.grade(sub, ("layer",)).checks
    assert layer.score == 14, details_of(layer)
    assert not any("exact GELU" in i for i in layer.info), layer.info


def details_of(check):
    return check.messages, [vars(p) for p in check.parts]


def test_each_question_is_fresh_and_secret():
    """Two asks of the same check share no tensor: nothing of one check's question tells another's."""
    from grading import questions

    a, b = questions.ask("layer"), questions.ask("layer")
    assert a.keys() == b.keys() and all(not torch.equal(a[k], b[k]) for k in a if k != "gelu.input")
    assert torch.equal(questions.ask("layer", seed=7)["x"], questions.ask("layer", seed=7)["x"])  # seeded: repeatable


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-6, 1e-5, 1e-3])
def test_layer_norm_eps_is_read_off_its_output(eps):
    from grading import checks, questions

    q = questions.ask("layer", seed=3)
    x, gain, bias = q["ln.input"], q["attention_layer_norm.weight"], q["attention_layer_norm.bias"]
    got = checks.measured_eps(torch.nn.functional.layer_norm(x, x.shape[-1:], gain, bias, eps), x, gain, bias)
    assert got is not None and abs(got - eps) <= 1e-3 * eps + 1e-10, got
    assert checks.measured_eps(torch.zeros_like(x), x, gain, bias) is None  # not a LayerNorm's output: no eps
