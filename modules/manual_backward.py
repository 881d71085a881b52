"""Hand-derived backward passes ("Transformer from scratch"): each op of the GPT-2 body as a torch.autograd.Function
whose backward is written out, saving only what that backward needs. `GPT2Config(backward="manual")` builds the
model from the modules at the bottom; autograd then only chains these Functions (and the embedding lookup, the
residual additions and the head reshapes, whose backward is trivial).

Notation: dy is the gradient of the loss with respect to an output y; sums over "rows" run over every leading
dimension (batch and time). Each backward is checked against autograd by gradcheck (tests/test_manual_backward.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from modules import transforms
from modules.cross_entropy import check_shapes


def _no_autocast(name: str) -> None:
    # Under autocast the forward would compute in bf16 while the backward multiplies saved fp32 tensors.
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        raise RuntimeError(f"{name}: the manual backward passes do not support autocast; use backward='autograd' "
                           f"for bf16/fp16 autocast, or run in one dtype")


class _Manual(torch.autograd.Function):
    """The Functions below: autograd chains their hand-written backward passes. torch.func's transforms (grad, vmap,
    jvp) take a Function only in the `setup_context` form with a vmap rule, which these, saving what their forward
    computes, are not, and forward-mode AD needs a jvp; there they stop with an error that says so instead of
    torch's. Their backward passes give first derivatives only (_first_order)."""

    @classmethod
    def apply(cls, *args):
        if transforms.torch_func():
            raise RuntimeError(f"{cls.__name__}: GPT2Config(backward='manual') runs its hand-written backward passes "
                               "under autograd (loss.backward(), torch.autograd.grad), not under torch.func's "
                               "transforms (grad, vmap, jvp) or forward-mode AD's dual tensors; build the model with "
                               "backward='autograd' for those: the same values")
        return super().apply(*args)


def _first_order(ctx) -> None:
    """A backward run with create_graph=True (grad mode on inside it) stops here: what the forwards save (a LayerNorm's
    mean and 1/std, the attention's and the loss's log-sum-exp) would stand as constants in a second derivative, a
    wrong answer without an error."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{type(ctx).__name__.removesuffix('Backward')}: GPT2Config(backward='manual') gives first "
                           "derivatives only; for second derivatives (create_graph=True) build the model with "
                           "backward='autograd'")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LinearFn(_Manual):
    """y = x W^T + b, x (..., in), W (out, in).

    dx = dy W;   dW = sum over rows of dy^T x;   db = sum over rows of dy.
    Saves x and W (the output is not needed).
    """

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        _no_autocast("linear")
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        _first_order(ctx)
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = _rows(dy).T @ _rows(x) if ctx.needs_input_grad[1] else None
        db = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class LayerNormFn(_Manual):
    """y = w * xhat + b over the last dimension (size N), xhat = (x - mu) r, r = (var + eps)^(-1/2).

    With g = dy * w:  dx = r (g - mean(g) - xhat mean(g * xhat))  (mean over the last dimension; the two terms
    remove the components of g along the directions that mu and var depend on);  dw = sum over rows of dy * xhat;
    db = sum over rows of dy. Saves x, w, mu and r (per row); xhat is recomputed.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        _no_autocast("layer_norm")
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        _first_order(ctx)
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x - mean) * rstd
        g = dy * weight
        dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = _rows(dy * xhat).sum(0) if ctx.needs_input_grad[1] else None
        db = _rows(dy).sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


class GeluTanhFn(_Manual):
    """GPT-2's GELU: y = x/2 (1 + t), t = tanh(u), u = k (x + a x^3), k = sqrt(2/pi), a = 0.044715.

    dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 a x^2)   (product rule; tanh' = 1 - tanh^2).
    Saves x only (t is recomputed, one tanh).
    """

    @staticmethod
    def forward(ctx, x):
        _no_autocast("gelu")
        ctx.save_for_backward(x)
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, dy):
        _first_order(ctx)
        (x,) = ctx.saved_tensors
        t = torch.tanh(_K * (x + _A * x * x * x))
        return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K * (1 + 3 * _A * x * x))


