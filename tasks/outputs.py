"""Where a run writes its prediction files, and the one rule that keeps one run from taking another's.

    folder = predictions_folder(cfg.predictions_dir, output_dir)   # OUTPUT_DIR/predictions unless given
    claim_outputs([dev_out, test_out], cfg.overwrite, cfg.resume)  # before training: refuse another run's files

Files keep the course's names (grading/predictions.py reads them); `--predictions_dir predictions` is the course's
layout. (Its own module: tasks.evaluate, where the files are read and written, imports tasks.sonnet's scorer.)
"""
from __future__ import annotations

from pathlib import Path


def predictions_folder(predictions_dir: str | None, output_dir: str | Path) -> Path:
    """--predictions_dir, else the run's own folder: OUTPUT_DIR/predictions."""
    return Path(predictions_dir) if predictions_dir else Path(output_dir) / "predictions"


def claim_outputs(paths, overwrite: bool = False, resume: bool = False, trains: bool = True) -> None:
    """Refuse, before anything trains, to replace prediction files that another run wrote: an existing file is
    replaced only with --overwrite, or with --resume (the run that wrote it, continued with the same flags) when this
    run trains (a decoding or a baseline has no run to continue)."""
    taken = [str(p) for p in map(Path, filter(None, paths)) if p.exists()]
    if taken and not (overwrite or resume and trains):
        them = "it" if len(taken) == 1 else "them"
        how = (f", --resume to continue the run that wrote {them}," if trains else
               " (this run trains nothing, so there is no run to --resume)")
        raise FileExistsError(f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''} (an earlier run's "
                              f"predictions): pass --overwrite to replace {them}{how} or "
                              f"--predictions_dir DIR (or --output_dir) to write elsewhere")
