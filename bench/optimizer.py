"""Time one AdamW step over GPT-2 (124M) sized parameters: ours (multi-tensor and fused) against
torch.optim.AdamW (foreach and fused).

The parameters are plain tensors with the shapes of the `gpt2` preset (no model needed) and random gradients.
The optimizers update the same tensors with their own state; steps alternate (ours, torch, torch fused, ours, ...)
so that load from other processes hits all alike, and the medians are compared. `--busy N` starts N processes that
spin on a core each for the whole run, to measure a busy machine (a laptop with a browser open).

    python bench/optimizer.py                      # 20 timed steps each, torch's default thread count
    python bench/optimizer.py --repeats 50 --threads 2
    python bench/optimizer.py --busy 1             # with one competing busy process
    python bench/optimizer.py --weight-decay 0 --no-correct-bias
    python bench/optimizer.py --dtype bfloat16     # bf16 parameters; also ours with fp32 masters (bf16-weights' step)
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from optimizer import AdamW  # noqa: E402


def gpt2_shapes(vocab: int = 50257, n_positions: int = 1024, n_embd: int = 768, n_layer: int = 12) -> list[tuple]:
    """Parameter shapes of GPT-2 small, in HF order (the LM head is tied to wte, so it adds nothing)."""
    shapes = [(vocab, n_embd), (n_positions, n_embd)]  # wte, wpe
    for _ in range(n_layer):
        shapes += [
            (n_embd,), (n_embd,),  # ln_1 weight, bias
            (n_embd, 3 * n_embd), (3 * n_embd,),  # attn.c_attn
            (n_embd, n_embd), (n_embd,),  # attn.c_proj
            (n_embd,), (n_embd,),  # ln_2
            (n_embd, 4 * n_embd), (4 * n_embd,),  # mlp.c_fc
            (4 * n_embd, n_embd), (n_embd,),  # mlp.c_proj
        ]
    return shapes + [(n_embd,), (n_embd,)]  # ln_f


def time_step(optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("benchmark")
    group.add_argument("--repeats", type=int, default=20, help="timed steps per optimizer (median is reported)")
    group.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer first (allocates state)")
    group.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    group.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    group.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay for all tensors")
    group.add_argument("--no-correct-bias", action="store_true", help="ours without bias correction (torch unchanged)")
    group.add_argument("--busy", type=int, default=0, help="processes spinning on a core each during the run")
    args = parser.parse_args()
    print_machine_header()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def run(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    params = [torch.randn(shape, dtype=dtype) * 0.02 for shape in gpt2_shapes()]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn_like(p) * 1e-3
    n_params = sum(p.numel() for p in params)

    hyper = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=args.weight_decay)
    optimizers = {
        "ours": AdamW(params, correct_bias=not args.no_correct_bias, **hyper),
        "ours-fused": AdamW(params, correct_bias=not args.no_correct_bias, fused=True, **hyper),
        "torch": torch.optim.AdamW(params, foreach=True, **hyper),
        "torch-fused": torch.optim.AdamW(params, fused=True, **hyper),
    }
    if dtype == torch.bfloat16:  # bf16 training's step: fp32 masters and moments, the parameters rounded to bf16
        optimizers["ours-fused-master"] = AdamW(params, correct_bias=not args.no_correct_bias, fused=True,
                                                master_weights=True, **hyper)
    with torch.no_grad():
        for _ in range(args.warmup):
            for optimizer in optimizers.values():
                optimizer.step()
        times = {name: [] for name in optimizers}
        for _ in range(args.repeats):
            for name, optimizer in optimizers.items():
                times[name].append(time_step(optimizer))

    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{len(params)} tensors, {n_params / 1e6:.1f}M {args.dtype} parameters, "
          f"threads {torch.get_num_threads()}, torch {torch.__version__}, median of {args.repeats} steps")
    for name, t in times.items():
        ms = [x * 1e3 for x in (median[name], min(t), max(t))]
        print(f"  {name:11s}  median {ms[0]:8.1f} ms   min {ms[1]:8.1f} ms   max {ms[2]:8.1f} ms")
    pairs = [("ours", "torch"), ("ours-fused", "torch"), ("ours-fused", "torch-fused")]
    for mine, other in pairs + [("ours-fused-master", "torch-fused")] * ("ours-fused-master" in optimizers):
        print(f"ratio {mine}/{other}: {median[mine] / median[other]:.3f} (median)  "
              f"{min(times[mine]) / min(times[other]):.3f} (min)")
    state_mb = {name: sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                          if torch.is_tensor(t)) / 2**20 for name, opt in optimizers.items()}
    print("optimizer state: " + ", ".join(f"{name} {mb:.0f} MB" for name, mb in state_mb.items()))
    rec = Recorder("optimizer")
    busy = f", {args.busy} busy process{'es' if args.busy > 1 else ''} beside it" if args.busy else ""
    rec.add(f"AdamW step, {n_params / 1e6:.1f}M {args.dtype} parameters ({len(params)} tensors){busy}",
            {name: 1e3 * m for name, m in median.items()}, "ms (median)", ratio=median["ours"] / median["torch"],
            ratio_of="ours' time / torch's foreach time",
            fused_vs_torch_fused=median["ours-fused"] / median["torch-fused"],
            notes=f"median of {args.repeats} steps, {torch.get_num_threads()} threads; ours fused / torch fused "
                  f"{median['ours-fused'] / median['torch-fused']:.2f}x; state MB: "
                  + ", ".join(f"{name} {mb:.0f}" for name, mb in state_mb.items()))
    rec.write()


if __name__ == "__main__":
    main()
