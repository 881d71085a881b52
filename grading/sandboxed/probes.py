"""What runs inside the sandbox: import the submission, drive one component on the grader's inputs, write outputs.

Loaded by grading/sandboxed/zygote.py in a child process whose import path starts at a copy of the submission. The grader's
inputs and weights (grading/questions.py, drawn from a secret seed) arrive as a read-only safetensors file; the
probe installs the weights into the submission's modules and writes only what the submission computed:
`result/tensors.safetensors` (read back by the grader without unpickling, against the shapes it expects) and
`result/info.json` ({'status': 'ok' | 'not_implemented' | 'error', 'message', 'notes', 'values'}). Nothing here is
trusted: the submission runs in this process and may rewrite any of it; the grader compares what comes back with
the reference it computes from its own inputs.

A projection that is not a plain nn.Linear (a LoRA wrapper, say) is replaced by one carrying the grader's weights,
so it grades like the course's nn.Linear. The weights a loader puts in place (from_pretrained) are read back as
*effective affine maps* (each projection probed with zeros and the identity).
"""
import contextlib
import importlib
import inspect
import json
import math
import os
import signal
import sys
import traceback

import torch
from torch import nn

# Tiny sizes: head dim 8 >= T, so a one-hot value per key position reads the attention probabilities out directly.
D, H, L, V, P, T = 32, 4, 2, 97, 16, 7
HD = D // H
MASKS = {  # 1 = real token; the right-padded batch is the one the course's models see
    "nopad": [[1] * T] * 3,
    "right": [[1] * T, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4],
    "left": [[1] * T, [0] * 2 + [1] * 5, [0] * 4 + [1] * 3],
}
DROPOUT_P = 0.5


class NotImplementedProbe(Exception):
    """The submission left a TODO: NotImplementedError, or None where a tensor is due."""


class Deviation(Exception):
    """An interface the grader cannot drive as the course defines it (signature, shape, missing name)."""


# The stand-ins this check grades with (grading/sandboxed/standins.py: the layer check's attention, the model check's layers and
# embed()), set by the fork server for the checks that need them; None in the others, so the submission's code in the
# attention or embed check finds no stand-in to call.
STANDINS = None
# The rubric's forbidden calls for this check (grading/sandboxed/forbidden.py's Recorder, set by the fork server before the
# submission is imported), or None when it lists none: `graded(part)` tells it which part the code running serves.
FORBIDDEN = None


@contextlib.contextmanager
def graded(part_name):
    """The submission's code run inside serves the rubric part `part_name` (None: a run that grades nothing): a
    forbidden call made there is recorded against that part."""
    if FORBIDDEN is None:
        yield
        return
    outer, FORBIDDEN.part = FORBIDDEN.part, part_name
    try:
        yield
    finally:
        FORBIDDEN.part = outer

LAYOUT_CAP_S, INFORMATION_CAP_S = 2.0, 5.0  # runs of the submission's code that grade nothing: never wait longer


class OverCap(BaseException):
    """A run of the submission's code that grades nothing went past its cap (BaseException: an `except Exception`
    in the submission does not swallow it)."""


@contextlib.contextmanager
def capped(seconds: float):
    """Raise OverCap in this (the main) thread after `seconds` of wall time: a Python loop in the submission stops
    here instead of spending the check's deadline on a run whose result costs or earns nothing."""
    def stop(signum, frame):
        raise OverCap(f"did not return within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def masks():
    return {k: torch.tensor(v) for k, v in MASKS.items()}


# ---- building the submission's objects --------------------------------------------------------------------------

def load(module, name):
    try:
        mod = importlib.import_module(module)
    except NotImplementedError as e:
        raise NotImplementedProbe(f"importing {module} raised NotImplementedError: {e}") from e
    if not hasattr(mod, name):
        raise Deviation(f"{module}.py defines no {name}")
    return getattr(mod, name)


def make_config(**over):
    kw = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=4 * D,
              max_position_embeddings=P, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              layer_norm_eps=1e-5, pad_token_id=0)  # the course's pad id 50256 would not fit this vocabulary
    kw.update(over)
    cls = load("config", "GPT2Config")
    try:
        cfg = cls(**kw)
    except TypeError:  # a config whose __init__ takes other names: build the default one and set the fields
        cfg = cls()
    for k, v in kw.items():  # some configs drop unknown kwargs or derive fields; force the course's values
        if getattr(cfg, k, None) != v:
            setattr(cfg, k, v)
    return cfg


