"""Score a submission's prediction files (the course's file names) with tasks.evaluate, as leaderboard values."""
from __future__ import annotations

from pathlib import Path

from tasks.evaluate import SCORERS

# leaderboard name, task, prediction file names (first found wins), gold file names
FILES = [
    ("SST dev accuracy", "sst", ["full-model-sst-dev-out.csv", "last-linear-layer-sst-dev-out.csv"], ["ids-sst-dev.csv"]),
    ("CFIMDB dev accuracy", "cfimdb", ["full-model-cfimdb-dev-out.csv", "last-linear-layer-cfimdb-dev-out.csv"],
     ["ids-cfimdb-dev.csv"]),
    ("Quora dev accuracy", "para", ["para-dev-output.csv"], ["quora-dev.csv"]),
    ("Sonnet dev chrF", "sonnet", ["generated_sonnets_dev.txt", "generated_sonnets.txt"],
     ["TRUE_sonnets_held_out_dev.txt"]),
]


def _first(folder: Path, names: list[str]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def score_predictions(pred_dir, gold_dir) -> tuple[list[dict], list[str]]:
    """({'name', 'value'} per scored file, messages); a missing or malformed file is a message, not an error."""
    pred_dir = Path(pred_dir)
    if gold_dir is None:
        return [], ["--predictions needs --gold (the folder with the course's dev files)"]
    gold_dir = Path(gold_dir)
    board, messages = [], []
    for name, task, pred_names, gold_names in FILES:
        pred, gold = _first(pred_dir, pred_names), _first(gold_dir, gold_names)
        if pred is None:
            messages.append(f"{name}: no {' or '.join(pred_names)} in {pred_dir}")
            continue
        if gold is None:
            messages.append(f"{name}: no gold file {' or '.join(gold_names)} in {gold_dir}")
            continue
        try:
            metrics = SCORERS[task].score(pred, gold)
        except (ValueError, FileNotFoundError, OSError) as e:
            messages.append(f"{name}: {pred.name} could not be scored: {e}")
            continue
        value = metrics["chrf"] if task == "sonnet" else metrics["accuracy"]
        board.append({"name": name, "value": round(float(value), 4)})
        messages.append(f"{name}: {value:.4f} ({pred.name}, n={metrics['n']})")
    return board, messages
