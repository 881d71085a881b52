"""Task data: readers for the course's tab-separated files, tokenization, and padded batches.

    examples = load_sentiment("data/cs224n/ids-sst-train.csv", split="train", num_labels=5)
    examples = load_paraphrase("data/quora/quora-dev-minbert.csv", split="train", skip_bad_rows=True)
    tokenizer = load_task_tokenizer("gpt2")             # falls back to data/gpt2-tokenizer when offline
    encoded = encode(examples, tokenizer, max_length=1024, prompt=sentiment_text)
    for batch in iterate_batches(encoded, batch_size=8, order=range(len(encoded))): ...

File formats (as the course starter reads them, with csv.DictReader(delimiter="\\t"): quotes as in CSV):
- SST / CFIMDB train and dev: header `\\tid\\tsentence\\tsentiment` (a leading unnamed index column); test files have
  the odd header `0\\t\\tid\\tsentence` and no labels. Sentences and ids get `.lower().strip()`.
- Quora: `id\\tsentence1\\tsentence2\\tis_duplicate`, with or without a leading unnamed index column; labels `0.0`/`1.0`;
  test files have no label column. Questions go through the course's `preprocess_string`.
A file is read with `datasets` (pandas' CSV parser, every column as text); a UTF-8 byte-order mark and CRLF line ends
are accepted. Text that is not UTF-8, malformed rows (a wrong number of fields, a quote left open), empty fields,
unknown or out-of-range labels, duplicate ids, empty files and missing columns raise DataError naming the file and line;
`skip_bad_rows=True` drops bad rows instead (the course silently skipped unparsable Quora rows) and reports them.
A `hub:NAME[:CONFIG]:SPLIT` source loads a Hugging Face hub dataset where the hub is reachable.
"""
from __future__ import annotations

import csv
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from models.hub import load_tokenizer, not_found

NUM_LABELS = {"sst": 5, "cfimdb": 2}  # the course's datasets
# Column names used by hub datasets for the same fields (first match wins).
COLUMN_ALIASES = {
    "id": ("id", "idx", "guid"),
    "sentence": ("sentence", "text", "review"),
    "sentiment": ("sentiment", "label"),
    "sentence1": ("sentence1", "question1", "text1"),
    "sentence2": ("sentence2", "question2", "text2"),
    "is_duplicate": ("is_duplicate", "label"),
}


class DataError(ValueError):
    """A data file that cannot be used as it is; the message names the file and the line."""


@dataclass
class Example:
    id: str
    text: str | tuple[str, str]  # a sentence, or a question pair
    label: int | None  # None for test files


@dataclass
class Encoded:
    id: str
    input_ids: list[int]
    label: int | None


# ---------------------------------------------------------------------------------------------------------------
# Reading tables


class _Table:
    """Rows of one source as dicts of strings, with a way to name a row's line in messages."""

    def __init__(self, source: str, rows, columns: list[str], is_file: bool):
        self.source, self.rows, self.columns, self.is_file = source, rows, columns, is_file
        self._lines: list[int] | None = None

    def where(self, index: int) -> str:
        if not self.is_file:
            return f"{self.source}, row {index}"
        if self._lines is None:  # physical start line of each record; computed only when a message needs it
            with open(self.source, newline="", encoding="utf-8") as f:
                reader, self._lines, end = csv.reader(f, delimiter="\t"), [], 1
                next(reader, None)
                for record in reader:
                    if record:  # pandas skips blank lines, so they are not rows
                        self._lines.append(end + 1)
                    end = reader.line_num
        line = self._lines[index] if index < len(self._lines) else "?"
        return f"{self.source}, line {line}"


def read_table(source: str | os.PathLike, required: Sequence[str]) -> _Table:
    """Read a tab-separated file (or `hub:` dataset) and check that the `required` columns are there."""
    source = str(source)
    if source.startswith("hub:"):
        return _read_hub(source, required)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(not_found("data file", source))
    text = _read_utf8(path)
    header_line = io.StringIO(text, newline="").readline()  # ends at \n, \r\n or \r
    if not header_line.strip():
        raise DataError(f"{source}, line 1: the file is empty (expected a tab-separated header)")
    header = header_line.rstrip("\r\n").split("\t")
    # Unnamed columns (the course files' leading index) get a placeholder; pandas would invent its own.
    names = [h.strip() or f"_unnamed{i}" for i, h in enumerate(header)]
    missing = [c for c in required if c not in names]
    if missing:
        raise DataError(f"{source}, line 1: missing column(s) {missing} in header {header}")
    line = _malformed_line(text, len(names), only_longer=True)
    if line:
        raise DataError(f"{source}, line {line}: malformed row: more fields than the {len(names)} columns of the "
                        f"header (a stray tab or a broken quote?)")
    import datasets
    from datasets.exceptions import DatasetGenerationError

    features = datasets.Features({n: datasets.Value("string") for n in names})
    level, bars = datasets.logging.get_verbosity(), not datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)  # we raise our own message; its logger would print another
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset("csv", data_files=str(path), delimiter="\t", header=0, column_names=names,
                                     features=features, keep_default_na=False, split="train", keep_in_memory=True,
                                     encoding="utf-8-sig")
    except DatasetGenerationError as e:
        cause = str(e.__cause__ or e.__context__).strip()
        line = _malformed_line(text, len(names))
        raise DataError(f"{source}{f', line {line}' if line else ''}: malformed row: {cause}") from None
    except ValueError as e:
        if "corresponds to no data" in str(e):
            raise DataError(f"{source}, line 2: no data rows after the header") from None
        raise
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()
    return _Table(source, rows, names, is_file=True)


