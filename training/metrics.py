"""The metrics log of a training run: one JSON line per event in OUT/metrics.jsonl, its curves in OUT/curves.png,
and optionally TensorBoard events in OUT/tensorboard.

    log = MetricsLog(out_dir, enabled=is_main(), tensorboard=args.tensorboard)
    log.log({"kind": "train", "step": 100, "epoch": 0, "train_loss": 2.31, "lr": 3e-4, "tokens_per_s": 5200.0,
             "wall_s": 12.5})
    log.log({"kind": "eval", "step": 100, "epoch": 0, "wall_s": 14.0, "val_loss": 2.40, "dev_acc": 0.51})
    log.log({"kind": "resume", "step": 100})      # a run that resumed from its step-100 checkpoint
    log.plot()                                      # OUT/curves.png, redrawn from the whole file
    log.refresh()                                   # the same, unless a redraw now would cost more than 5% of the run
    log.close()
    records = read_metrics(out_dir)                 # the run as it stands: steps rolled back by a resume dropped

Records: every record has "kind" ("train", "eval" or "resume") and an int "step" (optimizer steps); the caller
supplies the other keys, and the log adds only "unix" (time.time()) when the record has none. Conventions the plots
know: train records carry train_loss, lr, tokens_per_s, epoch, wall_s (seconds since the run began, carried across
resumes by the caller); eval records carry epoch, wall_s and any metrics (a key containing "loss" is a loss).
Values are plain numbers, strings, booleans or None (numpy scalars and 0-d tensors are unwrapped with .item()).
JSON has no NaN or infinity, so a non-finite float is written as the string "nan", "inf" or "-inf" and
read_metrics turns those three strings back into floats: every line stays strict JSON (jq, pandas, other languages
read it), and a diverged loss is recorded rather than lost. The plots leave a gap there and mark it with an x.

The file is opened in append mode and flushed after each line, so a crash loses nothing already logged; a line cut
short by a crash is dropped (with a warning) when the next run reopens the file. A resume appends rather than
rewrites: {"kind": "resume", "step": N} says that records before it with step > N were rolled back.
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KINDS = ("train", "eval", "resume")
FILENAME = "metrics.jsonl"
PLOT_SHARE = 0.05  # MetricsLog.refresh: the most of a run's wall time that redrawing curves.png may take
FIRST_PLOT_COST = 0.5  # s: what refresh() assumes a drawing costs before it has timed one (0.3-1 s, 2-core Xeon)
_DECODE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricsLog:
    """Appends records to OUT/metrics.jsonl (see the module docstring); with enabled=False (ranks other than 0)
    every method does nothing and nothing is created."""

    def __init__(self, out_dir, enabled: bool = True, tensorboard: bool = False, plot: bool = True):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / FILENAME
        self.enabled = enabled
        self.plot_enabled = plot  # False: plot() is a no-op (the caller may still call it at every evaluation)
        self._drawn_at = time.monotonic()  # when the last plot() ended (at first: when the log opened), its cost
        self._draw_cost = FIRST_PLOT_COST
        self.stale = False  # records logged since the last plot()
        self._file = None
        self._summary_writer_cls = None
        self._writer = None
        if not enabled:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("MetricsLog(tensorboard=True) needs the tensorboard package: "
                                  f"pip install tensorboard ({e})") from e
            self._summary_writer_cls = SummaryWriter
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _drop_torn_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            raise ValueError(f"MetricsLog of {self.out_dir} is closed")
        record = _checked(record)
        record.setdefault("unix", time.time())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")  # one write: a crash can only cut this line
        self._file.flush()
        self.stale = True
        if self._summary_writer_cls is not None:
            self._to_tensorboard(record)

    def _to_tensorboard(self, record: dict) -> None:
        step = record["step"]
        if record["kind"] == "resume" or self._writer is None:
            # purge_step hides the events of the rolled-back steps (step > N) that an earlier writer left
            if self._writer is not None:
                self._writer.close()
            purge = step + 1 if record["kind"] == "resume" else None
            self._writer = self._summary_writer_cls(log_dir=str(self.out_dir / "tensorboard"), purge_step=purge)
        walltime = record["unix"] if _is_number(record["unix"]) else None
        for key, value in record.items():
            if key in ("kind", "step", "unix"):
                continue
            value = _DECODE.get(value, value) if isinstance(value, str) else value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{record['kind']}/{key}", value, global_step=step, walltime=walltime)
        self._writer.flush()

    def plot(self) -> Path | None:
        """Redraw OUT/curves.png from the whole metrics.jsonl; None when disabled or there is nothing to draw."""
        if not (self.enabled and self.plot_enabled):
            return None
        start = time.monotonic()
        out = plot_records([(self.out_dir.name, read_metrics(self.path))], self.out_dir / "curves.png",
                           title=self.out_dir.name)
        self._drawn_at = time.monotonic()
        self._draw_cost = self._drawn_at - start
        self.stale = False
        return out

    def refresh(self, share: float = PLOT_SHARE) -> Path | None:
        """plot(), but only when the time since the last drawing (at first: since the log opened) is at least its
        cost / `share` (before any drawing, FIRST_PLOT_COST / `share`: 10 s): the redraws during a run take at most
        that share of it (a figure costs 0.3-1 s on a 2-core machine; a run that evaluates every second would
        otherwise spend most of its time drawing, and a run of a few seconds would draw twice). The engine calls this
        at each evaluation and plot() once more at the end, so the last figure always shows the whole run."""
        if time.monotonic() - self._drawn_at < self._draw_cost / share:
            return None
        return self.plot()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(key: str, value):
    """A JSON-ready value: plain types pass, non-finite floats become strings, numpy / torch scalars are unwrapped."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # "nan", "inf" or "-inf"
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(key, value.item())
    raise TypeError(f"metrics record key {key!r}: {type(value).__name__} is not a plain number or string")


def _checked(record: dict) -> dict:
    kind = record.get("kind")
    if kind not in KINDS:
        raise ValueError(f"metrics record needs 'kind' in {KINDS}, got {kind!r}: {record}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"metrics record needs an int 'step' >= 0, got {step!r}: {record}")
    return {str(k): _plain(str(k), v) for k, v in record.items()}


def _drop_torn_last_line(path: Path) -> None:
    """Before appending: a last line without its newline (a crash mid-write) is ended if it is a whole record, else
    cut off, so the next record does not land on the end of it."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = size
        while start > 0:  # back to the newline that ends the line before the torn one
            pos = max(0, start - 65536)
            f.seek(pos)
            i = f.read(start - pos).rfind(b"\n")
            if i >= 0:
                start = pos + i + 1
                break
            start = pos
        f.seek(start)
        tail = f.read()
        try:
            if not isinstance(json.loads(tail, parse_constant=_refuse), dict):
                raise ValueError("not a record")
            f.write(b"\n")
        except ValueError:
            warnings.warn(f"{path}: dropping its last line, cut short by an interrupted write ({len(tail)} bytes)",
                          stacklevel=3)
            f.truncate(start)


def metrics_file(path) -> Path:
    """The metrics.jsonl of a run folder, or the file itself."""
    path = Path(path)
    return path / FILENAME if path.is_dir() else path


def read_metrics(path, raw: bool = False) -> list[dict]:
    """The records of a metrics.jsonl (or of the run folder holding one), "nan" / "inf" / "-inf" back as floats.

    By default a {"kind": "resume", "step": N} record drops the records before it with step > N (the part of the run
    that was rolled back); the resume records themselves stay. raw=True returns every record as written.
    A last line that does not parse (cut short by a crash) is skipped with a warning; any other bad line raises
    ValueError naming the file and line.
    """
    path = metrics_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file: {path}")
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 inside a string is no newline
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_refuse)
        except ValueError as e:
            if i == last:
                warnings.warn(f"{path}, line {i + 1}: skipping a last line cut short (a crash mid-write?)",
                              stacklevel=2)
                continue
            raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(f"{path}, line {i + 1}: not a record with a 'kind' key")
        record = {k: _DECODE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}
        if not raw and record["kind"] == "resume":
            records = [r for r in records if not _is_number(r.get("step")) or r["step"] <= record["step"]]
        records.append(record)
    return records


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- curves -------------------------------------------------------------------------------------------------------

# Panels in order: (key, title, y label). A series goes to "loss" if its key contains "loss", to "lr" /
# "tokens_per_s" by name, and otherwise, for eval records only, to "metrics".
PANELS = (("loss", "loss", "loss"), ("metrics", "eval metrics", "value"), ("lr", "learning rate", "lr"),
          ("tokens_per_s", "throughput", "tokens/s"))
_NOT_SERIES = {"kind", "step", "epoch", "wall_s", "unix", "seconds", "ms_per_step", "skipped", "fp16_overflows"}
_SCHEDULE = {"lr"}  # values of the run at a step, not of a record kind: train and eval records make one series
_X_LABEL = {"step": "step (optimizer steps)", "wall_s": "wall time (s)"}
_EVAL_STYLES = (("--", "o"), (":", "s"), ("-.", "^"), ("--", "D"), (":", "v"), ("-.", "P"))


def _panel(kind: str, key: str) -> str | None:
    if "loss" in key:
        return "loss"
    if key in ("lr", "tokens_per_s"):
        return key
    return "metrics" if kind == "eval" else None


def series_of(records: list[dict], x: str = "step") -> dict[str, dict[tuple[str, str], tuple[list, list]]]:
    """{panel: {(kind, key): (xs, ys)}} of one run's numeric values, against the record key `x`. The learning rate is
    one schedule whichever record logged it: one ("train", "lr") series of every logged point in x order, so an eval
    at step 0 and the next one far after the warm-up do not draw a straight line over it."""
    out: dict = {}
    for r in records:
        if r.get("kind") not in ("train", "eval") or not _is_number(r.get(x)):
            continue
        for key, value in r.items():
            if (key in _NOT_SERIES or key.startswith("best_") or key == x or not _is_number(value)
                    or (panel := _panel(r["kind"], key)) is None):  # best_*: the running best, a copy of a series
                continue
            xs, ys = out.setdefault(panel, {}).setdefault(("train" if key in _SCHEDULE else r["kind"], key), ([], []))
            xs.append(r[x])
            ys.append(float(value))
    for key in _SCHEDULE:
        if (series := out.get(_panel("train", key), {}).get(("train", key))) is not None:
            points = dict(sorted(zip(*series), key=lambda p: p[0]))  # one point per x (train and eval at one step)
            series[0][:], series[1][:] = points.keys(), points.values()
    return out


def plot_records(runs: list[tuple[str, list[dict]]], out, keys=None, x: str = "step", title: str | None = None,
                 ) -> Path | None:
    """Draw runs [(label, records)] in one figure (one colour per run when there are several) and write it to `out`
    atomically; keys: only these series (e.g. ["val_loss", "dev_acc"]). None when there is nothing to draw."""
    if x not in _X_LABEL:
        raise ValueError(f"x must be one of {tuple(_X_LABEL)}, got {x!r}")
    per_run = [series_of(records, x) for _, records in runs]
    if keys is not None:
        keys = set(keys)
        found = {k for s in per_run for panel in s.values() for _, k in panel}
        if missing := sorted(keys - found):
            raise ValueError(f"no run has the key(s) {', '.join(missing)}; they have: {', '.join(sorted(found))}")
        per_run = [{p: {sk: v for sk, v in s.items() if sk[1] in keys} for p, s in run.items()} for run in per_run]
    panels = [p for p in PANELS if any(run.get(p[0]) for run in per_run)]
    if not panels:
        return None

    # matplotlib imported here, not at the top: it costs every training CLI about half a second of start-up (this
    # module is imported by them all) and is needed only once a run has something to plot
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg for this figure only; pyplot and its backend are never touched
    # 1 panel: whole figure; 2: side by side; 3: the first across the top; 4: two by two
    grid = fig.add_gridspec(2 if len(panels) > 2 else 1, 2 if len(panels) > 1 else 1)
    cells = [grid[0, :]] + [grid[1, 0], grid[1, 1]] if len(panels) == 3 else list(grid)
    overlay = len(runs) > 1
    first = None
    for cell, (panel, panel_title, ylabel) in zip(cells, panels):
        ax = fig.add_subplot(cell, sharex=first)
        first = first or ax
        # the panel's series over all runs, train first; each keeps one line style (and, alone, one colour)
        order = sorted({sk for run in per_run for sk in run.get(panel, {})}, key=lambda sk: (sk[0] != "train", sk))
        evals = [sk for sk in order if sk[0] == "eval"]
        styles = {sk: ("-", None) if sk[0] == "train" else _EVAL_STYLES[evals.index(sk) % len(_EVAL_STYLES)]
                  for sk in order}
        names = {(kind, key): f"{key} (eval)" if kind == "eval" and ("train", key) in styles else key
                 for kind, key in order}
        for i, run in enumerate(per_run):
            for sk, (xs, ys) in run.get(panel, {}).items():
                linestyle, marker = styles[sk]
                _draw_series(ax, xs, ys, f"C{(i if overlay else order.index(sk)) % 10}", linestyle,
                             marker or ("." if len(xs) == 1 else None), None if overlay else names[sk])
        if overlay:  # colours are runs (the figure's legend), line styles are series (this one)
            ax.legend([Line2D([], [], color="0.3", linestyle=styles[sk][0], marker=styles[sk][1]) for sk in order],
                      [names[sk] for sk in order], fontsize=8)
        else:
            ax.legend(fontsize=8)
        ax.set_title(panel_title)
        ax.set_xlabel(_X_LABEL[x])
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    if overlay:
        fig.legend([Line2D([], [], color=f"C{i % 10}", linewidth=2) for i in range(len(runs))],
                   [label for label, _ in runs], loc="outside upper center", ncols=min(len(runs), 4), fontsize=9)
    if title:
        fig.suptitle(title)
    return _save_atomic(fig, Path(out))


def _draw_series(ax, xs, ys, colour, linestyle, marker, label) -> None:
    finite = [y if math.isfinite(y) else math.nan for y in ys]  # a gap where the value is nan or infinite
    ax.plot(xs, finite, color=colour, linestyle=linestyle, marker=marker, markersize=4, linewidth=1.3, label=label)
    bad = [xv for xv, y in zip(xs, ys) if not math.isfinite(y)]
    if bad:  # mark non-finite values along the top edge of the panel
        ax.scatter(bad, [0.97] * len(bad), marker="x", color=colour, transform=ax.get_xaxis_transform(),
                   clip_on=False, label=f"{label}: non-finite" if label else None)


def _save_atomic(fig: Figure, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)  # a reader sees the old figure or the new one, never half of one
    finally:
        tmp.unlink(missing_ok=True)
    return out
