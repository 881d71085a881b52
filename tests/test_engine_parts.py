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
from training import distributed as dist
from training.batches import EpochBatches
from training.engine import TrainConfig, fit, load_weights
from training.steps import grad_norm, improved, micro_weight, nonfinite, nonfinite_error, optimizer_step
from training.train_config import NonFiniteError

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
    no_grads = [torch.nn.Parameter(torch.ones(2))]  # e.g. a frozen body whose head got no gradient this step
    for bound in (0.0, 1.0):
        norm = grad_norm(no_grads, max_norm=bound)
        assert norm.shape == () and norm.item() == 0.0 and no_grads[0].grad is None


# ---- the non-finite check and its error -------------------------------------------------------------------------

def test_nonfinite_tells_a_bad_loss_from_a_bad_gradient():
    t = torch.tensor
    assert nonfinite(t(2.5), t(0.3)) == (False, False)
    assert nonfinite(t(float("nan")), t(0.3)) == (True, True)
    assert nonfinite(t(float("inf")), t(float("nan"))) == (True, True)
    assert nonfinite(t(2.5), t(float("inf"))) == (True, False)  # the gradient alone: an fp16 overflow, say
    assert nonfinite(t(-2.0), t(float("nan"))) == (True, False)
    assert nonfinite(t(3e38), t(3e38)) == (False, False)  # finite both, though their float32 sum is not


def test_nonfinite_error_names_what_where_the_kept_checkpoint_and_the_way_out():
    where = "optimizer step 3 (epoch 1, batch 3 of 4)"
    stopped = nonfinite_error("loss nan", where, "no checkpoint had been written yet", 1, skipping=False)
    assert isinstance(stopped, NonFiniteError)
    assert str(stopped) == ("non-finite loss nan at optimizer step 3 (epoch 1, batch 3 of 4): training stopped; "
                            "no checkpoint had been written yet. Pass --skip_nonfinite to skip such batches; "
                            "a lower --lr or --max_grad_norm may help")
    diverged = nonfinite_error("gradient norm inf", where, "the last good checkpoint out/last is kept", 21, True)
    assert str(diverged) == ("non-finite gradient norm inf at optimizer step 3 (epoch 1, batch 3 of 4): training "
                             "stopped; the last good checkpoint out/last is kept. 21 bad steps in a row despite "
                             "--skip_nonfinite: the run is diverging; a lower --lr or --max_grad_norm may help")


# ---- the update ---------------------------------------------------------------------------------------------------

