"""Task heads (GPT2SentimentClassifier, ParaphraseGPT) and fine-tuning on the training engine (tasks/finetune.py, training/engine.py)."""
import pytest
import torch
from conftest import padded_batch, tiny_config

from models.gpt2 import GPT2Model
from tasks import finetune as T
from tasks.classifier import GPT2SentimentClassifier
from tasks.classifier import loss_fn as classifier_loss
from tasks.data import Encoded, Example, collate
from tasks.paraphrase import ParaphraseGPT, prompt_for_test, prompt_for_train
from tasks.paraphrase import loss_fn as paraphrase_loss
from training import engine as E


def body(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT2Model(tiny_config("h4-wide", **overrides))


def one_step(model, loss_fn, batch):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss, _ = loss_fn(model, batch)
    loss.backward()
    opt.step()


def batch_of(labels, seed=0):
    ids, mask = padded_batch([5, 3, 7, 2], 8, 1000, ["right", "left", "right", "left"], seed)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(labels)}


@pytest.mark.parametrize("mode", ["last-linear-layer", "full-model"])
def test_classifier_modes_freeze_or_train_the_body(mode):
    gpt = body()
    model = GPT2SentimentClassifier(gpt, num_labels=5, head_dropout=0.3, fine_tune_mode=mode)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one_step(model.train(), classifier_loss, batch_of([0, 1, 4, 2]))
    after = model.state_dict()
    body_changed = [k for k in before if k.startswith("gpt.") and not torch.equal(before[k], after[k])]
    head_changed = [k for k in before if not k.startswith("gpt.") and not torch.equal(before[k], after[k])]
    assert head_changed == ["classifier.weight", "classifier.bias"]
    assert (body_changed == []) == (mode == "last-linear-layer")
    assert model.gpt is gpt  # the body is wrapped, not copied: training the model trains the caller's body
    assert (not torch.equal(gpt.final_layer_norm.weight, before["gpt.final_layer_norm.weight"])) == (mode == "full-model")


def test_classifier_uses_the_last_real_token_on_either_side():
    model = GPT2SentimentClassifier(body(), 3).eval()
    ids = torch.randint(0, 1000, (1, 5))
    right = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask_r = torch.tensor([[1] * 5 + [0] * 3])
    logits = model(ids, torch.ones(1, 5, dtype=torch.long))
    torch.testing.assert_close(model(right, mask_r), logits)
    torch.testing.assert_close(model(left, mask_r.flip(1)), logits)
    assert logits.shape == (1, 3)


def test_paraphrase_logits_predictions_and_loss():
    model = ParaphraseGPT(body(), yes_id=7, no_id=3)
    batch = batch_of([1, 0, 1, 0])
    logits = model(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (4, 1000)
    ids, mask = batch["input_ids"], batch["attention_mask"]  # rows padded on the right and on the left
    alone = torch.stack([model.gpt.hidden_state_to_token(model.gpt(ids[i, mask[i].bool()][None])["last_token"][0])
                         for i in range(4)])  # each row's last real token, unpadded
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=0)
    preds = model.predict(batch["input_ids"], batch["attention_mask"])
    assert set(preds.tolist()) <= {7, 3}
    expected = torch.where(logits[:, 7] > logits[:, 3], 7, 3)
    assert torch.equal(preds, expected)
    loss, stats = paraphrase_loss(model, batch)
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor([7, 3, 7, 3]))
    torch.testing.assert_close(loss, ref)
    assert stats["count"] == 4 and stats["correct"] == int((expected == torch.tensor([7, 3, 7, 3])).sum())


