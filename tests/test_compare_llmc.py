"""bench/compare_llmc.py's files for llm.c: the checkpoint it writes, read back the way llm.c's train_gpt2.c reads it
(header, 16 tensors in its order, its (out, in) product weights) and run through a float64 forward written in llm.c's
conventions, must give transformers' logits; its token files and its reading of llm.c's output lines. (The bench run
itself checks the rest against llm.c: both trainers' losses step by step.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import compare_llmc
from tests.conftest import make_hf_model, tiny_config


def read_llmc_checkpoint(path):
    """llm.c's gpt2_build_from_checkpoint, in numpy: (config, {name: array}) with its shapes."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240326 and header[1] == 3
    max_t, vocab, layers, heads, c, vp = (int(x) for x in header[2:8])
    shapes = {"wte": (vp, c), "wpe": (max_t, c), "ln1w": (layers, c), "ln1b": (layers, c),
              "qkvw": (layers, 3 * c, c), "qkvb": (layers, 3 * c), "attprojw": (layers, c, c),
              "attprojb": (layers, c), "ln2w": (layers, c), "ln2b": (layers, c), "fcw": (layers, 4 * c, c),
              "fcb": (layers, 4 * c), "fcprojw": (layers, c, 4 * c), "fcprojb": (layers, c), "lnfw": (c,),
              "lnfb": (c,)}
    flat = np.fromfile(path, dtype=np.float32, offset=256 * 4)
    assert flat.size == sum(int(np.prod(s)) for s in shapes.values())  # nothing missing, nothing left over
    params, at = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        params[name] = flat[at: at + size].reshape(shape).astype(np.float64)
        at += size
    return dict(max_t=max_t, vocab=vocab, layers=layers, heads=heads, c=c, vp=vp), params


