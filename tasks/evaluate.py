"""Grade prediction files against gold files: accuracy and macro-F1 (scikit-learn), a table, and JSON.

    python -m tasks.evaluate --task sst --pred predictions/full-model-sst-dev-out.csv \\
        --gold data/cs224n/ids-sst-dev.csv --json out.json
    python -m tasks.evaluate --task para --pred predictions/para-dev-output.csv --gold quora-dev.csv \\
        --task cfimdb --pred predictions/full-model-cfimdb-dev-out.csv --gold ids-cfimdb-dev.csv
    python -m tasks.evaluate --task sonnet --pred predictions/generated_sonnets_dev.txt \\
        --gold data/cs224n/TRUE_sonnets_held_out_dev.txt

Prediction files are the course's graded format: a header `id \\t Predicted_Sentiment ` (or
`Predicted_Is_Paraphrase`), then one `<id>, <label> ` row per example; paraphrase labels are the token ids of
"yes" (8505) and "no" (3919). Every gold id must be predicted exactly once; missing, unknown or duplicate ids and
labels outside the task's set stop with an error naming the file and line. Sonnet files (`--Generated Sonnets-- `
then numbered sonnets) get the course's chrF: sacrebleu CHRF() defaults, one corpus score of the generated sonnets
(prompt lines included) against the gold sonnets, which must be as many. Scorers live in SCORERS, keyed by task.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tasks.data import NUM_LABELS, load_paraphrase, load_sentiment, split_head

YES_ID, NO_ID = 8505, 3919  # GPT-2 token ids of "yes" / "no": the course's paraphrase label codes
PARA_NAMES = {NO_ID: "no 3919", YES_ID: "yes 8505"}
HEADERS = {"sentiment": "Predicted_Sentiment", "paraphrase": "Predicted_Is_Paraphrase"}


class PredictionError(ValueError):
    """A prediction file that cannot be graded; the message names the file and line."""


def write_predictions(path: str | Path, ids: list[str], labels: list[int], kind: str) -> None:
    """Write `id \\t <header> ` then `<id>, <label> ` rows, byte for byte as the course's scripts do."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"id \t {HEADERS[kind]} \n")
        for i, label in zip(ids, labels):
            f.write(f"{i}, {int(label)} \n")