def _read_utf8(path: Path) -> str:
    """The file's text (a leading byte-order mark dropped); bytes that are not UTF-8 are refused naming the line."""
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not UTF-8 text ({e.reason}); re-save the file as UTF-8") from None


def _malformed_line(text: str, num_columns: int, only_longer: bool = False) -> int | None:
    """The line where the first record with the wrong number of fields (only_longer: more than the header's), or a
    quote left open, starts (the csv module's reading of the same quoting rules): pandas' parser refuses such files
    without naming the line, or, when the first row has one field too many, silently takes it for an index column
    and shifts every column of the file."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", strict=not only_longer)
    end = 0
    try:
        for record in reader:
            start, end = end + 1, reader.line_num
            wrong = len(record) > num_columns if only_longer else record and len(record) != num_columns
            if wrong and start > 1:
                return start
    except csv.Error:
        return end + 1
    return None


def _read_hub(source: str, required: Sequence[str]) -> _Table:
    parts = source[len("hub:"):].split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"hub source {source!r} must look like hub:NAME:SPLIT or hub:NAME:CONFIG:SPLIT")
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), parts[-1]
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise DataError(f"cannot load hub dataset {source!r} (is the hub reachable?): {e}") from None
    return hub_table(source, rows, required)


def hub_table(source: str, rows, required: Sequence[str]) -> _Table:
    """Map a hub dataset's columns (e.g. text/label, question1/question2/label, idx) onto the course's names."""
    rename = {}
    for want in list(required) + ["id"]:
        found = next((c for c in COLUMN_ALIASES.get(want, (want,)) if c in rows.column_names), None)
        if found is None and want != "id":
            raise DataError(f"{source}: no column for {want!r} (looked for {COLUMN_ALIASES.get(want, (want,))}; "
                            f"the dataset has {rows.column_names})")
        if found is not None:
            rename[want] = found
    mapped = [{want: ("" if r[col] is None else str(r[col])) for want, col in rename.items()} for r in rows]
    if "id" not in rename:  # ids are needed for prediction files; fall back to the row number
        for i, r in enumerate(mapped):
            r["id"] = str(i)
    return _Table(source, mapped, list(mapped[0]) if mapped else [], is_file=False)


# ---------------------------------------------------------------------------------------------------------------
# The two tasks' readers


def preprocess_string(s: str) -> str:
    """The course's Quora question normalisation: lower-case, space before . ? , ' and collapsed whitespace."""
    return " ".join(s.lower().replace(".", " .").replace("?", " ?").replace(",", " ,").replace("'", " '").split())


def _parse_rows(table: _Table, parse: Callable[[dict], tuple], skip_bad_rows: bool) -> list[Example]:
    """Apply `parse(row) -> (id, text, label)` to each row; collect or raise the problems with their lines."""
    examples, skipped, seen = [], [], {}
    for i, row in enumerate(table.rows):
        try:
            ex_id, text, label = parse(row)
            if ex_id in seen:
                raise ValueError(f"duplicate id {ex_id!r} (first seen on {table.where(seen[ex_id])})")
        except ValueError as e:
            if not skip_bad_rows:
                raise DataError(f"{table.where(i)}: {e}") from None
            skipped.append(f"{table.where(i)}: {e}")
            continue
        seen[ex_id] = i
        examples.append(Example(ex_id, text, label))
    if skipped:
        print(f"skipped {len(skipped)} bad row(s) of {table.source}:\n  " + "\n  ".join(skipped))
    if not examples:
        raise DataError(f"{table.source}: no usable rows")
    return examples


def _field(row: dict, name: str) -> str:
    value = row.get(name)
    if value is None or not value.strip():
        raise ValueError(f"empty {name!r} field (a missing tab or a broken quote?)")
    return value


def load_sentiment(source: str | os.PathLike, split: str = "train", num_labels: int | None = None,
                   skip_bad_rows: bool = False) -> list[Example]:
    """SST / CFIMDB rows as Examples with text = lower-cased, stripped sentence; labels in [0, num_labels)."""
    has_labels = split != "test"
    table = read_table(source, ["id", "sentence"] + (["sentiment"] if has_labels else []))

    def parse(row):
        label = None
        if has_labels:
            raw = _field(row, "sentiment").strip()
            try:
                label = int(raw)
            except ValueError:
                raise ValueError(f"sentiment {raw!r} is not an integer label") from None
            if label < 0 or (num_labels is not None and label >= num_labels):
                raise ValueError(f"sentiment {label} is out of range for {num_labels} classes (0..{num_labels - 1})")
        return _field(row, "id").lower().strip(), _field(row, "sentence").lower().strip(), label

    return _parse_rows(table, parse, skip_bad_rows)


def load_paraphrase(source: str | os.PathLike, split: str = "train", skip_bad_rows: bool = False) -> list[Example]:
    """Quora rows as Examples with text = (question 1, question 2) after preprocess_string; labels 0 / 1."""
    has_labels = split != "test"
    table = read_table(source, ["id", "sentence1", "sentence2"] + (["is_duplicate"] if has_labels else []))

    def parse(row):
        label = None
        if has_labels:
            raw = _field(row, "is_duplicate").strip()
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"is_duplicate {raw!r} is not a number (expected 0.0 or 1.0)") from None
            if value not in (0.0, 1.0):
                raise ValueError(f"is_duplicate {raw!r} is not a label (expected 0.0 or 1.0)")
            label = int(value)
        pair = (preprocess_string(_field(row, "sentence1")), preprocess_string(_field(row, "sentence2")))
        return _field(row, "id").lower().strip(), pair, label

    return _parse_rows(table, parse, skip_bad_rows)


def split_head(examples: list[Example], n: int, source: str = "") -> tuple[list[Example], list[Example]]:
    """First n examples and the rest (a deterministic train/dev split of one file)."""
    if not 0 < n < len(examples):
        raise ValueError(f"cannot split {len(examples)} examples of {source or 'the file'} at {n}: "
                         f"need 0 < N < {len(examples)}")
    return examples[:n], examples[n:]


# ---------------------------------------------------------------------------------------------------------------
# Tokenization and batches


def load_task_tokenizer(name: str = "gpt2"):
    """models.hub.load_tokenizer, for the tasks: they pad batches, so the tokenizer must have an EOS to pad with."""
    tokenizer = load_tokenizer(name)
    if tokenizer.pad_token is None:
        raise ValueError(f"tokenizer {name!r} has no EOS token to pad with")
    return tokenizer


def check_vocab(tokenizer, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab_size}: "
                         f"use a matching --tokenizer / --model")


def single_token_id(tokenizer, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{word!r} is not a single token for this tokenizer (ids {ids}); the cloze needs one")
    return ids[0]


def encode(examples: Sequence[Example], tokenizer, max_length: int, prompt: Callable[[Example], str],
           truncation_side: str = "right", what: str = "") -> list[Encoded]:
    """Tokenize `prompt(example)` for each example, truncating to max_length; report how many were truncated."""
    texts = [prompt(ex) for ex in examples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = sum(len(x) > max_length for x in ids)
    if truncated:
        longest = max(len(x) for x in ids)
        print(f"truncated {truncated} of {len(ids)} {what} examples to {max_length} tokens "
              f"({truncation_side} side; longest was {longest})")
    cut = (lambda x: x[:max_length]) if truncation_side == "right" else (lambda x: x[-max_length:])
    out = []
    for ex, x in zip(examples, ids):
        if not x:
            raise DataError(f"{what} example id {ex.id!r}: the text tokenizes to nothing")
        out.append(Encoded(ex.id, cut(x), ex.label))
    return out


def collate(items: Sequence[Encoded], pad_id: int, side: str = "right") -> dict:
    """Pad a list of Encoded into {'input_ids', 'attention_mask', 'labels' (or None), 'ids'}: on the right for
    training and classification, on the left for generation (every prompt then ends at the last column)."""
    width = max(len(it.input_ids) for it in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        span = slice(width - len(it.input_ids), width) if side == "left" else slice(0, len(it.input_ids))
        input_ids[i, span] = torch.tensor(it.input_ids)
        mask[i, span] = 1
    labels = None if items[0].label is None else torch.tensor([it.label for it in items])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "ids": [it.id for it in items]}


def iterate_batches(encoded: Sequence[Encoded], batch_size: int, order: Iterable[int], pad_id: int):
    """Batches of `batch_size` in the given order of indices."""
    order = list(order)
    for start in range(0, len(order), batch_size):
        yield collate([encoded[i] for i in order[start : start + batch_size]], pad_id)


def length_sorted(encoded: Sequence[Encoded]) -> list[int]:
    """Indices longest first: evaluation batches with little padding (results are put back in file order)."""
    return sorted(range(len(encoded)), key=lambda i: -len(encoded[i].input_ids))
