"""The training loop's decisions, each tested where it is made (training/steps.py, training/batches.py) and through fit():
which evaluation OUT/best keeps, clipping, micro-batch weights, the shuffle per epoch."""
import json
import math

import numpy as np
import pytest
import torch
from conftest import tiny_config

from models.gpt2 import GPT2LMHeadModel
from tasks import pretrain
from training.batches import EpochBatches
from training.engine import TrainConfig, fit, load_weights
from training.steps import grad_norm, improved, micro_weight

SCORES = [0.5, 0.7, 0.6, 0.7]  # evaluations after steps 1-4: the best is step 2's, tied at step 4


def tiny_lm(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_config("h3-inner"))


def token_rows(n: int, length: int = 9, vocab: int = 101, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def lm_batches(rows: torch.Tensor, batch_size: int, grad_accum: int = 1, epochs: int = 1, seed: int = 1):
    return EpochBatches(len(rows), batch_size, grad_accum, epochs, seed,
                        lambda idx: {"input_ids": rows[idx, :-1], "labels": rows[idx, 1:]})


def lm_loss(model, batch):
    return pretrain.next_token_loss(model, batch["input_ids"], batch["labels"])


def run_cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(**{"output_dir": str(tmp_path / "run"), "epochs": 1, "batch_size": 2, "lr": 1e-2,
                          "log_interval": 1, "plot": False, **kw})


def train_records(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


# ---- which evaluation is the best ---------------------------------------------------------------------------------

def test_improvement_rule_is_strict_in_the_chosen_direction():
    assert improved(0.1, None, True) and improved(0.1, None, False)
    assert improved(0.6, 0.5, True) and not improved(0.4, 0.5, True)
    assert improved(0.4, 0.5, False) and not improved(0.6, 0.5, False)
    assert not improved(0.5, 0.5, True) and not improved(0.5, 0.5, False)  # a tie keeps the earlier best


@pytest.mark.parametrize("select_max", [True, False])
def test_best_holds_the_weights_of_the_best_evaluation_and_a_tie_keeps_the_earlier(tmp_path, select_max):
    scores = iter(SCORES if select_max else [-s for s in SCORES])
    snapshots = []

    def evaluate(model):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {"score": next(scores)}

    model = tiny_lm()
    result = fit(model, lm_batches(token_rows(8), 2), lm_loss, evaluate,
                 run_cfg(tmp_path, eval_interval=1, select_metric="score", select_max=select_max), {})
    assert len(snapshots) == 4 and result["best"]["step"] == 2, result["best"]
    assert result["best"]["metrics"]["score"] == (0.7 if select_max else -0.7)
    best = tiny_lm(seed=1)
    load_weights(best, tmp_path / "run" / "best")
    saved = best.state_dict()
    assert all(torch.equal(saved[k], snapshots[1][k]) for k in saved)
    assert not all(torch.equal(saved[k], snapshots[3][k]) for k in saved)  # the steps moved the weights


# ---- gradient clipping -------------------------------------------------------------------------------------------

def _params_with_grads(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_grad_norm_clips_to_the_bound_and_leaves_smaller_gradients_alone():
    big = _params_with_grads(torch.full((3,), 4.0), torch.full((2, 2), 3.0))  # norm sqrt(48 + 36)
    norm = grad_norm(big, max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(84))  # the norm before clipping, for the records
    clipped = torch.cat([p.grad.flatten() for p in big]).norm().item()
    assert clipped <= 1.0 + 1e-6 and clipped == pytest.approx(1.0, rel=1e-4)
    small = _params_with_grads(torch.full((3,), 0.1))
    before = small[0].grad.clone()
    assert grad_norm(small, max_norm=1.0).item() == pytest.approx(math.sqrt(0.03))
    assert torch.equal(small[0].grad, before)
    unbounded = _params_with_grads(torch.full((3,), 4.0))
    grad_norm(unbounded)  # max_norm 0: no clipping
    assert torch.equal(unbounded[0].grad, torch.full((3,), 4.0))


def test_fit_clips_a_huge_gradient_to_max_grad_norm(tmp_path):
    """AdamW's first moment after one step is (1 - beta1) * the gradient it was given: OUT/last shows that gradient
    was clipped to the bound (the loss is scaled 1e4, so the raw gradient norm is far above it)."""
    fit(tiny_lm(), lm_batches(token_rows(2), 2), lambda m, b: 1e4 * lm_loss(m, b), lambda m: {"acc": 0.0},
        run_cfg(tmp_path, max_grad_norm=0.5), {})
    state = torch.load(tmp_path / "run" / "last" / "training_state.pt", weights_only=True)["optimizer"]["state"]
    given = torch.cat([s["exp_avg"].flatten() for s in state.values()]).norm().item() / (1 - 0.9)
    assert given == pytest.approx(0.5, rel=1e-3)
    assert pretrain.train_config(pretrain.PretrainConfig(data="x")).max_grad_norm == 1.0  # pretraining clips


# ---- micro-batch weights: one step's loss is the mean over its micro-batches -------------------------------------

def test_micro_weight_divides_a_share_among_micro_batches():
    assert micro_weight(2, 2, 1) == 1.0 and micro_weight(2, 4, 2) == 0.25 and micro_weight(1, 4, 2, world=2) == 0.25


@pytest.mark.parametrize("n, batch_size, grad_accum", [(7, 2, 2), (5, 2, 2), (9, 4, 3), (6, 3, 1)])
def test_epoch_batches_weights_sum_to_one_in_every_step_ragged_ones_too(n, batch_size, grad_accum):
    for count_fn in (None, lambda batch: float(batch["input_ids"].numel())):
        batches = EpochBatches(n, batch_size, grad_accum, 2, 0,
                               lambda idx: {"input_ids": torch.ones(len(idx), 1 + idx[0] % 3)}, count_fn=count_fn)
        while (step := batches.next_step()) is not None:
            assert sum(mb.weight for mb in step.micro) == pytest.approx(1.0), (step.where, count_fn)


@pytest.mark.parametrize("grad_accum", [1, 2, 3])
def test_random_windows_weights_sum_to_one(grad_accum):
    windows = pretrain.RandomWindows(np.arange(200) % 50, 4, 8, grad_accum, seed=0, device="cpu")
    for _ in range(3):
        step = windows.next_step()
        assert len(step.micro) == grad_accum and sum(mb.weight for mb in step.micro) == pytest.approx(1.0)


def test_first_logged_loss_of_a_fresh_model_with_grad_accum_2_is_ln_vocab(tmp_path):
    """Before it learns, a model predicts about uniformly: the mean loss is ln V; summing two micro-batches would
    log 2 ln V. Fine-tuning's EpochBatches and pretraining's RandomWindows."""
    ln_v = math.log(101)
    fit(tiny_lm(), lm_batches(token_rows(8), 2, grad_accum=2), lm_loss, lambda m: {"acc": 0.0},
        run_cfg(tmp_path, lr=1e-6), {})
    assert train_records(tmp_path)[0]["train_loss"] == pytest.approx(ln_v, abs=0.1)

    windows = pretrain.RandomWindows(np.arange(500) % 101, 2, 8, grad_accum=2, seed=0, device="cpu")
    fit(tiny_lm(), windows, pretrain.window_loss, lambda m: {"val_loss": 0.0},
        run_cfg(tmp_path, output_dir=str(tmp_path / "pre"), epochs=0, max_iters=1, lr=1e-6, select_metric="val_loss",
                select_max=False), {})
    record = next(r for r in map(json.loads, (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines())
                  if r["kind"] == "train")
    assert record["train_loss"] == pytest.approx(ln_v, abs=0.1)


# ---- the shuffle ------------------------------------------------------------------------------------------------

def _epochs_seen(batches: EpochBatches) -> list[list[int]]:
    seen = []
    batches.make_batch = lambda idx: seen.append(list(idx)) or {"input_ids": torch.ones(len(idx), 1)}
    while batches.next_step() is not None:
        pass
    per_epoch = batches.steps_per_epoch * batches.grad_accum  # batches an epoch makes
    return [sum(seen[e * per_epoch: (e + 1) * per_epoch], []) for e in range(batches.epochs)]


def test_each_epoch_is_a_new_permutation_repeated_by_the_seed_and_by_a_resume():
    orders = _epochs_seen(EpochBatches(16, 3, 2, 3, 7, None))
    assert all(sorted(o) == list(range(16)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # a new shuffle every epoch
    assert _epochs_seen(EpochBatches(16, 3, 2, 3, 7, None)) == orders
    assert _epochs_seen(EpochBatches(16, 3, 2, 3, 8, None)) != orders
    full = EpochBatches(16, 3, 2, 3, 7, lambda idx: {"x": torch.tensor(idx)})
    steps = [full.next_step() for _ in range(full.total_steps)]
    resumed = EpochBatches(16, 3, 2, 3, 7, lambda idx: {"x": torch.tensor(idx)})
    resumed.load_state_dict({"position": 4})  # e.g. OUT/last after 4 optimizer steps, in the second epoch
    rest = [resumed.next_step() for _ in range(full.total_steps - 4)]
    assert [[mb.batch["x"].tolist() for mb in s.micro] for s in rest] == \
        [[mb.batch["x"].tolist() for mb in s.micro] for s in steps[4:]]