def construct(cls, cfg):
    try:
        return cls(cfg)
    except NotImplementedError as e:
        raise NotImplementedProbe(f"{cls.__name__}(config) raised NotImplementedError") from e


def randomize(module, seed):
    """Every parameter random (LayerNorm gains near 1), so no mis-mapped bias hides behind a zero."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, nn.LayerNorm) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif isinstance(owner, nn.Embedding):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def tensor_out(value, what):
    """The tensor a method returned, refusing None (a TODO) and non-tensors."""
    if value is None:
        raise NotImplementedProbe(f"{what} returned None")
    if isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):
        value = value[0]
    if not torch.is_tensor(value):
        raise Deviation(f"{what} returned {type(value).__name__}, not a tensor")
    return value.detach().float()


def extended_mask(mask2d, notes):
    """The submission's own utils.get_extended_attention_mask, or the course's formula where it has none."""
    try:
        fn = load("utils", "get_extended_attention_mask")
        return tensor_out(fn(mask2d, torch.float32), "utils.get_extended_attention_mask")
    except (Deviation, ModuleNotFoundError, TypeError) as e:
        notes.append(f"utils.get_extended_attention_mask unusable ({e}); the grader built the course's mask")
        return (1.0 - mask2d[:, None, None, :].float()) * -10000.0


def affine(fn, d_in, what):
    """(W, b) of a module that maps (..., d_in) affinely (Linear, LoRA-wrapped Linear, ...), probed in eval mode."""
    if not callable(fn):
        raise Deviation(f"{what} is not a callable module")
    with torch.no_grad():
        b = tensor_out(fn(torch.zeros(1, 1, d_in)), what)[0, 0]
        w = (tensor_out(fn(torch.eye(d_in)[None]), what)[0] - b).t().contiguous()  # (out, in)
        x = torch.randn(2, 3, d_in, generator=gen(99))
        if not torch.allclose(tensor_out(fn(x), what), x @ w.t() + b, atol=1e-4):
            raise Deviation(f"{what} is not an affine map in eval mode")
    return w, b


def child(module, name, what):
    if not hasattr(module, name):
        names = ", ".join(n for n, _ in module.named_children())
        raise Deviation(f"{what} has no `{name}` (its submodules: {names})")
    return getattr(module, name)


def affine_is(fn, w, b):
    """Does fn compute x @ w.T + b (eval mode)?"""
    x = torch.randn(2, 3, w.shape[1], generator=gen(97))
    try:
        with torch.no_grad():
            y = fn(x)
        return torch.is_tensor(y) and y.shape == (2, 3, w.shape[0]) and \
            torch.allclose(y.float(), x @ w.t() + b, atol=1e-5)
    except Exception:  # noqa: BLE001  (not an affine map we can drive)
        return False


def install_affine(owner, name, w, b, what, notes):
    """Put the grader's (w, b) in owner.name: copied into a plain nn.Linear, else an nn.Linear in its place."""
    m = child(owner, name, what)
    if isinstance(m, nn.Linear) and tuple(m.weight.shape) == tuple(w.shape) and m.bias is not None:
        was = m.training
        with torch.no_grad():
            m.weight.copy_(w)
            m.bias.copy_(b)
        if affine_is(m.eval(), w, b):
            m.train(was)
            return
    lin = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    setattr(owner, name, lin)
    notes.append(f"{what}.{name} is a {type(m).__name__}, not a plain nn.Linear: graded with an nn.Linear carrying "
                 f"the grader's weights in its place")


def install_norm(owner, name, weight, bias, what):
    ln = child(owner, name, what)
    w, b = getattr(ln, "weight", None), getattr(ln, "bias", None)
    if not (torch.is_tensor(w) and torch.is_tensor(b) and w.shape == weight.shape and b.shape == bias.shape):
        raise Deviation(f"{what}.{name} has no weight and bias of shape {tuple(weight.shape)}")
    with torch.no_grad():
        w.copy_(weight)
        b.copy_(bias)


