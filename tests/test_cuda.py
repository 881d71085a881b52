"""The GPU path: parity with transformers on CUDA (fp32 with TF32 off, bf16 and fp16 autocast), KV-cache decoding,
AdamW on CUDA tensors, every training CLI on `cuda`, checkpoints between GPU and CPU, and a single-process nccl group.

Every test here is marked `cuda` and skipped, saying why, where no CUDA device is present (CI is CPU-only);
`bench/gpu_check.sh` runs them on a GPU machine. GPT2_CUDA_TESTS_ON_CPU=1 runs them on the CPU instead (a dry run
of the tests' own logic; the nccl test still needs a GPU).
"""
import os
import random

import pytest
import torch
from conftest import make_hf_model, padded_batch, tiny_config
from safetensors.torch import load_file
from test_pretrain import TEXT, TINY
from test_sonnet import course_file, make_bpe_tokenizer, make_sonnet
from test_task_data import make_tokenizer, write_quora, write_sentiment

import run_classifier
import run_paraphrase
import run_pretrain
import run_sonnet
from models.gpt2 import GPT2LMHeadModel, position_ids_from_mask
from models.loading import hf_to_ours
from optimizer import AdamW
from training import checkpoint as ck

DRY_RUN = os.environ.get("GPT2_CUDA_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not (HAS_CUDA or DRY_RUN),
    reason="no CUDA device: the GPU path runs on a GPU machine (bench/gpu_check.sh; GPT2_CUDA_TESTS_ON_CPU=1 dry-runs it)")]
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a real CUDA device (its generator, nccl)")

# Tolerances, stated once. fp32 with TF32 off: as on the CPU. Half precision: relative to the logits' scale (bf16
# keeps 8 significant bits, fp16 11; a few layers of tiny models stay well within these).
FP32_ATOL = 1e-4
HALF_REL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def no_tf32():
    """TF32 off for the fp32 comparisons (the project never turns it on; torch's default for matmuls is off)."""
    if not HAS_CUDA:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def pair(name="h4-wide", seed=0):
    config = tiny_config(name)
    hf = make_hf_model(config, seed).to(DEVICE)
    ours = GPT2LMHeadModel(config)
    ours.gpt.load_state_dict(hf_to_ours(hf.cpu().state_dict(), config.n_layer))
    return hf.to(DEVICE).eval(), ours.to(DEVICE).eval(), config


def test_fp32_logits_equal_transformers_on_the_device():
    hf, ours, config = pair()
    ids, mask = padded_batch([9, 4, 7], 9, config.vocab_size, ["right", "left", "right"], seed=1)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        got = ours(ids, mask)["logits"]
    real = mask.bool()
    assert got.device.type == DEVICE
    torch.testing.assert_close(got[real], want[real], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_autocast_logits_track_fp32(dtype):
    hf, ours, config = pair()
    ids, mask = padded_batch([9, 4, 7], 9, config.vocab_size, "left", seed=2)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with torch.no_grad():
        ref = ours(ids, mask)["logits"]
        with torch.autocast(DEVICE, dtype=dtype):
            low = ours(ids, mask)["logits"]
            hf_low = hf(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    real = mask.bool()
    scale = ref[real].abs().max()
    assert (low.float() - ref)[real].abs().max() <= HALF_REL[dtype] * scale
    assert (low.float() - hf_low.float())[real].abs().max() <= HALF_REL[dtype] * scale  # both sides round alike


def test_batched_left_padded_greedy_decoding_equals_transformers_on_the_device():
    """Every table of the loop (the output, the finished rows, the tokens a repetition penalty has seen) lives on the
    prompt's device."""
    hf, ours, config = pair("h3-inner")
    ids, mask = padded_batch([6, 3, 5], 6, config.vocab_size, "left", seed=3)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       min_new_tokens=12)
    got = ours.generate(ids, mask, max_new_tokens=12)
    assert got.device.type == DEVICE and torch.equal(got, want)
    kw = dict(max_new_tokens=12, eos_token_id=int(got[0, 6 + 2]), pad_token_id=1)
    want = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert torch.equal(ours.generate(ids, mask, **kw), want)
    row = ids[:1]  # no padding: transformers' penalty would count the pads
    want = hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=12, min_new_tokens=12,
                       do_sample=False, repetition_penalty=1.3, pad_token_id=0)
    assert torch.equal(ours.generate(row, max_new_tokens=12, repetition_penalty=1.3), want)


