"""The metrics log of training runs (training/metrics.py) and the overlay plot CLI (training/plot.py)."""
import json
import math
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from training import metrics
from training import plot as plot_cli
from training.metrics import MetricsLog, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(out_dir, steps=range(0, 101, 10), eval_every=50, scale=1.0, **kw):
    """A small run as the training engine logs it; returns what was logged (without "unix")."""
    logged = []
    with MetricsLog(out_dir, **kw) as log:
        for step in steps:
            record = {"kind": "train", "step": step, "epoch": step // 50, "train_loss": scale * 3.0 / (1 + step / 20),
                      "lr": 1e-3 * (1 - step / 200), "tokens_per_s": 1000.0 + 37 * (step % 3), "wall_s": 0.5 * step}
            log.log(record)
            logged.append(record)
            if step and step % eval_every == 0:
                record = {"kind": "eval", "step": step, "epoch": step // 50, "wall_s": 0.5 * step + 0.2,
                          "val_loss": scale * 3.2 / (1 + step / 20), "dev_acc": 0.4 + step / 400, "dev_f1": 0.3}
                log.log(record)
                logged.append(record)
    return logged


def _without_unix(records):
    return [{k: v for k, v in r.items() if k != "unix"} for r in records]


def _assert_png(path, min_size=(500, 800)):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[0] >= min_size[0] and image.shape[1] >= min_size[1]
    rgb = image[..., :3]
    assert rgb.std() > 0.05  # not a blank canvas
    assert ((rgb.max(-1) - rgb.min(-1)) > 0.25).mean() > 0.002  # coloured pixels: curves, not only axes and text
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # the temp file was renamed


def test_records_round_trip_as_strict_json_lines(tmp_path):
    run = tmp_path / "a" / "run"  # folders are created
    logged = _write_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(logged) == 13
    for line in lines:
        record = json.loads(line)
        assert isinstance(record["unix"], float) and record["kind"] in ("train", "eval")
    assert _without_unix(read_metrics(run)) == logged
    assert read_metrics(run / "metrics.jsonl") == read_metrics(run)


def test_appends_across_logs_and_keeps_a_callers_unix(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "train", "step": 1, "train_loss": 1.0, "unix": 5.0})
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "train", "step": 2, "train_loss": np.float32(0.5), "note": "ok", "flag": True, "x": None})
    records = read_metrics(tmp_path)
    assert records[0] == {"kind": "train", "step": 1, "train_loss": 1.0, "unix": 5.0}
    assert _without_unix(records[1:]) == [{"kind": "train", "step": 2, "train_loss": 0.5, "note": "ok", "flag": True,
                                           "x": None}]


def test_non_finite_values_are_strings_in_the_file_and_floats_when_read(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "train", "step": 1, "train_loss": float("nan"), "lr": float("inf"), "grad": -math.inf})
    line = (tmp_path / "metrics.jsonl").read_text()
    json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the file is not JSON"))
    assert '"train_loss": "nan"' in line and '"lr": "inf"' in line and '"grad": "-inf"' in line
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["train_loss"]) and record["lr"] == math.inf and record["grad"] == -math.inf


def test_bad_records_are_refused(tmp_path):
    with MetricsLog(tmp_path) as log:
        for bad in ({"step": 1}, {"kind": "evl", "step": 1}, {"kind": "eval"}, {"kind": "eval", "step": 1.5}):
            with pytest.raises(ValueError, match="kind|step"):
                log.log(bad)
        with pytest.raises(TypeError, match="'losses'"):
            log.log({"kind": "train", "step": 1, "losses": [1.0, 2.0]})
    with pytest.raises(ValueError, match="closed"):
        log.log({"kind": "train", "step": 1})
    assert read_metrics(tmp_path) == []


def test_disabled_log_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # tensorboard is not needed either
    log = MetricsLog(tmp_path / "run", enabled=False, tensorboard=True)
    log.log({"kind": "train", "step": 1, "train_loss": 1.0})
    log.log({"bad": "records are not even checked"})
    assert log.plot() is None
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    logged = _write_run(tmp_path, steps=[10, 20])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 30, "train_lo')  # a crash mid-write
    with pytest.warns(UserWarning, match="line 3"):
        assert _without_unix(read_metrics(tmp_path)) == logged