def install_embedding(owner, name, weight, what):
    e = getattr(child(owner, name, what), "weight", None)
    if not (torch.is_tensor(e) and e.shape == weight.shape):
        raise Deviation(f"{what}.{name} has no weight of shape {tuple(weight.shape)}")
    with torch.no_grad():
        e.copy_(weight)


def install_layer(layer, w, notes, prefix=""):
    """The grader's weights (this project's names, under `prefix`) into the submission's GPT2Layer."""
    att = attention_module(layer)
    for n in ("query", "key", "value"):
        k = f"{prefix}self_attention.{n}"
        install_affine(att, n, w[f"{k}.weight"], w[f"{k}.bias"], "CausalSelfAttention", notes)
    for n in ("attention_dense", "interm_dense", "out_dense"):
        install_affine(layer, n, w[f"{prefix}{n}.weight"], w[f"{prefix}{n}.bias"], "GPT2Layer", notes)
    for n in ("attention_layer_norm", "out_layer_norm"):
        install_norm(layer, n, w[f"{prefix}{n}.weight"], w[f"{prefix}{n}.bias"], "GPT2Layer")


def measure_layer(layer, given, out, prefix=""):
    """Its LayerNorms on a small-variance input (the grader reads their eps off the outputs) and its interm_af on
    fixed points (the grader tells exact from tanh GELU); an unusable interm_af is left out."""
    with torch.no_grad():
        for n in ("attention_layer_norm", "out_layer_norm"):
            measure_norm(child(layer, n, "GPT2Layer"), given, out, f"ln.{prefix}{n}")
        fn = getattr(layer, "interm_af", None)
        try:
            y = fn(given["gelu.input"]) if callable(fn) else None
            if torch.is_tensor(y) and y.shape == given["gelu.input"].shape:
                out["gelu" + (f".{prefix[:-1]}" if prefix else "")] = y.detach().float()
        except Exception:  # noqa: BLE001  (then the grader fits the GELU to the outputs)
            pass


def measure_norm(ln, given, out, key):
    """A LayerNorm on the grader's (1, rows, C) input, as the layer would call it; left out if it cannot run."""
    try:
        with torch.no_grad():
            y = tensor_out(ln(given["ln.input"][None]), key)
        if y.shape[1:] == given["ln.input"].shape:
            out[key] = y[0]
    except Exception:  # noqa: BLE001  (the grader then uses eps 1e-5 and says so)
        pass


def attention_module(layer, with_name=False):
    if hasattr(layer, "self_attention"):
        return ("self_attention", layer.self_attention) if with_name else layer.self_attention
    for name, m in layer.named_children():
        if "attention" in type(m).__name__.lower():
            return (name, m) if with_name else m
    raise Deviation("GPT2Layer has no `self_attention` module")


def with_reference_attention(layer, given, notes, prefix=""):
    """Replace the layer's attention by the reference on the grader's weights, so the layer is graded on its own."""
    name, att = attention_module(layer, with_name=True)
    w = {k[len(prefix) + len("self_attention."):]: v for k, v in given.items()
         if k.startswith(prefix + "self_attention.")}
    unmerged = False
    try:  # keep the layout the layer expects from its attention: (B, T, D) or the heads unmerged
        with torch.no_grad(), capped(LAYOUT_CAP_S), graded(None):
            y = att.eval()(torch.randn(1, T, D, generator=gen(98)), torch.zeros(1, 1, 1, T))
        unmerged = torch.is_tensor(y) and y.dim() == 4
    except OverCap as e:  # a hanging attention costs the attention check, not this one
        notes.append(f"its attention {e} (the layout probe): the course's layout assumed")
    except Exception:  # noqa: BLE001  (a broken attention: the course's layout)
        pass
    if unmerged:  # only where its layer takes them: a layer written to the course's (B, T, C) gets that
        setattr(layer, name, STANDINS.RefAttention(w, H, True))
        try:
            with torch.no_grad(), capped(LAYOUT_CAP_S), graded(None):
                layer(torch.randn(1, T, D, generator=gen(98)), torch.zeros(1, 1, 1, T))
            notes.append("its attention returns the heads unmerged (B, h, T, hd) and its layer takes them so: "
                         "graded with a reference attention in that layout")
        except OverCap as e:
            unmerged = False
            notes.append(f"its layer {e} (the layout probe): the course's layout assumed")
        except Exception:  # noqa: BLE001  (its layer takes the course's (B, T, C))
            unmerged = False
    setattr(layer, name, STANDINS.RefAttention(w, H, unmerged))
    notes.append("graded with the reference attention in place of the submission's (the attention check grades it)")