def test_batched_beam_search_equals_transformers_on_the_device():
    """Every table of the search (beams, scores, finished hypotheses, their lengths) lives on the prompt's device."""
    hf, ours, config = pair("h3-inner")
    ids, mask = padded_batch([6, 3, 5], 6, config.vocab_size, "left", seed=3)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    eos = int(ours.generate(ids, mask, max_new_tokens=2)[0, -1])
    kw = dict(max_new_tokens=10, num_beams=3, eos_token_id=eos, pad_token_id=1, length_penalty=0.5)
    want = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    got = ours.generate(ids, mask, **kw)
    assert got.device.type == DEVICE and torch.equal(got, want)


def test_our_adamw_equals_torch_adamw_on_device_tensors():
    torch.manual_seed(0)
    ours_params = [torch.randn(33, 17, device=DEVICE, requires_grad=True), torch.randn(17, device=DEVICE,
                                                                                          requires_grad=True)]
    ref_params = [p.detach().clone().requires_grad_() for p in ours_params]
    ours = AdamW([{"params": ours_params[:1], "weight_decay": 0.1}, {"params": ours_params[1:]}], lr=1e-2, eps=1e-8)
    ref = torch.optim.AdamW([{"params": ref_params[:1], "weight_decay": 0.1},
                             {"params": ref_params[1:], "weight_decay": 0.0}], lr=1e-2, eps=1e-8, foreach=True)
    for step in range(50):
        grads = [torch.randn_like(p) for p in ours_params]
        for p, q, g in zip(ours_params, ref_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_params, ref_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# ---- the CLIs on the device --------------------------------------------------------------------------------------

GPU = ["--use_gpu"]
MODEL = "random:n_layer=2,n_head=2,n_embd=16,n_positions=96,vocab_size=64"


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16"]])
def test_classifier_and_paraphrase_train_on_the_device(tmp_path, capsys, precision):
    tok = make_tokenizer(tmp_path / "tok")
    common = ["--tokenizer", tok, "--model", MODEL, "--epochs", "1", "--batch_size", "8", "--lr", "1e-3",
              *GPU, *precision]
    paths = write_sentiment(tmp_path, "sst", 24)
    assert run_classifier.main(common + ["--fine-tune-mode", "full-model", "--train", str(paths["train"]),
                                         "--dev", str(paths["dev"]), "--output_dir", str(tmp_path / "cls"),
                                         "--dev_out", str(tmp_path / "d.csv")]) == 0
    quora = write_quora(tmp_path / "q.csv", 30)
    assert run_paraphrase.main(common + ["--para_train", str(quora), "--split_dev", "20", "--output_dir",
                                         str(tmp_path / "para"), "--para_dev_out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert ("running on CPU" in out) == (not HAS_CUDA)
    for run in ("cls", "para"):
        weights = load_file(tmp_path / run / "last" / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values())


def test_sonnet_trains_and_generates_on_the_device(tmp_path, capsys):
    rng = random.Random(5)
    tokenizer = make_bpe_tokenizer(tmp_path / "bpe", [make_sonnet(rng, 14) for _ in range(20)])
    tokenizer.save_pretrained(tmp_path / "tok")
    train, dev = [make_sonnet(rng, 14) for _ in range(6)], [make_sonnet(rng, 14) for _ in range(2)]
    (tmp_path / "train.txt").write_text(course_file(train))
    (tmp_path / "gold.txt").write_text(course_file(dev, first=11))
    (tmp_path / "dev.txt").write_text(course_file(["\n".join(s.splitlines()[:3]) for s in dev], first=11))
    model = f"random:n_layer=2,n_head=2,n_embd=32,n_positions=160,vocab_size={len(tokenizer)}"
    assert run_sonnet.main(["--tokenizer", str(tmp_path / "tok"), "--model", model, "--sonnet_path",
                            str(tmp_path / "train.txt"), "--dev_sonnet_path", str(tmp_path / "dev.txt"),
                            "--dev_gold_path", str(tmp_path / "gold.txt"), "--held_out_sonnet_path",
                            str(tmp_path / "dev.txt"), "--dev_out", str(tmp_path / "o.txt"), "--sonnet_out",
                            str(tmp_path / "s.txt"), "--max_new_tokens", "20", "--epochs", "1", "--batch_size", "4",
                            "--output_dir", str(tmp_path / "ck"), *GPU]) == 0
    assert (tmp_path / "s.txt").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pretraining_on_the_device_resumes_there_and_loads_on_the_cpu(tmp_path, dtype):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--eval_interval", "4", "--lr_decay_iters", "8", "--device", DEVICE,
              "--dtype", dtype, "--dropout", "0.1"]  # dropout draws from the device's generator, which resume restores
    full = run_pretrain.main(common + ["--out_dir", str(tmp_path / "full"), "--max_iters", "8"])
    run_pretrain.main(common + ["--out_dir", str(tmp_path / "split"), "--max_iters", "4"])
    resumed = run_pretrain.main(common + ["--out_dir", str(tmp_path / "split"), "--max_iters", "8", "--resume"])
    assert next(resumed["model"].parameters()).device.type == DEVICE
    for (name, a), b in zip(full["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name  # exact resume on the device
    on_cpu = GPT2LMHeadModel.from_pretrained(tmp_path / "split" / "best")  # a GPU checkpoint loads on the CPU
    ids = torch.randint(0, on_cpu.config.vocab_size, (2, 12))
    with torch.no_grad():
        cpu_logits = on_cpu(ids)["logits"]
        dev_logits = on_cpu.to(DEVICE)(ids.to(DEVICE))["logits"].cpu()  # and back on the device
    torch.testing.assert_close(dev_logits, cpu_logits, atol=FP32_ATOL, rtol=0)


@needs_gpu
def test_the_cuda_generator_round_trips_through_a_checkpoint_and_a_cpu_state_restores_on_a_gpu(tmp_path):
    """Dropout and sampling on the GPU draw from the CUDA generator: a resume must restore it exactly. A state captured
    on a CPU-only machine has no CUDA generator in it and restores on a GPU machine too, leaving that one as it was."""
    torch.cuda.manual_seed_all(3)
    ck.save_checkpoint(tmp_path / "c", state={"rng": ck.capture_rng()})
    first = torch.rand(5, device="cuda")
    torch.rand(100, device="cuda")
    ck.restore_rng(ck.load_checkpoint(tmp_path / "c").state["rng"])
    assert torch.equal(torch.rand(5, device="cuda"), first)
    cpu_state = {k: v for k, v in ck.capture_rng().items() if k != "cuda"}
    before = torch.cuda.get_rng_state_all()
    ck.restore_rng(cpu_state)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), before, strict=True))


@needs_gpu
def test_nccl_collectives_take_the_cpu_tensors_the_loops_hand_them(monkeypatch):
    import torch.distributed as tdist

    from training import distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    tdist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert dist.comm_device().type == "cuda"
        meter = torch.tensor(3.5)  # pretraining's loss meter lives on the CPU
        assert dist.all_reduce_sum(meter) is meter and meter.device.type == "cpu" and float(meter) == 3.5
        assert dist.all_reduce_sum(2.0) == 2.0
        assert dist.any_rank(True) is True and dist.any_rank(False) is False
        assert dist.gather_objects({"a": torch.ones(2)})[0]["a"].sum() == 2
    finally:
        tdist.destroy_process_group()
