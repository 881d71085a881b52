"""What a newcomer trips on (issue 30): output folders that do not exist yet, the confusion matrix in the table,
the unreachable hub (one probe, then offline), offline errors that say what to do, LoRA on a random base, and
prediction files that one run must not silently take from another."""
import json
import re

import pytest
from test_evaluate import GOLD_PARA, GOLD_SST, files

from tasks import evaluate as E


def test_evaluate_json_creates_its_folder_and_prints_the_confusion_matrix(tmp_path, monkeypatch, capsys):
    pred, gold = files(tmp_path, GOLD_SST, ["aa1, 4", "bb2, 1", "cc3, 2", "dd4, 3"])
    monkeypatch.chdir(tmp_path)
    assert E.main(["--task", "sst", "--pred", pred, "--gold", gold, "--json", "runs/deeper/eval.json"]) == 0
    assert json.loads((tmp_path / "runs" / "deeper" / "eval.json").read_text())[0]["accuracy"] == 0.75
    out = capsys.readouterr().out
    table = out[out.index("sst confusion matrix"):].splitlines()
    assert table[1].split() == ["gold", "\\", "pred", "0", "1", "2", "3", "4"]
    assert table[2].split() == ["0", "0", "1", "0", "0", "0"]  # gold 0 predicted as 1
    assert [row.split()[0] for row in table[2:7]] == ["0", "1", "2", "3", "4"]


def test_evaluate_names_the_paraphrase_answers_in_the_confusion_matrix(tmp_path, capsys):
    pred, gold = files(tmp_path, GOLD_PARA, ["1 x-1, 8505", "2 y-2, 8505", "3 z-3, 3919"],
                       header="id \t Predicted_Is_Paraphrase ")
    assert E.main(["--task", "para", "--pred", pred, "--gold", gold]) == 0
    out = capsys.readouterr().out
    assert re.search(r"no 3919 +1 +1\n +yes 8505 +0 +1", out), out


# ---- the hub: one probe, then offline -----------------------------------------------------------------------------

@pytest.fixture
def dead_hub(monkeypatch):
    """The hub as on the machines this project is built on (no request connects), without the waiting: every
    request huggingface_hub makes fails at once and is counted; its retry back-off does not sleep."""

    from huggingface_hub import constants
    from huggingface_hub.utils import _http, close_session, set_client_factory

    from models import hub

    httpx = pytest.importorskip("httpx2", reason="huggingface_hub's HTTP client")
    attempts = []

    def refuse(request):
        # the hub's files and probes; not huggingface_hub's daily agent lookup nor datasets' download-count ping to
        # S3 (one request each, never retried; go_offline stops the latter too)
        if request.url.host == "huggingface.co" and not request.url.path.endswith("/api/agent-harnesses"):
            attempts.append(str(request.url))
        raise httpx.ConnectError("[Errno -2] Name or service not known", request=request)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored (to the tests' 1) afterwards
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_hub_answered", None, raising=False)
    monkeypatch.setattr(_http.time, "sleep", lambda s: None)
    set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(refuse),
                                            event_hooks={"request": [_http.hf_request_event_hook]}))
    yield attempts
    set_client_factory(_http.default_client_factory)
    close_session()


