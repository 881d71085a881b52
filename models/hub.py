"""Where files come from: the data folder, and tokenizers from the Hugging Face hub with one offline fallback.

    data_dir() / "tinyshakespeare" / "input.txt"   # the project's data/, or $GPT2_SHARED_DIR/data when that is set
    tokenizer_dir()                    # GPT-2's BPE: data/gpt2-tokenizer, or $GPT2_SHARED_DIR/gpt2-tokenizer
    tokenizer = load_tokenizer("gpt2")  # the HF cache, else the hub, else (offline) tokenizer_dir(), the same BPE
    hub_reachable()                    # one request, once per process; unreachable: offline mode from then on
    tokenizer_for(None, "checkpoints/run/best")   # a model folder's own tokenizer when it holds one, else "gpt2"
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

PROJECT_ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
BUNDLED_DATA = PROJECT_ROOT / "data"  # what the main job and the tests need, with data/SOURCES.md
GPT2_IDS = ("gpt2", "openai-community/gpt2")  # the names the bundled tokenizer may stand in for


def _override() -> Path | None:
    """$GPT2_SHARED_DIR: a shared folder (data/<set>/ and gpt2-tokenizer/, e.g. larger copies) used instead of the
    bundled data/. Read at each call, so setting the variable later takes effect."""
    value = os.environ.get("GPT2_SHARED_DIR")
    return Path(os.path.expanduser(value)) if value else None


def data_dir() -> Path:
    """The data folder (tinyshakespeare/, cs224n/, quora/): $GPT2_SHARED_DIR/data when the variable is set, else the
    project's own data/. One or the other, never a mix, so a run reads what the variable says."""
    override = _override()
    return override / "data" if override else BUNDLED_DATA


def tokenizer_dir() -> Path:
    """GPT-2's BPE tokenizer: $GPT2_SHARED_DIR/gpt2-tokenizer when the variable is set, else data/gpt2-tokenizer."""
    override = _override()
    return override / "gpt2-tokenizer" if override else BUNDLED_DATA / "gpt2-tokenizer"


def missing_data(path: str | os.PathLike) -> str:
    """Where a data file that is not there comes from and how to get it: for the error that names it."""
    if _override():
        return (f"$GPT2_SHARED_DIR is set ({_override()}) and replaces the project's data/: put the file there, or "
                f"unset the variable to use the bundled copy")
    return ("the project's data/ folder holds the bundled data in a full clone (git checkout -- data/ restores it; "
            "data/SOURCES.md says where each file comes from), or set GPT2_SHARED_DIR to a folder with data/ and "
            "gpt2-tokenizer/ in it")


def not_found(what: str, path: str | os.PathLike) -> str:
    """'WHAT not found: PATH', and missing_data()'s how-to-get-it when PATH is in the data folder."""
    where = Path(os.path.abspath(expand(path)))
    ours = any(where.is_relative_to(os.path.abspath(root)) for root in (data_dir(), tokenizer_dir(), BUNDLED_DATA))
    return f"{what} not found: {path}" + (f" ({missing_data(path)})" if ours else "")


def expand(spec: str | os.PathLike) -> str:
    """A user's path as the shell would have expanded it (`~/models/x` arrives unexpanded when quoted)."""
    return os.path.expanduser(str(spec))


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")  # any one makes a folder AutoTokenizer loads
_hub_answered: bool | None = None  # the probe's answer, kept for the rest of the process


class HubUnavailableError(FileNotFoundError):
    """A hub id that is neither in the local cache nor reachable on the hub; the message says what to pass instead.
    `what` is the first part alone, for a caller that says more precisely what to do (with_offline_help)."""

    def __init__(self, what: str, hint: str = ""):
        super().__init__(f"{what}. {hint}" if hint else what)
        self.what = what


def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers. One request without retries, made once per process; when it gets no
    answer, huggingface_hub (and transformers, which asks it) is switched to offline mode for the rest of the process,
    so no later call waits through the hub's retries (five, about 25 s, for every file asked for)."""
    global _hub_answered
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if _hub_answered is None:
        from huggingface_hub.utils import get_session

        try:
            get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
            _hub_answered = True
        except Exception as e:  # DNS, connection, proxy, TLS or timeout: any way of getting no answer
            _hub_answered = False
            go_offline(f"{type(e).__name__}: {e}")
    return _hub_answered