class SoftmaxFn(_Manual):
    """y = softmax(x) over the last dimension.

    dy_i/dx_j = y_i (delta_ij - y_j), so dx = y (dy - sum(dy * y)). Saves y only.
    """

    @staticmethod
    def forward(ctx, x):
        _no_autocast("softmax")
        y = torch.softmax(x, dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        _first_order(ctx)
        (y,) = ctx.saved_tensors
        return y * (dy - (dy * y).sum(-1, keepdim=True))


class AttentionFn(_Manual):
    """Masked scaled dot-product attention with dropout, q (B, h, T, d), k and v (B, h, S, d):

        S = s q k^T, masked entries set to the dtype's minimum;  P = softmax(S);  Pd = P * M / (1 - p);  O = Pd v

    mask: bool, broadcastable to (B, h, T, S), True where a query may attend a key; keep M: bool (B, h, T, S) or
    None (no dropout). Backward:
        dv = Pd^T dO;   dPd = dO v^T;   dP = dPd * M / (1 - p);
        dS = P (dP - D) with D = rowsum(dP * P) = rowsum(dO * O)   (the softmax rule; the second form needs no P);
        dS = 0 where masked (masked_fill passes no gradient);  dq = s dS k;  dk = s dS^T q.
    Saves q, k, v, O, the log-sum-exp of each row of S and the masks; P (T x S per head) is recomputed from them,
    so the saved size grows with T x S only through the bool masks.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, keep, scale, p):
        _no_autocast("attention")
        scores = (q @ k.transpose(-1, -2)) * scale  # (B, h, T, S)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, h, T, 1)
        probs = torch.exp(scores - lse)
        if keep is not None:
            probs = probs * keep / (1 - p)
        # (B, h, T, d) laid out as (B, T, h, d): merging the heads afterwards is then a view, and the tensor saved
        # here is the one the output projection saves too, not a second copy of it
        out = (probs @ v).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, mask, keep)
        ctx.scale, ctx.p = scale, p
        return out

    @staticmethod
    def backward(ctx, dout):
        _first_order(ctx)
        q, k, v, out, lse, mask, keep = ctx.saved_tensors
        scale, p = ctx.scale, ctx.p
        scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, torch.finfo(q.dtype).min)
        probs = torch.exp(scores - lse)  # P, recomputed
        dropped = probs * keep / (1 - p) if keep is not None else probs
        dv = dropped.transpose(-1, -2) @ dout
        dprobs = dout @ v.transpose(-1, -2)
        if keep is not None:
            dprobs = dprobs * keep / (1 - p)
        dscores = probs * (dprobs - (dout * out).sum(-1, keepdim=True))
        dscores = dscores.masked_fill(~mask, 0.0) * scale
        return dscores @ k, dscores.transpose(-1, -2) @ q, dv, None, None, None, None


class CrossEntropyFn(_Manual):
    """Mean cross-entropy of logits z (N, V) against targets y (N,), rows with y == ignore_index left out:

        L = (1/n) sum_i (lse(z_i) - z_i[y_i]),  n = number of counted rows;
        dz_i = (softmax(z_i) - onehot(y_i)) / n for counted rows, 0 for ignored ones.
    Saves z, the targets and lse per row (softmax(z) = exp(z - lse) is recomputed).
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        _no_autocast("cross_entropy")
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        counted = targets != ignore_index
        picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
        n = counted.sum()
        loss = ((lse - picked) * counted).sum() / n  # nan when nothing is counted, as F.cross_entropy
        ctx.save_for_backward(logits, targets, lse, counted, n)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        _first_order(ctx)
        logits, targets, lse, counted, n = ctx.saved_tensors
        dz = torch.exp(logits - lse.unsqueeze(1))
        dz.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
        dz *= (counted.to(dz.dtype) / n * dloss).unsqueeze(1)  # not counted / n: int / int gives float32
        return dz, None, None


# ---- the model's building blocks, built when GPT2Config(backward="manual") -------------------------------------

def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return LinearFn.apply(x, weight, bias)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return GeluTanhFn.apply(x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return SoftmaxFn.apply(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    check_shapes(logits, targets)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision up, float64 kept
    return CrossEntropyFn.apply(logits, targets, ignore_index)


class ManualLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) with LinearFn's backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearFn.apply(x, self.weight, self.bias)


class ManualLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) with LayerNormFn's backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LayerNormFn.apply(x, self.weight, self.bias, self.eps)


class ManualAttention(nn.Module):
    """The attention core of CausalSelfAttention (after the projections) with AttentionFn's backward; dropout on the
    probabilities in training. forward(key, query, value, attention_mask) -> (B, T, C), as
    CausalSelfAttention.attention."""

    def __init__(self, scale: float, dropout: float):
        super().__init__()
        self.scale, self.p = scale, dropout

    def forward(self, key: torch.Tensor, query: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        B, h, T, _ = query.shape
        S = key.shape[2]
        if attention_mask is None:  # plain causal (bottom-right aligned when keys include cached tokens)
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
        keep = None
        if self.training and self.p > 0:
            keep = torch.empty(B, h, T, S, dtype=torch.bool, device=query.device).bernoulli_(1 - self.p)
        out = AttentionFn.apply(query, key, value, attention_mask, keep, self.scale, self.p)  # (B, h, T, d)
        return rearrange(out, "b h t d -> b t (h d)")