def llmc_forward(cfg: dict, p: dict, ids: np.ndarray) -> np.ndarray:
    """Logits (T, Vp) of llm.c's forward for one row: out = inp @ W^T + b with W (out, in), q | k | v along the
    channels, each head's hs channels in turn, tanh GELU, LayerNorm eps 1e-5, the token table as the head."""
    def norm(x, w, b):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w + b

    c, nh, t = cfg["c"], cfg["heads"], len(ids)
    hs = c // nh
    x = p["wte"][ids] + p["wpe"][:t]
    causal = np.tril(np.ones((t, t), dtype=bool))
    for layer in range(cfg["layers"]):
        qkv = norm(x, p["ln1w"][layer], p["ln1b"][layer]) @ p["qkvw"][layer].T + p["qkvb"][layer]
        q, k, v = qkv[:, :c], qkv[:, c: 2 * c], qkv[:, 2 * c:]
        y = np.empty((t, c))
        for h in range(nh):
            s = slice(h * hs, (h + 1) * hs)
            att = np.where(causal, q[:, s] @ k[:, s].T / np.sqrt(hs), -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            y[:, s] = (att / att.sum(-1, keepdims=True)) @ v[:, s]
        x = x + y @ p["attprojw"][layer].T + p["attprojb"][layer]
        h1 = norm(x, p["ln2w"][layer], p["ln2b"][layer]) @ p["fcw"][layer].T + p["fcb"][layer]
        h1 = 0.5 * h1 * (1 + np.tanh(np.sqrt(2 / np.pi) * (h1 + 0.044715 * h1 ** 3)))
        x = x + h1 @ p["fcprojw"][layer].T + p["fcprojb"][layer]
    return norm(x, p["lnfw"], p["lnfb"]) @ p["wte"].T


def test_checkpoint_gives_transformers_logits_the_way_llmc_reads_it(tmp_path):
    config = tiny_config("h4-wide")  # vocab 1000 (padded to 1024), 64 channels, 4 heads, 2 layers
    hf = make_hf_model(config)
    path = tmp_path / "model.bin"
    compare_llmc.write_checkpoint(hf.state_dict(), config.n_layer, config.n_head, path)
    cfg, params = read_llmc_checkpoint(path)
    assert (cfg["max_t"], cfg["vocab"], cfg["layers"], cfg["heads"], cfg["c"], cfg["vp"]) == (64, 1000, 2, 4, 64, 1024)
    assert not params["wte"][1000:].any()  # the padded rows are zeros
    ids = np.array([5, 999, 17, 0, 312, 42, 42, 7, 800, 3, 64, 1])
    with torch.no_grad():
        want = hf(torch.tensor(ids)[None]).logits[0].double().numpy()
    got = llmc_forward(cfg, params, ids)
    assert np.abs(got[:, :1000] - want).max() < 1e-4  # float32 weights: transformers' fp32 rounding only
    assert np.abs(got[:, 1000:]).max() == 0  # the padded vocabulary's logits


def test_checkpoint_refuses_what_llmc_cannot_hold(tmp_path):
    config = tiny_config("h3-inner")  # n_inner 40, not 4 x 24
    with pytest.raises(ValueError, match="4 x n_embd.*n_inner 40"):
        compare_llmc.write_checkpoint(make_hf_model(config).state_dict(), config.n_layer, config.n_head,
                                      tmp_path / "model.bin")
    assert not (tmp_path / "model.bin").exists()


@pytest.mark.parametrize("vocab, padded", [(50257, 50304), (1000, 1024), (128, 128), (1, 128)])
def test_padded_vocab(vocab, padded):
    assert compare_llmc.padded_vocab(vocab) == padded


def test_token_file(tmp_path):
    path = tmp_path / "dev" / "tokens.bin"
    compare_llmc.write_tokens([0, 50256, 65535, 7], path)
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert list(header[:3]) == [20240520, 1, 4] and not header[3:].any()
    assert list(np.fromfile(path, dtype=np.uint16, offset=1024)) == [0, 50256, 65535, 7]
    assert path.stat().st_size == 1024 + 4 * 2  # llm.c checks the file's size against the count


@pytest.mark.parametrize("tokens", [[], [65536], [-1], [[1, 2]]])
def test_token_file_refuses_ids_it_cannot_hold(tmp_path, tokens):
    with pytest.raises(ValueError, match="0..65535"):
        compare_llmc.write_tokens(tokens, tmp_path / "tokens.bin")


def test_parse_step_reads_llmcs_lines():
    assert compare_llmc.parse_step("step 7: train loss 4.281733 (took 7412.5 ms)\n") == (7, 4.281733, 7.4125)
    assert compare_llmc.parse_step("step 0: train loss 10.840711 (took 9000 ms)") == (0, 10.840711, 9.0)
    assert compare_llmc.parse_step("step 12: train loss nan (took 1.5 ms)")[0] == 12  # a diverged run still counts
    for other in ("val loss 10.840711", "train dataset num_batches: 1", "generating:", ""):
        assert compare_llmc.parse_step(other) is None


def test_loss_note_gives_the_largest_difference():
    note = compare_llmc.loss_note([10.0, 9.0, 8.0], [10.0, 9.00003, 7.9999])
    assert note.startswith("losses step by step within 1.0e-04 of llm.c's") and "step 2 7.9999 vs 8.0000" in note


def test_build_refuses_a_folder_without_llmc_or_a_machine_without_make(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no train_gpt2.c and Makefile there"):
        compare_llmc.build_llmc(tmp_path, tmp_path / "build")
    for name in ("train_gpt2.c", "Makefile"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(compare_llmc.shutil, "which", lambda tool: None if tool == "make" else f"/usr/bin/{tool}")
    with pytest.raises(SystemExit, match="not found here: make \\("):
        compare_llmc.build_llmc(tmp_path, tmp_path / "build")
    assert not (tmp_path / "build").exists()


def test_run_llmc_stops_at_the_last_step_it_needs(tmp_path):
    """llm.c's trainer runs 40 steps with sampling at steps 20 and 40: the bench reads its lines as they come (stdio
    line-buffers a terminal, not a pipe) and stops it after step steps-1."""
    script = tmp_path / "train_gpt2"
    script.write_text("#!/bin/sh\necho \"val loss 10.9\"\nfor i in 0 1 2; do echo \"step $i: train loss 1$i.5 (took "
                      "2$i.0 ms)\"; done\nsleep 30\necho \"step 3: train loss 9.0 (took 1.0 ms)\"\n")
    script.chmod(0o755)
    assert compare_llmc.run_llmc(script, 3, 2) == ([10.5, 11.5, 12.5], [0.020, 0.021, 0.022])
    script.write_text("#!/bin/sh\necho \"step 0: train loss 1.0 (took 1.0 ms)\"\necho \"Error: file size\"\nexit 1\n")
    with pytest.raises(SystemExit, match=r"stopped after 1 of 3 steps:(.|\n)*Error: file size"):
        compare_llmc.run_llmc(script, 3, 2)
