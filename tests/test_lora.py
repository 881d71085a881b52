"""LoRA (models/lora.py, modules/lora.py): PEFT parity both ways, merge / unmerge, merged checkpoints, training and resuming with
adapters, and the bad inputs. PEFT on transformers' GPT-2 is the reference throughout."""
import copy
import json

import pytest
import torch
from conftest import padded_batch, tiny_config
from torch import nn

from models.gpt2 import GPT2LMHeadModel
from models.loading import CheckpointError
from models.lora import AdapterError, apply_lora, load_adapter, lora_modules, merge_lora, save_adapter, unmerge_lora
from modules.linear import Linear as DecodeLinear
from modules.lora import LoRALinear


class _Peft:
    """peft, imported by the first test that uses it (6 s of every worker's collection otherwise); a test skips
    without it."""

    def __getattr__(self, name):
        if name.startswith("__"):  # pytest's collection asks every module global for __test__ and the like
            raise AttributeError(name)
        return getattr(pytest.importorskip("peft"), name)


peft = _Peft()
transformers = pytest.importorskip("transformers")


def randomize_adapters(model, seed=0):
    """Random A and B (a fresh adapter has B = 0, which would hide any mistake in B or in the scaling)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def hf_logits(model, ids, mask):
    """transformers numbers positions 0..T-1 whatever the padding; give it ours (cumsum - 1) to compare."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def batches(vocab):
    return [padded_batch([7, 4, 9], 9, vocab, side) for side in ("right", "left")]


def assert_same_logits(ours, ref, vocab):
    for ids, mask in batches(vocab):
        a = ours(ids, mask)["logits"]
        b = hf_logits(ref, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)


@pytest.fixture
def base(hf_folder):
    """(our LM, transformers' LM, folder) on the same random weights."""
    hf, folder = hf_folder(tiny_config("h3-inner"))
    return GPT2LMHeadModel.from_pretrained(folder), hf, folder


def peft_from(folder, adapter):
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    return peft.PeftModel.from_pretrained(hf, adapter).eval()


@pytest.mark.parametrize("rank,targets", [(1, ["c_attn"]), (4, ["attention", "mlp"]),
                                          (3, ["query", "value", "mlp.c_proj"]), (2, "c_fc,c_proj")])
def test_our_adapter_loads_in_peft_with_the_same_logits(base, tmp_path, rank, targets):
    ours, _, folder = base
    apply_lora(ours, rank=rank, alpha=2.5 * rank, targets=targets)
    randomize_adapters(ours)
    save_adapter(ours.eval(), tmp_path / "adapter", base_model=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == rank and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) <= {"c_attn", "c_proj", "attn.c_proj", "c_fc", "mlp.c_proj"}
    assert_same_logits(ours, peft_from(folder, tmp_path / "adapter"), ours.config.vocab_size)


PEFT_CONFIGS = [
    dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
    dict(r=2, lora_alpha=5, target_modules=["c_attn", "c_proj", "c_fc"], use_rslora=True, lora_dropout=0.1),
    dict(r=3, lora_alpha=6, target_modules=["c_attn", "c_fc"], layers_to_transform=[0, 2],
         rank_pattern={"h.2.attn.c_attn": 5}, alpha_pattern={"h.0.mlp.c_fc": 1.5}),
]


@pytest.mark.parametrize("kw", PEFT_CONFIGS, ids=["c_attn", "rslora-all", "patterns-some-layers"])
def test_a_peft_adapter_loads_into_ours_with_the_same_logits_and_saves_back_unchanged(base, tmp_path, kw):
    ours, hf, folder = base
    ref = peft.get_peft_model(hf, peft.LoraConfig(fan_in_fan_out=True, **kw))
    randomize_adapters(ref, seed=1)
    ref.save_pretrained(tmp_path / "peft")
    load_adapter(ours, tmp_path / "peft")
    assert_same_logits(ours, ref.eval(), ours.config.vocab_size)

    save_adapter(ours, tmp_path / "back")  # exact both ways: the same tensors, and PEFT reads the same model
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_logits(ours, peft_from(folder, tmp_path / "back"), ours.config.vocab_size)


