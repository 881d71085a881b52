"""`python -m models.parity`: passes on faithful weights, fails (exit 1) when ours diverge from the reference."""
import torch

from models import parity
from models.gpt2 import GPT2LMHeadModel


def test_parity_command_passes_on_a_saved_folder(hf_folder, capsys):
    _, folder = hf_folder()
    assert parity.main([str(folder), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "layer  2 output" in out and "greedy generation, 8 new tokens" in out and "identical" in out
    assert out.rstrip().endswith(f"-> PASS (weights from {folder})")


def test_parity_verdict_says_when_it_compared_a_random_init_model(tmp_path, capsys, monkeypatch):
    """Issue 37: offline, `python -m models.parity gpt2` fell back to random init and ended in a bare PASS."""
    import transformers

    from config import GPT2Config

    def unreachable(*args, **kwargs):
        raise FileNotFoundError("cannot get 'gpt2' from the Hugging Face hub")

    def tiny_reference(preset, directory, seed=0):  # a tiny model standing in for gpt2's 124M
        config = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=64).to_hf()
        transformers.GPT2LMHeadModel(config).save_pretrained(directory)
        return directory

    monkeypatch.setattr(parity, "make_random_reference", tiny_reference)
    load = GPT2LMHeadModel.from_pretrained.__func__
    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained",
                        classmethod(lambda cls, spec, **kw: unreachable() if spec == "gpt2" else load(cls, spec, **kw)))
    argv = ["gpt2", "--max-new-tokens", "2", "--random-dir", str(tmp_path)]
    assert parity.main(argv) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.endswith("-> PASS (random-init gpt2, the official weights could not be fetched)")
    assert parity.main(argv + ["--random-init"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("-> PASS (random-init gpt2, as --random-init asked)")


def test_parity_command_fails_when_weights_differ(hf_folder, capsys, monkeypatch):
    _, folder = hf_folder()
    load = GPT2LMHeadModel.from_pretrained

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.gpt.gpt_layers[1].out_dense.bias.add_(1e-2)
        return model

    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", perturbed)
    assert parity.main([str(folder), "--max-new-tokens", "8"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out.splitlines()[-1]


def test_parity_command_reports_an_unreachable_model(capsys):
    assert parity.main(["./no/such/folder", "--no-fallback"]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
