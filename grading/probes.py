"""What runs inside the sandbox: import the submission, drive one component on fixed random inputs, write tensors.

Loaded by grading/zygote.py in a child process whose import path starts at a copy of the submission. Every probe
writes `result/tensors.safetensors` (read back by the grader without unpickling) and `result/info.json`
({'status': 'ok' | 'not_implemented' | 'error', 'message', 'notes', 'values'}). Nothing is compared here: the
reference lives in the grader's process, out of the submission's reach.

Weights are read back as *effective affine maps* (each projection probed with zeros and the identity), so a
LoRA-wrapped `query` (`query.linear.weight` plus A/B, even a non-zero B) grades like a plain nn.Linear.
"""
import importlib
import inspect
import json
import math
import os
import traceback

import torch
import torch.nn.functional as F
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


def layer_norm(module, name, what, out):
    ln = child(module, name, what)
    out[f"{name}.weight"] = ln.weight.detach().float().clone()
    out[f"{name}.bias"] = ln.bias.detach().float().clone()
    return float(getattr(ln, "eps", 1e-5))


def activation_of(layer):
    """Which GELU the layer's given code uses: 'exact' (the course starter's F.gelu), 'tanh' (GPT-2's), or None."""
    fn = getattr(layer, "interm_af", None)
    if not callable(fn):
        return None
    x = torch.linspace(-4, 4, 101)
    try:
        y = fn(x)
    except Exception:  # noqa: BLE001
        return None
    for name, approx in (("exact", "none"), ("tanh", "tanh")):
        if torch.is_tensor(y) and y.shape == x.shape and torch.allclose(y, F.gelu(x, approximate=approx), atol=1e-6):
            return name
    return "other"


def attention_module(layer, with_name=False):
    if hasattr(layer, "self_attention"):
        return ("self_attention", layer.self_attention) if with_name else layer.self_attention
    for name, m in layer.named_children():
        if "attention" in type(m).__name__.lower():
            return (name, m) if with_name else m
    raise Deviation("GPT2Layer has no `self_attention` module")


def extract_layer(layer, prefix=""):
    """The layer's effective weights under this project's names (CausalSelfAttention / GPT2Layer)."""
    out, info = {}, {}
    att = attention_module(layer)
    for name in ("query", "key", "value"):
        w, b = affine(child(att, name, "CausalSelfAttention"), D, f"self_attention.{name}")
        out[f"self_attention.{name}.weight"], out[f"self_attention.{name}.bias"] = w, b
    for name, d_in in (("attention_dense", D), ("interm_dense", D), ("out_dense", None)):
        m = child(layer, name, "GPT2Layer")
        if d_in is None:
            d_in = out["interm_dense.weight"].shape[0]
        out[f"{name}.weight"], out[f"{name}.bias"] = affine(m, d_in, name)
    info["eps_attn"] = layer_norm(layer, "attention_layer_norm", "GPT2Layer", out)
    info["eps_mlp"] = layer_norm(layer, "out_layer_norm", "GPT2Layer", out)
    info["activation"] = activation_of(layer)
    return {prefix + k: v for k, v in out.items()}, info


class RefAttention(nn.Module):
    """The course's attention on given (W, b): stands in for the submission's when another component is graded."""

    def __init__(self, w, unmerged=False):
        super().__init__()
        self.w, self.unmerged = w, unmerged  # unmerged: return (B, h, T, hd), as the submission's attention does

    def forward(self, hidden_states, attention_mask, *args, **kwargs):  # course names; extra flags ignored
        x, mask = hidden_states, attention_mask
        q, k, v = (heads(x @ self.w[f"{n}.weight"].t() + self.w[f"{n}.bias"]) for n in ("query", "key", "value"))
        if mask.dim() == 2:  # a submission that hands its layers the (B, T) mask
            mask = (1.0 - mask[:, None, None, :].float()) * -10000.0
        elif mask.dtype == torch.bool:
            mask = (~mask).float() * -10000.0
        s = q @ k.transpose(-1, -2) / math.sqrt(HD)
        s = s.masked_fill(~torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(), float("-inf")) + mask
        y = torch.softmax(s, dim=-1) @ v
        if self.unmerged:
            return y
        return y.transpose(1, 2).reshape(x.shape[0], x.shape[1], D)