def test_an_unreachable_hub_is_asked_once_per_process(tmp_path, monkeypatch, dead_hub, capsys):
    """The default tokenizer with a random model, for both course datasets (two tokenizer loads): one request in
    all, then offline; before, each load retried the hub six times (about 25 s each here)."""
    from conftest import tokenizer_path
    from huggingface_hub import constants
    from test_task_data import write_sentiment

    import run_classifier

    tokenizer_path()
    for name in ("sst", "cfimdb"):
        write_sentiment(tmp_path, name, 8, num_labels=5 if name == "sst" else 2)
    monkeypatch.chdir(tmp_path)
    code = run_classifier.main(["--data_dir", str(tmp_path), "--model", "random:n_layer=1,n_head=1,n_embd=8",
                                "--epochs", "1", "--threads", "1", "--output_dir", str(tmp_path / "ck")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(dead_hub) <= 1, dead_hub  # 0 where the HF cache holds gpt2
    assert "Retry" not in out and out.count("gpt2-tokenizer (the same GPT-2 BPE)") == 2
    if dead_hub:
        assert constants.HF_HUB_OFFLINE and "offline from here on" in out


def test_a_model_folder_brings_its_own_tokenizer_and_needs_no_hub(tmp_path, monkeypatch, dead_hub, capsys):
    from test_task_data import make_tokenizer, write_sentiment

    import run_classifier
    from config import GPT2Config
    from models.gpt2 import GPT2Model

    folder = tmp_path / "model"
    GPT2Model(GPT2Config(n_layer=1, n_head=1, n_embd=8, n_positions=32, vocab_size=64)).save_pretrained(folder)
    make_tokenizer(folder)  # a tokenizer of 60-odd words: the GPT-2 one would not fit this model's vocabulary
    paths = write_sentiment(tmp_path, "sst", 8)
    code = run_classifier.main(["--model", str(folder), "--train", str(paths["train"]), "--dev", str(paths["dev"]),
                                "--epochs", "1", "--threads", "1", "--output_dir", str(tmp_path / "ck"),
                                "--dev_out", str(tmp_path / "dev.csv")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert dead_hub == [] and "hub" not in out.out


# ---- offline errors say what to do ------------------------------------------------------------------------------

def test_the_course_command_without_the_hub_names_the_local_choices_and_a_short_recipe(tmp_path, monkeypatch,
                                                                                         capsys):
    """`run_classifier.py --fine-tune-mode last-linear-layer --lr 1e-3` with no hub (the tests' HF_HUB_OFFLINE=1)."""
    import shlex

    from test_task_data import write_sentiment

    import run_classifier
    from models import parity

    write_sentiment(tmp_path, "sst", 8)
    monkeypatch.chdir(tmp_path)
    assert run_classifier.main(["--fine-tune-mode", "last-linear-layer", "--lr", "1e-3", "--task", "sst",
                                "--data_dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot get 'gpt2' from the Hugging Face hub" in err
    assert "--model checkpoints/random-gpt2" in err and "python -m models.parity" in err
    assert "--model random:n_layer=4,n_head=4,n_embd=256" in err
    recipe = re.search(r"without the hub, on a small model .*:\n +(python run_classifier\.py .*)", err).group(1)
    cfg = run_classifier.get_args(shlex.split(recipe)[2:])  # the recipe's flags parse
    assert cfg.model.startswith("random:") and cfg.epochs == 1 and cfg.threads == 1
    assert (cfg.fine_tune_mode, cfg.lr, cfg.task) == ("last-linear-layer", 1e-3, "sst")  # the user's own flags

    saved = []  # where `python -m models.parity` puts its random-init gpt2 when the hub is unreachable

    def stop(preset, directory, seed=0):
        saved.append(directory)
        raise SystemExit(0)

    monkeypatch.setattr(parity, "make_random_reference", stop)
    with pytest.raises(SystemExit):
        parity.main(["gpt2"])
    assert [str(d) for d in saved] == ["checkpoints/random-gpt2"]


def test_the_offline_recipe_keeps_every_flag_the_user_gave(tmp_path, monkeypatch, capsys):
    """Issue 37: `--task sst --lora_rank 8 --lora_alpha 16 --merge_lora` offline was told to run a command without
    --lora_rank, which trains no adapters."""
    import shlex

    from test_task_data import write_sentiment

    import run_classifier
    import run_paraphrase
    from tasks.finetune import offline_recipe

    write_sentiment(tmp_path, "sst", 8)
    monkeypatch.chdir(tmp_path)
    assert run_classifier.main(["--task", "sst", "--data_dir", str(tmp_path), "--lora_rank", "8", "--lora_alpha",
                                "16", "--merge_lora", "--epochs=5", "--model_size", "gpt2"]) == 1
    recipe = re.search(r"\n +(python run_classifier\.py .*)", capsys.readouterr().err).group(1)
    cfg = run_classifier.get_args(shlex.split(recipe)[2:])
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.merge_lora, cfg.task, cfg.data_dir) == (8, 16, True, "sst", str(tmp_path))
    assert cfg.epochs == 5 and cfg.model.startswith("random:") and "--model_size" not in recipe
    # a group of the recipe's flags (its data: --train, --split_dev, --skip_bad_rows) stays out when the user set any
    argv = ["--para_train", "mine.csv", "--split_dev", "10", "--model=gpt2"]
    recipe = offline_recipe("run_paraphrase.py", run_paraphrase.build_parser, argv, run_paraphrase.NO_HUB_RECIPE)
    cfg = run_paraphrase.get_args(shlex.split(recipe)[2:])
    assert (cfg.train, cfg.split_dev, cfg.skip_bad_rows, cfg.epochs) == ("mine.csv", 10, False, 1)
    assert cfg.model.startswith("random:") and "gpt2 " not in recipe


def test_a_missing_quora_file_names_the_bundled_pairs_only_where_they_are(tmp_path, monkeypatch, capsys):
    """Issue 37: `python run_paraphrase.py` said `data file not found: data/quora-train.csv` and nothing else."""
    import run_paraphrase

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2_SHARED_DIR", str(tmp_path / "shared"))
    assert run_paraphrase.main([]) == 1
    assert capsys.readouterr().err == "error: data file not found: data/quora-train.csv\n"  # no shared copy: no hint
    shared = tmp_path / "shared" / "data" / "quora" / "quora-dev-minbert.csv"
    shared.parent.mkdir(parents=True)
    shared.write_text("id\tsentence1\tsentence2\tis_duplicate\n")
    assert run_paraphrase.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: data file not found: data/quora-train.csv; the data folder holds")
    assert f"--train {shared} --split_dev 16000 --skip_bad_rows" in err


# ---- LoRA on a random base --------------------------------------------------------------------------------------

def test_a_lora_run_on_a_random_base_saves_the_base_so_peft_loads_best(tmp_path, capsys):
    import peft
    import torch
    from safetensors.torch import load_file
    from test_task_data import make_tokenizer, write_quora

    import run_paraphrase
    from models.gpt2 import GPT2LMHeadModel
    from models.lora import load_adapter
    from tasks.finetune import build_body

    spec = "random:n_layer=2,n_head=2,n_embd=16,n_positions=64,vocab_size=64"
    args = ["--tokenizer", make_tokenizer(tmp_path / "tok"), "--model", spec, "--epochs", "1", "--threads", "1",
            "--para_train", str(write_quora(tmp_path / "q.csv", 24)), "--split_dev", "16", "--lr", "1e-2",
            "--output_dir", str(tmp_path / "run"), "--para_dev_out", str(tmp_path / "p.csv"), "--lora_rank", "2"]
    assert run_paraphrase.main(args) == 0, capsys.readouterr().err
    best = tmp_path / "run" / "best"
    config = json.loads((best / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "run" / "base").resolve())

    torch.manual_seed(11711)  # the run's seed: its random init, which the saved base must be
    init = build_body(spec).state_dict()
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "base")
    for name, tensor in init.items():
        torch.testing.assert_close(ours.gpt.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    assert any(v.abs().sum() > 0 for k, v in load_file(best / "adapter_model.safetensors").items() if "lora_B" in k)

    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(best)).eval()  # PEFT alone, from best/ as it is
    load_adapter(ours, best)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours.eval()(ids)["logits"], atol=1e-5, rtol=0)


# ---- prediction files: in the run's folder, never silently replaced -----------------------------------------------

def test_predictions_go_to_the_runs_folder_and_the_course_layout_is_one_flag(tmp_path, monkeypatch, capsys):
    from test_task_data import make_tokenizer, write_sentiment

    import run_classifier
    from grading.predictions import FILES

    paths = write_sentiment(tmp_path, "sst", 16)
    monkeypatch.chdir(tmp_path)
    common = ["--tokenizer", make_tokenizer(tmp_path / "tok"), "--model",
              "random:n_layer=1,n_head=1,n_embd=8,n_positions=64,vocab_size=64", "--epochs", "1", "--threads", "1",
              "--fine-tune-mode", "full-model", "--task", "sst", "--train", str(paths["train"]), "--dev",
              str(paths["dev"]), "--test", str(paths["test-student"])]
    assert run_classifier.main(common + ["--output_dir", "runs/a"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs" / "a" / "predictions").iterdir()) == [
        "full-model-sst-dev-out.csv", "full-model-sst-test-out.csv"]
    assert not (tmp_path / "predictions").exists()

    # the course's layout, which a submission (and grading/predictions.py) reads
    assert run_classifier.main(common + ["--output_dir", "runs/b", "--predictions_dir", "predictions"]) == 0
    assert "full-model-sst-dev-out.csv" in FILES[0][2] and (tmp_path / "predictions" / FILES[0][2][0]).is_file()
    before = (tmp_path / "predictions" / "full-model-sst-dev-out.csv").read_bytes()
    capsys.readouterr()

    # another run may not take them over silently: refused before it trains, files untouched
    assert run_classifier.main(common + ["--output_dir", "runs/c", "--predictions_dir", "predictions",
                                         "--seed", "2"]) == 1
    err = capsys.readouterr().err
    assert "predictions/full-model-sst-dev-out.csv, predictions/full-model-sst-test-out.csv already exist" in err
    assert "pass --overwrite" in err and not (tmp_path / "runs" / "c").exists()
    assert (tmp_path / "predictions" / "full-model-sst-dev-out.csv").read_bytes() == before
    assert run_classifier.main(common + ["--output_dir", "runs/c", "--predictions_dir", "predictions",
                                         "--seed", "2", "--overwrite"]) == 0


def test_a_generate_only_run_leaves_the_fine_tuned_sonnets_alone(tmp_path, monkeypatch, capsys):
    import random

    from test_sonnet import course_file, make_bpe_tokenizer, make_sonnet

    import run_sonnet

    rng = random.Random(5)
    train, dev = [make_sonnet(rng, 14) for _ in range(6)], [make_sonnet(rng, 14) for _ in range(2)]
    prompts = course_file(["\n".join(s.splitlines()[:3]) for s in dev])
    for name, text in (("train", course_file(train)), ("gold", course_file(dev)), ("dev", prompts)):
        (tmp_path / f"{name}.txt").write_text(text)
    tok = make_bpe_tokenizer(tmp_path / "tok", train)
    monkeypatch.chdir(tmp_path)
    common = ["--sonnet_path", "train.txt", "--dev_sonnet_path", "dev.txt", "--dev_gold_path", "gold.txt",
              "--held_out_sonnet_path", "dev.txt", "--max_new_tokens", "8", "--threads", "1"]
    assert run_sonnet.main(common + ["--tokenizer", str(tmp_path / "tok"), "--epochs", "1", "--lr", "1e-2",
                                     "--model", f"random:n_layer=1,n_head=1,n_embd=16,n_positions=64,"
                                                f"vocab_size={len(tok)}"]) == 0, capsys.readouterr().err
    tuned = tmp_path / "checkpoints" / "sonnet" / "predictions" / "generated_sonnets.txt"
    before = tuned.read_bytes()
    # the best/ folder holds its tokenizer: no --tokenizer needed
    for decoding in (["--greedy"], ["--num_beams", "2"]):
        assert run_sonnet.main(common + ["--generate_only", "--model", "checkpoints/sonnet/best", *decoding]) == 0
    assert tuned.read_bytes() == before
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("checkpoints/*/predictions/*_dev.txt"))
    assert written == [f"checkpoints/{d}/predictions/generated_sonnets_dev.txt"
                       for d in ("sonnet-generate-beam2", "sonnet-generate-greedy", "sonnet")]
    assert run_sonnet.main(common + ["--generate_only", "--model", "checkpoints/sonnet/best", "--greedy",
                                     "--output_dir", "checkpoints/sonnet"]) == 1
    assert "generated_sonnets_dev.txt" in capsys.readouterr().err and tuned.read_bytes() == before


# ---- the main job's last lines ------------------------------------------------------------------------------------

def test_the_main_job_ends_by_naming_its_checkpoint_metrics_and_curves(tmp_path, capsys):
    from test_pretrain import TEXT, TINY

    import run_pretrain

    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "run"
    run_pretrain.main(["--data", str(tmp_path / "corpus.txt"), "--output_dir", str(out), *TINY, "--max_iters", "4",
                       "--eval_interval", "2", "--num_samples", "1", "--max_new_tokens", "5"])
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("files: ") and f"checkpoint {out / 'best'}" in last
    assert f"metrics {out / 'metrics.jsonl'}" in last and f"curves {out / 'curves.png'}" in last
    assert (out / "metrics.jsonl").is_file() and (out / "curves.png").is_file()
