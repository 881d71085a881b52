"""A small, correct course-layout submission: this project's attention, layer, model and AdamW, adapted to the
CS224N interface (course config names, the additive extended mask, `add()`, copy-by-name `from_pretrained`).

`python -m grading --example DIR [--bug NAME]` writes it for a newcomer to grade; the tests write it too.
`write_submission(folder, **replace)` writes it; each keyword names a file (`attention`, `layer`, `model`,
`optimizer`, `config`, `utils`) and maps to a list of (old, new) substitutions that must each match once, which is
how the tests make mutated submissions. `BUGS` holds a few such mutations, each named by the grader's diagnosis. The
course's starter code is not copied here; these files are written to its interface.
"""
from __future__ import annotations

from pathlib import Path

CONFIG = '''
from transformers import PretrainedConfig


class GPT2Config(PretrainedConfig):
    model_type = "gpt2"

    def __init__(self, vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 max_position_embeddings=1024, initializer_range=0.02, layer_norm_eps=1e-5, pad_token_id=50256,
                 **kwargs):
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
'''

UTILS = '''
import torch


def get_extended_attention_mask(attention_mask, dtype):
    # (B, T) 1 = real -> (B, 1, 1, T): 0 for real tokens, a large negative number for padding
    extended = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - extended) * -10000.0
'''

BASE_GPT = '''
import torch
from torch import nn


class GPTPreTrainedModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def init_weights(self):
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    @property
    def dtype(self):
        return next(self.parameters()).dtype
'''

ATTENTION = '''
import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transform(self, x, linear_layer):
        proj = linear_layer(x)  # (B, T, C)
        proj = proj.view(x.shape[0], x.shape[1], self.num_attention_heads, self.attention_head_size)
        return proj.transpose(1, 2)  # (B, h, T, hd)

    def attention(self, key, query, value, attention_mask):
        scores = torch.matmul(query, key.transpose(-1, -2))  # (B, h, T, T)
        scores = scores / math.sqrt(self.attention_head_size)
        T = scores.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        out = torch.matmul(probs, value)  # (B, h, T, hd)
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], self.all_head_size)

    def forward(self, hidden_states, attention_mask):
        key_layer = self.transform(hidden_states, self.key)
        value_layer = self.transform(hidden_states, self.value)
        query_layer = self.transform(hidden_states, self.query)
        return self.attention(key_layer, query_layer, value_layer, attention_mask)
'''

LAYER = '''
import torch.nn.functional as F
from torch import nn

from modules.attention import CausalSelfAttention


class GPT2Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attention = CausalSelfAttention(config)
        self.attention_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.interm_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.interm_af = F.gelu
        self.out_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.out_dropout = nn.Dropout(config.hidden_dropout_prob)

    def add(self, input, output, dense_layer, dropout):
        return input + dropout(dense_layer(output))

    def forward(self, hidden_states, attention_mask):
        attn = self.self_attention(self.attention_layer_norm(hidden_states), attention_mask)
        hidden_states = self.add(hidden_states, attn, self.attention_dense, self.attention_dropout)
        mlp = self.interm_af(self.interm_dense(self.out_layer_norm(hidden_states)))
        return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)
'''

MODEL = '''
import torch
from torch import nn
from transformers import GPT2Model as OpenAIGPT2Model

from config import GPT2Config
from models.base_gpt import GPTPreTrainedModel
from modules.gpt2_layer import GPT2Layer
from utils import get_extended_attention_mask


class GPT2Model(GPTPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.word_embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.pos_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embed_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).unsqueeze(0))
        self.gpt_layers = nn.ModuleList([GPT2Layer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.init_weights()

    def embed(self, input_ids):
        pos_ids = self.position_ids[:, :input_ids.shape[1]]
        return self.embed_dropout(self.word_embedding(input_ids) + self.pos_embedding(pos_ids))

    def encode(self, hidden_states, attention_mask):
        extended_attention_mask = get_extended_attention_mask(attention_mask, self.dtype)
        for layer_module in self.gpt_layers:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        return hidden_states

    def forward(self, input_ids, attention_mask):
        hidden = self.encode(self.embed(input_ids), attention_mask)
        hidden = self.final_layer_norm(hidden)
        last_idx = attention_mask.sum(dim=1) - 1
        last_token = hidden[torch.arange(hidden.shape[0]), last_idx]
        return {"last_hidden_state": hidden, "last_token": last_token}

    def hidden_state_to_token(self, hidden_state):
        return hidden_state @ self.word_embedding.weight.t()

    @classmethod
    def from_pretrained(cls, model="gpt2", d=768, l=12, num_heads=12):
        hf = OpenAIGPT2Model.from_pretrained(model).eval()
        ours = GPT2Model(GPT2Config(hidden_size=d, num_hidden_layers=l, num_attention_heads=num_heads,
                                    intermediate_size=d * 3)).eval()
        ours.word_embedding.load_state_dict(hf.wte.state_dict())
        ours.pos_embedding.load_state_dict(hf.wpe.state_dict())
        for i in range(l):
            mine, theirs = ours.gpt_layers[i], hf.h[i]
            c_attn = theirs.attn.c_attn
            for j, name in enumerate(("query", "key", "value")):
                proj = getattr(mine.self_attention, name)
                proj.weight.data = c_attn.weight[:, j * d:(j + 1) * d].T
                proj.bias.data = c_attn.bias[j * d:(j + 1) * d]
            mine.attention_dense.weight.data = theirs.attn.c_proj.weight.T
            mine.attention_dense.bias.data = theirs.attn.c_proj.bias
            mine.interm_dense.weight.data = theirs.mlp.c_fc.weight.T
            mine.interm_dense.bias.data = theirs.mlp.c_fc.bias
            mine.out_dense.weight.data = theirs.mlp.c_proj.weight.T
            mine.out_dense.bias.data = theirs.mlp.c_proj.bias
            for norm, src in (("attention_layer_norm", theirs.ln_1), ("out_layer_norm", theirs.ln_2)):
                getattr(mine, norm).weight.data = src.weight
                getattr(mine, norm).bias.data = src.bias
        ours.final_layer_norm.weight.data = hf.ln_f.weight
        ours.final_layer_norm.bias.data = hf.ln_f.bias
        return ours
'''