def test_merge_then_unmerge_restores_the_base_and_a_merged_checkpoint_loads_in_transformers(base, tmp_path):
    ours, _, folder = base
    before = {k: v.clone() for k, v in ours.state_dict().items() if "lora_" not in k}
    apply_lora(ours, rank=4, alpha=8, targets="all")
    randomize_adapters(ours)
    ids, mask = batches(ours.config.vocab_size)[1]
    with torch.no_grad():
        adapted = ours(ids, mask)["logits"]
        merge_lora(ours)
        merged = ours(ids, mask)["logits"]
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    ours.save_pretrained(tmp_path / "merged")
    hf_merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    real = mask.bool()
    torch.testing.assert_close(hf_logits(hf_merged, ids, mask)[real], adapted[real], atol=1e-5, rtol=0)

    unmerge_lora(ours)
    after = ours.state_dict()
    assert max((after[k] - v).abs().max().item() for k, v in before.items()) <= 1e-6
    with pytest.raises(CheckpointError, match="unmerged LoRA"):
        ours.save_pretrained(tmp_path / "unmerged")  # would silently drop the adapter


def test_bad_hyperparameters_and_targets_are_refused_naming_the_problem(base):
    ours = base[0]
    for kw, msg in [(dict(rank=0), "rank must be a positive integer"), (dict(alpha=0), "alpha must be positive"),
                    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"), (dict(dropout=-0.1), "dropout"),
                    (dict(targets=["c_attn", "lm_head"]), "'lm_head' names no layer; valid targets: c_attn")]:
        with pytest.raises(ValueError, match=msg):
            apply_lora(ours, **kw)
    assert not lora_modules(ours) and all(p.requires_grad for p in ours.parameters())  # nothing half-applied


def test_adapters_for_another_shape_or_with_unsupported_peft_features_are_refused(base, hf_folder, tmp_path):
    ours, _, _ = base
    _, other = hf_folder(tiny_config("h3-inner", n_embd=30, n_inner=40), seed=1)  # wider body, same layer count
    ref = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(other), peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    ref.save_pretrained(tmp_path / "wide")
    with pytest.raises(AdapterError, match=r"another base shape: h\.0\.attn\.c_attn\.lora_A \(2, 30\)"):
        load_adapter(ours, tmp_path / "wide")
    assert not lora_modules(ours)

    hf = transformers.GPT2LMHeadModel.from_pretrained(base[2])
    for kw, msg in [(dict(use_dora=True), "use_dora"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                    (dict(bias="lora_only"), "bias='lora_only'")]:
        dora = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(base[2]), peft.LoraConfig(
            r=2, target_modules=["c_attn"], fan_in_fan_out=True, **kw))
        dora.save_pretrained(tmp_path / msg)
        with pytest.raises(AdapterError, match=f"cannot represent exactly: {msg}"):
            load_adapter(ours, tmp_path / msg)
    emb = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["wte", "c_fc"], fan_in_fan_out=True))
    emb.save_pretrained(tmp_path / "emb")
    with pytest.raises(AdapterError, match=r"not LoRA A/B of GPT-2's .*transformer\.wte\.lora_embedding_A"):
        load_adapter(ours, tmp_path / "emb")


# ---- LoRALinear on its own -----------------------------------------------------------------------------------------

class OneLinear(nn.Module):
    """The smallest model PEFT adapts: one Linear named `lin`."""

    def __init__(self, bias: bool):
        super().__init__()
        self.lin = nn.Linear(6, 5, bias=bias)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("bias,dropout", [(True, None), (False, 0.5)], ids=["defaults", "dropout"])