def raised_at(e: BaseException) -> str:
    """Where in the submission an exception came from: its innermost frame in the submission's folder (the check's
    working directory) and, when the error came from a library call there, that line: " (at models/gpt2.py:120, in
    `torch.load(...)`)". A bare "IndexError: pop from empty list" from unpickling a garbage checkpoint named no file."""
    frames = traceback.extract_tb(e.__traceback__)
    here = os.getcwd() + os.sep
    own = [f for f in frames if os.path.abspath(f.filename).startswith(here)]
    if not own:
        return ""
    last = own[-1]
    where = f" (at {os.path.relpath(last.filename)}:{last.lineno}"
    if frames[-1] is not last and last.line:
        where += f", in `{last.line.strip()[:120]}`"
    return where + ")"


def part(values, name, fn):
    """Run one graded part; a TODO or a deviation there costs that part only (recorded in values['parts'])."""
    try:
        with graded(name):
            fn()
    except (NotImplementedProbe, NotImplementedError) as e:
        values.setdefault("parts", {})[name] = f"not implemented: {e or type(e).__name__}"
    except Deviation as e:
        values.setdefault("parts", {})[name] = f"error: {e}"
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001  (the submission's error in this part is this part's finding)
        values.setdefault("parts", {})[name] = \
            f"error: the submission raised {type(e).__name__}: {e}{raised_at(e)}"[:2000]


def heads(x):
    return x.view(x.shape[0], x.shape[1], H, HD).transpose(1, 2)  # (B, h, T, hd)


# ---- probes: each gets the grader's tensors (`given`) and fills `out` with the submission's outputs only --------

STAND_IN = {"eps_attn": 1e-5, "eps_mlp": 1e-5, "activation": "tanh"}  # the reference layers' choices in the model probe


def probe_attention(given, out, notes, values):
    cfg = make_config()
    cls = load("modules.attention", "CausalSelfAttention")
    att = construct(cls, cfg)
    randomize(att, 1)  # parameters the grader does not set (extra ones of the submission's) are random, not zero
    for name in ("query", "key", "value"):
        install_affine(att, name, given[f"{name}.weight"], given[f"{name}.bias"], "CausalSelfAttention", notes)
    att.eval()
    x = given["x"]
    with torch.no_grad():
        with graded("forward"):
            for case, m in masks().items():  # as returned: the grader judges the shape (the course's: (B, T, C))
                out[f"forward.{case}"] = tensor_out(att(x, extended_mask(m, notes)), "CausalSelfAttention.forward")
        # attention() on its own, with q/k/v in the course's (B, h, T, hd) layout
        q, k, v = (heads(x @ given[f"{n}.weight"].t() + given[f"{n}.bias"]) for n in ("query", "key", "value"))
        try:
            with graded("attention"):
                out["attention.left"] = tensor_out(att.attention(k, q, v, extended_mask(masks()["left"], notes)),
                                                   "attention()")
        except (TypeError, AttributeError, Deviation) as e:
            notes.append(f"attention() could not be called as attention(key, query, value, mask) ({e}); "
                         f"graded through forward()")
    probe_attention_training(given, cls, out, notes, values)