OPTIMIZER = '''
import math

import torch
from torch.optim import Optimizer


class AdamW(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))

    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size = step_size * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                p.data.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)
                p.data.add_(p.data, alpha=-group["lr"] * group["weight_decay"])
        return loss
'''

FILES = {"config": ("config.py", CONFIG), "utils": ("utils.py", UTILS), "base_gpt": ("models/base_gpt.py", BASE_GPT),
         "attention": ("modules/attention.py", ATTENTION), "layer": ("modules/gpt2_layer.py", LAYER),
         "model": ("models/gpt2.py", MODEL), "optimizer": ("optimizer.py", OPTIMIZER)}


def write_submission(folder, **replace) -> Path:
    """Write the submission into `folder`; replace={file key: [(old, new), ...]} mutates it (each old must occur)."""
    folder = Path(folder)
    unknown = set(replace) - set(FILES)
    if unknown:
        raise KeyError(f"unknown submission file(s) {sorted(unknown)}; known: {sorted(FILES)}")
    for key, (rel, text) in FILES.items():
        for old, new in replace.get(key, []):
            if text.count(old) != 1:
                raise ValueError(f"{rel}: {old!r} occurs {text.count(old)} times, expected once")
            text = text.replace(old, new)
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip())
    return folder


BUGS = {  # one per check: the grader's diagnosis key -> (the check that loses points, substitutions)
    "no_scale": ("attention", {"attention": [("scores = scores / math.sqrt(self.attention_head_size)",
                                              "scores = scores")]}),
    "post_ln": ("layer", {"layer": [  # LayerNorm after each residual add instead of before each sublayer
        ("        attn = self.self_attention(self.attention_layer_norm(hidden_states), attention_mask)\n"
         "        hidden_states = self.add(hidden_states, attn, self.attention_dense, self.attention_dropout)\n"
         "        mlp = self.interm_af(self.interm_dense(self.out_layer_norm(hidden_states)))\n"
         "        return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)\n",
         "        attn = self.self_attention(hidden_states, attention_mask)\n"
         "        hidden_states = self.attention_layer_norm(\n"
         "            self.add(hidden_states, attn, self.attention_dense, self.attention_dropout))\n"
         "        mlp = self.interm_af(self.interm_dense(hidden_states))\n"
         "        return self.out_layer_norm(self.add(hidden_states, mlp, self.out_dense, self.out_dropout))\n")]}),
    "no_positions": ("embed", {"model": [("self.word_embedding(input_ids) + self.pos_embedding(pos_ids)",
                                          "self.word_embedding(input_ids)")]}),
    "no_final_ln": ("model", {"model": [("        hidden = self.final_layer_norm(hidden)\n", "")]}),
    "qkv_swapped": ("from_pretrained", {"model": [('enumerate(("query", "key", "value"))',
                                                   'enumerate(("key", "query", "value"))')]}),
    "no_bias_correction": ("adamw", {"optimizer": [('if group["correct_bias"]:', "if False:")]}),
    # attention() returns the heads unmerged and forward() returns that: the course's (B, T, C) contract broken (its
    # own layer's attention_dense cannot take it)
    "heads_unmerged": ("attention", {"attention": [
        ("return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], self.all_head_size)",
         "return out  # (B, h, T, hd): the heads never merged")]}),
}


def write_example(folder, bug: str | None = None) -> Path:
    """Write the correct submission, or with `bug` (a key of BUGS) the same submission carrying that one bug."""
    if bug is not None and bug not in BUGS:
        raise KeyError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")
    return write_submission(folder, **(BUGS[bug][1] if bug else {}))