class RefLayer(nn.Module):
    """The course's pre-LN layer on the submission's effective weights, eps and GELU (eval mode)."""

    def __init__(self, w, info):
        super().__init__()
        self.w, self.info = w, info
        self.att = RefAttention({k[len("self_attention."):]: x for k, x in w.items() if k.startswith("self_attention.")})

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        x, mask, w = hidden_states, attention_mask, self.w
        ln = lambda y, n, e: F.layer_norm(y, (D,), w[f"{n}.weight"], w[f"{n}.bias"], e)  # noqa: E731
        x = x + F.linear(self.att(ln(x, "attention_layer_norm", self.info["eps_attn"]), mask),
                         w["attention_dense.weight"], w["attention_dense.bias"])
        approx = "tanh" if self.info.get("activation") == "tanh" else "none"
        h = F.gelu(F.linear(ln(x, "out_layer_norm", self.info["eps_mlp"]), w["interm_dense.weight"],
                            w["interm_dense.bias"]), approximate=approx)
        return x + F.linear(h, w["out_dense.weight"], w["out_dense.bias"])


def ref_embed(model):
    """The course's embed() on the submission's own embedding tables (no dropout: the model is probed in eval)."""
    we, pe = model.word_embedding.weight.detach(), model.pos_embedding.weight.detach()

    def embed(input_ids):  # the course's argument name: the starter calls self.embed(input_ids=...)
        return F.embedding(input_ids, we) + pe[: input_ids.shape[1]]
    return embed


def with_reference_attention(layer, notes):
    """Replace the layer's attention by the reference on the same weights, so the layer is graded on its own."""
    name, att = attention_module(layer, with_name=True)
    w = {}
    for n in ("query", "key", "value"):
        w[f"{n}.weight"], w[f"{n}.bias"] = affine(child(att, n, "CausalSelfAttention"), D, f"self_attention.{n}")
    unmerged = False
    try:  # keep the layout the layer expects from its attention: (B, T, D) or the heads unmerged
        with torch.no_grad():
            y = att.eval()(torch.randn(1, T, D, generator=gen(98)), torch.zeros(1, 1, 1, T))
        unmerged = torch.is_tensor(y) and y.dim() == 4
    except Exception:  # noqa: BLE001  (a broken attention: the course's layout)
        pass
    setattr(layer, name, RefAttention(w, unmerged))
    notes.append("graded with the reference attention in place of the submission's (the attention check grades it)")


def part(values, name, fn):
    """Run one graded part; a TODO or a deviation there costs that part only (recorded in values['parts'])."""
    try:
        fn()
    except (NotImplementedProbe, NotImplementedError) as e:
        values.setdefault("parts", {})[name] = f"not implemented: {e or type(e).__name__}"
    except Deviation as e:
        values.setdefault("parts", {})[name] = f"error: {e}"
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001  (the submission's error in this part is this part's finding)
        values.setdefault("parts", {})[name] = f"error: the submission raised {type(e).__name__}: {e}"[:2000]


def heads(x):
    return x.view(x.shape[0], x.shape[1], H, HD).transpose(1, 2)  # (B, h, T, hd)


def merged(y, what, notes):
    """(B, T, D) as the course returns it; (B, h, T, hd) is merged here and said so."""
    if y.dim() == 4 and y.shape[1] == H and y.shape[-1] == HD:
        notes.append(f"{what} returns the heads unmerged (B, h, T, hd); the grader merged them")
        return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], D)
    if y.dim() != 3 or y.shape[-1] != D:
        raise Deviation(f"{what} returned shape {tuple(y.shape)}, expected (B, T, {D})")
    return y


# ---- probes -------------------------------------------------------------------------------------------------------

def probe_attention(out, notes, values):
    cfg = make_config()
    cls = load("modules.attention", "CausalSelfAttention")
    att = construct(cls, cfg)
    randomize(att, 1)
    att.eval()
    for name in ("query", "key", "value"):
        out[f"{name}.weight"], out[f"{name}.bias"] = affine(child(att, name, "CausalSelfAttention"), D, name)
    x = torch.randn(3, T, D, generator=gen(2))
    out["x"] = x
    with torch.no_grad():
        for case, m in masks().items():
            ext = extended_mask(m, notes)
            out[f"forward.{case}"] = merged(tensor_out(att(x, ext), "CausalSelfAttention.forward"),
                                            "CausalSelfAttention.forward", notes)
        # attention() on its own, with q/k/v in the course's (B, h, T, hd) layout
        q, k, v = (heads(x @ out[f"{n}.weight"].t() + out[f"{n}.bias"]) for n in ("query", "key", "value"))
        try:
            y = tensor_out(att.attention(k, q, v, extended_mask(masks()["left"], notes)), "attention()")
            out["attention.left"] = merged(y, "attention()", notes)
        except (TypeError, AttributeError, Deviation) as e:
            notes.append(f"attention() could not be called as attention(key, query, value, mask) ({e}); "
                         f"graded through forward()")
    probe_attention_training(cfg, cls, out, notes, values)


