"""The backward of y = F.linear(x, weight, bias) for the output's gradient g (as (rows, out)): the input's gradient
g W, the weight's g^T x and the bias's sum of g over rows. Shared by the autograd Functions whose forward is a linear
layer's and whose products differ: oneDNN's inner product (modules/onednn.py), the LM head's weight gradient in
blocks of vocabulary rows (modules/head_grad.py), AMX's transposed forms (modules/transposed.py) and the fused
q/k/v product (modules/fused_qkv.py). Each passes its own two products; under create_graph=True (second derivatives:
a backward of the gradients) torch's are taken, which autograd can differentiate again."""

from __future__ import annotations

from collections.abc import Callable

import torch

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gradients(x: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor, needs: tuple[bool, ...],
              input_gradient: Product | None = None, weight_gradient: Product | None = None) -> tuple:
    """(d_x, d_weight, d_bias) of F.linear(x, weight, bias), each None where `needs` (ctx.needs_input_grad: x, weight
    and, if there is one, the bias) asks none. input_gradient(g, weight) -> g W and weight_gradient(g, rows) -> g^T rows
    (g (N, out), rows: x as (N, in)) replace torch's products, but under create_graph=True. The weight is read only
    for x's gradient: None will do where none is asked (a weight made for the call, as the fused q/k/v's)."""
    if torch.is_grad_enabled():  # create_graph=True: torch's products, a graph autograd can differentiate again
        input_gradient = weight_gradient = None
    g = grad.reshape(-1, grad.shape[-1])
    d_x = d_weight = d_bias = None
    if needs[0]:
        d_x = (input_gradient(g, weight) if input_gradient else g @ weight).view(x.shape)
    if needs[1]:
        rows = x.reshape(-1, x.shape[-1])
        d_weight = weight_gradient(g, rows) if weight_gradient else g.t() @ rows
    if len(needs) > 2 and needs[2]:
        d_bias = g.sum(0)
    return d_x, d_weight, d_bias
