"""The grader's side of each comparison: the reference outputs, and reference variants that each carry one bug.

References are this project's modules (CausalSelfAttention, GPT2Layer), transformers' GPT2Model and
torch.optim.AdamW, built with the grader's own weights (grading/questions.py) and with the submission's choices as
measured from its outputs (LayerNorm eps, exact or tanh GELU). The variants are a small functional GPT-2 with switches, one typical
bug each; `functional(no bugs)` is held equal to the references at run time, so a variant differs from the
reference only by its bug.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from config import GPT2Config
from models.loading import ours_to_hf
from modules.attention import CausalSelfAttention
from modules.gpt2_layer import GPT2Layer

ACTIVATIONS = {"exact": "gelu", "tanh": "gelu_new"}  # the submission's GELU -> the HF / our config name

BUGS = {  # variant -> what the diagnosis says
    "no_scale": "scores not scaled by 1/sqrt(head_dim)",
    "no_causal": "causal mask missing",
    "pad_ignored": "padding mask ignored",
    "pad_inverted": "padding mask inverted (real tokens masked, padding attended)",
    "softmax_axis": "softmax over the wrong axis (over queries instead of keys)",
    "merge_no_transpose": "heads merged without the transpose ((B, h, T, hd) reshaped straight to (B, T, C))",
    "no_ln_attn": "LayerNorm before the attention missing",
    "no_ln_mlp": "LayerNorm before the MLP missing",
    "post_ln": "post-LayerNorm (normalizing after the residual add) instead of pre-LayerNorm",
    "residual_normed": "residual misplaced: the normalized input is added back instead of the block input",
    "no_final_ln": "final LayerNorm missing",
    "no_positions": "position embeddings missing",
    "last_position": "last_token taken at the last position instead of the last real token (wrong under padding)",
    "conv1d_not_transposed": "HF Conv1D weights copied without the transpose (attention projections)",
    "qkv_swapped": "q/k/v split wrong (query and key taken from each other's slice of c_attn)",
    "no_bias_correction": "AdamW without bias correction",
    "decay_in_gradient": "weight decay added to the gradient (Adam with L2) instead of decoupled",
}
ATTENTION_BUGS = ("no_scale", "no_causal", "pad_ignored", "pad_inverted", "softmax_axis", "merge_no_transpose")
LAYER_BUGS = ATTENTION_BUGS + ("no_ln_attn", "no_ln_mlp", "post_ln", "residual_normed")
MODEL_BUGS = LAYER_BUGS + ("no_final_ln", "no_positions", "last_position")
LOAD_BUGS = MODEL_BUGS + ("conv1d_not_transposed", "qkv_swapped")
ADAMW_BUGS = ("no_bias_correction", "decay_in_gradient")


def config(n_embd, n_head, n_layer=1, vocab_size=97, n_positions=16, n_inner=None, activation="tanh", eps=1e-5):
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      n_inner=n_inner, activation_function=ACTIVATIONS[activation], layer_norm_epsilon=eps,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")


def bool_mask(mask2d: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 = real -> (B, 1, T, T) True where a query may attend a key (causal and not padding)."""
    T = mask2d.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril() & mask2d.bool()[:, None, None, :]


def sub(weights: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


# ---- references (this project's modules, transformers) -------------------------------------------------------------

def attention(weights, x, mask2d, n_head):
    mod = CausalSelfAttention(config(x.shape[-1], n_head)).eval()
    mod.load_state_dict(sub(weights, ""), strict=False)
    with torch.no_grad():
        return mod(x, bool_mask(mask2d))


def layer(weights, x, mask2d, n_head, activation, eps_attn, eps_mlp):
    inner = weights["interm_dense.weight"].shape[0]
    mod = GPT2Layer(config(x.shape[-1], n_head, n_inner=inner, activation=activation)).eval()
    mod.load_state_dict(weights)
    mod.attention_layer_norm.eps, mod.out_layer_norm.eps = eps_attn, eps_mlp
    with torch.no_grad():
        return mod(x, bool_mask(mask2d))


def hf_model(weights, n_head, activation, eps):
    """transformers.GPT2Model on our-named weights, with the submission's GELU and LayerNorm eps."""
    import transformers

    n_layer = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("gpt_layers."))
    vocab, n_embd = weights["word_embedding.weight"].shape
    inner = weights["gpt_layers.0.interm_dense.weight"].shape[0]
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=weights["pos_embedding.weight"].shape[0],
                                  n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_inner=inner,
                                  activation_function=ACTIVATIONS[activation], layer_norm_epsilon=eps,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2Model(cfg)
    model.load_state_dict(ours_to_hf(weights, n_layer), strict=False)
    return model.eval()


def model_forward(model, ids, mask2d):
    with torch.no_grad():
        h = model(input_ids=ids, attention_mask=mask2d).last_hidden_state
    last = h[torch.arange(h.shape[0]), mask2d.long().sum(1) - 1]
    return h, last


# ---- the functional twin with switches, for diagnosis -------------------------------------------------------------

def f_probs(q, k, mask2d, bugs=()):
    """Attention probabilities (B, h, T, T) from q, k (B, h, T, hd), with the score and softmax bugs."""
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2)
    if "no_scale" not in bugs:
        scores = scores / math.sqrt(q.shape[-1])
    if "no_causal" not in bugs:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    real = mask2d.float()[:, None, None, :]
    if "pad_inverted" in bugs:
        scores = scores + real * -10000.0
    elif "pad_ignored" not in bugs:
        scores = scores + (1.0 - real) * -10000.0
    return F.softmax(scores, dim=-2 if "softmax_axis" in bugs else -1)


