"""Where files come from: the shared data folder, and tokenizers from the Hugging Face hub with one offline fallback.

    shared_dir()                       # $GPT2_SHARED_DIR, else ../shared beside the project (course data, tokenizer)
    tokenizer = load_tokenizer("gpt2")  # the hub (or its cache); offline, the shared copy of the same GPT-2 BPE
"""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
GPT2_IDS = ("gpt2", "openai-community/gpt2")  # the names the shared tokenizer may stand in for


def shared_dir() -> Path:
    """The shared folder (course data, the GPT-2 tokenizer): $GPT2_SHARED_DIR when set, else ../shared beside the
    project root. Read at each call, so setting the variable later takes effect."""
    return Path(os.path.expanduser(os.environ.get("GPT2_SHARED_DIR", PROJECT_ROOT.parent / "shared")))


def shared_tokenizer_dir() -> Path:
    return shared_dir() / "gpt2-tokenizer"


def expand(spec: str | os.PathLike) -> str:
    """A user's path as the shell would have expanded it (`~/models/x` arrives unexpanded when quoted)."""
    return os.path.expanduser(str(spec))


def load_tokenizer(spec: str | os.PathLike = "gpt2"):
    """AutoTokenizer for a hub id or a folder. The one fallback: `gpt2` (or `openai-community/gpt2`) that cannot be
    loaded from the hub or its cache loads the shared copy of the same tokenizer, saying so. The pad token is set
    to EOS where the tokenizer has none (GPT-2 has none; padding is given by attention masks anyway)."""
    from transformers import AutoTokenizer

    spec = expand(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        fallback = shared_tokenizer_dir()
        if spec not in GPT2_IDS or not fallback.is_dir():
            raise OSError(f"cannot load tokenizer {spec!r}: {e}") from None
        print(f"tokenizer {spec!r} cannot be loaded from the hub ({type(e).__name__}); using {fallback} "
              f"(the same GPT-2 BPE)")
        tokenizer = AutoTokenizer.from_pretrained(fallback)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
