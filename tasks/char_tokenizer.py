"""Character-level tokenizer ("Let's build GPT"): the vocabulary is the sorted set of characters of the training text.

    tok = CharTokenizer.from_text(open("input.txt").read())
    ids = tok.encode("To be")          # list of ints; a character outside the vocabulary raises, naming it
    tok.decode(ids) == "To be"
    tok.save_pretrained(folder)        # char_vocab.json, next to the model's config.json
    tok = CharTokenizer.from_pretrained(folder)

The method names follow transformers' tokenizers, so checkpoint code can save either kind the same way.

char_vocab.json is UTF-8 JSON, one entry per line, the characters as themselves (not \\u escapes), so a vocabulary
reads and diffs as text: {"type": "char", "chars": [...]}, the id of a character its index in "chars". A file whose
"type" names another kind of vocabulary is refused; a hand-written one without "type" is read as a character one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

VOCAB_FILE = "char_vocab.json"


class CharTokenizer:
    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("a character vocabulary needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"vocabulary entries must be single characters, got {bad[:5]!r}")
        if len(set(chars)) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"vocabulary has duplicate characters {dupes!r}")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        # Code points sorted for np.searchsorted, and the id of each: encoding a big text is one vectorised lookup.
        codes = np.array([ord(c) for c in chars], dtype=np.uint32)
        self._order = np.argsort(codes, kind="stable")
        self._sorted_codes = codes[self._order]

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """Vocabulary = sorted set of the characters of `text` (a string, or an iterable of chunks of one)."""
        seen: set[str] = set()
        for chunk in [text] if isinstance(text, str) else text:
            seen.update(chunk)
        if not seen:
            raise ValueError("cannot build a character vocabulary from an empty text")
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def encode_array(self, text: str) -> np.ndarray:
        """text -> int64 array of ids. Raises ValueError naming the characters the vocabulary lacks."""
        codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        pos = np.searchsorted(self._sorted_codes, codes)
        found = self._sorted_codes[np.minimum(pos, len(self._sorted_codes) - 1)] == codes
        if not found.all():
            missing = sorted({chr(c) for c in codes[~found].tolist()})
            shown = ", ".join(repr(c) for c in missing[:20]) + (", ..." if len(missing) > 20 else "")
            raise ValueError(f"{len(missing)} character(s) not in the {len(self)}-character vocabulary of this "
                             f"model: {shown}")
        return self._order[pos].astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the character vocabulary [0, {len(self.chars)})")
        return "".join(self.chars[i] for i in ids)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        path = Path(folder) / VOCAB_FILE
        path.write_text(json.dumps({"type": "char", "chars": self.chars}, ensure_ascii=False, indent=0) + "\n",
                        encoding="utf-8")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "CharTokenizer":
        path = Path(folder) / VOCAB_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no character vocabulary {VOCAB_FILE} in {folder}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("chars"), list):
            raise ValueError(f"{path} must hold an object with a 'chars' list")
        if data.get("type", "char") != "char":
            raise ValueError(f"{path} holds a {data['type']!r} vocabulary, not a character one")
        return cls(data["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={len(self)})"