def test_a_lora_linear_trains_like_peft_s_lora_layer(bias, dropout):
    """In training mode, outputs and adapter gradients equal PEFT's: our defaults are LoraConfig's (no dropout, alpha / r
    scaling), and with dropout the adapter's input is dropped as PEFT drops it (the same mask under the same seed)."""
    torch.manual_seed(0)
    model = OneLinear(bias)
    ours = LoRALinear(copy.deepcopy(model.lin), 4, 8, **({} if dropout is None else dict(dropout=dropout)))
    ref = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lin"],
                                                     **({} if dropout is None else dict(lora_dropout=dropout))))
    with torch.no_grad():
        ours.lora_B.normal_()
        ref.base_model.model.lin.lora_A["default"].weight.copy_(ours.lora_A)
        ref.base_model.model.lin.lora_B["default"].weight.copy_(ours.lora_B)
    ours.train(), ref.train()
    x = torch.randn(2, 3, 6)
    outs = []
    for layer, A, B in [(ours, ours.lora_A, ours.lora_B),
                        (ref, ref.base_model.model.lin.lora_A["default"].weight, ref.base_model.model.lin.lora_B["default"].weight)]:
        torch.manual_seed(1)
        y = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), A.grad, B.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if dropout:  # the dropout did drop something: training and eval outputs differ
        assert not torch.allclose(outs[0][0], ours.eval()(x))


@pytest.mark.parametrize("bias", [True, False])
def test_a_lora_linear_freezes_its_base_and_starts_as_it_with_a_like_nn_linear_s_weight(bias):
    base = nn.Linear(6, 5, bias=bias, dtype=torch.float64)
    torch.manual_seed(0)
    layer = LoRALinear(base, rank=3, alpha=6)
    torch.manual_seed(0)
    A = nn.Linear(6, 3, bias=False, dtype=torch.float64).weight  # PEFT's default init of lora_A: nn.Linear's
    assert torch.equal(layer.lora_A, A) and layer.lora_A.dtype == layer.lora_B.dtype == torch.float64
    assert torch.equal(layer.lora_B, torch.zeros(5, 3, dtype=torch.float64))
    assert layer.weight is base.weight and layer.bias is base.bias
    assert [name for name, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(layer(x), base(x))  # B = 0: a new adapter changes nothing
    on_meta = LoRALinear(nn.Linear(6, 5, bias=bias, device="meta"), rank=3, alpha=6)  # another device than the CPU
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
    with pytest.raises(ValueError, match=r"^a shared lora_A has shape \(3, 5\), expected \(2, 6\)$"):
        LoRALinear(base, rank=2, alpha=4, lora_A=nn.Parameter(torch.zeros(3, 5, dtype=torch.float64)))


def test_a_new_adapter_counts_as_unmerged_in_its_repr_and_when_saving_a_whole_checkpoint(tmp_path):
    layer = LoRALinear(nn.Linear(6, 5), rank=2, alpha=3)
    assert layer.extra_repr() == "in_features=6, out_features=5, rank=2, alpha=3, merged=False"
    layer.merge()
    assert layer.extra_repr().endswith("merged=True")
    model = apply_lora(GPT2LMHeadModel(tiny_config()), rank=2, alpha=4)
    with pytest.raises(CheckpointError, match="^the model has unmerged LoRA adapters"):
        model.save_pretrained(tmp_path)


def test_merge_with_unload_leaves_the_models_own_linears_like_peft_s_merge_and_unload(base, tmp_path):
    ours, _, folder = base
    keys = set(ours.state_dict())
    apply_lora(ours, rank=2, alpha=5, targets="all")
    randomize_adapters(ours)
    save_adapter(ours.eval(), tmp_path / "adapter", base_model=str(folder))
    rng = torch.get_rng_state()
    merge_lora(ours, unload=True)
    assert torch.equal(torch.get_rng_state(), rng)  # unloading draws no random numbers (a seeded run stays seeded)
    assert not lora_modules(ours) and set(ours.state_dict()) == keys
    linears = [m for name, m in ours.named_modules() if name.endswith(("query", "key", "value", "_dense"))]
    # the model's own Linear, as a model loaded from the merged weights has (its int8/int4 decoding takes them)
    assert len(linears) == 6 * ours.config.n_layer and all(type(m) is DecodeLinear for m in linears)
    assert_same_logits(ours, peft_from(folder, tmp_path / "adapter").merge_and_unload(), ours.config.vocab_size)


# ---- training, checkpoints and the task CLIs -----------------------------------------------------------------------

def test_training_with_lora_changes_only_adapters_and_head_and_checkpoints_hold_only_them(tmp_path):
    from safetensors.torch import load_file

    from models.gpt2 import GPT2Model
    from tasks.classifier import GPT2SentimentClassifier, loss_fn
    from tasks.data import Encoded, collate
    from tasks.finetune import train
    from training.engine import TrainConfig, load_weights

    torch.manual_seed(0)
    model = GPT2SentimentClassifier(GPT2Model(tiny_config()), 3, 0.0, "full-model")
    apply_lora(model, rank=2, alpha=4, targets="query,value,mlp", dropout=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = [Encoded(str(i), torch.randint(0, 100, (5,), generator=g).tolist(), i % 3) for i in range(16)]
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), epochs=1, batch_size=4, lr=1e-2, weight_decay=0.1)
    train(model, len(data), lambda idx: collate([data[i] for i in idx], 0), loss_fn, lambda m: {"acc": 0.0}, cfg, {})

    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    expected = {k for k in before if "lora_" in k or k.startswith("classifier.")}
    assert changed == expected  # every adapter tensor and the head moved; no base weight did (decay included)
    files = {p.name for p in (tmp_path / "out" / "last").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "extra.safetensors"} <= files
    assert "model.safetensors" not in files
    assert set(load_file(tmp_path / "out" / "last" / "extra.safetensors")) == {"classifier.weight", "classifier.bias"}

    fresh = GPT2SentimentClassifier(GPT2Model(tiny_config()), 3, 0.0, "full-model")
    with pytest.raises(ValueError, match="holds a LoRA adapter, not a whole model"):
        load_weights(fresh, tmp_path / "out" / "last")
    apply_lora(fresh, rank=2, alpha=4, targets="query,value,mlp")
    load_weights(fresh, tmp_path / "out" / "last")
    assert all(torch.equal(v, after[k]) for k, v in fresh.state_dict().items() if "lora_" in k or "classifier" in k)
    apply_other = GPT2SentimentClassifier(GPT2Model(tiny_config()), 3, 0.0, "full-model")
    apply_lora(apply_other, rank=3, alpha=4, targets="query,value,mlp")
    with pytest.raises(AdapterError, match=r"h\.0\.attn\.c_attn has rank 2, alpha 4, .* the model's LoRA there has rank 3"):
        load_weights(apply_other, tmp_path / "out" / "last")