def test_optimizer_step_updates_on_its_threads_then_the_loop_is_back_on_one_and_gradients_are_freed():
    """With threads (Muon beside --split_batch) the update runs on them and the loop gets its one thread back; the
    gradients are freed (None, not zero tensors: no memory held between steps, and a parameter left out of the next
    backward has no stale gradient for the optimizer to apply)."""
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.get_num_threads())
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(3))
    opt = Recording([p], lr=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    p.grad = torch.full((3,), 2.0)
    optimizer_step(opt, scaler, schedule, threads=3)
    assert seen == [3] and torch.get_num_threads() == 1
    assert torch.equal(p.detach(), torch.zeros(3)) and opt.param_groups[0]["lr"] == 0.25
    assert p.grad is None
    torch.set_num_threads(2)
    p.grad = torch.full((3,), 2.0)
    optimizer_step(opt, scaler, schedule)  # no threads: the count is left alone
    assert seen == [3, 2] and torch.get_num_threads() == 2 and torch.equal(p.detach(), torch.full((3,), -0.5))
    assert p.grad is None


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
    assert micro_weight(0.25, 0.5, 1) == 0.5  # counted units need not be whole (a count_fn of example weights)
    assert micro_weight(0.0, 0.0, 2) == 0.0  # nothing counted on any rank: weight 0, not a division by zero


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
    again = EpochBatches(16, 3, 2, 3, 7, lambda idx: {"x": torch.tensor(idx)})
    for _ in range(4):
        again.next_step()
    assert again.state_dict() == {"position": 4}  # OUT/last's "batches" entry: what the resume above read


def test_the_shuffle_of_a_seed_and_epoch_is_the_one_earlier_runs_trained_on():
    """The order is part of what a checkpoint means: a run resumed from OUT/last written by an earlier version (or
    rerun with the same --seed) must see the same examples in the same order."""
    batches = EpochBatches(8, 2, 1, 3, 1, None)
    assert [batches.epoch_order(e) for e in range(3)] == [[3, 1, 5, 6, 7, 4, 0, 2], [5, 7, 1, 3, 6, 0, 4, 2],
                                                          [7, 5, 0, 4, 3, 6, 1, 2]]
    assert EpochBatches(8, 2, 1, 3, 2, None).epoch_order(0) == [6, 3, 2, 5, 0, 4, 1, 7]


def test_the_shuffle_is_drawn_once_per_epoch_not_once_per_step():
    drawn = []

    class Counting(EpochBatches):
        def epoch_order(self, epoch):
            drawn.append(epoch)
            return super().epoch_order(epoch)

    batches = Counting(12, 2, 1, 2, 0, lambda idx: {"x": torch.tensor(idx)})
    while batches.next_step() is not None:
        pass
    assert drawn == [0, 1]


def test_steps_name_their_batches_and_epoch_and_end_each_epoch():
    batches = EpochBatches(5, 2, 2, 2, 0, lambda idx: {"x": torch.tensor(idx)})  # 3 batches: steps of 2 and 1
    steps = [batches.next_step() for _ in range(batches.total_steps)]
    assert batches.next_step() is None
    assert [s.where for s in steps] == ["optimizer step {step} (epoch 1, batches 1-2 of 3)",
                                        "optimizer step {step} (epoch 1, batch 3 of 3)",
                                        "optimizer step {step} (epoch 2, batches 1-2 of 3)",
                                        "optimizer step {step} (epoch 2, batch 3 of 3)"]
    assert [s.epoch for s in steps] == [0.5, 1.0, 1.5, 2.0]
    assert [s.ends_epoch for s in steps] == [False, True, False, True]
    assert [len(s.micro) for s in steps] == [2, 1, 2, 1]


def test_batches_arrive_on_the_sources_device_and_other_values_pass_through():
    batches = EpochBatches(4, 2, 1, 1, 0, lambda idx: {"input_ids": torch.tensor(idx), "ids": [f"e{i}" for i in idx]},
                           device="meta")  # a device every machine has
    mb = batches.next_step().micro[0]
    assert mb.batch["input_ids"].device.type == "meta"
    assert mb.batch["ids"] == [f"e{i}" for i in batches.epoch_order(0)[:2]]
    assert mb.tokens == 0  # no attention_mask: tokens are not counted


# ---- under torchrun (simulated): each rank's slice, weighted so that DDP's average is one process's mean ---------

LENGTHS = [1 + i % 3 for i in range(8)]  # example i's real tokens
LOSS_SUMS = [0.1 * (i + 1) for i in range(8)]  # example i's loss summed over its counted units


def _loss_batch(idx):
    mask = torch.tensor([[int(t < LENGTHS[i]) for t in range(3)] for i in idx])
    return {"attention_mask": mask, "loss_sum": torch.tensor([LOSS_SUMS[i] for i in idx]),
            "ids": [str(i) for i in idx]}


def _tokens(batch):
    return batch["attention_mask"].sum()


def _ranks_steps(monkeypatch, world, count_fn):
    """Every rank's steps of one epoch of 8 examples (batches of 3, 2 per step) in a simulated world: dist's rank and
    world size patched, the all-reduce answered with the sum over ranks of what each counted (learned in a first
    pass). Returns the steps per rank and the number of all-reduces a rank made."""
    monkeypatch.setattr(dist, "world_size", lambda: world)
    counted = {}

    def run(answer):
        per_rank, calls = [], []
        for r in range(world):
            monkeypatch.setattr(dist, "rank", lambda r=r: r)
            calls.clear()
            monkeypatch.setattr(dist, "all_reduce_sum", lambda c, r=r: calls.append(c) or answer(r, len(calls), c))
            batches = EpochBatches(8, 3, 2, 1, 0, _loss_batch, count_fn=count_fn)
            per_rank.append([batches.next_step() for _ in range(batches.total_steps)])
        return per_rank, len(calls)

    run(lambda r, i, c: counted.setdefault(i, {}).setdefault(r, c))
    return run(lambda r, i, c: sum(counted[i].values()))


@pytest.mark.parametrize("count_fn", [None, _tokens])
def test_ranks_weights_make_ddps_average_the_one_process_mean(monkeypatch, count_fn):
    """Batches [3, 3, 2] over 3 ranks: the last batch leaves rank 2 empty. The mean over ranks of each rank's
    weighted micro-batch losses (what DDP's gradient average gives) is the single-process step loss: the mean over
    the step's micro-batches of each one's loss per counted unit (examples, or tokens with count_fn)."""
    (one,), _ = _ranks_steps(monkeypatch, 1, count_fn)
    ranks, reduces = _ranks_steps(monkeypatch, 3, count_fn)
    assert reduces == (3 if count_fn else 0)  # the rows are known everywhere: no collective without count_fn
    unit = (lambda b: float(_tokens(b))) if count_fn else (lambda b: len(b["ids"]))
    for s, step in enumerate(one):
        ids = [[int(i) for i in mb.batch["ids"]] for mb in step.micro]
        expected = sum(sum(LOSS_SUMS[i] for i in mb) / sum((LENGTHS[i] if count_fn else 1) for i in mb)
                       for mb in ids) / len(ids)
        ddp = sum(mb.weight * float(mb.batch["loss_sum"].sum()) / unit(mb.batch)
                  for rank in ranks for mb in rank[s].micro) / 3
        assert ddp == pytest.approx(expected), step.where
        for m, mb_ids in enumerate(ids):
            assert sum(rank[s].micro[m].tokens for rank in ranks) == sum(LENGTHS[i] for i in mb_ids)
            assert step.micro[m].tokens == sum(LENGTHS[i] for i in mb_ids)
    idle = ranks[2][1].micro[0]  # rank 2's slice of the 2-example batch is empty
    assert idle.weight == 0.0 and idle.tokens == 0
    assert len(idle.batch["ids"]) == 1  # it still joins the all-reduce, with the least work: one example