def probe_attention_training(given, cls, out, notes, values):
    """Attention probabilities in training mode with dropout on: values are one-hot key positions, so the output
    of head h at query i is row i of its (dropped-out) probability matrix."""
    att = construct(cls, make_config(attention_probs_dropout_prob=DROPOUT_P))
    randomize(att, 3)
    for name in ("query", "key", "value"):
        install_affine(att, name, given[f"{name}.weight"], given[f"{name}.bias"], "CausalSelfAttention", [])
    q, k = given["train.q"], given["train.k"]
    v = torch.zeros(q.shape[0], H, T, HD)
    v[..., :T] = torch.eye(T)
    ext = extended_mask(masks()["right"], notes)
    route = "attention()"
    try:
        run = lambda: att.attention(k, q, v, ext)  # noqa: E731
        att.eval()
        with torch.no_grad(), graded("training"):
            tensor_out(run(), "attention()")
    except (TypeError, AttributeError, Deviation):
        # Through forward(): the grader's input carries a one-hot position in its first T features and `value` is
        # replaced by a Linear that copies them into every head.
        route = "forward()"
        lin = nn.Linear(D, D)
        with torch.no_grad():
            lin.weight.zero_()
            lin.bias.zero_()
            for h in range(H):
                lin.weight[h * HD + torch.arange(T), torch.arange(T)] = 1.0
        att.value = lin
        run = lambda: att(given["train.x"], ext)  # noqa: E731
    with torch.no_grad(), graded("training"):
        att.eval()
        probs = {"eval": run()}
        att.train()
        torch.manual_seed(5)
        probs["train"] = run()
    for mode, y in probs.items():
        y = tensor_out(y, f"{route} ({mode} mode)")
        if y.dim() == 3:
            y = heads(y)
        out[f"probs.{mode}"] = y[..., :T].contiguous()  # (B, h, T_query, T_key)
    values["probs_route"] = route  # which of the grader's two inputs the probabilities answer


class MaskedDropout(nn.Module):
    """A residual dropout with the grader's mask: the layer's training-mode output is then the grader's to compute."""

    def __init__(self, mask, name):
        super().__init__()
        self.mask, self.name = mask, name

    def forward(self, x):
        if not self.training:
            return x
        if x.shape != self.mask.shape:
            raise Deviation(f"{self.name} was applied to a tensor of shape {tuple(x.shape)}, not to the "
                            f"{tuple(self.mask.shape)} output of its dense layer")
        return x * self.mask / (1 - DROPOUT_P)


def probe_layer(given, out, notes, values):
    layer = construct(load("modules.gpt2_layer", "GPT2Layer"), make_config())
    randomize(layer, 11)
    install_layer(layer, given, notes)
    layer.eval()
    with graded("forward"):  # its LayerNorms' eps and its GELU pick forward()'s reference
        measure_layer(layer, given, out)
    own = attention_module(layer, with_name=True)
    with_reference_attention(layer, given, notes)
    x = given["x"]
    try:
        with torch.no_grad(), graded("forward"):
            layer(x, extended_mask(masks()["nopad"], []))
    except TypeError as e:  # it calls its attention with another interface: its own attention, said so
        if "RefAttention" not in str(e):
            raise
        setattr(layer, *own)
        notes[-1] = (f"its layer calls the attention with another interface ({e}): graded with its own attention, "
                     f"so attention bugs also show here")
    with torch.no_grad():
        with graded("forward"):
            for case, m in masks().items():
                out[f"forward.{case}"] = tensor_out(layer(x, extended_mask(m, notes)), "GPT2Layer.forward")
        try:
            with graded("add"):
                y = layer.add(given["add.input"], given["add.output"], layer.attention_dense, layer.attention_dropout)
            out["add"] = tensor_out(y, "GPT2Layer.add")
        except (TypeError, AttributeError) as e:
            notes.append(f"add(input, output, dense_layer, dropout) could not be called ({e}); graded through forward()")

    def training():
        """Training mode, each residual dropout replaced by the grader's mask."""
        for drop, mask in (("attention_dropout", "train.mask_attention"), ("out_dropout", "train.mask_out")):
            try:
                child(layer, drop, "GPT2Layer")
            except Deviation as e:
                raise Deviation(f"skipped: {e}") from None
            setattr(layer, drop, MaskedDropout(given[mask], drop))
        layer.train()
        with torch.no_grad():
            out["train"] = tensor_out(layer(x, extended_mask(masks()["nopad"], [])), "GPT2Layer.forward (training)")
    part(values, "training", training)