def write_base(folder):
    """A random-init body saved in HF format, so runs and the test start from the same base weights."""
    from config import GPT2Config
    from models.gpt2 import GPT2Model

    torch.manual_seed(3)
    GPT2Model(GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2)).save_pretrained(folder)
    return str(folder)


def test_a_lora_classifier_run_killed_resumes_to_the_same_adapter_and_merges(tmp_path, capsys):
    import sys

    from safetensors.torch import load_file
    from test_reliability import ROOT, kill_once_checkpointed
    from test_task_data import make_tokenizer, write_sentiment

    import run_classifier
    from models.gpt2 import GPT2Model

    tok, paths, base_dir = make_tokenizer(tmp_path / "tok"), write_sentiment(tmp_path, "sst", 48), write_base(tmp_path / "base")
    common = ["--tokenizer", tok, "--model", base_dir, "--epochs", "3", "--batch_size", "4", "--save_every", "1",
              "--threads", "1", "--train", str(paths["train"]), "--dev", str(paths["dev"]),
              "--lora_rank", "4", "--lora_targets", "c_attn,c_fc", "--lora_dropout", "0.1", "--lr", "1e-2"]
    out = lambda d: ["--output_dir", str(tmp_path / d), "--dev_out", str(tmp_path / d / "dev.csv")]  # noqa: E731
    kill_once_checkpointed([sys.executable, str(ROOT / "run_classifier.py"), *common, *out("killed")],
                           [tmp_path / "killed" / "last"], tmp_path)
    capsys.readouterr()
    assert run_classifier.main(common + out("killed") + ["--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert run_classifier.main(common + out("full") + ["--merge_lora"]) == 0
    assert "LoRA rank 4, alpha 8" in capsys.readouterr().out

    for name in ("adapter_model.safetensors", "extra.safetensors"):
        a, b = load_file(tmp_path / "full" / "last" / name), load_file(tmp_path / "killed" / "last" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name  # exactly equal
    assert (tmp_path / "full" / "dev.csv").read_text() == (tmp_path / "killed" / "dev.csv").read_text()
    assert sum(p.stat().st_size for p in (tmp_path / "full" / "last").iterdir()) < 200_000  # no base weights

    # merged/ = base + the best adapter, a whole checkpoint transformers loads; the head beside it
    ours = load_adapter(GPT2Model.from_pretrained(base_dir), tmp_path / "full" / "best")
    hf = transformers.GPT2Model.from_pretrained(tmp_path / "full" / "merged", attn_implementation="eager").eval()
    ids, mask = padded_batch([6, 3], 6, 64, "right")
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                                   ours(ids, mask)["last_hidden_state"][real], atol=1e-5, rtol=0)
    assert set(load_file(tmp_path / "full" / "merged" / "extra.safetensors")) == {"classifier.weight", "classifier.bias"}
    lm = load_adapter(GPT2LMHeadModel.from_pretrained(base_dir), tmp_path / "full" / "best")
    assert_same_logits(lm, peft_from(base_dir, tmp_path / "full" / "best"), 64)  # PEFT reads a run's best/ as it is


def test_paraphrase_and_sonnet_clis_train_adapters_and_refuse_contradictions(tmp_path, capsys):
    import random

    from test_sonnet import course_file, make_bpe_tokenizer, make_sonnet
    from test_task_data import make_tokenizer, write_quora

    import run_paraphrase
    import run_sonnet

    tok = make_tokenizer(tmp_path / "tok")
    train = write_quora(tmp_path / "quora.csv", 24)
    common = ["--tokenizer", tok, "--model", write_base(tmp_path / "base"), "--epochs", "1", "--batch_size", "8",
              "--threads", "1", "--para_train", str(train), "--split_dev", "16", "--output_dir", str(tmp_path / "p"),
              "--para_dev_out", str(tmp_path / "p.csv"), "--lora_rank", "2", "--lora_targets", "attention"]
    assert run_paraphrase.main(common) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 2, alpha 4" in out and "0.00M trainable" in out  # the adapters alone (no head to train)
    assert (tmp_path / "p" / "best" / "adapter_model.safetensors").is_file()
    with pytest.raises(SystemExit):
        run_paraphrase.main(common + ["--fine-tune-mode", "last-linear-layer"])
    assert "LoRA adapters in the body would never learn" in capsys.readouterr().err

    rng = random.Random(5)
    sonnets = [make_sonnet(rng, 14) for _ in range(6)]
    tokenizer = make_bpe_tokenizer(tmp_path / "bpe", sonnets * 3)
    for name, text in {"train": course_file(sonnets[:4]), "gold": course_file(sonnets[4:], first=5),
                       "dev": course_file(["\n".join(s.splitlines()[:3]) for s in sonnets[4:]], first=5)}.items():
        (tmp_path / f"{name}.txt").write_text(text)
    files = ["--tokenizer", str(tmp_path / "bpe"), "--sonnet_path", str(tmp_path / "train.txt"),
             "--dev_sonnet_path", str(tmp_path / "dev.txt"), "--dev_gold_path", str(tmp_path / "gold.txt"),
             "--held_out_sonnet_path", str(tmp_path / "dev.txt"), "--dev_out", str(tmp_path / "dev_out.txt"),
             "--sonnet_out", str(tmp_path / "out.txt"), "--max_new_tokens", "8", "--threads", "1"]
    model = f"random:n_layer=2,n_head=2,n_embd=16,n_positions=160,vocab_size={len(tokenizer)}"
    assert run_sonnet.main(files + ["--model", model, "--epochs", "1", "--batch_size", "4", "--lora_rank", "2",
                                    "--output_dir", str(tmp_path / "s"), "--merge_lora"]) == 0
    assert "the adapter merged into the base" in capsys.readouterr().out
    assert run_sonnet.main(files + ["--generate_only", "--model", str(tmp_path / "s" / "merged"), "--overwrite"]) == 0
    with pytest.raises(SystemExit):
        run_sonnet.main(files + ["--generate_only", "--model", model, "--lora_rank", "2"])
    assert "--generate_only and --baseline do not train" in capsys.readouterr().err