def probe_attention_training(cfg, cls, out, notes, values):
    """Attention probabilities in training mode with dropout on: values are one-hot key positions, so the output
    of head h at query i is row i of its (dropped-out) probability matrix."""
    cfg = make_config(attention_probs_dropout_prob=DROPOUT_P)
    att = construct(cls, cfg)
    randomize(att, 3)
    g = gen(4)
    q, k = torch.randn(3, H, T, HD, generator=g), torch.randn(3, H, T, HD, generator=g)
    v = torch.zeros(3, H, T, HD)
    v[..., :T] = torch.eye(T)
    ext = extended_mask(masks()["right"], notes)
    route = "attention()"
    try:
        run = lambda: att.attention(k, q, v, ext)  # noqa: E731
        att.eval()
        with torch.no_grad():
            tensor_out(run(), "attention()")
    except (TypeError, AttributeError, Deviation):
        # Through forward(): x carries a one-hot position in its first T features and `value` is replaced by a
        # Linear that copies them into every head.
        route = "forward()"
        x = torch.randn(3, T, D, generator=g)
        x[..., :T] = torch.eye(T)
        lin = nn.Linear(D, D)
        with torch.no_grad():
            lin.weight.zero_()
            lin.bias.zero_()
            for h in range(H):
                lin.weight[h * HD + torch.arange(T), torch.arange(T)] = 1.0
        att.value = lin
        run = lambda: att(x, ext)  # noqa: E731
    with torch.no_grad():
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
    values["probs_route"] = route
    values["dropout_p"] = DROPOUT_P


def probe_layer(out, notes, values):
    cfg = make_config()
    layer = construct(load("modules.gpt2_layer", "GPT2Layer"), cfg)
    randomize(layer, 11)
    layer.eval()
    weights, info = extract_layer(layer)
    out.update(weights)
    values.update(info)
    own = attention_module(layer, with_name=True)
    with_reference_attention(layer, notes)
    g = gen(12)
    x = torch.randn(3, T, D, generator=g)
    out["x"] = x
    try:
        with torch.no_grad():
            layer(x, extended_mask(masks()["nopad"], []))
    except TypeError as e:  # it calls its attention with another interface: its own attention, said so
        if "RefAttention" not in str(e):
            raise
        setattr(layer, *own)
        notes[-1] = (f"its layer calls the attention with another interface ({e}): graded with its own attention, "
                     f"so attention bugs also show here")
    with torch.no_grad():
        for case, m in masks().items():
            out[f"forward.{case}"] = tensor_out(layer(x, extended_mask(m, notes)), "GPT2Layer.forward")
        a, o = torch.randn(3, T, D, generator=g), torch.randn(3, T, D, generator=g)
        out["add.input"], out["add.output"] = a, o
        try:
            y = layer.add(a, o, layer.attention_dense, layer.attention_dropout)
            out["add"] = tensor_out(y, "GPT2Layer.add")
        except (TypeError, AttributeError) as e:
            notes.append(f"add(input, output, dense_layer, dropout) could not be called ({e}); graded through forward()")
    values["dropout_placement"] = probe_layer_dropout(x, notes)


def probe_layer_dropout(x, notes):
    """Training mode: is each residual dropout applied to its dense layer's output, as the course places it?
    Hooks record what attention_dense / out_dense return and what the two dropout modules receive."""
    layer = construct(load("modules.gpt2_layer", "GPT2Layer"), make_config(hidden_dropout_prob=0.5))
    randomize(layer, 13)
    with_reference_attention(layer, [])
    layer.train()
    seen, placement, calls = {}, {}, {}
    pairs = {"attention_dropout": "attention_dense", "out_dropout": "out_dense"}
    try:
        for drop, dense in pairs.items():
            child(layer, dense, "GPT2Layer").register_forward_hook(
                lambda m, i, o, k=dense: seen.setdefault(k, o.detach().clone()))
            child(layer, drop, "GPT2Layer").register_forward_hook(record(drop, seen, calls))
    except Deviation as e:
        notes.append(f"dropout placement not checked: {e}")
        return {}
    with torch.no_grad():
        layer(x, extended_mask(masks()["nopad"], []))
    for drop, dense in pairs.items():
        if drop not in seen:
            placement[drop] = "not called in training mode"
        elif calls[drop] != 1:
            placement[drop] = f"applied {calls[drop]} times in one forward pass (once is the course's placement)"
        elif dense in seen and seen[drop].shape == seen[dense].shape and torch.equal(seen[drop], seen[dense]):
            placement[drop] = "ok"
        else:
            placement[drop] = f"not applied to the output of {dense}"
    return placement