def run_model(model, ids, mask, out, prefix):
    with torch.no_grad():
        res = model(ids, mask)
    if res is None:
        raise NotImplementedProbe("GPT2Model.forward returned None")
    if not isinstance(res, dict) or "last_hidden_state" not in res or "last_token" not in res:
        raise Deviation("GPT2Model.forward must return a dict with 'last_hidden_state' and 'last_token'")
    out[f"{prefix}last_hidden_state"] = tensor_out(res["last_hidden_state"], "forward()['last_hidden_state']")
    out[f"{prefix}last_token"] = tensor_out(res["last_token"], "forward()['last_token']")


def embedding_model(given, seed, **config):
    model = construct(load("models.gpt2", "GPT2Model"), make_config(**config))
    randomize(model, seed)
    for name in ("word_embedding", "pos_embedding"):
        install_embedding(model, name, given[f"{name}.weight"], "GPT2Model")
    return model


def probe_embed(given, out, notes, values):
    ids = given["ids"].long()
    model = embedding_model(given, 31).eval()
    with torch.no_grad(), graded("embed"):
        out["embed"] = tensor_out(model.embed(ids), "GPT2Model.embed")
    # training mode with dropout 0.5: every entry must be dropped (0) or scaled by 1/(1-p), some dropped
    model = embedding_model(given, 31, hidden_dropout_prob=DROPOUT_P).train()
    torch.manual_seed(33)
    with torch.no_grad(), graded("training"):
        out["embed.train"] = tensor_out(model.embed(ids), "GPT2Model.embed (training mode)")


def probe_model(given, out, notes, values):
    model = embedding_model(given, 21)
    layers = child(model, "gpt_layers", "GPT2Model")
    if len(layers) != L:
        raise Deviation(f"GPT2Model built {len(layers)} layers for num_hidden_layers={L}")
    for i, layer in enumerate(layers):
        install_layer(layer, given, notes, f"gpt_layers.{i}.")
        with graded("forward"):  # its layers' eps and GELU, where forward() falls back to them
            measure_layer(layer, given, out, f"gpt_layers.{i}.")
    install_norm(model, "final_layer_norm", given["final_layer_norm.weight"], given["final_layer_norm.bias"],
                 "GPT2Model")
    model.eval()
    with graded("forward"):
        measure_norm(model.final_layer_norm, given, out, "ln.final_layer_norm")
    # The model's own code on reference layers and embed(): their bugs cost their own checks, not this one.
    own = list(layers)
    for i in range(len(layers)):
        w = {k[len(f"gpt_layers.{i}."):]: x for k, x in given.items() if k.startswith(f"gpt_layers.{i}.")}
        layers[i] = STANDINS.RefLayer(w, STAND_IN, H)
    model.embed = STANDINS.ref_embed(model)
    notes.append("graded with reference layers and a reference embed() in place of the submission's "
                 "(the layer and embed checks grade those)")
    ids, mask = given["ids"].long(), masks()["right"]

    def forward():
        try:
            run_model(model, ids, mask, out, "")
        except TypeError as e:  # its layers or embed() take another interface: its own components, said so
            if "Ref" not in str(e) and "embed()" not in str(e):
                raise
            for i, layer in enumerate(own):
                layers[i] = layer
            del model.embed
            values["own_components"] = True
            notes.append(f"its forward() calls layers or embed() with another interface ({e}): graded with its own "
                         f"layers and embed(), so their bugs also show here")
            run_model(model, ids, mask, out, "")
    part(values, "forward", forward)
    h = given["head.input"]  # the head on the grader's input: a missing forward() costs it nothing

    def head():
        with torch.no_grad():
            out["logits"] = tensor_out(model.hidden_state_to_token(h), "hidden_state_to_token")
            install_embedding(model, "word_embedding", given["head.word_embedding"], "GPT2Model")
            out["logits.tied"] = tensor_out(model.hidden_state_to_token(h), "hidden_state_to_token")  # tied: follows
    part(values, "hidden_state_to_token", head)


