"""Multi-process data-parallel training under torchrun: the process group, who writes files, collectives.

    dist = init()                      # reads RANK / WORLD_SIZE / LOCAL_RANK set by torchrun; a no-op without them
    if is_main(): save(...)            # only rank 0 writes checkpoints, predictions and logs
    part = shard(global_batch)         # this rank's contiguous slice of a global batch
    total = all_reduce_sum(x)          # the sum over ranks (x itself in a single process)
    cleanup()

Every rank draws the same global batch (same seed, same order) and trains on its slice; gradients are averaged by
DistributedDataParallel, and each rank scales its loss so the average equals the loss of the whole global batch.
So N processes reach the weights one process reaches on the same global batches (up to float rounding).
Backend: nccl when the run asked for a CUDA device, gloo otherwise (a CPU run on a GPU host too); the collectives
put their tensors where the backend wants them (nccl takes only CUDA tensors). Without torchrun every function
behaves as for one process.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def backend_for(device: str | torch.device) -> str:
    """nccl for a run on CUDA devices, gloo for one on the CPU (whatever the host has)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(threads: int = 0, device: str | torch.device = "cpu", timeout_minutes: float = 60.0) -> bool:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); True if distributed. `device` is the
    device the run asked for ('cuda' or 'cpu'): it picks the backend (backend_for).

    Each process gets `threads` CPU threads, or its share of the cores (torchrun also sets OMP_NUM_THREADS=1).
    Ranks other than 0 print nothing to stdout (their warnings and errors still reach stderr). The timeout bounds how
    long ranks wait for rank 0 while it evaluates and saves.
    """
    if is_distributed():
        return True
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return False
    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    backend = backend_for(device)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA run was asked for under torchrun, but CUDA is not available")
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    if not is_main():
        sys.stdout = open(os.devnull, "w")  # one copy of every log line: rank 0's
    return True


def device(use_gpu: bool) -> torch.device:
    """This process's device: its own GPU (cuda:LOCAL_RANK) under torchrun, else cuda or cpu."""
    if use_gpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank()) if is_distributed() else torch.device("cuda")
    return torch.device("cpu")


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (e.g. writes a cache), then the others (which then find it)."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def shard(items: list) -> list:
    """This rank's contiguous slice of a global batch; slices differ in size by at most one (may be empty)."""
    n, r = world_size(), rank()
    base, extra = divmod(len(items), n)
    start = r * base + min(r, extra)
    return items[start: start + base + (r < extra)]


def comm_device() -> torch.device:
    """Where collective tensors must live: this rank's GPU under nccl, the CPU under gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """Sum over ranks, in place for a tensor (on whatever device it is); floats come back as floats (float64 on
    the wire)."""
    if not is_distributed():
        return value
    if torch.is_tensor(value):
        wire = value.to(comm_device())
        dist.all_reduce(wire)
        if wire is not value:
            value.copy_(wire)
        return value
    t = torch.tensor(float(value), dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return float(t)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any (so all ranks take the same branch)."""
    if not is_distributed():
        return flag
    t = torch.tensor(int(flag), device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] in a single process). obj: plain values and
    tensors, sent through torch.save and read back with weights_only=True (all_gather_object's own unpickling of
    tensors fails on CPU)."""
    if not is_distributed():
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    out = [None] * world_size()
    dist.all_gather_object(out, buf.getvalue())
    return [torch.load(io.BytesIO(b), weights_only=True) for b in out]


def wrap(module: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
    """DistributedDataParallel around `module` when distributed (it syncs rank 0's weights to all ranks now, and
    averages gradients in backward), else the module itself."""
    if not is_distributed():
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [dev.index] if dev.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def no_sync(module: torch.nn.Module, skip: bool):
    """DDP's no_sync() while accumulating gradients over micro-batches (skip=True), else a null context."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()
