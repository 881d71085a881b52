"""Shared fixtures: tiny configs, reference transformers models saved in HF format, the data folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("PYTHONDONTWRITEBYTECODE") and "mutmut" not in sys.modules:
    # The suite keeps bytecode caches (__pycache__, git-ignored) even where the environment turns them off, as some
    # sandboxes do: otherwise each worker recompiles every test module it collects (13.7 s against 4.2 s of
    # collection on an Ice Lake Xeon) and each of the hundreds of processes the tests start recompiles the project.
    # Where the folder is read-only Python skips the writes silently. mutmut's runs (bench/mutation.py) keep it off.
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.dont_write_bytecode = False
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GPT2_BENCH_RESULTS", "off")  # a benchmark run by a test never appends to bench/results
os.environ.setdefault("GPT2_DECODE_PLAN", "off")  # no timing of kernel forms in tests (tests/test_decode_plan.py does)
os.environ.setdefault("GPT2_ONEDNN_LINEAR", "1")  # oneDNN's products without the timing (tests/test_onednn.py times)
os.environ.setdefault("GPT2_ONEDNN_TRAINING", "1")  # fp32 training's too (tests/test_onednn_training.py times)
os.environ.setdefault("GPT2_TRAIN_THREADS", "off")  # fit's steps keep torch's count: runs compared to the last digit
if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    # mutmut's stats run (bench/mutation.py) records which tests call each function; the variable would make a test's
    # subprocess record too, which needs mutmut's config in its cwd and fails. Without it the subprocess runs the
    # original code; this process stays in stats mode through mutmut's own copy of the setting.
    del os.environ["MUTANT_UNDER_TEST"]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

# torch is imported where it is used, not here: the xdist controller loads this file and runs no test (torch's import
# was 1.7 s of its start, before it starts any worker).
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N (pyproject.toml): the cores shared among the workers
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from config import GPT2Config  # noqa: E402
from models.hub import data_dir, missing_data, tokenizer_dir  # noqa: E402

# Odd shapes on purpose: head counts 3 and 5, n_inner set, vocab sizes that are not multiples of 64.
TINY_CONFIGS = {
    "h3-inner": dict(vocab_size=101, n_positions=40, n_embd=24, n_layer=3, n_head=3, n_inner=40),
    "h5": dict(vocab_size=257, n_positions=32, n_embd=20, n_layer=2, n_head=5),
    "h4-wide": dict(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4),
}


def tiny_config(name: str = "h3-inner", **overrides) -> GPT2Config:
    kw = dict(TINY_CONFIGS[name], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kw.update(bos_token_id=kw["vocab_size"] - 1, eos_token_id=kw["vocab_size"] - 1)
    kw.update(overrides)
    return GPT2Config(**kw)


def make_hf_model(config: GPT2Config, seed: int = 0):
    """A random-init transformers GPT2LMHeadModel (eager attention) with biases and LayerNorms randomised too,
    so that a mis-mapped bias or LayerNorm cannot hide behind zeros and ones."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(config.to_hf(attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf.eval()


