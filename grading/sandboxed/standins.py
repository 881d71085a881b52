"""The stand-ins a check grades the submission's other components with: the course's attention, pre-LN layer and
embed() on the grader's weights (each component is graded on its own, so a bug elsewhere costs nothing here).

They live in the check's process, where the submission's code can reach whatever the probe holds, so each check
gets only the stand-ins it grades with (grading/sandboxed/zygote.py compiles just those definitions of this file, before the
sandbox hides the grader's checkout): the layer check the attention, the model check the layers and embed(), the
attention and embed checks none. A stand-in can therefore never earn the points of the component it stands in for.
Nothing here imports the project (its module names collide with the submission's).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RefAttention(nn.Module):
    """The course's attention on given (W, b): stands in for the submission's when another component is graded."""

    def __init__(self, w, num_heads, unmerged=False):
        super().__init__()
        self.w, self.h, self.unmerged = w, num_heads, unmerged  # unmerged: return (B, h, T, hd), as the submission's

    def forward(self, hidden_states, attention_mask, *args, **kwargs):  # course names; extra flags ignored
        x, mask = hidden_states, attention_mask
        B, T = x.shape[:2]
        q, k, v = (F.linear(x, self.w[f"{n}.weight"], self.w[f"{n}.bias"]).view(B, T, self.h, -1).transpose(1, 2)
                   for n in ("query", "key", "value"))  # (B, h, T, hd)
        if mask.dim() == 2:  # a submission that hands its layers the (B, T) mask
            mask = (1.0 - mask[:, None, None, :].float()) * -10000.0
        elif mask.dtype == torch.bool:
            mask = (~mask).float() * -10000.0
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")) + mask
        y = torch.softmax(s, dim=-1) @ v  # (B, h, T, hd)
        return y if self.unmerged else y.transpose(1, 2).reshape(B, T, -1)


class RefLayer(nn.Module):
    """The course's pre-LN layer on the grader's weights, with the given eps and GELU (eval mode)."""

    def __init__(self, w, info, num_heads):
        super().__init__()
        self.w, self.info = w, info
        self.att = RefAttention({k[len("self_attention."):]: x for k, x in w.items() if k.startswith("self_attention.")},
                                num_heads)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        x, mask, w = hidden_states, attention_mask, self.w
        ln = lambda y, n, e: F.layer_norm(y, y.shape[-1:], w[f"{n}.weight"], w[f"{n}.bias"], e)  # noqa: E731
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
