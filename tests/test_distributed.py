"""torchrun: two CPU processes (gloo) sharing each global batch reach the weights of one process (within 1e-6).

Each test launches `python -m torch.distributed.run --standalone --nproc_per_node=2` on a tiny model with dropout 0
and compares the checkpoint it wrote with an in-process single-process run of the same command."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_pretrain import TEXT
from test_task_data import make_tokenizer, write_sentiment

import run_classifier
import run_pretrain
from training import distributed as dist

ROOT = Path(__file__).resolve().parents[1]
NO_DROPOUT = "random:n_layer=2,n_head=2,n_embd=16,n_positions=64,vocab_size=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def torchrun(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # TMPDIR: torchrun's log folders (torchelastic_*) go to the test's folder, not the machine's /tmp
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(cwd)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / script),
           *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def max_difference(folder_a: Path, folder_b: Path, names=("model.safetensors",)) -> float:
    worst = 0.0
    for name in names:
        a, b = load_file(folder_a / name), load_file(folder_b / name)
        assert a.keys() == b.keys()
        worst = max(worst, max(float((a[k] - b[k]).abs().max()) for k in a))
    return worst


def test_two_processes_fine_tune_to_the_weights_of_one(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    # 41 examples in batches of 8: the last batch holds 1, so one rank's slice of it is empty (weight 0).
    paths = write_sentiment(tmp_path, "sst", 41)
    common = ["--tokenizer", tok, "--model", NO_DROPOUT, "--epochs", "2", "--batch_size", "8", "--lr", "1e-3",
              "--fine-tune-mode", "full-model", "--head_dropout", "0", "--grad_accum", "2",
              "--train", str(paths["train"]), "--dev", str(paths["dev"]), "--test", str(paths["test-student"])]
    files = lambda d: ["--output_dir", str(tmp_path / d), "--dev_out", str(tmp_path / d / "dev.csv"),  # noqa: E731
                       "--test_out", str(tmp_path / d / "test.csv")]
    assert run_classifier.main(common + files("one") + ["--threads", "1"]) == 0
    done = torchrun("run_classifier.py", common + files("two"), tmp_path)

    diff = max_difference(tmp_path / "one" / "last", tmp_path / "two" / "last",
                          ("model.safetensors", "extra.safetensors"))
    assert diff < 1e-6, diff
    assert "distributed: 2 processes" in done.stdout
    assert done.stdout.count("epoch 2/2 |") == 1  # rank 0 alone logs
    assert (tmp_path / "two" / "dev.csv").read_text() == (tmp_path / "one" / "dev.csv").read_text()
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["best", "curves.png", "dev.csv", "last", "metrics.jsonl",
                                                                   "test.csv"]


def test_two_processes_pretrain_to_the_weights_of_one(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 2, encoding="utf-8")
    common = ["--data", str(corpus), "--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "16",
              "--batch_size", "5", "--grad_accum", "2", "--eval_iters", "2", "--eval_interval", "4",
              "--max_iters", "8", "--warmup_iters", "2", "--num_samples", "0", "--log_interval", "4",
              "--learning_rate", "3e-4", "--min_lr", "3e-5"]  # Adam turns rounding noise into steps of up to lr
    run_pretrain.main(common + ["--out_dir", str(tmp_path / "one"), "--threads", "1"])
    done = torchrun("run_pretrain.py", common + ["--out_dir", str(tmp_path / "two")], tmp_path)

    diff = max_difference(tmp_path / "one" / "best", tmp_path / "two" / "best")
    assert diff < 1e-6, diff
    assert done.stdout.count("done: step 8") == 1
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["best", "curves.png", "data", "last", "metrics.jsonl"]


def test_single_process_helpers_are_identities():
    assert not dist.init() and dist.world_size() == 1 and dist.is_main()
    assert dist.shard(list(range(5))) == [0, 1, 2, 3, 4]
    assert dist.all_reduce_sum(2.5) == 2.5 and dist.any_rank(False) is False
    assert dist.gather_objects({"a": torch.ones(2)})[0]["a"].sum() == 2


def test_the_backend_follows_the_device_asked_for_not_the_host(monkeypatch):
    """A CPU run under torchrun on a GPU host gets gloo (nccl would refuse its CPU tensors); a CUDA run gets nccl."""
    import torch.distributed as tdist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    asked = []
    monkeypatch.setattr(tdist, "init_process_group", lambda backend, **kw: asked.append(backend))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert dist.init(1, "cpu") and dist.init(1, "cuda") and dist.init(1, torch.device("cuda", 0))
    assert asked == ["gloo", "nccl", "nccl"]
    assert dist.backend_for("cpu") == "gloo" and dist.backend_for("cuda:1") == "nccl"


def test_collectives_in_a_real_single_process_group_keep_tensors_where_they_were():
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.is_distributed() and dist.comm_device() == torch.device("cpu")
        meter = torch.tensor(2.5)
        assert dist.all_reduce_sum(meter) is meter and float(meter) == 2.5
        assert dist.all_reduce_sum(1.25) == 1.25 and isinstance(dist.all_reduce_sum(1.25), float)
        assert dist.any_rank(True) is True and dist.any_rank(False) is False
        assert dist.gather_objects({"a": torch.ones(2)})[0]["a"].sum() == 2
    finally:
        tdist.destroy_process_group()