def test_reopening_after_a_torn_write_drops_the_torn_line(tmp_path):
    _write_run(tmp_path, steps=[10])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    with pytest.warns(UserWarning, match="cut short"):
        log = MetricsLog(tmp_path)
    log.log({"kind": "resume", "step": 10})
    log.close()
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["train", "resume"]
    # a whole record that only lost its newline is kept
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 11, "train_loss": 1.5}')
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "train", "step": 12, "train_loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [10, 10, 11, 12]


def test_malformed_middle_line_raises_naming_file_and_line(tmp_path):
    _write_run(tmp_path, steps=[10, 20, 30])
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:-5]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2"):
        read_metrics(tmp_path)
    path.write_text('{"kind": "train", "step": 1}\n[1, 2]\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match="line 2: not a record"):
        read_metrics(path)


def test_resume_drops_the_rolled_back_steps(tmp_path):
    _write_run(tmp_path, steps=range(10, 61, 10), eval_every=20)  # crashed after step 60; last checkpoint at 40
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "resume", "step": 40})
        for step in (50, 60, 70):
            log.log({"kind": "train", "step": step, "train_loss": 0.1 * step})
    raw = read_metrics(tmp_path, raw=True)
    assert [(r["kind"], r["step"]) for r in raw] == [
        ("train", 10), ("train", 20), ("eval", 20), ("train", 30), ("train", 40), ("eval", 40), ("train", 50),
        ("train", 60), ("eval", 60), ("resume", 40), ("train", 50), ("train", 60), ("train", 70)]
    kept = read_metrics(tmp_path)
    assert [(r["kind"], r["step"]) for r in kept] == [
        ("train", 10), ("train", 20), ("eval", 20), ("train", 30), ("train", 40), ("eval", 40), ("resume", 40),
        ("train", 50), ("train", 60), ("train", 70)]
    assert [r["train_loss"] for r in kept if r["step"] > 40] == [5.0, 6.0, 7.0]


def test_plot_writes_a_legible_png_with_non_finite_values(tmp_path):
    already_pyplot = "matplotlib.pyplot" in sys.modules
    _write_run(tmp_path)
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "train", "step": 110, "train_loss": float("nan"), "lr": 1e-4, "tokens_per_s": math.inf})
        path = log.plot()
    assert path == tmp_path / "curves.png"
    _assert_png(path, min_size=(700, 1000))  # 10 x 7 inches at dpi 100
    assert already_pyplot or "matplotlib.pyplot" not in sys.modules  # pyplot's global backend is left alone
    assert MetricsLog(tmp_path / "quiet", plot=False).plot() is None


class _SlowPlots:
    """training.metrics with a clock that moves only when a figure is drawn (each costs `cost` seconds): a stand-in
    for plot_records that records how many records each drawing saw."""

    def __init__(self, monkeypatch, cost=1.0):
        from types import SimpleNamespace

        from training import metrics

        self.now, self.cost, self.seen = 0.0, cost, []
        monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: self.now, time=lambda: 1e9))
        monkeypatch.setattr(metrics, "plot_records", self.draw)

    def draw(self, runs, out, **kw):
        self.now += self.cost
        self.seen.append([(r["kind"], r["step"]) for r in runs[0][1]])
        return out


def test_refresh_redraws_only_when_the_drawing_costs_at_most_its_share_of_the_time(tmp_path, monkeypatch):
    slow = _SlowPlots(monkeypatch, cost=1.0)
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "eval", "step": 1, "val_loss": 3.0})
        slow.now += 9.5  # before any drawing: 9.5 s since the log opened < FIRST_PLOT_COST (0.5 s) / 0.05
        assert log.refresh() is None and log.stale
        slow.now += 0.5
        assert log.refresh() == tmp_path / "curves.png" and log.stale is False
        log.log({"kind": "eval", "step": 2, "val_loss": 2.9})
        slow.now += 19.5  # 19.5 s since the drawing ended < 1 s / 0.05
        assert log.refresh() is None and log.stale
        slow.now += 0.5
        assert log.refresh() is not None and not log.stale
        assert log.refresh(share=1.0) is None  # share: the same rule with another budget
        slow.now += 1.0
        assert log.refresh(share=1.0) is not None
    assert [len(s) for s in slow.seen] == [1, 2, 2]
    assert MetricsLog(tmp_path / "quiet", plot=False).refresh() is None


@pytest.mark.parametrize("first_cost, drawings", [(0.0, 2), (metrics.FIRST_PLOT_COST, 1)],
                         ids=["first-refresh-draws", "short-run-draws-at-its-end"])
