"""One training run's settings (TrainConfig) and the errors the engine raises about a run."""
from __future__ import annotations

from dataclasses import dataclass

from training.precision import BF16_WEIGHTS


@dataclass
class TrainConfig:
    """One training run's settings (fine-tuning or pretraining); every field has the meaning of the CLI flag of the
    same name."""
    output_dir: str
    epochs: int = 10  # passes over the data (a source of epochs: fine-tuning)
    max_iters: int = 0  # optimizer steps of the run (a source without epochs: pretraining)
    batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-5
    min_lr: float = 0.0  # where a decaying schedule ends
    schedule: str = "constant"  # constant (the course), linear or cosine decay after warmup
    warmup_ratio: float = 0.0  # fraction of all optimizer steps spent warming up ...
    warmup_steps: int | None = None  # ... or this many steps
    decay_steps: int = 0  # the step where the decay reaches min_lr (0: the end of the run)
    weight_decay: float = 0.0
    decay_embeddings: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6  # AdamW epsilon (the course's default)
    optimizer: str = "adamw"  # adamw, or muon: Muon for the blocks' matrices, AdamW (lr) for the rest
    muon_lr: float = 0.02  # Muon's peak lr; the schedule scales it as it scales lr
    max_grad_norm: float = 0.0  # 0 = no clipping (the course does not clip)
    dtype: str = "float32"  # autocast: float32 (none), bfloat16, float16 with a gradient scaler; or bf16-weights:
    #                         the model in bf16, fp32 master weights and moments in AdamW, no autocast
    seed: int = 11711
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    eval_interval: int = 0  # evaluate every N optimizer steps (0: where the batch source ends an epoch)
    eval_at_start: bool = False  # also evaluate before the first step
    log_interval: int = 50  # one metrics record every N optimizer steps
    print_logs: bool = False  # print each log record as a line (pretraining), else only the progress bar shows it
    save_every: int = 0  # also checkpoint OUT/last every N optimizer steps (0: at evaluations only)
    max_steps: int = 0  # benchmark: stop after N optimizer steps, no evaluation or checkpoint (0 = off)
    select_metric: str = "acc"  # the evaluation metric that picks OUT/best
    select_max: bool = True  # higher is better (False: lower, e.g. a validation loss)
    eval_prefix: str = "dev_"  # the evaluation's metrics are recorded as dev_acc, ...
    skip_nonfinite: bool = False  # skip (and count) steps with a non-finite loss or gradient instead of stopping
    gradient_checkpointing: bool = False  # recompute each block's activations in backward: less memory, more time
    split_batch: bool = False  # on a CPU, cut each micro-batch across the threads (dropout 0; exact for a loss that
    #                            averages over equally weighted rows, as pretraining's windows)
    threads: int = 0  # CPU threads of the steps: 0 chooses among torch's count and its halves by timing the steps
    #                   (fit's thread choice; GPT2_TRAIN_THREADS), N keeps the N the caller set (a run then repeats
    #                   to the last digit: another count rounds the products' sums differently)
    compile: bool = False  # torch.compile the training forward and loss (the first steps compile; evaluation is eager)
    tensorboard: bool = False  # also write TensorBoard events to OUT/tensorboard
    plot: bool = True  # OUT/curves.png: redrawn at evaluations (within 5% of the run's time) and at the end

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def bf16_weights(self) -> bool:
        return self.dtype == BF16_WEIGHTS

    @property
    def fp16(self) -> bool:
        return self.dtype == "float16"


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; the message names the step."""


class ArchitectureMismatchError(ValueError):
    """A checkpoint whose shapes are not those of the model it is loaded into."""
