"""Whether torch traces or transforms the code that runs: torch.compile (dynamo), or a torch.func transform (grad,
vmap, jacrev, jvp: per-sample gradients, Jacobians, functional training). Under either, the fused kernels and the
hand-written autograd Functions step aside for torch's own ops, which those transforms know how to trace, batch and
differentiate (a kernel of ours is opaque to them, and a Function without a `setup_context` and vmap rule is refused
by torch.func). The values are the same; only the speed differs."""

import torch


def active() -> bool:
    """True inside torch.compile's tracing or under any torch.func transform."""
    return torch.compiler.is_compiling() or torch_func()


def torch_func() -> bool:
    """True under a torch.func transform. Attention then takes its explicit form (scores, softmax, weighted sum), which
    every transform handles: SDPA's CPU kernel has no forward-mode derivative (jvp) and no vmap rule (torch runs it
    once per example). torch.compile keeps SDPA, which it maps to its own kernels."""
    return torch._C._are_functorch_transforms_active()


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `tensor`'s values under every torch.func level: vmap's batched tensor (each example's
    values, the vmapped dimensions among its own) and grad's wrapper both step down to the plain tensor beneath. For
    checks of values that a transform cannot batch (`.tolist()`): a reduction over all of its elements is the reduction
    over every example's. Outside the transforms, the tensor itself."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor
