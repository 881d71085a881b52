"""Property-based fuzzing (hypothesis) of the data readers: course-format files with odd encodings (a BOM, CR or
CRLF line ends, invalid UTF-8), malformed rows and empty fields are either read exactly or refused with an error
naming the line.

Each file is built from known rows, optionally with one row broken in a known way, so the test knows both the right
parse and the line a refusal must name. Examples are few and derandomized, so the suite stays fast and repeatable.
"""
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks import data as D
from tasks.sonnet import SonnetFileError, read_sonnets

FUZZ = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# Words without tabs, newlines or quotes at their start (those are the file format's own characters).
WORD = st.text(st.sampled_from("abcXYZ019 .,?!'-éßΩ中🙂"), min_size=1, max_size=8).filter(lambda w: w.strip())
SENTENCE = st.lists(WORD, min_size=1, max_size=5).map(" ".join)
ENCODING = st.fixed_dictionaries({"bom": st.booleans(), "eol": st.sampled_from(["\n", "\r\n", "\r"]),
                                  "final_newline": st.booleans()})


SCRATCH = tempfile.TemporaryDirectory(prefix="fuzz-readers-")  # removed at exit: hypothesis writes hundreds of files


def write(lines: list[str], enc: dict, inject: dict[int, bytes] | None = None) -> Path:
    """Join the lines with LF, CRLF or CR, UTF-8 with an optional BOM; `inject` appends raw bytes to a line."""
    eol = enc["eol"].encode()
    raw = [line.encode("utf-8") + (inject or {}).get(i, b"") for i, line in enumerate(lines)]
    data = (b"\xef\xbb\xbf" if enc["bom"] else b"") + eol.join(raw) + (eol if enc["final_newline"] else b"")
    path = Path(tempfile.mkdtemp(dir=SCRATCH.name)) / "ids-fuzz-train.csv"
    path.write_bytes(data)
    return path


MUTATIONS = ["none", "empty_field", "bad_label", "out_of_range", "extra_field", "missing_field", "duplicate_id",
             "invalid_utf8", "open_quote"]


def mutate(fields: list[str], kind: str, label_col: int, text_col: int, other_id: str, bad_labels: list[str]):
    """(fields of the broken row, bytes to append to its line, what the error must say)."""
    fields = list(fields)
    if kind == "empty_field":
        fields[text_col] = ""
        return fields, b"", "empty"
    if kind == "bad_label":
        fields[label_col] = bad_labels[0]
        return fields, b"", "not"
    if kind == "out_of_range":
        fields[label_col] = bad_labels[1]
        return fields, b"", "out of range|not a label"
    if kind == "extra_field":
        return fields + ["surplus"], b"", "malformed row"
    if kind == "missing_field":
        return fields[:-1], b"", "empty|malformed row"
    if kind == "duplicate_id":
        fields[label_col - 2 if text_col == label_col - 1 else 0] = other_id
        return fields, b"", "duplicate id"
    if kind == "invalid_utf8":
        return fields, b"\xff\xfe", "not UTF-8"
    if kind == "open_quote":
        fields[text_col] = '"' + fields[text_col]
        return fields, b"", "malformed row"
    return fields, b"", None


def check(read, path: Path, expected: list, broken: int | None, message: str | None):
    if message is None:
        assert [(e.id, e.text, e.label) for e in read(path)] == expected
        return
    with pytest.raises(D.DataError) as error:
        read(path)
    text = str(error.value)
    assert str(path) in text and f"line {broken + 2}" in text, text  # header is line 1, row i is line i + 2
    assert any(part in text for part in message.split("|")), text