def record(key, seen, calls):
    """A forward hook that keeps the first input by value (an in-place `+=` on it comes later) and counts calls;
    it returns None, so the module's output is left as it is."""
    def hook(module, inputs, output):
        seen.setdefault(key, inputs[0].detach().clone())
        calls[key] = calls.get(key, 0) + 1
    return hook


def model_and_weights(out, values, cfg=None, model=None):
    if model is None:
        model = construct(load("models.gpt2", "GPT2Model"), cfg or make_config())
        randomize(model, 21)
    model.eval()
    for name in ("word_embedding", "pos_embedding"):
        out[f"{name}.weight"] = child(model, name, "GPT2Model").weight.detach().float().clone()
    layers = child(model, "gpt_layers", "GPT2Model")
    for i, layer in enumerate(layers):
        weights, info = extract_layer(layer, f"gpt_layers.{i}.")
        out.update(weights)
        values.setdefault("layers", []).append(info)
    values["eps_final"] = layer_norm(model, "final_layer_norm", "GPT2Model", out)
    values["n_layer"] = len(layers)
    return model


def run_model(model, ids, mask, out, prefix):
    with torch.no_grad():
        res = model(ids, mask)
    if res is None:
        raise NotImplementedProbe("GPT2Model.forward returned None")
    if not isinstance(res, dict) or "last_hidden_state" not in res or "last_token" not in res:
        raise Deviation("GPT2Model.forward must return a dict with 'last_hidden_state' and 'last_token'")
    out[f"{prefix}last_hidden_state"] = tensor_out(res["last_hidden_state"], "forward()['last_hidden_state']")
    out[f"{prefix}last_token"] = tensor_out(res["last_token"], "forward()['last_token']")


def probe_embed(out, notes, values):
    model = construct(load("models.gpt2", "GPT2Model"), make_config())
    randomize(model, 31)
    model.eval()
    for name in ("word_embedding", "pos_embedding"):
        out[f"{name}.weight"] = child(model, name, "GPT2Model").weight.detach().float().clone()
    ids = torch.randint(0, V, (3, T), generator=gen(32))
    out["ids"] = ids.float()
    with torch.no_grad():
        out["embed"] = tensor_out(model.embed(ids), "GPT2Model.embed")
    # training mode with dropout 0.5: every entry must be dropped (0) or scaled by 1/(1-p), some dropped
    model = construct(load("models.gpt2", "GPT2Model"), make_config(hidden_dropout_prob=DROPOUT_P))
    randomize(model, 31)
    model.train()
    torch.manual_seed(33)
    with torch.no_grad():
        out["embed.eval"] = tensor_out(model.eval().embed(ids), "GPT2Model.embed")
        out["embed.train"] = tensor_out(model.train().embed(ids), "GPT2Model.embed (training mode)")
    values["dropout_p"] = DROPOUT_P


def probe_model(out, notes, values):
    model = model_and_weights(out, values)
    # The model's own code on reference layers and embed(): their bugs cost their own checks, not this one.
    layers = child(model, "gpt_layers", "GPT2Model")
    own = list(layers)
    for i in range(len(layers)):
        info = values["layers"][i]
        info["activation"] = info["activation"] if info["activation"] in ("exact", "tanh") else "exact"
        layers[i] = RefLayer({k[len(f"gpt_layers.{i}."):]: x for k, x in out.items()
                              if k.startswith(f"gpt_layers.{i}.")}, info)
    model.embed = ref_embed(model)
    notes.append("graded with reference layers and a reference embed() in place of the submission's "
                 "(the layer and embed checks grade those)")
    ids = torch.randint(0, V, (3, T), generator=gen(22))
    mask = masks()["right"]
    out["ids"], out["mask"] = ids.float(), mask.float()

    def forward():
        try:
            run_model(model, ids, mask, out, "")
        except TypeError as e:  # its layers or embed() take another interface: its own components, said so
            if "Ref" not in str(e) and "embed()" not in str(e):
                raise
            for i, layer in enumerate(own):
                layers[i] = layer
            del model.embed
            notes.append(f"its forward() calls layers or embed() with another interface ({e}): graded with its own "
                         f"layers and embed(), so their bugs also show here")
            run_model(model, ids, mask, out, "")
    part(values, "forward", forward)
    h = torch.randn(3, T, D, generator=gen(23))  # the head on its own input: a missing forward() costs it nothing
    out["head.input"] = h

    def head():
        with torch.no_grad():
            logits = tensor_out(model.hidden_state_to_token(h), "hidden_state_to_token")
            model.word_embedding.weight.add_(1.0)  # a tied head must see this change
            values["head_follows_word_embedding"] = not torch.equal(
                tensor_out(model.hidden_state_to_token(h), "hidden_state_to_token"), logits)
            model.word_embedding.weight.sub_(1.0)
        out["logits"] = logits
    part(values, "hidden_state_to_token", head)


