"""GPT-2 training on the CPU against llm.c (github.com/karpathy/llm.c), the C trainer people pick to train GPT-2
without a framework: its `train_gpt2.c`, built and run as its README says (`make train_gpt2`, `OMP_NUM_THREADS=<cores>
./train_gpt2`), side by side with ours on the same weights, the same batch and the same update.

llm.c's CPU trainer is fp32, gpt2's size (124M), batch 4 x 64 and AdamW (lr 1e-4, betas 0.9 / 0.999, eps 1e-8, no
weight decay), all fixed in its main(), and has no dropout. Ours runs that step: the same 4 x 64 tokens, dropout off,
optimizer.AdamW with llm.c's settings as fit() builds it (fused; for bf16 `--dtype bf16-weights`: bf16 weights with
fp32 masters), the steps' thread count chosen as fit() chooses it. The weights are a gpt2-size GPT-2 made by
transformers at random init (the official ones cannot be downloaded here), written into llm.c's checkpoint format
(`write_checkpoint`), and the training file holds exactly one batch (4 x 64 + 1 tokens of tiny shakespeare, GPT-2
tokenizer), so llm.c's shuffling loader serves the same batch at every step and both trainers take the same steps:
their losses, step by step, are a check of each against the other (fp32: the same arithmetic up to the order of its
sums). Each run is a process of its own, the contenders interleaved over --rounds; a run's figure is the median of its
steps 1..N-1 (step 0 pays for first touches of memory), llm.c's from its own "(took X ms)" lines, ours timed the
same way (forward, backward and update).

    git clone https://github.com/karpathy/llm.c /tmp/llm.c
    python bench/compare_llmc.py --llmc /tmp/llm.c              # quiet: fp32, and bf16 where bf16 products are fast
    python bench/compare_llmc.py --llmc /tmp/llm.c --busy 1     # one process spinning on a core beside every run
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import busy_suffix, print_machine_header, spin, stop  # noqa: E402
from bench.results import Recorder  # noqa: E402

B, T = 4, 64  # llm.c's train_gpt2.c main(): fixed there
LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8  # its gpt2_update call (weight decay 0)
MODEL_MAGIC, MODEL_VERSION = 20240326, 3  # llm.c's checkpoint header: fp32 weights, vocabulary padded
TOKENS_MAGIC, TOKENS_VERSION = 20240520, 1  # its token files: uint16 ids
HEADER_INTS = 256
STEP_LINE = re.compile(r"^step (\d+): train loss ([-+\d.eEnaif]+) \(took ([\d.]+) ms\)")
TARGET = 1.0  # ours' steps at least as fast as llm.c's


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    """The vocabulary rounded up as llm.c pads it (50257 -> 50304)."""
    return -(-vocab // multiple) * multiple


def llmc_tensors(state: dict, n_layer: int) -> list[np.ndarray]:
    """transformers' GPT-2 state dict as llm.c's 16 parameter tensors, in its order and layout: the token table
    padded with zero rows to padded_vocab, each layer's tensors stacked over the layers, and the products' weights
    as (out, in) (transformers' Conv1D keeps them (in, out))."""
    def get(name: str) -> np.ndarray:
        return state[name].detach().float().cpu().numpy()

    def layers(name: str, transpose: bool = False) -> np.ndarray:
        return np.stack([get(f"transformer.h.{i}.{name}").T if transpose else get(f"transformer.h.{i}.{name}")
                         for i in range(n_layer)])

    wte = get("transformer.wte.weight")
    padded = np.zeros((padded_vocab(wte.shape[0]), wte.shape[1]), dtype=np.float32)
    padded[: wte.shape[0]] = wte
    return [padded, get("transformer.wpe.weight"), layers("ln_1.weight"), layers("ln_1.bias"),
            layers("attn.c_attn.weight", True), layers("attn.c_attn.bias"), layers("attn.c_proj.weight", True),
            layers("attn.c_proj.bias"), layers("ln_2.weight"), layers("ln_2.bias"), layers("mlp.c_fc.weight", True),
            layers("mlp.c_fc.bias"), layers("mlp.c_proj.weight", True), layers("mlp.c_proj.bias"),
            get("transformer.ln_f.weight"), get("transformer.ln_f.bias")]


def write_checkpoint(state: dict, n_layer: int, n_head: int, path: Path) -> None:
    """llm.c's model file (version 3): 256 int32 of header (magic, version, max_seq_len, vocab_size, num_layers,
    num_heads, channels, padded_vocab_size), then every parameter in float32, in llmc_tensors' order. A model llm.c
    cannot hold (an MLP other than 4 x n_embd wide) is refused with ValueError."""
    vocab, channels = state["transformer.wte.weight"].shape
    inner = state["transformer.h.0.mlp.c_fc.weight"].shape[1]
    if inner != 4 * channels or channels % n_head:
        raise ValueError(f"llm.c's GPT-2 has an MLP of 4 x n_embd and n_embd divisible by n_head; this model has "
                         f"n_inner {inner}, n_embd {channels}, n_head {n_head}")
    tensors = llmc_tensors(state, n_layer)
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:8] = [MODEL_MAGIC, MODEL_VERSION, state["transformer.wpe.weight"].shape[0], vocab, n_layer, n_head,
                  channels, padded_vocab(vocab)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(np.ascontiguousarray(t, dtype=np.float32).tobytes())


def write_tokens(tokens: list[int], path: Path) -> None:
    """llm.c's token file: 256 int32 of header (magic, version 1, count), then the ids as uint16."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= 2 ** 16:
        raise ValueError("llm.c's token files hold a non-empty list of ids in 0..65535")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = [TOKENS_MAGIC, TOKENS_VERSION, len(ids)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.astype(np.uint16).tobytes())


def parse_step(line: str) -> tuple[int, float, float] | None:
    """(step, loss, seconds) from a line of llm.c's training output, None for any other line."""
    m = STEP_LINE.match(line.strip())
    return (int(m[1]), float(m[2]), float(m[3]) / 1000) if m else None


def build_llmc(source: Path, work: Path) -> tuple[Path, str]:
    """Copy llm.c's tree (without .git) into `work` and `make train_gpt2` there, as its README builds the CPU trainer;
    the binary and the compile line make printed."""
    if not (source / "train_gpt2.c").is_file() or not (source / "Makefile").is_file():
        raise SystemExit(f"--llmc {source}: no train_gpt2.c and Makefile there; pass a clone of "
                         "https://github.com/karpathy/llm.c")
    missing = [tool for tool in ("make", "cc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"llm.c's trainer is built with make and a C compiler with OpenMP; not found here: "
                         f"{', '.join(missing)} (Debian / Ubuntu: apt install build-essential)")
    shutil.copytree(source, work, ignore=shutil.ignore_patterns(".git"))
    proc = subprocess.run(["make", "train_gpt2"], cwd=work, capture_output=True, text=True)
    if proc.returncode != 0 or not (work / "train_gpt2").exists():
        raise SystemExit(f"llm.c's `make train_gpt2` failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    line = next((s for s in proc.stdout.splitlines() if "train_gpt2.c" in s and "-o train_gpt2" in s), "")
    return work / "train_gpt2", line.strip()


def run_llmc(binary: Path, steps: int, threads: int) -> tuple[list[float], list[float]]:
    """One run of llm.c's trainer in its folder, stopped once step steps-1 is printed: (losses, seconds) per step.
    Its output goes to a pseudo-terminal: into a pipe, C's stdio would hold the step lines back in its buffer until
    the run's sampling at step 20 flushes them."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    main, child = os.openpty()
    proc = subprocess.Popen([str(binary)], cwd=binary.parent, env=env, stdout=child, stderr=child,
                            stdin=subprocess.DEVNULL)
    os.close(child)
    losses, seconds, tail = [], [], []
    try:
        with open(main, errors="replace") as out:
            for line in out:
                tail = (tail + [line])[-20:]
                found = parse_step(line)
                if found:
                    losses.append(found[1])
                    seconds.append(found[2])
                    if found[0] >= steps - 1:
                        break
    except OSError:  # the terminal's other end closed: llm.c ended (an error, said in the tail)
        pass
    finally:
        proc.kill()
        proc.wait()
    if len(losses) < steps:
        raise SystemExit(f"llm.c's trainer stopped after {len(losses)} of {steps} steps:\n{''.join(tail)}")
    return losses, seconds


def run_ours(work: Path, dtype: str, steps: int) -> tuple[list[float], list[float], str]:
    """One run of ours in a process of its own (the worker below): (losses, seconds) per step and its thread note."""
    proc = subprocess.run([sys.executable, __file__, "--worker", str(work), "--dtype", dtype, "--steps", str(steps)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"ours' {dtype} run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["losses"], out["seconds"], out["threads"]


def worker(work: Path, dtype: str, steps: int) -> None:
    """Ours' steps on the bench's weights and batch, as fit() takes them; prints one JSON line."""
    import safetensors.torch
    import torch

    from bench.compare_hf import threads_note
    from config import GPT2Config
    from models.gpt2 import GPT2LMHeadModel
    from models.loading import hf_to_ours
    from optimizer import AdamW
    from training.allocator import keep_freed_memory
    from training.engine import steps_choice

    keep_freed_memory()  # as fit() does
    state = safetensors.torch.load_file(work / "state.safetensors")
    tokens = torch.tensor(json.loads((work / "tokens.json").read_text()))
    config = GPT2Config.from_preset("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # llm.c: no dropout
    model = GPT2LMHeadModel(config)
    model.gpt.load_state_dict(hf_to_ours(state, config.n_layer))
    bf16 = dtype == "bf16"
    if bf16:
        model.to(torch.bfloat16)
    model.train()
    inputs, targets = tokens[:-1].view(B, T), tokens[1:].view(B, T)  # llm.c's batch: one window of B*T+1 tokens
    opt = AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True, master_weights=bf16)
    threads = steps_choice(("compare_llmc", dtype), active=True)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        threads.step()
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)["logits"]
        loss = model.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # every position
        loss.backward()
        threads.stop(work=inputs.numel())
        opt.step()
        torch.set_num_threads(threads.original)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    threads.close()
    note = threads_note(threads) or f"ours' steps on torch's {torch.get_num_threads()} threads (GPT2_TRAIN_THREADS)"
    print(json.dumps({"losses": losses, "seconds": seconds, "threads": note}))


def batch_tokens(count: int) -> list[int]:
    """The first `count` GPT-2 tokens of tiny shakespeare (the project's bundled copy and tokenizer)."""
    import transformers

    from models.hub import data_dir, tokenizer_dir

    transformers.logging.set_verbosity_error()  # (its warning that 20,000 characters exceed 1024 positions)

    text = (data_dir() / "tinyshakespeare" / "input.txt").read_text()[:20_000]
    ids = transformers.AutoTokenizer.from_pretrained(tokenizer_dir())(text)["input_ids"]
    if len(ids) < count:
        raise SystemExit(f"tiny shakespeare's first 20,000 characters give {len(ids)} tokens, fewer than {count}")
    return ids[:count]


def loss_note(llmc: list[float], ours: list[float]) -> str:
    diff = max(abs(a - b) for a, b in zip(llmc, ours))
    return (f"losses step by step within {diff:.1e} of llm.c's (step 0 {ours[0]:.4f} vs {llmc[0]:.4f}, step "
            f"{len(ours) - 1} {ours[-1]:.4f} vs {llmc[-1]:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llmc", type=Path, help="a clone of https://github.com/karpathy/llm.c")
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=None,
                        help="ours' rows (default: fp32, and bf16 where the CPU has bf16 products: AVX512-BF16 or AMX)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every contender once, in turn")
    parser.add_argument("--steps", type=int, default=10, help="training steps a run (timed: 1..steps-1)")
    parser.add_argument("--seed", type=int, default=0, help="the random-init weights' seed")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on a core beside the runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: one run of ours
    parser.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.dtype, args.steps)
    if args.llmc is None:
        parser.error("--llmc DIR is required: a clone of https://github.com/karpathy/llm.c")
    if args.steps < 3:
        parser.error("--steps must be at least 3 (step 0 is not timed)")
    import safetensors.torch
    import torch

    from bench.compare_hf import hf_reference
    from config import GPT2Config
    from training.precision import bf16_matmul_is_fast

    print_machine_header()
    dtypes = args.dtypes or (["fp32", "bf16"] if bf16_matmul_is_fast(torch.device("cpu")) else ["fp32"])
    threads = torch.get_num_threads()
    config = GPT2Config.from_preset("gpt2")
    rec = Recorder("compare_llmc")
    with tempfile.TemporaryDirectory(prefix="compare-llmc-") as tmp:
        work = Path(tmp)
        binary, compile_line = build_llmc(args.llmc.resolve(), work / "llm.c")
        commit = subprocess.run(["git", "-C", str(args.llmc), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "commit unknown"
        print(f"llm.c {commit}: {compile_line}", flush=True)
        state = hf_reference("gpt2", args.seed)
        write_checkpoint(state, config.n_layer, config.n_head, binary.parent / "gpt2_124M.bin")
        safetensors.torch.save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
                                    work / "state.safetensors")
        tokens = batch_tokens(B * T + 1)
        (work / "tokens.json").write_text(json.dumps(tokens))
        for split in ("train", "val"):  # llm.c reads tiny shakespeare's files where they exist
            write_tokens(tokens, binary.parent / "dev/data/tinyshakespeare" / f"tiny_shakespeare_{split}.bin")
        names = ["llm.c"] + [f"ours {d}" for d in dtypes]
        rates = {n: [] for n in names}
        losses, notes = {}, {}
        spinners = spin(args.busy) if args.busy else []
        if spinners:
            print(f"{args.busy} busy process{'es' if args.busy > 1 else ''} spinning beside the runs", flush=True)
        load = os.getloadavg()[0]
        try:
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    if name == "llm.c":
                        run_losses, seconds = run_llmc(binary, args.steps, threads)
                    else:
                        run_losses, seconds, notes[name] = run_ours(work, name.split()[1], args.steps)
                    losses[name] = run_losses
                    rates[name].append(B * T / statistics.median(seconds[1:]))
                    print(f"  round {r + 1} {name}: {rates[name][-1]:.0f} tokens/s, losses "
                          f"{run_losses[0]:.4f} -> {run_losses[-1]:.4f}", flush=True)
        finally:
            stop(spinners)
    medians = {n: statistics.median(v) for n, v in rates.items()}
    for dtype in dtypes:
        name = f"ours {dtype}"
        ratio = medians[name] / medians["llm.c"]
        met = ratio >= TARGET
        spans = f"ours {min(rates[name]):.0f}-{max(rates[name]):.0f}, llm.c {min(rates['llm.c']):.0f}-" \
                f"{max(rates['llm.c']):.0f}"
        row = f"train step gpt2 {B}x{T} {dtype} vs llm.c fp32{busy_suffix(args.busy)}"
        note = (f"median of {args.rounds} rounds of {args.steps} steps (1..{args.steps - 1} timed); min-max {spans}; "
                f"{loss_note(losses['llm.c'], losses[name])}; {notes[name]}; llm.c {commit}, OMP_NUM_THREADS="
                f"{threads}, `{compile_line}`")
        print(f"{row}: ours {medians[name]:.0f}, llm.c {medians['llm.c']:.0f} tokens/s: {ratio:.2f}x (target >= "
              f"{TARGET}x: {'met' if met else 'NOT met'}); {note}", flush=True)
        rec.add(row, {"ours": medians[name], "llm.c": medians["llm.c"]}, "tokens/s", ratio=ratio,
                ratio_of="ours / llm.c", target=f">= {TARGET}x llm.c", met=met, notes=note, load=load,
                losses={"llm.c": losses["llm.c"], "ours": losses[name]},  # each step's, the last round's runs
                **({"busy": args.busy} if args.busy else {}))
    rec.write()


if __name__ == "__main__":
    main()