def go_offline(reason: str) -> None:
    """Offline mode for this process and the processes it starts (HF_HUB_OFFLINE), saying so once."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True  # read at every request by huggingface_hub and transformers
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets when imported, and by the processes this one starts
    if "datasets" in sys.modules:  # datasets copied the flag at import: its download-count ping per file read
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    print(f"the Hugging Face hub does not answer ({reason}): offline from here on, local files only "
          f"(set HF_HUB_OFFLINE=1 to skip this check)")


def offline_help(recipe: str) -> str:
    """What a task CLI prints when its --model is a hub id that cannot be had: the local choices, and `recipe`, the
    user's command on a small random-init model, the flags they did not give set for a run of a few minutes."""
    return ("Without the hub, give --model a local model:\n"
            "  --model checkpoints/random-gpt2               the random-init gpt2 (124M) that "
            "`python -m models.parity` saves there (run it first, from the same folder)\n"
            "  --model random:n_layer=4,n_head=4,n_embd=256  a small model from random init (any GPT2Config fields; "
            "no files needed)\n"
            "  --model DIR                                   any folder made with save_pretrained (a run's best/, a "
            "model pretrained with run_pretrain.py)\n"
            f"Your command without the hub, on a small model from random init (the flags you did not give set for "
            f"a run of a few minutes):\n  {recipe}")


def with_offline_help(job: Callable[[], T], recipe: str) -> T:
    """job(), with offline_help(recipe) added to the message of a HubUnavailableError it raises."""
    try:
        return job()
    except HubUnavailableError as e:
        raise HubUnavailableError(f"{e.what}.\n{offline_help(recipe)}") from None


def model_tokenizer(model: str | os.PathLike | None) -> Path | None:
    """The folder of `model` (a model folder, or the folder of a weights file) when it holds a tokenizer."""
    if not model:
        return None
    path = Path(expand(model))
    folder = path if path.is_dir() else path.parent if path.is_file() else None
    if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES):
        return folder
    return None


def tokenizer_for(spec: str | os.PathLike | None, model: str | os.PathLike | None = None) -> str:
    """The tokenizer a task uses: `spec` when given, else the model folder's own (a run's best/ saves it), else
    GPT-2's ('gpt2')."""
    if spec:
        return expand(spec)
    folder = model_tokenizer(model)
    return str(folder) if folder is not None else "gpt2"


def load_tokenizer(spec: str | os.PathLike = "gpt2"):
    """AutoTokenizer for a hub id or a folder. A hub id is looked up in the local HF cache first (no network), then
    on the hub if it answers (hub_reachable); the one fallback: `gpt2` (or `openai-community/gpt2`) that neither
    has loads the bundled copy of the same tokenizer (tokenizer_dir()), saying so. The pad token is set to EOS where the tokenizer has
    none (GPT-2 has none; padding is given by attention masks anyway)."""
    from transformers import AutoTokenizer

    spec = expand(spec)
    if Path(spec).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(spec)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError) as e:
            tokenizer = _from_hub_or_bundled(spec, e)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_hub_or_bundled(spec: str, cache_error: Exception):
    from transformers import AutoTokenizer

    error: Exception = cache_error
    if hub_reachable():
        try:
            return AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as e:
            error = e
    fallback = tokenizer_dir()
    if spec not in GPT2_IDS or not fallback.is_dir():
        where = "the hub" if hub_reachable() else "the local cache, and the hub does not answer"
        bundled = f"\n{not_found('the offline fallback', fallback)}" if spec in GPT2_IDS else ""
        raise OSError(f"cannot load tokenizer {spec!r} from {where}: {error}{bundled}") from None
    print(f"tokenizer {spec!r} is not in the local cache and cannot be had from the hub; using {fallback} "
          f"(the same GPT-2 BPE)")
    return AutoTokenizer.from_pretrained(fallback)
