"""The training engine: one loop for fine-tuning (tasks/finetune.py) and pretraining (tasks/pretrain.py).

    result = fit(model, batches, loss_fn, evaluate_fn, TrainConfig(output_dir="out", lr=1e-3, ...), run_info)

A task supplies the model, a source of batches (training/batches.py's EpochBatches for a set of examples; pretraining's
random windows), a loss and an evaluation. fit() composes the parts, each in its own file:
- training/train_config.py: TrainConfig, the run's settings, and the errors the engine raises;
- training/optimization.py: the optimizer (AdamW, or Muon for the blocks' matrices with AdamW for the rest) and schedule;
- training/backward.py: forward and backward of the step's micro-batches under autocast (training/precision.py), DDP's
  no_sync until the last; with `split_batch` each micro-batch is cut row-wise across the CPU threads;
- training/steps.py: the step's decisions as small functions: micro-batch weights, clipping, the non-finite check, the
  update, and whether an evaluation is the new best (a tie keeps the earlier one);
- training/runfolder.py: OUT/last, everything an exact resume needs, at every evaluation and every `save_every` steps;
  OUT/best, the weights (with tokenizer and metrics), when the selected metric improves; `resume=True` continues
  OUT/last and ends with the weights of an uninterrupted run (a changed setting in run_info is refused by name, only
  `epochs` / `max_iters` may grow); model, head and adapter weights in and out of checkpoints;
- training/records.py: OUT/metrics.jsonl records (one per log interval and per evaluation; resumes append), the lines
  printed, the --max_steps benchmark; training/metrics.py draws OUT/curves.png at evaluations (within 5% of the
  run's time) and at the end.
The cadence is fit's own: a metrics record every `log_interval` steps, an evaluation where the batch source ends an
epoch or every `eval_interval` steps, and at the end. A non-finite loss or gradient stops the run (NonFiniteError
naming the step; the checkpoints on disk are the last good ones), or with skip_nonfinite the step is skipped and
counted. Under torchrun rank 0 alone evaluates and writes.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from models import decode_threads
from models.decode_threads import LONGEST_PERIOD, TRAIN_ENV, DecodeThreads
from modules.rows import inductor_why_not, keep_inductor_cache_apart
from training import distributed as dist
from training.allocator import keep_freed_memory
from training.backward import Backward, LossOf, set_gradient_checkpointing, split_workers
from training.batches import BatchSource, EpochBatches, MicroBatch, Step
from training.checkpoint import Checkpoint, resolve
from training.metrics import MetricsLog
from training.optimization import build_optimizer, build_scheduler
from training.precision import DTYPES, autocast, bf16_matmul_is_fast
from training.records import INTERVAL_RATES, Meter, benchmark_report, epoch_number, log_line, rates, summary_line
from training.runfolder import (
    ARCHITECTURE,
    CHECKPOINTS,
    RunState,
    check_architecture,
    exists,
    load_weights,
    open_run,
    remove_run,
    resume_run,
    save_model,
    save_run,
)
from training.steps import MAX_SKIPPED_IN_A_ROW, grad_norm, improved, nonfinite, nonfinite_error, optimizer_step
from training.train_config import ArchitectureMismatchError, NonFiniteError, TrainConfig

__all__ = [  # the engine's public names, wherever they live, so callers import them from here
    "ARCHITECTURE", "CHECKPOINTS", "DTYPES", "ArchitectureMismatchError", "BatchSource", "EpochBatches", "MicroBatch",
    "NonFiniteError", "Step", "TrainConfig", "autocast", "bf16_matmul_is_fast", "build_optimizer",
    "check_architecture", "fit", "grad_norm", "load_weights", "open_run", "remove_run", "save_model", "summary_line",
]


@dataclass
class _Run:
    """What the evaluations and checkpoints of one fit() call share."""
    cfg: TrainConfig
    model: nn.Module
    batches: BatchSource
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    state: RunState
    log: MetricsLog
    run_info: dict
    tokenizer: object
    report: Callable[[dict, bool, TrainConfig], str]
    threads: tuple[int, int]  # torch's threads while evaluating, and while training
    choice: DecodeThreads  # the steps' thread count chosen by timing them (inactive: threads[1] throughout)
    log_meter: Meter
    eval_meter: Meter

    def save(self, best: bool) -> bool:
        """OUT/best when `best`, and OUT/last (a collective)."""
        self.state.log_sums, self.state.eval_sums = self.log_meter.merged(), self.eval_meter.merged()
        save_run(Path(self.cfg.output_dir), self.model, self.state, self.run_info, best, self.optimizer,
                 self.scheduler, self.scaler, self.batches, self.tokenizer)
        return True

    def evaluate(self, evaluate_fn: Callable[[nn.Module], dict], bar, initial: bool = False) -> None:
        """Evaluate, record, and checkpoint (not the evaluation before the first step: nothing has trained)."""
        cfg, state = self.cfg, self.state
        torch.set_num_threads(self.choice.best if self.choice.options else self.threads[0])  # (a busy core: fewer)
        t0 = time.perf_counter()
        sums = self.eval_meter.merged()
        better, record = False, None
        if dist.is_main():  # rank 0 evaluates and writes; the others wait for it at the next collective
            with autocast(cfg.device, cfg.bf16, cfg.fp16):
                metrics = evaluate_fn(self.model)
            numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            best = state.best["metrics"][cfg.select_metric] if state.best else None
            better = improved(numbers[cfg.select_metric], best, cfg.select_max)
            record = {"kind": "eval", "step": state.step, "epoch": epoch_number(state.epoch),
                      "lr": self.scheduler.get_last_lr()[0], **(rates(sums) if sums.get("steps") else {}),
                      **({"skipped": state.skipped} if state.skipped else {}),
                      **({"fp16_overflows": state.overflows} if state.overflows else {}),
                      **{f"{cfg.eval_prefix}{k}": v for k, v in numbers.items()}}
            if better and not initial:
                state.best = {"step": state.step, "epoch": epoch_number(state.epoch), "metrics": numbers}
            if state.best:
                record[f"best_{cfg.eval_prefix}{cfg.select_metric}"] = state.best["metrics"][cfg.select_metric]
            state.history.append({**record, **{f"{cfg.eval_prefix}{k}": v for k, v in metrics.items()}})
            state.last_eval = record
        state.evaluated_at = state.step
        self.eval_meter.reset()
        saved = not initial and self.save(better)
        state.wall_s += time.perf_counter() - t0
        if dist.is_main():
            record["wall_s"] = round(state.wall_s, 3)
            self.log.log({k: v for k, v in record.items() if k not in INTERVAL_RATES})  # train records carry those
            self.log.refresh()  # curves.png, redrawn within 5% of the run's time (the end of fit draws the last)
            line = self.report(record, better and saved, cfg)
            tqdm.write(line) if bar is not None else print(line, flush=True)
        torch.set_num_threads(self.threads[1])

    def log_interval(self, bar) -> None:
        """A train record of the steps since the last one."""
        sums = self.log_meter.merged()
        self.log_meter.reset()
        if dist.is_main():
            record = {"kind": "train", "step": self.state.step, "epoch": epoch_number(self.state.epoch),
                      "lr": self.scheduler.get_last_lr()[0], **rates(sums), "wall_s": round(self.state.wall_s, 3)}
            self.log.log(record)
            bar.set_postfix(loss=f"{record['train_loss']:.4f}")
            if self.cfg.print_logs:
                tqdm.write(log_line(record))


def _positions(micro: list[MicroBatch]) -> int | None:
    """The token positions a step's forward computes (padding included), or None where its batches have no
    input_ids."""
    return sum(mb.batch["input_ids"].numel() for mb in micro if "input_ids" in mb.batch) or None


def thread_choice(cfg: TrainConfig, device: torch.device, workers: int, params: list) -> DecodeThreads:
    """The steps' thread count, chosen by timing them (models/decode_threads.py, as decoding's): torch's count, its
    halves, down to 1. With a core busy, every operation of a step on 2 threads waits at its barrier for the thread
    that shares that core, and one thread is faster (gpt2 fine-tuning: docs/performance.md, "Training beside a busy
    core"); on a quiet machine the trial of a slower count costs about 1% of the steps' time (EXPLORE_SHARE). A run
    that starts beside a busy core (free_cpus) starts on the count that fits the free cores. Inactive (torch's count
    throughout) where cfg.threads fixes the count, off the CPU, with the batch split across threads (each thread a
    worker of its own), under torchrun and with --compile (its kernels are built for the count they were traced
    at). GPT2_TRAIN_THREADS=off / N / auto, as for decoding. The count changes how torch's products round their
    sums, so a run repeats to the last digit only with a fixed count (--threads N)."""
    active = (device.type == "cpu" and workers == 1 and not cfg.threads and not cfg.compile
              and dist.world_size() == 1)
    return steps_choice(("train", cfg.dtype, sum(p.numel() for p in params)), active)


def steps_choice(key: tuple, active: bool = True) -> DecodeThreads:
    """The DecodeThreads of training steps (thread_choice's, and bench/compare_hf.py's steps as fit runs them):
    GPT2_TRAIN_THREADS, trials backed off from the start, a busy machine's start on its free cores."""
    return DecodeThreads(key, active=active, env=TRAIN_ENV, first_period=LONGEST_PERIOD,
                         start=decode_threads.free_cpus() if active else None)


def compile_why_not(device: torch.device) -> str | None:
    """Why --compile cannot run on `device` here (on the CPU: inductor's C++ build, rows.inductor_why_not), or None."""
    return inductor_why_not() if device.type == "cpu" else None


def fit(model: nn.Module, batches: BatchSource, loss_fn: Callable, evaluate_fn: Callable[[nn.Module], dict],
        cfg: TrainConfig, run_info: dict, tokenizer=None, resume_from: Checkpoint | None = None,
        report: Callable[[dict, bool, TrainConfig], str] | None = None, optimizer_groups: list | None = None) -> dict:
    """Train `model` on `batches` and keep OUT/{last,best} and OUT/metrics.jsonl.

    loss_fn(model, batch) -> mean loss, or (mean loss, {name: summed stat}) such as {'correct', 'count'} (then the
    records carry train_acc); evaluate_fn(model) -> {metric: value} including cfg.select_metric (non-numbers, such
    as a confusion matrix, are kept in the returned history but not recorded). report(record, improved, cfg) -> the
    line printed after each evaluation (default: the fine-tuning summary line). resume_from: the OUT/last checkpoint
    when the caller has already loaded its weights into `model` (pretraining builds its model from it).
    Returns {'best', 'history', 'last_eval', 'step', 'steps_run', 'skipped', 'fp16_overflows', 'complete',
    'ms_per_step', 'tokens_per_s', 'seconds'} (the metrics on rank 0 only)."""
    # Setup: model, optimizer, schedule, loss scaler, then the run folder (new, or OUT/last resumed).
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    if device.type == "cpu":
        keep_freed_memory()  # no page faults for the same big tensors every step (training/allocator.py)
    model.to(device)
    if cfg.bf16_weights:  # the weights in bf16 (no autocast casts); the optimizer keeps their fp32 masters
        if not bf16_matmul_is_fast(device):
            warnings.warn("--dtype bf16-weights on a CPU without bf16 matrix instructions (no AVX512-BF16/AMX): bf16 "
                          "matmuls run much slower than fp32 here", stacklevel=2)
        model.to(torch.bfloat16)
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)
    out = Path(cfg.output_dir)
    total = batches.total_steps or cfg.max_iters
    optimizer = build_optimizer(model, cfg, optimizer_groups)
    scheduler = build_scheduler(optimizer, cfg, total)
    # fp16 gradients underflow without loss scaling; the scaler raises the scale while steps stay finite and halves
    # it (skipping the step) when they overflow. Disabled, it is a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)
    main, world = dist.is_main(), dist.world_size()
    ck = resume_from if resume_from is not None else (open_run(cfg) if not cfg.max_steps else None)
    state = RunState() if ck is None else resume_run(ck, model, optimizer, scheduler, scaler, batches, run_info,
                                                     weights_loaded=resume_from is not None)
    dist.barrier()  # every rank has looked at OUT before rank 0 may write there
    log = MetricsLog(out, enabled=main and not cfg.max_steps, tensorboard=cfg.tensorboard, plot=cfg.plot)
    if ck is not None:
        log.log({"kind": "resume", "step": state.step, "wall_s": state.wall_s})
        print(f"resuming from {ck.path} at step {state.step}" + (f" (epoch {epoch_number(state.epoch)})"
                                                                  if batches.total_steps else ""))
    if world > 1:
        print(f"distributed: {world} processes, each on its slice of every batch of {cfg.batch_size}")

    trainer = dist.wrap(LossOf(model, loss_fn), device)  # DDP under torchrun; the model itself is trained either way
    if cfg.compile and (why := compile_why_not(device)):
        warnings.warn(f"--compile: torch.compile cannot build its C++ here ({why}); training eagerly instead",
                      stacklevel=2)
    elif cfg.compile:
        keep_inductor_cache_apart()
        trainer = torch.compile(trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    threads = torch.get_num_threads()
    workers = split_workers(cfg, model)
    backward = Backward(trainer, params, workers, lambda: autocast(device, cfg.bf16, cfg.fp16))
    # While the batch is split torch runs on one thread; Muon's Newton-Schulz products gain from every core.
    step_threads = threads if workers > 1 and cfg.optimizer == "muon" else None
    run = _Run(cfg, model, batches, optimizer, scheduler, scaler, state, log, run_info, tokenizer,
               report or summary_line, (threads, 1 if workers > 1 else threads),
               thread_choice(cfg, device, workers, params), Meter(state.log_sums), Meter(state.eval_sums))
    start_step, bad_in_a_row, session_s = state.step, 0, 0.0
    bench = Meter({"seconds": 0.0, "steps": 0, "batches": 0, "tokens": 0.0})
    steps_per_epoch = getattr(batches, "steps_per_epoch", 0)

    bar = None
    done = lambda: (cfg.max_iters and state.step >= cfg.max_iters)  # noqa: E731
    try:
        if cfg.eval_at_start and state.step == 0 and not cfg.max_steps:
            run.evaluate(evaluate_fn, bar, initial=True)
        bar = tqdm(total=(cfg.max_steps or total), initial=min(state.step, cfg.max_steps or total), unit="step",
                   desc="training", dynamic_ncols=True, leave=False, disable=None if main else True)
        model.train()
        torch.set_num_threads(run.threads[1])
        while not done():
            step = batches.next_step()
            if step is None:
                break
            run.choice.step()  # the thread count of this step: the fastest so far, or a due trial of another
            # The step: backward of its micro-batches, true (unscaled, clipped) gradients, one read-back, update.
            t0 = time.perf_counter()
            step_loss, stats, tokens = backward.accumulate(step.micro, scaler.scale, device)
            run.choice.stop(work=_positions(step.micro))  # forward and backward, per position (fine-tuning's
            #   batches differ in length; the update's time is the same for every batch and only blurs that)
            scaler.unscale_(optimizer)  # a no-op without fp16
            norm = grad_norm(params, cfg.max_grad_norm)  # after DDP's all-reduce: the same on every rank
            bad, loss_bad = nonfinite(step_loss, norm)
            stepped = False
            if cfg.fp16 and dist.any_rank(bad and not loss_bad):
                # an fp16 overflow at this loss scale, not a diverging run: the scaler lowers the scale, no step
                optimizer.zero_grad(set_to_none=True)
                scaler.update()
                state.overflows += 1
            elif dist.any_rank(bad):
                optimizer.zero_grad(set_to_none=True)
                where = step.where.format(step=state.step + 1)
                what = (f"loss {float(step_loss * world)}" if loss_bad else f"gradient norm {float(norm)}" if bad
                        else "loss or gradient on another rank")
                bad_in_a_row += 1
                if not cfg.skip_nonfinite or bad_in_a_row > MAX_SKIPPED_IN_A_ROW:
                    kept = (f"the last good checkpoint {resolve(out / 'last')} is kept" if exists(out / "last")
                            else "no checkpoint had been written yet")
                    raise nonfinite_error(what, where, kept, bad_in_a_row, cfg.skip_nonfinite)
                state.skipped += 1
                tqdm.write(f"warning: skipped {where}: non-finite {what} ({state.skipped} skipped so far)")
            else:
                bad_in_a_row, stepped = 0, True
                optimizer_step(optimizer, scaler, scheduler, step_threads)
                state.step += 1
                dt = time.perf_counter() - t0
                for meter in (run.log_meter, run.eval_meter):
                    meter.add(loss=step_loss, steps=1, tokens=tokens, seconds=dt, **stats)
                session_s += dt
                state.wall_s += dt
                bench.add(seconds=dt, steps=1, batches=len(step.micro), tokens=tokens)
                bar.update()
            state.epoch = step.epoch

            # The cadence: benchmark end, train record, evaluation (with checkpoints) or a checkpoint alone.
            if not stepped and not step.ends_epoch:
                continue
            if cfg.max_steps and state.step >= cfg.max_steps:
                return benchmark_report(bench.sums, steps_per_epoch)
            if stepped and cfg.log_interval and state.step % cfg.log_interval == 0:
                run.log_interval(bar)
            due = step.ends_epoch or (cfg.eval_interval and state.step % cfg.eval_interval == 0) or done()
            if due and state.evaluated_at != state.step:
                run.evaluate(evaluate_fn, bar)
                model.train()
            elif stepped and cfg.save_every and state.step % cfg.save_every == 0:
                run.save(best=False)
        if cfg.max_steps:  # the data ran out before max_steps
            return benchmark_report(bench.sums, steps_per_epoch)
        if state.evaluated_at != state.step:  # the data ended between evaluations
            run.evaluate(evaluate_fn, bar)
    finally:
        if bar is not None:
            bar.close()
        backward.close()
        run.choice.close()
        torch.set_num_threads(threads)
        if log.stale:
            log.plot()  # the whole run, whatever refresh() skipped (also when it stopped on an error)
        log.close()

    steps_run = state.step - start_step
    complete = ck is not None and steps_run == 0
    if complete and main:
        where = (f"step {state.step} of --max_iters {cfg.max_iters}; its checkpoint is {resolve(out / 'last')}. "
                 f"Raise --max_iters" if cfg.max_iters else
                 f"{epoch_number(state.epoch)} of {cfg.epochs} epochs; its checkpoints are {out / 'best'} and "
                 f"{out / 'last'}. Raise --epochs")
        print(f"the run in {out} is already complete: {where} to train it further")
    seconds = max(session_s, 1e-9)
    return {"best": state.best, "history": state.history, "last_eval": state.last_eval, "step": state.step,
            "steps_run": steps_run, "skipped": state.skipped, "fp16_overflows": state.overflows,
            "complete": bool(complete), "ms_per_step": 1000 * session_s / max(steps_run, 1),
            "tokens_per_s": bench.sums["tokens"] / seconds, "seconds": time.perf_counter() - t_start, "main": main}