def f_attention(x, w, mask2d, n_head, bugs=()):
    B, T, C = x.shape
    hd = C // n_head
    q, k, v = (F.linear(x, w[f"{n}.weight"], w[f"{n}.bias"]).view(B, T, n_head, hd).transpose(1, 2)
               for n in ("query", "key", "value"))  # (B, h, T, hd)
    out = f_probs(q, k, mask2d, bugs) @ v  # (B, h, T, hd)
    return out.reshape(B, T, C) if "merge_no_transpose" in bugs else out.transpose(1, 2).reshape(B, T, C)


def f_layer(x, w, mask2d, n_head, activation, eps_attn, eps_mlp, bugs=(), drop=None):
    """drop: (mask after attention_dense, mask after out_dense, p), the residual dropouts of training mode."""
    C = x.shape[-1]
    d1, d2 = (lambda t: t * drop[0] / (1 - drop[2]), lambda t: t * drop[1] / (1 - drop[2])) if drop else \
        (lambda t: t, lambda t: t)
    ln1 = lambda t: F.layer_norm(t, (C,), w["attention_layer_norm.weight"], w["attention_layer_norm.bias"], eps_attn)  # noqa: E731
    ln2 = lambda t: F.layer_norm(t, (C,), w["out_layer_norm.weight"], w["out_layer_norm.bias"], eps_mlp)  # noqa: E731
    attn = lambda t: F.linear(f_attention(t, sub(w, "self_attention."), mask2d, n_head, bugs),  # noqa: E731
                              w["attention_dense.weight"], w["attention_dense.bias"])
    act = (lambda t: F.gelu(t, approximate="tanh")) if activation == "tanh" else F.gelu
    mlp = lambda t: F.linear(act(F.linear(t, w["interm_dense.weight"], w["interm_dense.bias"])),  # noqa: E731
                             w["out_dense.weight"], w["out_dense.bias"])
    if "post_ln" in bugs:
        h = ln1(x + d1(attn(x)))
        return ln2(h + d2(mlp(h)))
    a_in = x if "no_ln_attn" in bugs else ln1(x)
    h = (a_in if "residual_normed" in bugs else x) + d1(attn(a_in))
    m_in = h if "no_ln_mlp" in bugs else ln2(h)
    return (m_in if "residual_normed" in bugs else h) + d2(mlp(m_in))


def f_model(ids, mask2d, w, n_head, layers_info, eps_final, activation, bugs=()):
    T = ids.shape[1]
    h = F.embedding(ids, w["word_embedding.weight"])
    if "no_positions" not in bugs:
        h = h + w["pos_embedding.weight"][:T]
    for i, info in enumerate(layers_info):
        h = f_layer(h, sub(w, f"gpt_layers.{i}."), mask2d, n_head, activation, info["eps_attn"], info["eps_mlp"], bugs)
    if "no_final_ln" not in bugs:
        h = F.layer_norm(h, h.shape[-1:], w["final_layer_norm.weight"], w["final_layer_norm.bias"], eps_final)
    idx = torch.full((ids.shape[0],), T - 1) if "last_position" in bugs else mask2d.long().sum(1) - 1
    return h, h[torch.arange(ids.shape[0]), idx]


def mis_loaded(w, bug, n_layer):
    """Weights as a loader with one mapping bug would have copied them from an HF checkpoint."""
    w = dict(w)
    for i in range(n_layer):
        p = f"gpt_layers.{i}."
        if bug == "conv1d_not_transposed":
            for name in ("self_attention.query", "self_attention.key", "self_attention.value", "attention_dense"):
                w[f"{p}{name}.weight"] = w[f"{p}{name}.weight"].t()
        if bug == "qkv_swapped":
            for kind in ("weight", "bias"):
                q, k = f"{p}self_attention.query.{kind}", f"{p}self_attention.key.{kind}"
                w[q], w[k] = w[k], w[q]
    return w


# ---- AdamW -------------------------------------------------------------------------------------------------------

def adamw_variant(params, grads_fn, groups, steps, bug=None, betas=(0.9, 0.99), eps=1e-8, form="torch"):
    """Hand-rolled AdamW replay for the variants (the reference itself is torch.optim.AdamW). form="handout": the
    course handout's correct form, the bias corrections folded into the step size (eps added to sqrt(v) before
    them) and the decay after the update; over 200 steps it drifts from torch's form by up to ~3e-5 on a few
    questions in a thousand, past the course's tolerance, so a correct submission of either form is compared with
    its own."""
    if form not in ("torch", "handout"):
        raise ValueError(f"adamw_variant: form must be 'torch' or 'handout', got {form!r}")
    if bug is not None and bug not in ADAMW_BUGS:
        raise ValueError(f"adamw_variant: unknown bug {bug!r} (known: {', '.join(ADAMW_BUGS)})")
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in params}
    b1, b2 = betas
    for t in range(1, steps + 1):
        grads_fn()
        with torch.no_grad():
            for g in groups:
                for p in g["params"]:
                    grad = p.grad + g["weight_decay"] * p if bug == "decay_in_gradient" else p.grad
                    m, v = state[id(p)]
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    if form == "handout" and bug is None:
                        step = g["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                        p.addcdiv_(m, v.sqrt() + eps, value=-step)
                        p.add_(p, alpha=-g["lr"] * g["weight_decay"])
                        continue
                    if bug == "no_bias_correction":
                        mh, vh = m, v
                    else:
                        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
                    if bug != "decay_in_gradient":
                        p.mul_(1 - g["lr"] * g["weight_decay"])
                    p.addcdiv_(mh, vh.sqrt() + eps, value=-g["lr"])
