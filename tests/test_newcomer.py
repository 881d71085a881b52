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
    from conftest import shared_path
    from huggingface_hub import constants
    from test_task_data import write_sentiment

    import run_classifier

    shared_path("gpt2-tokenizer")
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
