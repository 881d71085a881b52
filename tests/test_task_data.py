"""Task data (tasks/data.py): the course's file formats, every bad-input error, tokenization and batches.

Also home of the helpers the other task tests import: a tiny word-level tokenizer and tiny course-format files."""
import random

import pytest
import torch
from conftest import data_path, tokenizer_path

from tasks import data as D

WORDS = ["good", "great", "fun", "bad", "awful", "dull", "film", "plot", "the", "was", "a", "very", "movie", "how",
         "what", "do", "i", "learn", "python", "cook", "rice", "why", "is", "sky", "blue", "can", "fly"]
PROMPT_WORDS = ["question", "1", "2", "are", "these", "questions", "asking", "same", "thing", "paraphrase", "of",
                "answer", "yes", "or", "no", '"', ":", "?", ".", ",", "'", "\n"]


def make_tokenizer(folder):
    """A word-level tokenizer over WORDS + the prompts' words, saved so AutoTokenizer loads it; EOS last."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]"] + WORDS + [w for w in PROMPT_WORDS if w not in WORDS])}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return str(folder)


def sentence(rng, label, num_labels):
    """Words that carry the label (good words for high labels), so a model can learn something."""
    pool = WORDS[:3] if label >= num_labels / 2 else WORDS[3:6]
    return " " + " ".join(rng.choice(pool + WORDS[6:12]) for _ in range(rng.randint(3, 9))).capitalize() + " ."


def write_sentiment(folder, name, n, num_labels=5, seed=0):
    """ids-{name}-{train,dev,test-student}.csv in the course's formats (test: the odd `0\\t\\tid\\tsentence` header)."""
    rng = random.Random(seed)
    paths = {}
    for split, count in (("train", n), ("dev", n // 2), ("test-student", n // 2)):
        lines = ["\tid\tsentence\tsentiment"] if split != "test-student" else ["0\t\tid\tsentence"]
        for i in range(count):
            label = rng.randrange(num_labels)
            ex_id = f"{split[:2]}{i:05d}abc"
            if split == "test-student":
                lines.append(f"{i}\t{float(i % 2)}\t{ex_id}\t{sentence(rng, label, num_labels)}")
            else:
                lines.append(f"{i}\t{ex_id}\t{sentence(rng, label, num_labels)}\t{label}")
        paths[split] = folder / f"ids-{name}-{split}.csv"
        paths[split].write_text("\n".join(lines) + "\n")
    return paths


def write_quora(path, n, index_column=True, labels=True, seed=0):
    rng = random.Random(seed)
    lines = [("\t" if index_column else "") + "id\tsentence1\tsentence2" + ("\tis_duplicate" if labels else "")]
    for i in range(n):
        q1 = " ".join(rng.choice(WORDS[12:]) for _ in range(5)).capitalize() + "?"
        same = rng.random() < 0.4
        q2 = q1 if same else " ".join(rng.choice(WORDS[12:]) for _ in range(5)).capitalize() + "?"
        row = ([str(i)] if index_column else []) + [f"{i} q{i:04d}", q1, q2] + ([f"{float(same)}"] if labels else [])
        lines.append("\t".join(row))
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------


def test_course_sentiment_formats_train_dev_and_odd_test_header(tmp_path):
    paths = write_sentiment(tmp_path, "sst", 10)
    train = D.load_sentiment(paths["train"], "train", num_labels=5)
    assert len(train) == 10 and all(0 <= ex.label < 5 for ex in train)
    assert train[0].text == train[0].text.lower().strip() and train[0].id == "tr00000abc"
    test = D.load_sentiment(paths["test-student"], "test")
    assert len(test) == 5 and test[0].label is None and test[0].id == "te00000abc"


def test_quoted_fields_as_csv_dictreader_reads_them(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('\tid\tsentence\tsentiment\n0\tAB\t"""Quoted"" Title , Fine"\t1\n1\tcd\t plain \t0\n')
    ex = D.load_sentiment(path, "train", 2)
    assert [e.id for e in ex] == ["ab", "cd"]
    assert ex[0].text == '"quoted" title , fine' and ex[1].text == "plain"


def test_quora_with_and_without_index_column_and_test_file(tmp_path):
    a = D.load_paraphrase(write_quora(tmp_path / "a.csv", 6, index_column=True), "train")
    b = D.load_paraphrase(write_quora(tmp_path / "b.csv", 6, index_column=False), "dev")
    assert [(e.id, e.text, e.label) for e in a] == [(e.id, e.text, e.label) for e in b]
    assert {e.label for e in a} <= {0, 1} and a[0].id == "0 q0000"
    assert a[0].text[0] == D.preprocess_string(a[0].text[0]) and a[0].text[0].endswith(" ?")
    test = D.load_paraphrase(write_quora(tmp_path / "t.csv", 4, labels=False), "test")
    assert len(test) == 4 and test[0].label is None


def test_preprocess_string_is_the_courses():
    assert D.preprocess_string("What's  it, Mr. X?") == "what 's it , mr . x ?"


BAD_SENTIMENT = {
    "extra field": ("0\ta\tok\t1\n1\tb\tfine\t2\tEXTRA\n", r"line 3: malformed row: more fields than"),
    "extra field in the first row": ("0\ta\tok\t1\tEXTRA\n", r"line 2: malformed row"),  # pandas: an index
    "missing label": ("0\ta\tok\t1\n1\tb\tfine\n", r"bad\.csv, line 3: empty 'sentiment'"),
    "unknown label": ("0\ta\tok\t1\n1\tb\tfine\tpositive\n", r"line 3: sentiment 'positive' is not an integer"),
    "out of range": ("0\ta\tok\t1\n1\tb\tfine\t7\n", r"line 3: sentiment 7 is out of range for 5 classes"),
    "duplicate id": ("0\ta\tok\t1\n1\tA\tfine\t2\n", r"line 3: duplicate id 'a' \(first seen on .*line 2\)"),
    "empty sentence": ("0\ta\t  \t1\n", r"line 2: empty 'sentence'"),
    # a quoted field spanning two lines: the bad row after it is on physical line 4
    "line after multi-line field": ('0\ta\t"two\nlines"\t1\n1\tb\tfine\t9\n', r"line 4: sentiment 9 is out of range"),
}


@pytest.mark.parametrize("case", sorted(BAD_SENTIMENT))
def test_bad_sentiment_rows_name_file_and_line(tmp_path, case):
    body, pattern = BAD_SENTIMENT[case]
    path = tmp_path / "bad.csv"
    path.write_text("\tid\tsentence\tsentiment\n" + body)
    with pytest.raises(D.DataError, match=pattern):
        D.load_sentiment(path, "train", num_labels=5)


@pytest.mark.parametrize("content, pattern", [
    ("", r"empty\.csv, line 1: the file is empty"),
    ("\tid\tsentence\tsentiment\n", r"line 2: no data rows"),
    ("\tid\ttext\tsentiment\n0\ta\tb\t1\n", r"line 1: missing column\(s\) \['sentence'\]"),
])
def test_empty_files_and_missing_columns(tmp_path, content, pattern):
    path = tmp_path / "empty.csv"
    path.write_text(content)
    with pytest.raises(D.DataError, match=pattern):
        D.load_sentiment(path, "train", 5)


def test_missing_file_and_bad_quora_labels(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        D.load_sentiment(tmp_path / "nope.csv")
    path = tmp_path / "q.csv"
    path.write_text("id\tsentence1\tsentence2\tis_duplicate\n1 x\ta?\tb?\t1.0\n2 y\tc?\td?\t2.0\n3 z\te?\tf?\tyes\n")
    with pytest.raises(D.DataError, match=r"q\.csv, line 3: is_duplicate '2\.0' is not a label"):
        D.load_paraphrase(path)


def test_skip_bad_rows_drops_and_lists_them(tmp_path, capsys):
    path = tmp_path / "q.csv"
    path.write_text("id\tsentence1\tsentence2\tis_duplicate\n1 x\ta?\tb?\t1.0\n2 y\tc?\t\t\n3 z\te?\tf?\t0.0\n")
    ex = D.load_paraphrase(path, skip_bad_rows=True)
    assert [e.id for e in ex] == ["1 x", "3 z"]
    assert "skipped 1 bad row(s)" in capsys.readouterr().out


def test_bundled_quora_file_has_two_malformed_rows():
    path = data_path("quora", "quora-dev-minbert.csv")
    with pytest.raises(D.DataError, match=r"line 2577: empty 'is_duplicate'"):
        D.load_paraphrase(path)
    assert len(D.load_paraphrase(path, skip_bad_rows=True)) == 20212


def test_hub_datasets_map_their_column_names():
    import datasets

    rows = datasets.Dataset.from_dict({"text": ["Nice film", "Bad film"], "label": [1, 0]})
    table = D.hub_table("hub:some/sst:train", rows, ["id", "sentence", "sentiment"])
    assert list(table.rows) == [{"sentence": "Nice film", "sentiment": "1", "id": "0"},
                                {"sentence": "Bad film", "sentiment": "0", "id": "1"}]
    with pytest.raises(D.DataError, match="no column for 'sentence1'"):
        D.hub_table("hub:x:train", rows, ["sentence1"])


def test_unreachable_hub_dataset_says_so(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(D.DataError, match=r"cannot load hub dataset 'hub:SetFit/sst5:train' \(is the hub reachable"):
        D.load_sentiment("hub:SetFit/sst5:train")


def test_encode_truncates_and_counts(tmp_path, capsys):
    tok = D.load_tokenizer(make_tokenizer(tmp_path / "tok"))
    assert tok.pad_token == tok.eos_token
    ex = [D.Example("a", "good film", 1), D.Example("b", "the film was very very dull", 0)]
    right = D.encode(ex, tok, 4, prompt=lambda e: e.text, what="train")
    assert "truncated 1 of 2 train examples to 4 tokens" in capsys.readouterr().out
    full = tok("the film was very very dull", add_special_tokens=False)["input_ids"]
    assert right[1].input_ids == full[:4]
    left = D.encode(ex, tok, 4, prompt=lambda e: e.text, truncation_side="left")
    assert left[1].input_ids == full[-4:] and left[0].input_ids == right[0].input_ids
    batch = D.collate(right, tok.pad_token_id)
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["input_ids"][0, 2:].tolist() == [tok.pad_token_id] * 2 and batch["labels"].tolist() == [1, 0]


def test_split_head_is_deterministic_and_checked():
    ex = [D.Example(str(i), "x", 0) for i in range(5)]
    train, dev = D.split_head(ex, 3)
    assert [e.id for e in train] == ["0", "1", "2"] and [e.id for e in dev] == ["3", "4"]
    with pytest.raises(ValueError, match="cannot split 5 examples"):
        D.split_head(ex, 5)


def test_gpt2_tokenizer_falls_back_to_the_bundled_copy(capsys):
    tokenizer_path()
    tok = D.load_tokenizer("gpt2")  # the hub is off in tests (HF_HUB_OFFLINE=1)
    assert D.single_token_id(tok, "yes") == 8505 and D.single_token_id(tok, "no") == 3919
    assert tok.pad_token_id == tok.eos_token_id == 50256


def test_the_bundled_data_is_the_default(monkeypatch):
    """A clone finds its data in the project's data/ (issue 54): the corpus, the course files, the tokenizer."""
    from models import hub
    from tasks import sonnet
    from tasks.pretrain import default_corpus

    monkeypatch.delenv("GPT2_SHARED_DIR", raising=False)
    assert hub.data_dir() == hub.PROJECT_ROOT / "data" and hub.tokenizer_dir() == hub.PROJECT_ROOT / "data" / "gpt2-tokenizer"
    assert default_corpus() == hub.PROJECT_ROOT / "data" / "tinyshakespeare" / "input.txt" and default_corpus().is_file()
    assert sonnet.course_file("sonnets.txt") == str(hub.PROJECT_ROOT / "data" / "cs224n" / "sonnets.txt")
    assert (hub.PROJECT_ROOT / "data" / "SOURCES.md").is_file()


def test_a_missing_data_file_says_how_to_get_it(tmp_path, monkeypatch):
    from models import hub

    monkeypatch.delenv("GPT2_SHARED_DIR", raising=False)
    gone = hub.data_dir() / "cs224n" / "no-such-file.csv"
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*no-such-file\.csv \(.*git checkout -- data/"):
        D.read_table(gone, ["id"])
    monkeypatch.setenv("GPT2_SHARED_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"GPT2_SHARED_DIR is set .* unset the variable"):
        D.read_table(hub.data_dir() / "cs224n" / "ids-sst-train.csv", ["id"])
    with pytest.raises(FileNotFoundError, match=r"^data file not found: mine\.csv$"):  # a user's own file: no hint
        D.read_table("mine.csv", ["id"])


def test_a_moved_shared_folder_is_found_through_gpt2_shared_dir(tmp_path, monkeypatch, capsys):
    """One resolver (models.hub.data_dir and tokenizer_dir) for every consumer: the tokenizer fallback, the course
    data defaults of the CLIs, the parity tool's tokenizer, the tests' data. $GPT2_SHARED_DIR, when set, replaces
    the bundled data/ (no mix of the two)."""
    import shutil

    from conftest import data_path as test_data_path

    import run_classifier
    from models import hub, parity
    from tasks import classifier, sonnet

    moved = tmp_path / "elsewhere"
    shutil.copytree(tokenizer_path(), moved / "gpt2-tokenizer")
    (moved / "data" / "cs224n").mkdir(parents=True)
    (moved / "data" / "cs224n" / "sonnets.txt").write_text("x\n")
    monkeypatch.setenv("GPT2_SHARED_DIR", str(moved))
    monkeypatch.chdir(tmp_path)  # no data/ folder here: the CLIs fall back to the data folder
    assert hub.data_dir() == moved / "data" and hub.tokenizer_dir() == moved / "gpt2-tokenizer"
    tok = D.load_tokenizer("gpt2")
    assert str(moved / "gpt2-tokenizer") in capsys.readouterr().out and len(tok) == 50257
    assert parity.pick_tokenizer(None, str(tmp_path)) is not None
    assert sonnet.course_file("sonnets.txt") == str(moved / "data" / "cs224n" / "sonnets.txt")
    jobs = classifier.jobs(run_classifier.get_args(["--task", "sst"]))
    assert jobs[0][1] == moved / "data" / "cs224n" / "ids-sst-train.csv"
    assert test_data_path("cs224n", "sonnets.txt") == moved / "data" / "cs224n" / "sonnets.txt"
    monkeypatch.setenv("GPT2_SHARED_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(OSError, match="(?s)cannot load tokenizer .gpt2.*\\nthe offline fallback not found: .*nowhere"):
        D.load_tokenizer("gpt2")


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="cannot load tokenizer"):
        D.load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_iterate_batches_follows_the_order(tmp_path):
    enc = [D.Encoded(str(i), [1] * (i + 1), i) for i in range(5)]
    batches = list(D.iterate_batches(enc, 2, [4, 0, 2, 1, 3], pad_id=0))
    assert [b["ids"] for b in batches] == [["4", "0"], ["2", "1"], ["3"]]
    assert torch.equal(batches[0]["attention_mask"].sum(1), torch.tensor([5, 1]))