@pytest.mark.parametrize("kind", MUTATIONS)  # every kind of damage, each with a few generated files
@FUZZ
@given(rows=st.lists(st.tuples(SENTENCE, st.integers(0, 4)), min_size=1, max_size=6), enc=ENCODING, data=st.data())
def test_sentiment_reader(rows, enc, kind, data):
    lines = ["\tid\tsentence\tsentiment"]
    expected = []
    for i, (sentence, label) in enumerate(rows):
        lines.append(f"{i}\tid{i}\t{sentence}\t{label}")
        expected.append((f"id{i}", sentence.lower().strip(), label))
    broken, message, inject = None, None, {}
    if kind != "none" and not (kind == "duplicate_id" and len(rows) < 2):
        broken = data.draw(st.integers(1 if kind == "duplicate_id" else 0, len(rows) - 1))
        fields, extra, message = mutate(lines[broken + 1].split("\t"), kind, 3, 2, "id0", ["x", "7"])
        if kind == "duplicate_id":
            fields[1] = "id0"
        lines[broken + 1] = "\t".join(fields)
        inject = {broken + 1: extra}
    check(lambda p: D.load_sentiment(p, "train", num_labels=5), write(lines, enc, inject), expected, broken, message)


@pytest.mark.parametrize("kind", MUTATIONS)
@FUZZ
@given(rows=st.lists(st.tuples(SENTENCE, SENTENCE, st.booleans()), min_size=1, max_size=6), enc=ENCODING,
       index_column=st.booleans(), data=st.data())
def test_paraphrase_reader(rows, enc, index_column, kind, data):
    lead = "\t" if index_column else ""
    lines = [f"{lead}id\tsentence1\tsentence2\tis_duplicate"]
    expected = []
    for i, (q1, q2, same) in enumerate(rows):
        lines.append((f"{i}\t" if index_column else "") + f"q{i}\t{q1}\t{q2}\t{float(same)}")
        expected.append((f"q{i}", (D.preprocess_string(q1), D.preprocess_string(q2)), int(same)))
    broken, message, inject = None, None, {}
    if kind != "none" and not (kind == "duplicate_id" and len(rows) < 2):
        broken = data.draw(st.integers(1 if kind == "duplicate_id" else 0, len(rows) - 1))
        offset = int(index_column)
        fields, extra, message = mutate(lines[broken + 1].split("\t"), kind, 3 + offset, 2 + offset, "q0",
                                        ["yes", "2.0"])
        if kind == "duplicate_id":
            fields[offset] = "q0"
        lines[broken + 1] = "\t".join(fields)
        inject = {broken + 1: extra}
    check(lambda p: D.load_paraphrase(p, "train"), write(lines, enc, inject), expected, broken, message)


LINE = st.lists(WORD, min_size=1, max_size=4).map(" ".join).filter(lambda s: not s.strip().isdigit())
SONNET = st.lists(LINE, min_size=1, max_size=4).map("\n".join)


@pytest.mark.parametrize("kind", ["none", "empty", "invalid_utf8"])
@settings(FUZZ, max_examples=25)
@given(sonnets=st.lists(SONNET, min_size=1, max_size=5), enc=ENCODING, data=st.data())
def test_sonnet_reader(sonnets, enc, kind, data):
    lines = ["Shakespeare's Sonnets", ""]
    starts = []
    for i, sonnet in enumerate(sonnets):
        starts.append(len(lines))  # index of the sonnet's number line
        lines += [str(i + 1), *sonnet.split("\n"), ""]
    broken = data.draw(st.integers(0, len(sonnets) - 1)) if kind != "none" else None
    inject = {}
    if kind == "empty":  # the number line followed directly by the next one (or the end of the file)
        end = starts[broken + 1] if broken + 1 < len(sonnets) else len(lines)
        del lines[starts[broken] + 1: end - (broken + 1 < len(sonnets))]
    elif kind == "invalid_utf8":
        inject = {starts[broken] + 1: b"\xc3("}
    path = write(lines, enc, inject)
    if kind == "none":
        assert read_sonnets(path) == [s.strip() for s in sonnets]
        return
    with pytest.raises(SonnetFileError) as error:
        read_sonnets(path)
    line = starts[broken] + 1 + (kind == "invalid_utf8")  # 1-based: the number line, or the sonnet's first line
    assert f"{path}, line {line}:" in str(error.value), (str(error.value), lines)
