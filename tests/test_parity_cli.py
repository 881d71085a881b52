"""`python -m models.parity`: passes on faithful weights, fails (exit 1) when ours diverge from the reference."""
import torch

from models import parity
from models.gpt2 import GPT2LMHeadModel


def test_parity_command_passes_on_a_saved_folder(hf_folder, capsys):
    _, folder = hf_folder()
    assert parity.main([str(folder), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "layer  2 output" in out and "greedy generation, 8 new tokens" in out and "identical" in out
    assert out.rstrip().endswith("PASS")


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