def read_predictions(path: str | Path, allowed: set[int] | None = None) -> dict[str, int]:
    """Read a prediction file into {id: label} (file order), refusing malformed rows, duplicates, unknown labels."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prediction file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].strip().startswith("id"):
        raise PredictionError(f"{path}, line 1: expected a header `id \\t Predicted_...`, got {lines[:1]}")
    out: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        sep = ", " if ", " in line else ("," if "," in line else "\t")
        if sep not in line:
            raise PredictionError(f"{path}, line {n}: expected `<id>, <label>`, got {line!r}")
        ex_id, raw = line.rsplit(sep, 1)
        ex_id = ex_id.strip().lower()
        try:
            label = int(raw.strip())
        except ValueError:
            raise PredictionError(f"{path}, line {n}: label {raw.strip()!r} is not an integer") from None
        if allowed is not None and label not in allowed:
            raise PredictionError(f"{path}, line {n}: unknown label {label} (allowed: {sorted(allowed)})")
        if ex_id in out:
            raise PredictionError(f"{path}, line {n}: duplicate id {ex_id!r} (first on line {first_line[ex_id]})")
        out[ex_id], first_line[ex_id] = label, n
    if not out:
        raise PredictionError(f"{path}: no predictions after the header")
    return out


def classification_metrics(y_true: list[int], y_pred: list[int], labels: list[int]) -> dict:
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "n": len(y_true),
        "labels": labels,
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=labels).tolist(),  # rows: gold, columns: predicted
    }


def format_confusion(matrix: list[list[int]], names: list[str]) -> str:
    """The confusion matrix as a text table: one row per gold label, one column per predicted label."""
    width = max(6, *(len(n) for n in names), *(len(str(c)) for row in matrix for c in row))
    corner = "gold \\ pred"
    lines = [f"{corner:>11} " + " ".join(f"{n:>{width}}" for n in names)]
    lines += [f"{name:>11} " + " ".join(f"{c:>{width}}" for c in row) for name, row in zip(names, matrix)]
    return "\n".join(lines)


def align(pred: dict[str, int], gold: dict[str, int], pred_path, gold_path) -> tuple[list[int], list[int]]:
    missing = [i for i in gold if i not in pred]
    unknown = [i for i in pred if i not in gold]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"{len(missing)} gold id(s) have no prediction (e.g. {missing[:3]})")
        if unknown:
            problems.append(f"{len(unknown)} predicted id(s) are not in {gold_path} (e.g. {unknown[:3]})")
        raise PredictionError(f"{pred_path}: " + "; ".join(problems))
    return [gold[i] for i in gold], [pred[i] for i in gold]


@dataclass
class Scorer:
    score: Callable[..., dict]  # (pred_path, gold_path, skip_bad_rows=, split_dev=) -> metrics
    columns: tuple[str, ...] = ("accuracy", "macro_f1")  # shown in the table


def _gold(examples, gold_path, split_dev):
    return split_head(examples, split_dev, gold_path)[1] if split_dev else examples


def _sentiment_scorer(num_labels: int) -> Scorer:
    def score(pred_path, gold_path, skip_bad_rows=False, split_dev=None):
        examples = load_sentiment(gold_path, "dev", num_labels, skip_bad_rows)
        gold = {ex.id: ex.label for ex in _gold(examples, gold_path, split_dev)}
        pred = read_predictions(pred_path, set(range(num_labels)))
        return classification_metrics(*align(pred, gold, pred_path, gold_path), labels=list(range(num_labels)))

    return Scorer(score)


def _paraphrase_score(pred_path, gold_path, skip_bad_rows=False, split_dev=None):
    examples = _gold(load_paraphrase(gold_path, "dev", skip_bad_rows), gold_path, split_dev)
    gold = {ex.id: (YES_ID if ex.label == 1 else NO_ID) for ex in examples}
    pred = read_predictions(pred_path, {YES_ID, NO_ID})
    return classification_metrics(*align(pred, gold, pred_path, gold_path), labels=[NO_ID, YES_ID])


def _sonnet_score(pred_path, gold_path, skip_bad_rows=False, split_dev=None):
    from tasks.sonnet import score_file

    if split_dev:
        raise ValueError("--split_dev does not apply to sonnet files")
    return score_file(pred_path, gold_path)


SCORERS: dict[str, Scorer] = {
    "sst": _sentiment_scorer(NUM_LABELS["sst"]),
    "cfimdb": _sentiment_scorer(NUM_LABELS["cfimdb"]),
    "para": Scorer(_paraphrase_score),
    "sonnet": Scorer(_sonnet_score, columns=("chrf",)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("what to grade (repeat the three flags to grade several files)")
    g.add_argument("--task", action="append", required=True, choices=sorted(SCORERS), help="task of the file")
    g.add_argument("--pred", action="append", required=True, help="prediction file in the course's format")
    g.add_argument("--gold", action="append", required=True,
                   help="gold data file with labels (the dev csv; for sonnets the full gold sonnets)")
    g.add_argument("--json", help="also write the results to this JSON file")
    g.add_argument("--split_dev", type=int, metavar="N",
                   help="gold = the examples after the first N of the gold file (as run_paraphrase.py --split_dev N)")
    g.add_argument("--skip_bad_rows", action="store_true", help="skip malformed gold rows (as the training run did)")
    args = parser.parse_args(argv)
    if not len(args.task) == len(args.pred) == len(args.gold):
        parser.error(f"give --task, --pred and --gold the same number of times "
                     f"(got {len(args.task)}, {len(args.pred)}, {len(args.gold)})")
    results = []
    try:
        for task, pred, gold in zip(args.task, args.pred, args.gold):
            metrics = SCORERS[task].score(pred, gold, skip_bad_rows=args.skip_bad_rows, split_dev=args.split_dev)
            results.append({"task": task, "pred": pred, "gold": gold, **metrics})
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{'task':<8} {'n':>6}  metrics")
    for r in results:
        metrics = "  ".join(f"{c} {r[c]:.4f}" for c in SCORERS[r["task"]].columns)
        print(f"{r['task']:<8} {r['n']:>6}  {metrics}  ({r['pred']})")
    for r in results:
        if "confusion_matrix" in r:
            names = [PARA_NAMES.get(label, str(label)) if r["task"] == "para" else str(label) for label in r["labels"]]
            print(f"\n{r['task']} confusion matrix ({r['pred']}):\n{format_confusion(r['confusion_matrix'], names)}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)  # runs/eval.json on a fresh clone: runs/ does not exist yet
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
