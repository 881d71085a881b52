"""Whether torch traces or transforms the code that runs: torch.compile (dynamo), a torch.func transform (grad, vmap,
jacrev, jvp: per-sample gradients, Jacobians, functional training) or forward-mode AD's dual tensors. Under any of
them the fused kernels and the hand-written autograd Functions step aside for torch's own ops, which those know how to
trace, batch and differentiate (a kernel of ours is opaque to them, and a Function without a `setup_context`, a vmap
rule and a jvp is refused). The values are the same; only the speed differs."""

import torch
from torch.autograd import forward_ad


def active() -> bool:
    """True inside torch.compile's tracing, under any torch.func transform or in forward-mode AD."""
    return torch.compiler.is_compiling() or torch_func()


def torch_func() -> bool:
    """True under a torch.func transform, or inside torch.autograd.forward_ad's dual_level (forward-mode AD with dual
    tensors, which our Functions have no jvp for). Attention then takes its explicit form (scores, softmax, weighted
    sum), which every transform handles: SDPA's CPU kernel has no forward-mode derivative (jvp) and no vmap rule (torch
    runs it once per example). torch.compile keeps SDPA, which it maps to its own kernels."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `tensor`'s values under every torch.func level: vmap's batched tensor (each example's
    values, the vmapped dimensions among its own) and grad's wrapper both step down to the plain tensor beneath. For
    checks of values that a transform cannot batch (`.tolist()`): a reduction over all of its elements is the reduction
    over every example's. Outside the transforms, the tensor itself."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def torch_backward(reference, inputs: tuple, needs_input_grad: tuple, *grads: torch.Tensor) -> tuple:
    """A Function's backward under create_graph=True (second derivatives: gradient penalties, Hessian-vector products,
    MAML), where a kernel's backward is opaque to autograd: the gradients of reference(*inputs), torch's ops computing
    what the Function's forward computes (again: for elementwise and row-wise kernels, whose forward is cheap beside
    the products; the linear layers' Functions write their rule instead, modules/linear_backward.py), taken as a graph
    that can itself be differentiated. One entry per input: None where no gradient is asked or the input is not a
    tensor. `inputs` are the Function's own (saved) inputs, so the graph leads back to whatever made them."""
    wanted = [i for i, (x, need) in enumerate(zip(inputs, needs_input_grad)) if need and isinstance(x, torch.Tensor)]
    with torch.enable_grad():
        outputs = reference(*inputs)
    found = torch.autograd.grad(outputs, [inputs[i] for i in wanted], grads, create_graph=True)
    result = [None] * len(inputs)
    for i, gradient in zip(wanted, found):
        result[i] = gradient
    return tuple(result)