def test_paraphrase_last_linear_layer_trains_only_the_tied_output_layer():
    model = ParaphraseGPT(body(), 7, 3, fine_tune_mode="last-linear-layer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one_step(model.train(), paraphrase_loss, batch_of([1, 0, 1, 0]))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert changed == ["gpt.word_embedding.weight"]


def test_the_course_prompts():
    ex = Example("1", ("how do i cook rice ?", "what is rice ?"), 1)
    assert prompt_for_train(ex) == ('Question 1: "how do i cook rice ?"\nQuestion 2: "what is rice ?\n'
                                'Are these questions asking the same thing?\n')
    assert prompt_for_test(ex) == 'Is "how do i cook rice ?" a paraphrase of "what is rice ?"? Answer "yes" or "no": '


# ---------------------------------------------------------------------------------------------------------------
# The training loop


def _data(n=22, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Encoded(str(i), torch.randint(0, 1000, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
                    .tolist(), i % 3) for i in range(n)]


def _run(tmp_path, name, stop_after=None, resume=False, **cfg):
    """Train a fresh tiny classifier (dropout on) for 3 epochs; optionally crash after `stop_after` loss calls."""
    data = _data()
    T.seed_everything(5)
    model = GPT2SentimentClassifier(body(seed=1, resid_pdrop=0.2, embd_pdrop=0.2), 3, 0.3, "full-model")
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        if stop_after is not None and calls["n"] > stop_after:
            raise KeyboardInterrupt("simulated crash")
        return classifier_loss(m, batch)

    snapshots = []  # the weights at each evaluation (epoch end), to check what best/ and last/ hold

    def evaluate(m):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        preds = T.predict_in_order(m, data[:6], 4, 0, lambda m, i, a: m(i, a).argmax(-1), "cpu")
        return {"acc": sum(p == e.label for p, e in zip(preds, data)) / 6}

    config = E.TrainConfig(output_dir=str(tmp_path / name), epochs=3, batch_size=4, lr=1e-2, grad_accum=2,
                           schedule="linear", warmup_ratio=0.2, seed=3, resume=resume, **cfg)
    result = T.train(model, len(data), lambda idx: collate([data[i] for i in idx], 0), loss_fn, evaluate, config,
                     run_info={"lr": 1e-2, "name": "x"})
    result["loss_calls"] = calls["n"]
    result["snapshots"] = snapshots
    return model, result


def test_resume_after_a_crash_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    straight, result = _run(tmp_path, "a")
    again, _ = _run(tmp_path, "b")
    for k, v in straight.state_dict().items():  # runs are reproducible
        assert torch.equal(v, again.state_dict()[k]), k
    # 6 batches per epoch, 3 optimizer steps; crash in epoch 2 after the checkpoint at step 5 (mid-epoch)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "c", stop_after=6 + 5, save_every=5)
    resumed, resumed_result = _run(tmp_path, "c", resume=True, save_every=5)
    assert resumed_result["loss_calls"] == 18 - 10  # it went on from batch 4 of epoch 2, not from the start
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # the resumed history (epoch 1 from the checkpoint, 2-3 trained again) is the uninterrupted one, loss for loss
    assert [h["train_loss"] for h in resumed_result["history"]] == [h["train_loss"] for h in result["history"]]
    assert len({h["train_loss"] for h in result["history"]}) == 3  # the losses move: the comparison means something
    assert len(result["history"]) == 3 and result["best"]["metrics"]["acc"] == max(
        h["dev_acc"] for h in result["history"])


def test_best_checkpoint_reloads_into_a_fresh_model(tmp_path):
    model, result = _run(tmp_path, "a")
    fresh = GPT2SentimentClassifier(body(seed=9), 3)
    ck = E.load_weights(fresh, tmp_path / "a" / "best")
    assert ck.state["best"]["epoch"] == result["best"]["epoch"]
    assert (tmp_path / "a" / "last" / "config.json").is_file()  # the body in HF format
    at_best = result["snapshots"][result["best"]["epoch"] - 1]
    for k, v in at_best.items():  # best/ holds the weights of the best epoch, head included
        assert torch.equal(v, fresh.state_dict()[k]), k
    E.load_weights(fresh, tmp_path / "a" / "last")
    for k, v in model.state_dict().items():  # last/ holds the weights at the end of training
        assert torch.equal(v, fresh.state_dict()[k]), k
    assert not torch.equal(result["snapshots"][0]["classifier.weight"], model.state_dict()["classifier.weight"])


def test_refuses_to_overwrite_or_resume_the_wrong_run(tmp_path):
    _run(tmp_path, "a")
    with pytest.raises(FileExistsError, match="pass --resume"):
        _run(tmp_path, "a")
    _run(tmp_path, "a", overwrite=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _run(tmp_path, "nothing-here", resume=True)


def test_resume_with_other_settings_is_refused(tmp_path):
    _run(tmp_path, "a")
    data = _data()
    model = GPT2SentimentClassifier(body(), 3, 0.3, "full-model")
    config = E.TrainConfig(output_dir=str(tmp_path / "a"), epochs=3, batch_size=4, resume=True)
    with pytest.raises(ValueError, match=r"settings differ from the saved run.s: lr was 0.01, now 0.5"):
        T.train(model, len(data), lambda idx: collate([data[i] for i in idx], 0), classifier_loss,
                lambda m: {"acc": 0.0}, config, run_info={"lr": 0.5, "name": "x"})


def test_build_body_random_spec():
    model = T.build_body("random:n_layer=2,n_head=2,n_embd=32,resid_pdrop=0.0")
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (2, 32, 50257)
    assert model.config.resid_pdrop == 0.0
    assert T.build_body("random:gpt2,n_layer=1").config.n_embd == 768
    with pytest.raises(ValueError, match="neither key=value nor a preset"):
        T.build_body("random:gpt9")