# The files holding the suite's long tests (sandboxes, subprocesses, torchrun: 5-30 s a test) run first, the file with
# the longest test first. pytest-xdist hands each worker a contiguous share of the collection and lets an idle worker
# take queued tests from a busy one, but never its running test nor the next one: a long test left for the end keeps
# the other cores idle while it runs (two 7 s tests at the end of one worker's queue cost 13 s of a 5-minute suite on 2
# cores). Only the order of the files changes; each file keeps its own. tests/test_suite.py checks the names.
SLOW_FILES = ("test_grading_payloads.py", "test_distributed.py", "test_grading_isolation.py",
              "test_grading_batch_attacks.py", "test_grading_package.py", "test_grading_class.py", "test_lora.py",
              "test_grading.py", "test_grading_venv.py", "test_grading_hostile.py", "test_grading_sandbox.py",
              "test_reliability.py", "test_quant.py", "test_grading_batch.py", "test_rows_kernel.py",
              "test_docs_commands.py", "test_decode_plan.py", "test_allocator.py", "test_gelu.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))  # stable: the rest as collected


@pytest.fixture(autouse=True)
def restore_threads():
    """CLIs under test set torch's thread count (--threads, torchrun, --split_batch); later tests get it back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def need_inductor() -> None:
    """Skip the calling test, naming why, where torch.compile cannot build C++ here (modules/rows.py's
    inductor_why_not: it fails, for one, where the venv's path holds an apostrophe, as CI's fresh-clone folder does on
    purpose; the project's compiled int8 loop then falls back to the dequantized weight with a warning)."""
    from modules.rows import inductor_why_not

    if why := inductor_why_not():
        pytest.skip(f"torch.compile cannot build C++ in this environment ({why})")


def train_counting(config: GPT2Config, steps: int) -> list[float]:
    """A GPT2LMHeadModel of `config` (seed 0) trained `steps` AdamW steps (lr 3e-3) on counting sequences of
    config.vocab_size tokens (batches of 4 x 17, seed 1): a pattern 20 steps learn. The losses, step by step; the
    kernel tests run it with a path on and off."""
    import torch

    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(0)
    vocab = config.vocab_size
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.randint(0, vocab, (steps, 4, 1), generator=torch.Generator().manual_seed(1))
    data = (starts + torch.arange(17)) % vocab
    losses = []
    for batch in data:
        logits = model(batch[:, :-1])["logits"]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def kernel_or_torch(side: str, monkeypatch, module) -> str:
    """One side of a kernel-backed op for a parametrised fixture: "kernel" (module.ENV unset; skipped where
    module.available() is false) or "torch" (module.ENV=0: torch's ops). Returns the side."""
    if side == "kernel":
        monkeypatch.delenv(module.ENV, raising=False)
        if not module.available():
            pytest.skip("the rows kernel does not build here")
    else:
        monkeypatch.setenv(module.ENV, "0")
    return side


def check_kernel_loader(monkeypatch, module, env: str, warning: str) -> bool:
    """A C++ kernel module's own loader (modules/adamw.py, modules/dropout.py), its cached library reset so that its
    first load runs here: with `env`=0 it is False; a failed build warns (`warning`, a regex: the kernel and what runs
    instead) and is False; then the real build is loaded once and kept. Returns whether the kernel builds here."""
    monkeypatch.delenv(env, raising=False)  # whether it builds, whatever the run's setting (a CI matrix run: 0)
    monkeypatch.setattr(module, "_library", None)
    built = module.available()
    monkeypatch.setattr(module, "_library", None)
    monkeypatch.setenv(env, "0")
    assert module.available() is False and module._library is False
    monkeypatch.setattr(module, "_library", None)
    monkeypatch.delenv(env)

    def failing(*args):
        raise OSError("no compiler here")
    real = module.library
    monkeypatch.setattr(module, "library", failing)
    with pytest.warns(UserWarning, match=warning):
        assert module.available() is False
    monkeypatch.setattr(module, "library", real)
    monkeypatch.setattr(module, "_library", None)
    assert module.available() is built
    if built:
        assert module._load() is module._library  # loaded once, then kept
    return built


@pytest.fixture
def hf_folder(tmp_path):
    """Factory: save a random-init HF model and return (hf_model, folder)."""

    def make(config: GPT2Config | None = None, seed: int = 0, **save_kwargs):
        hf = make_hf_model(config or tiny_config(), seed)
        folder = tmp_path / f"hf-{seed}-{id(hf)}"
        hf.save_pretrained(folder, **save_kwargs)
        return hf, folder

    return make


def checkpointed_twin(config: GPT2Config):
    """Two GPT2LMHeadModels in training mode with the same weights (seed 0), the second with gradient checkpointing."""
    import torch

    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(0)
    a = GPT2LMHeadModel(config).train()
    b = GPT2LMHeadModel(config).train()
    b.load_state_dict(a.state_dict())
    b.gpt.gradient_checkpointing = True
    return a, b


def packed_switch(monkeypatch):
    """modules/packed.py's path forced on (GPT2_PACKED_BF16=force) for the test; the returned switch's off() turns it
    off for a reference run of the plain path, on() back."""
    from modules import packed

    monkeypatch.setenv(packed.ENV, "force")

    class Switch:
        @staticmethod
        def off():
            monkeypatch.setenv(packed.ENV, "0")

        @staticmethod
        def on():
            monkeypatch.setenv(packed.ENV, "force")
    return Switch


def data_path(*parts: str) -> Path:
    """A file of the data folder (models.hub.data_dir(): the bundled data/, or $GPT2_SHARED_DIR/data), e.g.
    data_path("cs224n", "sonnets.txt"); skips the test, saying why, where it is absent (a folder named by
    GPT2_SHARED_DIR without it: a clone has the whole data/)."""
    return _present(data_dir().joinpath(*parts))


def tokenizer_path() -> Path:
    """GPT-2's tokenizer folder (models.hub.tokenizer_dir()), or skip as data_path does."""
    return _present(tokenizer_dir())


def _present(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"data not found: {path} ({missing_data(path)})")
    return path


def padded_batch(lengths: list[int], width: int, vocab: int, side: str | list[str], seed: int = 0):
    """Random ids with padding: side 'left', 'right', or one side per row. Padding ids are arbitrary tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    sides = [side] * len(lengths) if isinstance(side, str) else side
    for i, (n, s) in enumerate(zip(lengths, sides)):
        if s == "left":
            mask[i, width - n:] = 1
        else:
            mask[i, :n] = 1
    return ids, mask


@pytest.fixture
def onednn_fresh(monkeypatch, tmp_path):
    """modules/onednn.py with neither setting, an empty kernel cache, no choice made yet in this process and its
    inner product present: the folder of the cache."""
    from modules import onednn

    for env in (onednn.ENV, onednn.TRAINING_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_choices", {})
    monkeypatch.setattr(onednn, "has_inner_product", lambda: True)
    return tmp_path


def loss_and_grads(model, ids):
    """One training forward and backward of an LM on ids (its own labels): (the loss, {name: a copy of its gradient})."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def bf16_head_case(rows: int, vocab: int, width: int, seed: int = 0, shape: tuple | None = None):
    """bf16 hidden states (rows or shape, width), a (vocab, width) weight of scale 0.1 and a logits' gradient."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*(shape or (rows,)), width, generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, width, generator=g) * 0.1).to(torch.bfloat16)
    grad = torch.randn(*h.shape[:-1], vocab, generator=g).to(torch.bfloat16)
    return h, w, grad


def graph_names(tensor: torch.Tensor) -> set[str]:
    """The class names of every node in tensor's autograd graph."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.fixture
def fused_paths_on(monkeypatch):
    """The fused training paths a test asserts in a graph on, whatever the environment switched off (CI's path matrix
    runs with each off in turn)."""
    from modules import cross_entropy, dropout, fused_qkv, gelu, layer_norm, masked_softmax, rmsnorm

    for module in (cross_entropy, dropout, fused_qkv, gelu, layer_norm, masked_softmax, rmsnorm):
        monkeypatch.delenv(module.ENV, raising=False)
    monkeypatch.setattr(gelu, "_on", None)  # read again without the switch