def loaded_weights(model, out):
    """The weights a loader put in place, as effective maps under this project's names (what the grader compares)."""
    for name in ("word_embedding", "pos_embedding"):
        out[f"{name}.weight"] = child(model, name, "GPT2Model").weight.detach().float().clone()
    for i, layer in enumerate(child(model, "gpt_layers", "GPT2Model")):
        p, att = f"gpt_layers.{i}.", attention_module(layer)
        for name in ("query", "key", "value"):
            w, b = affine(child(att, name, "CausalSelfAttention"), D, f"self_attention.{name}")
            out[f"{p}self_attention.{name}.weight"], out[f"{p}self_attention.{name}.bias"] = w, b
        for name, d_in in (("attention_dense", D), ("interm_dense", D), ("out_dense", None)):
            d_in = d_in or out[f"{p}interm_dense.weight"].shape[0]
            out[f"{p}{name}.weight"], out[f"{p}{name}.bias"] = affine(child(layer, name, "GPT2Layer"), d_in, name)
        for name in ("attention_layer_norm", "out_layer_norm"):
            ln = child(layer, name, "GPT2Layer")
            out[f"{p}{name}.weight"], out[f"{p}{name}.bias"] = (ln.weight.detach().float().clone(),
                                                                ln.bias.detach().float().clone())
    ln = child(model, "final_layer_norm", "GPT2Model")
    out["final_layer_norm.weight"], out["final_layer_norm.bias"] = (ln.weight.detach().float().clone(),
                                                                    ln.bias.detach().float().clone())


def probe_from_pretrained(given, out, notes, values):
    cls = load("models.gpt2", "GPT2Model")
    fp = getattr(cls, "from_pretrained", None)
    if fp is None:
        raise Deviation("GPT2Model has no from_pretrained")
    size = dict(d=D, l=L, num_heads=H)
    try:
        params = inspect.signature(fp).parameters
    except (TypeError, ValueError):
        params = {}
    with graded("from_pretrained"):
        if all(k in params for k in size):
            model = fp(model="gpt2", **size) if "model" in params else fp("gpt2", **size)
        else:
            notes.append(f"from_pretrained takes {list(params)}, not (model, d, l, num_heads); called as "
                         f"from_pretrained('gpt2')")
            model = fp("gpt2")
        if model is None:
            raise NotImplementedProbe("from_pretrained returned None")
        model.eval()
        loaded_weights(model, out)
    ids = given["ids"].long()

    def outputs():  # information only: capped, so a hang elsewhere in the model costs this check nothing
        try:
            with capped(INFORMATION_CAP_S), graded(None):
                run_model(model, ids, masks()["right"], out, "")
        except OverCap as e:
            raise Deviation(f"the loaded model's forward {e} (information only, not graded)") from None
    part(values, "outputs", outputs)


