"""The character tokenizer (tasks/char_tokenizer.py): ids, the vocabulary file, and the errors a user sees. Pure Python
and numpy, no model: bench/mutation.py runs this file against every mutant of the module."""
import json
import locale
import re

import numpy as np
import pytest
import torch

from tasks.char_tokenizer import VOCAB_FILE, CharTokenizer


def test_round_trip_save_load_and_unknown_characters(tmp_path):
    text = "Héllo, wörld!\n\tΩ≈ 🙂"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text)) and len(tok) == tok.vocab_size == len(set(text))
    assert tok.decode(tok.encode(text)) == text
    tok.save_pretrained(tmp_path)
    again = CharTokenizer.from_pretrained(tmp_path)
    assert again.chars == tok.chars and again.encode(text) == tok.encode(text)
    with pytest.raises(ValueError, match=r"^2 character\(s\) not in the 16-character vocabulary of this model: 'Z', 'q'$"):
        tok.encode("HqZ")


def test_ids_are_int64_and_decode_takes_any_integer_sequence():
    tok = CharTokenizer(list("abc"))
    ids = tok.encode_array("cab")
    assert ids.dtype == np.int64 and ids.tolist() == [2, 0, 1]  # the dtype the pretraining corpus is stored in
    assert [type(i) for i in tok.encode("cab")] == [int, int, int]
    assert tok.decode(np.array([2, 0, 1], dtype=np.uint16)) == tok.decode(torch.tensor([2, 0, 1])) == "cab"
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert CharTokenizer(list("ca\n")).stoi == {"c": 0, "a": 1, "\n": 2}  # nanoGPT's stoi (sampling's prompt reads it)


def test_characters_past_either_end_of_the_vocabulary_are_found_or_refused():
    tok = CharTokenizer(list("bdf"))
    assert tok.encode("fbdf") == [2, 0, 1, 2]  # the first and the last code point of the vocabulary
    for missing in ("a", "c", "g", "\U0010ffff"):  # below, between, above, the last code point there is
        with pytest.raises(ValueError, match=f"^1 character\\(s\\) not in the 3-character vocabulary of this model: "
                                             f"{re.escape(repr(missing))}$"):
            tok.encode("b" + missing)


def test_the_missing_characters_are_listed_up_to_twenty():
    tok = CharTokenizer(["."])
    twenty = [chr(c) for c in range(ord("a"), ord("a") + 20)]
    with pytest.raises(ValueError, match=r"^20 character\(s\) not in the 1-character vocabulary of this model: "
                                         + re.escape(", ".join(map(repr, twenty))) + "$"):
        tok.encode("." + "".join(reversed(twenty)) * 2)
    with pytest.raises(ValueError, match=r"^21 character\(s\) not .*: " + re.escape(", ".join(map(repr, twenty)))
                                         + r", \.\.\.$"):
        tok.encode("".join(twenty) + "u")


def test_a_lone_surrogate_is_a_character_like_any_other():
    """Text read with errors="surrogateescape" holds lone surrogates for undecodable bytes: they encode if the
    vocabulary has them and are named if not, instead of failing inside the codec."""
    tok = CharTokenizer(["a", "\udcff"])
    assert tok.encode("a\udcffa") == [0, 1, 0] and tok.decode([1, 0]) == "\udcffa"
    with pytest.raises(ValueError, match=r"^1 character\(s\) not in the 2-character vocabulary of this model: "
                                         r"'\\udc80'$"):
        tok.encode("a\udc80")


def test_ids_outside_the_vocabulary_are_refused_not_wrapped_around():
    tok = CharTokenizer(list("xyz"))
    assert tok.decode([0, 2]) == "xz"
    for ids, shown in [([3], "[3]"), ([0, -1], "[-1]"), ([5, 6, 7, -8, 9, 3, 1], "[5, 6, 7, -8, 9]")]:
        with pytest.raises(ValueError, match=f"^token ids {re.escape(shown)} are outside the character vocabulary "
                                             r"\[0, 3\)$"):
            tok.decode(ids)


def test_bad_vocabularies_are_refused_naming_the_entries():
    with pytest.raises(ValueError, match="^a character vocabulary needs at least one character$"):
        CharTokenizer([])
    for chars, shown in [(["a", "bc"], "['bc']"), (["a", ""], "['']"), (["a", 7], "[7]"),
                         (["ab", "c", "de", "fg", "hi", "jk", "lm"], "['ab', 'de', 'fg', 'hi', 'jk']")]:
        with pytest.raises(ValueError, match=f"^vocabulary entries must be single characters, got {re.escape(shown)}$"):
            CharTokenizer(chars)
    with pytest.raises(ValueError, match=r"^vocabulary has duplicate characters \['a', 'b'\]$"):
        CharTokenizer(list("abcab"))


def test_from_text_takes_a_string_or_chunks_of_one():
    assert CharTokenizer.from_text("baca\n").chars == ["\n", "a", "b", "c"]
    chunks = (line for line in ["ba", "ca\n", ""])  # an iterable read once, e.g. a file's lines
    assert CharTokenizer.from_text(chunks).chars == ["\n", "a", "b", "c"]
    for empty in ("", [], ["", ""]):
        with pytest.raises(ValueError, match="^cannot build a character vocabulary from an empty text$"):
            CharTokenizer.from_text(empty)


def test_the_vocabulary_file_is_utf8_text_one_entry_per_line(tmp_path):
    chars = ["\n", '"', "a", "é", "🙂"]
    CharTokenizer(chars).save_pretrained(tmp_path)
    expected = '{\n"type": "char",\n"chars": [\n"\\n",\n"\\"",\n"a",\n"é",\n"🙂"\n]\n}\n'
    assert (tmp_path / VOCAB_FILE).read_bytes() == expected.encode("utf-8")


@pytest.fixture
def ascii_locale():
    """The C locale, whose default text encoding is ASCII (as on a bare server or in a minimal container)."""
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            pytest.skip("Python's UTF-8 mode is on: the default encoding cannot differ from UTF-8")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


def test_a_non_ascii_vocabulary_saves_and_loads_whatever_the_locale_s_encoding(tmp_path, ascii_locale):
    chars = list("aé€🙂")
    CharTokenizer(chars).save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).chars == chars
    assert json.loads((tmp_path / VOCAB_FILE).read_bytes().decode("utf-8"))["chars"] == chars


def test_a_missing_broken_or_foreign_vocabulary_file_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^no character vocabulary char_vocab.json in {re.escape(str(tmp_path))}$"):
        CharTokenizer.from_pretrained(tmp_path)
    path = tmp_path / VOCAB_FILE
    path.write_text('{"chars": ["a",', encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not valid JSON: Expecting value"):
        CharTokenizer.from_pretrained(tmp_path)
    for data in (["a", "b"], {"chars": "ab"}, {"type": "char"}):
        path.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))} must hold an object with a 'chars' list$"):
            CharTokenizer.from_pretrained(tmp_path)
    path.write_text(json.dumps({"type": "bpe", "chars": ["a"]}), encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} holds a 'bpe' vocabulary, not a character one$"):
        CharTokenizer.from_pretrained(tmp_path)
    path.write_text(json.dumps({"chars": ["b", "a"]}), encoding="utf-8")  # written by hand: no "type"
    assert CharTokenizer.from_pretrained(tmp_path).encode("ab") == [1, 0]
    path.write_text(json.dumps({"type": "char", "chars": ["a", "a"]}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"^vocabulary has duplicate characters \['a'\]$"):
        CharTokenizer.from_pretrained(tmp_path)