def probe_from_pretrained(out, notes, values):
    cls = load("models.gpt2", "GPT2Model")
    fp = getattr(cls, "from_pretrained", None)
    if fp is None:
        raise Deviation("GPT2Model has no from_pretrained")
    size = dict(d=D, l=L, num_heads=H)
    try:
        params = inspect.signature(fp).parameters
    except (TypeError, ValueError):
        params = {}
    if all(k in params for k in size):
        model = fp(model="gpt2", **size) if "model" in params else fp("gpt2", **size)
    else:
        notes.append(f"from_pretrained takes {list(params)}, not (model, d, l, num_heads); called as from_pretrained('gpt2')")
        model = fp("gpt2")
    if model is None:
        raise NotImplementedProbe("from_pretrained returned None")
    model_and_weights(out, values, model=model)
    ids = torch.randint(0, 1000, (3, T), generator=gen(41))
    out["ids"], out["mask"] = ids.float(), masks()["right"].float()
    part(values, "outputs", lambda: run_model(model, ids, masks()["right"], out, ""))  # information only


def adamw_params(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def probe_adamw(out, notes, values):
    import numpy as np

    AdamW = load("optimizer", "AdamW")
    # The course's optimizer_test.py: 1000 steps of a 3 -> 2 linear regression.
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, correct_bias=True)
    for _ in range(1000):
        opt.zero_grad()
        x = torch.FloatTensor(rng.uniform(size=[model.in_features]))
        y = torch.Tensor([x[0] + x[1], -x[2]])
        ((y - model(x)) ** 2).sum().backward()
        opt.step()
    out["course.weight"] = model.weight.detach().clone()
    # 200 steps with two parameter groups (decay on one, its own lr on the other), replayed by the grader
    # with torch.optim.AdamW. lr * lr * weight_decay stays small, so decay before or after the update (both are
    # AdamW) differ by about 2e-7 in the end, inside the course's tolerance.
    net = adamw_net()
    opt = AdamW(adamw_groups(net), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for x, y in adamw_batches():
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    for n, p in adamw_params(net).items():
        out[f"torch.{n}"] = p


def adamw_net():
    g = gen(51)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def adamw_groups(net):
    return [{"params": list(net[0].parameters()), "weight_decay": 0.001},
            {"params": list(net[2].parameters()), "weight_decay": 0.0, "lr": 3e-3}]


def adamw_batches(steps=200):
    g = gen(52)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        yield x, torch.stack([x[:, 0] * x[:, 1], x[:, 2] - x[:, 3]], dim=1)


IMPORT_ORDER = ("config", "utils", "modules.attention", "modules.gpt2_layer", "models.gpt2", "optimizer")


def probe_imports(out, notes, values):
    """Import each graded module once, in dependency order; a failure is recorded and the next one tried. Progress
    goes to stdout, so a hang is located by the last "importing" line the grader reads back."""
    values["imports"] = {}
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


PROBES = {"imports": probe_imports, "attention": probe_attention, "layer": probe_layer, "embed": probe_embed, "model": probe_model,
          "from_pretrained": probe_from_pretrained, "adamw": probe_adamw}


def main(name, resultdir, args):
    """Run one probe; always write info.json. Returns the process exit code."""
    out, notes, values = {}, [], {}
    info = {"status": "ok", "message": "", "notes": notes, "values": values}
    torch.manual_seed(0)
    try:
        PROBES[name](out, notes, values)
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
        info.update(status="error", message=f"{type(e).__name__}: {e}", traceback="".join(tb)[-4000:])
        if "cuda" in str(e).lower():
            info["device"] = "a hard-coded CUDA device: the code asks for 'cuda' on a machine without a GPU"
        if "memory" in str(e).lower() or "alloc" in str(e).lower():
            info["message"] += " (the sandbox's memory limit)"
    if info["status"] == "ok":
        import safetensors.torch

        safetensors.torch.save_file({k: v.contiguous() for k, v in out.items()},
                                    os.path.join(resultdir, "tensors.safetensors"))
    with open(os.path.join(resultdir, "info.json"), "w") as f:
        json.dump(info, f)
    return 0