def probe_adamw(given, out, notes, values):
    import numpy as np

    AdamW = load("optimizer", "AdamW")
    # The course's optimizer_test.py: 1000 steps of a 3 -> 2 linear regression.
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    with graded("course_test"):
        opt = AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, correct_bias=True)
        for _ in range(1000):
            opt.zero_grad()
            x = torch.FloatTensor(rng.uniform(size=[model.in_features]))
            y = torch.Tensor([x[0] + x[1], -x[2]])
            ((y - model(x)) ** 2).sum().backward()
            opt.step()
    out["course.weight"] = model.weight.detach().clone()
    # The grader's net and batches, replayed by the grader with torch.optim.AdamW (two parameter groups, each with
    # its own lr, decay on one; see adamw_groups).
    net = adamw_net(given)
    with graded("torch_adamw"):
        opt = AdamW(adamw_groups(net), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
        for x, y in zip(given["x"], given["y"]):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
    for n, p in net.named_parameters():
        out[f"torch.{n}"] = p.detach().clone()


def adamw_net(given):
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(given[f"init.{n}"])
    return net


def adamw_groups(net):
    # Decay with a small lr on the first group: a decay scaled by the bias-corrected step (a real submission's bug)
    # moves the weights by about 0.06 * wd * |p| over 200 steps, 60x the tolerance, while decaying before or after
    # the update (both AdamW) differs by at most steps * lr^2 * wd = 2e-7. With lr 1e-3, wd 1e-3 that bug passed
    # on about 1 question in 7 (simulated over 150 secret seeds; 0 of 150 here, and no false alarm on either order).
    return [{"params": list(net[0].parameters()), "weight_decay": 0.1, "lr": 1e-4},
            {"params": list(net[2].parameters()), "weight_decay": 0.0, "lr": 3e-3}]


IMPORT_ORDER = ("config", "utils", "modules.attention", "modules.gpt2_layer", "models.gpt2", "optimizer")


class _ImportLog:
    """A finder that only logs: each of the submission's graded modules, when an import of it starts (config
    importing utils logs utils), so the last "importing" line names the module that hung, not the one that asked."""

    def find_spec(self, name, path=None, target=None):
        if name in IMPORT_ORDER and name not in sys.modules:
            print(f"grading: importing {name}", flush=True)
        return None  # the real finders do the work


def probe_imports(given, out, notes, values):
    """Import each graded module once, in dependency order; a failure is recorded and the next one tried. Progress
    goes to stdout, so a hang is located by the last "importing" line the grader reads back."""
    values["imports"] = {}
    sys.meta_path.insert(0, _ImportLog())
    for mod in IMPORT_ORDER:
        print(f"grading: importing {mod}", flush=True)
        try:
            importlib.import_module(mod)
            values["imports"][mod] = "ok"
        except NotImplementedError as e:
            values["imports"][mod] = f"not_implemented: importing {mod} raised NotImplementedError: {e}"
        except SystemExit as e:
            values["imports"][mod] = f"error: importing {mod}: the submission called sys.exit({e.code!r})"
        except Exception as e:  # noqa: BLE001
            values["imports"][mod] = f"error: {type(e).__name__}: {e}"[:2000]
    print("grading: imports done", flush=True)


PROBES = {"imports": probe_imports, "attention": probe_attention, "layer": probe_layer, "embed": probe_embed,
          "model": probe_model, "from_pretrained": probe_from_pretrained, "adamw": probe_adamw}


def main(name, resultdir, args, given_path=None):
    """Run one probe on the grader's tensors (read before any of the submission's code runs); always write
    info.json. Returns the process exit code."""
    import safetensors.torch

    out, notes, values = {}, [], {}
    info = {"status": "ok", "message": "", "notes": notes, "values": values}
    given = safetensors.torch.load_file(given_path) if given_path else {}
    torch.manual_seed(0)
    try:
        PROBES[name](given, out, notes, values)
    except NotImplementedProbe as e:
        info.update(status="not_implemented", message=str(e))
    except NotImplementedError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}()"
        info.update(status="not_implemented", message=f"NotImplementedError raised at {where}")
    except Deviation as e:
        info.update(status="error", message=str(e))
    except SystemExit as e:
        info.update(status="error", message=f"the submission called sys.exit({e.code!r})")
    except MemoryError:
        info.update(status="error", message="out of memory (the sandbox's memory limit)")
    except BaseException as e:  # noqa: BLE001  (whatever the submission raises is a finding, not our crash)
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        info.update(status="error", message=f"{type(e).__name__}: {e}{raised_at(e)}", traceback="".join(tb)[-4000:])
        if any(word in str(e).lower() for word in ("cuda", "nvidia")):  # a CPU build's words, then a CUDA build's
            info["device"] = "a hard-coded CUDA device: the code asks for 'cuda' on a machine without a GPU"
        if "memory" in str(e).lower() or "alloc" in str(e).lower():
            info["message"] += " (the sandbox's memory limit)"
    if FORBIDDEN is not None:  # always written when watched: a result without it is malformed (grading/checks.py)
        values["forbidden_calls"] = FORBIDDEN.report()
        if FORBIDDEN.unwatched:
            values["forbidden_unwatched"] = FORBIDDEN.unwatched
    if info["status"] == "ok":
        # written into the file the grader made (the result folder is read-only: no temporary file and rename)
        with open(os.path.join(resultdir, "tensors.safetensors"), "wb") as f:
            f.write(safetensors.torch.save({k: v.contiguous() for k, v in out.items()}))
    with open(os.path.join(resultdir, "info.json"), "w") as f:
        json.dump(info, f)
    return 0