def test_a_run_that_evaluates_every_step_draws_the_whole_run_at_its_end(tmp_path, monkeypatch, first_cost, drawings):
    """fit refreshes the curves at each evaluation (each costs more than 5% of the time since the last drawing:
    here the clock moves only when a figure is drawn, so the first refresh draws only where the first drawing is
    assumed free) and draws the whole run at its end."""
    from test_pretrain import TEXT, TINY

    import run_pretrain

    monkeypatch.setattr(metrics, "FIRST_PLOT_COST", first_cost)
    slow = _SlowPlots(monkeypatch, cost=1.0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    run_pretrain.main(["--data", str(corpus), *TINY, "--max_iters", "12", "--eval_interval", "1", "--eval_iters", "1",
                       "--out_dir", str(tmp_path / "run")])
    evals = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert len(evals) >= 12 and len(slow.seen) == drawings
    assert [step for kind, step in slow.seen[-1] if kind == "eval"] == evals  # the end draws every evaluation


def test_plot_with_nothing_to_draw_returns_none(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log({"kind": "resume", "step": 0})
        assert log.plot() is None
    assert not (tmp_path / "curves.png").exists()


def test_cli_overlays_two_runs(tmp_path, capsys):
    _write_run(tmp_path / "run-a")
    _write_run(tmp_path / "run-b", steps=range(0, 61, 10), scale=1.3)
    out = tmp_path / "figs" / "both.png"
    assert plot_cli.main([str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    _assert_png(out)
    out2 = tmp_path / "wall.png"
    assert plot_cli.main([str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(out2), "--x", "wall_s",
                          "--keys", "val_loss", "dev_acc", "--labels", "A", "B"]) == 0
    _assert_png(out2)


def test_cli_errors_are_one_line(tmp_path, capsys):
    _write_run(tmp_path / "run-a")
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "missing"): "no such run folder", str(tmp_path / "empty"): "has no metrics.jsonl"}
    for run, message in cases.items():
        assert plot_cli.main([str(tmp_path / "run-a"), run, "--out", str(tmp_path / "x.png")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert plot_cli.main([str(tmp_path / "run-a"), "--keys", "val_los", "--out", str(tmp_path / "x.png")]) == 1
    assert "val_los" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_tensorboard_scalars_read_back_and_a_resume_purges_rolled_back_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is pinned in requirements.txt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_run(tmp_path, steps=range(10, 61, 10), eval_every=20, tensorboard=True)
    with MetricsLog(tmp_path, tensorboard=True) as log:
        log.log({"kind": "resume", "step": 40})
        log.log({"kind": "train", "step": 50, "train_loss": -1.0, "note": "strings are not scalars"})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "train/train_loss", "train/lr", "train/tokens_per_s", "train/epoch", "train/wall_s",
        "eval/val_loss", "eval/dev_acc", "eval/dev_f1", "eval/epoch", "eval/wall_s"}
    losses = {e.step: e.value for e in events.Scalars("train/train_loss")}
    assert losses == pytest.approx({10: 2.0, 20: 1.5, 30: 1.2, 40: 1.0, 50: -1.0})  # 60 was rolled back
    assert [e.step for e in events.Scalars("eval/dev_acc")] == [20, 40]
    assert events.Scalars("eval/dev_acc")[1].value == pytest.approx(0.5)


def test_tensorboard_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLog(tmp_path, tensorboard=True)


def test_the_learning_rate_is_one_series_through_every_logged_point():
    """Issue 37: pretraining logs lr on its evals (steps 0, 250, ...) and its train lines (50, 100, ...); the eval
    points alone drew a straight line from step 0 to 250 over the warm-up that peaks at step 100."""
    from training.metrics import series_of

    def lr(step):
        return 1e-3 * min(step / 100, 1 - (step - 100) / 400)

    records = [{"kind": "eval", "step": 0, "lr": lr(0), "val_loss": 4.2}]
    for step in range(50, 301, 50):
        records.append({"kind": "train", "step": step, "lr": lr(step), "train_loss": 3.0})
        if step % 250 == 0:
            records.append({"kind": "eval", "step": step, "lr": lr(step), "val_loss": 2.5})
    steps = [0, 50, 100, 150, 200, 250, 300]
    assert series_of(records)["lr"] == {("train", "lr"): (steps, [lr(s) for s in steps])}
    assert set(series_of(records)["loss"]) == {("train", "train_loss"), ("eval", "val_loss")}  # the others keep kinds
