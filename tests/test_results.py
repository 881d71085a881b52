"""Benchmark results as data (bench/results.py) and the pages' tables generated from them (bench/report.py).

The check that matters most: every generated table in README.md and docs/ equals what bench/results/ gives, so a
figure typed by hand into one fails here (and `python -m bench.report` rewrites it)."""
from __future__ import annotations

import json
import shutil

import pytest

from bench import report, results


def record(row="forward fp32", cls="AMX", date="2026-11-25T12:00Z", ratio=1.1, ours=100.0, hf=None, load=1.0,
           **extra):
    flags = {"AMX": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "AVX2": ["avx2"]}[cls]
    return {"bench": "compare_hf", "row": row, "values": {"ours": ours, "hf-sdpa": hf or ours / ratio},
            "unit": "tokens/s", "ratio": ratio, "ratio_of": "ours / best transformers, same dtype", "target": None,
            "met": None, "notes": None, "machine": {"cpu": f"cpu-{cls}", "class": cls, "flags": flags, "cores": 2,
                                                   "torch": "2.13.0+cpu", "threads": 2, "device": "cpu"},
            "commit": "abc1234", "date": date, "load": load, "source": "run", **extra}


def test_every_generated_table_matches_the_records():
    assert report.main(["--check"]) == 0, "run `python -m bench.report` and commit the pages"


def test_the_pages_have_generated_tables():
    marked = {str(p.relative_to(report.ROOT)): report.MARK.findall(p.read_text()) for p in report.pages()}
    assert marked["README.md"] and marked["docs/performance.md"] and marked["docs/gpu.md"], \
        "README.md, docs/performance.md and docs/gpu.md hold generated tables"
    for page, marks in marked.items():
        for _, spec, _, _ in marks:
            report.render(spec, results.load())  # every spec is one the report knows


def test_a_figure_edited_by_hand_fails_the_check(tmp_path, capsys):
    shutil.copy(report.ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "README.md"
    text = page.read_text()
    start = text.index("<!-- results: claims -->")
    cut = text.index("x transformers", start)  # the first ratio in the claims table, e.g. "1.06x transformers"
    page.write_text(text[:cut - 1] + "9" + text[cut:])
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "README.md" in capsys.readouterr().err
    assert report.main(["--root", str(tmp_path)]) == 0  # the rewrite restores the figure
    assert page.read_text() == text


def test_recorder_appends_records_with_machine_commit_date_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_BENCH_RESULTS", str(tmp_path))
    rec = results.Recorder("demo")
    rec.add("row one", {"ours": 2.0, "theirs": 1.0}, "tokens/s", ratio=2.0)
    rec.note("tokens identical")
    rec.write()
    rec.add("row two", {"ours": 3}, "s")
    rec.write()
    lines = (tmp_path / "demo.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["notes"] == "tokens identical" and first["source"] == "run"
    assert set(first["machine"]) >= {"cpu", "class", "flags", "cores", "device"}
    assert first["machine"]["class"] in results.CLASSES
    assert first["date"].endswith("Z") and "load" in first
    assert [r["row"] for r in results.load(tmp_path)] == ["row one", "row two"]
    monkeypatch.setattr(results.os, "getloadavg", lambda: (3.9, 3.0, 2.0))
    assert rec.add("row three", {"ours": 1}, "s")["load"] == 3.9  # the load now, by default
    assert rec.add("row four", {"ours": 1}, "s", load=0.7712)["load"] == 0.77  # a command's own load left out


def test_recording_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_BENCH_RESULTS", "off")
    rec = results.Recorder("demo")
    rec.add("row", {"ours": 1.0}, "s")
    assert rec.write() is None


def test_recorder_refuses_values_that_are_not_numbers():
    with pytest.raises(ValueError, match="values must be"):
        results.Recorder("demo").add("row", {"ours": "fast"}, "s")


def test_a_malformed_record_is_named_by_file_and_line(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps(record()) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        results.load(tmp_path)
    (tmp_path / "x.jsonl").write_text(json.dumps({"bench": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"x.jsonl:1: record lacks"):
        results.load(tmp_path)


@pytest.mark.parametrize("flags, cls", [({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AMX"),
                                        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512-BF16"),
                                        ({"avx2", "avx512f"}, "AVX512"), ({"avx2", "fma"}, "AVX2"), (set(), "other")])
def test_cpu_class(flags, cls):
    assert results.cpu_class(flags) == cls


def test_compare_table_takes_the_latest_run_per_class_and_the_range_of_all():
    recs = [record(date="2026-11-25T10:00Z", ratio=1.20), record(date="2026-11-25T12:00Z", ratio=1.05),
            record(date="2026-11-24T12:00Z", ratio=1.50), record(cls="AVX2", ratio=0.90)]
    amx = report.render("compare-hf class=AMX", recs)
    assert "| 1.05x |" in amx and "1.05x-1.50x (3 runs)" in amx and "0.90x" not in amx
    assert "2026-11-25 12:00 UTC, load 1.0, abc1234" in amx
    avx2 = report.render("compare-hf class=AVX2", recs)
    assert "0.90x" in avx2 and "1.05x" not in avx2
    assert "no compare_hf records" in report.render("compare-hf class=AVX512", recs)


def test_gpu_rows_stay_out_of_the_cpu_tables():
    gpu = record(ratio=1.3)
    gpu["machine"] = dict(gpu["machine"], device="NVIDIA H200")
    assert "1.30x" in report.render("compare-hf device=cuda", [gpu])
    assert "1.30x" not in report.render("compare-hf class=AMX", [gpu])


def test_unknown_table_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unknown results table 'nonsense'"):
        report.render("nonsense", [])


def test_one_bench_table_lists_each_row_once():
    recs = [record(row="a", ratio=1.0), record(row="b", ratio=2.0), record(row="a", ratio=3.0, date="2026-11-26T00:00Z")]
    for r in recs:
        r["bench"] = "optimizer"
    out = report.render("bench=optimizer", recs)
    assert out.count("| a |") == 1 and "3.00x" in out and "1.00x-3.00x (2 runs)" in out


def test_a_busy_run_does_not_replace_the_quiet_headline():
    """A run at a load above the cores + 1 (another process competing) is kept, but the table's row is the latest
    quiet run, and the busy one is counted apart."""
    recs = [record(ratio=1.20, date="2026-11-25T10:00Z"), record(ratio=0.70, date="2026-11-26T10:00Z", load=3.5)]
    out = report.render("compare-hf class=AMX", recs)
    assert "| 1.20x |" in out and "one run; 1 busy run apart" in out and "0.70x" not in out
    only_busy = report.render("compare-hf class=AMX", recs[1:])
    assert "| 0.70x |" in only_busy and "load 3.5 (busy)" in only_busy


def test_rows_measured_with_busy_processes_are_rows_of_their_own_beside_the_quiet_one():
    """compare_hf.py --busy N records its rows as '<row>, N busy process(es) beside it' with busy=N: the table shows
    them under the quiet row with the row's own label, and they never stand in for the quiet figure."""
    name = "train as run 4x128 bf16"
    recs = [record(row=name, ratio=1.13, date="2026-11-29T12:00Z"),
            record(row=f"{name}, 1 busy process beside it", ratio=1.40, date="2026-11-29T13:00Z", load=3.2, busy=1)]
    out = report.render("compare-hf class=AMX", recs).splitlines()
    quiet = next(i for i, line in enumerate(out) if line.startswith(f"| {report.COMPARE_ROWS[name]} |"))
    assert "| 1.13x |" in out[quiet] and "busy" not in out[quiet]
    assert out[quiet + 1].startswith(f"| {report.COMPARE_ROWS[name]}, 1 busy process beside it |")
    assert "| 1.40x |" in out[quiet + 1] and "load 3.2 (busy)" in out[quiet + 1]
    assert sum("1.40x" in line for line in out) == 1


def test_the_benchmarks_name_their_busy_rows_as_the_report_reads_them():
    from bench import compare_engines, compare_hf, machine

    assert compare_hf.busy_suffix is compare_engines.busy_suffix is machine.busy_suffix
    assert machine.busy_suffix(1) == ", 1 busy process beside it"
    assert machine.busy_suffix(2) == ", 2 busy processes beside it"
    assert machine.busy_suffix(0) == ""


def test_the_race_claim_names_each_classes_fastest_recipe_of_its_latest_race():
    def race(cls, date, ratios):
        return [record(f"time to nanogpt's val loss: {name}", cls, date, ratio=ratio, bench="speedrun",
                       values={"seconds to target": 100 * ratio, "nanogpt s": 100.0}) for name, ratio in ratios.items()]
    records = (race("AVX2", "2026-11-20T10:00Z", {"baseline": 0.98, "best": 0.30})  # an older race: not shown
               + race("AVX2", "2026-11-23T10:00Z", {"nanogpt": 1.0, "baseline": 0.97, "best": 0.45, "rope": 0.74})
               + race("AMX", "2026-11-28T10:00Z", {"best": 0.70, "best-adamw": 0.50}))
    text, used = report._race_claim(records)
    assert text == ("AMX: best-adamw in 0.50x nanoGPT's training time (50.0 vs 100.0 s); "
                    "AVX2: best in 0.45x nanoGPT's training time (45.0 vs 100.0 s)"), text
    assert [r["row"] for r in used] == ["time to nanogpt's val loss: best-adamw", "time to nanogpt's val loss: best"]
    assert report._race_claim(race("AVX2", "2026-11-23T10:00Z", {"baseline": 0.9})) == ("", [])


def test_the_training_thread_claim_compares_the_choice_with_each_fixed_count_quiet_and_busy():
    def run(dtype, choice, fixed, busy=0, date="2026-12-03T05:00Z", cls="AMX"):
        best = max(fixed, key=fixed.get)
        return record(f"fine-tune sst gpt2 {dtype}" + (", 1 busy process beside it" if busy else ""), cls, date,
                      ratio=choice / fixed[best], bench="train_threads", ratio_of=f"choice / fixed {best}",
                      values={"choice": choice, **{f"fixed {n}": v for n, v in fixed.items()}},
                      **({"busy": busy} if busy else {}))
    records = [run("fp32", 100.0, {2: 50.0, 1: 40.0}, date="2026-12-01T05:00Z"),  # older: not shown
               run("fp32", 97.0, {2: 100.0, 1: 50.0}), run("fp32", 60.0, {2: 20.0, 1: 64.0}, busy=1),
               run("bf16", 99.0, {2: 100.0, 1: 66.0}), run("fp32", 10.0, {2: 10.0, 1: 5.0}, cls="AVX2")]
    text, used = report._train_threads_claim(records)
    assert text == ("AMX: fp32 quiet 0.97x 2 threads, 1.94x 1 thread; with a core busy 3.00x 2 threads, 0.94x 1 "
                    "thread; bf16 quiet 0.99x 2 threads, 1.50x 1 thread; AVX2: fp32 quiet 1.00x 2 threads, 2.00x 1 "
                    "thread"), text
    assert len(used) == 4
    assert report._train_threads_claim([]) == ("", [])


def test_the_commands_timer_counts_the_cpu_of_the_command_and_of_what_it_waited_for():
    """bench/commands.py records the CPU seconds beside the wall time: a command that spends 0.3 s of CPU itself and
    0.3 s more in a child it waits for counts at least 0.6 s; its peak RSS and exit code come back with it."""
    import sys

    from bench import commands

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}]); exec({spin!r}); sys.exit(3)"
    seconds, peak_mb, cpu, proc = commands.timed([sys.executable, "-c", child])
    assert proc.returncode == 3 and cpu >= 0.6 and seconds > 0 and peak_mb > 1, (cpu, seconds, peak_mb)


def test_the_race_leaves_its_bf16_contender_out_by_default_where_bf16_is_slow(monkeypatch, capsys):
    from bench import speedrun

    monkeypatch.setattr(speedrun, "bf16_matmul_is_fast", lambda device: False)
    names = speedrun.default_contenders()
    assert "best-adamw-bf16" not in names and "best-adamw" in names
    assert "no bf16 units" in capsys.readouterr().out
    monkeypatch.setattr(speedrun, "bf16_matmul_is_fast", lambda device: True)
    assert speedrun.default_contenders() == list(speedrun.CONTENDERS)
    assert "--dtype" in speedrun.CONTENDERS["best-adamw-bf16"][1]


def test_the_commit_stamp_counts_code_not_records_or_plots(tmp_path, monkeypatch):
    """A record's commit gets '+changes' when tracked code differs from the commit; records appended by an earlier
    run (bench/results), plots a bench redraws before it records (docs/images) and prose (docs/, .md) do not count."""
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("needs git")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    pages = ("docs/page.md", "README.md", "sub/notes.md")
    for name in ("code.py", "bench/results/x.jsonl", "docs/images/plot.png", *pages):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("one\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    monkeypatch.setattr(results, "ROOT", tmp_path)
    clean = results.current_commit()
    assert clean and "+changes" not in clean
    (tmp_path / "bench/results/x.jsonl").write_text("one\ntwo\n")
    (tmp_path / "docs/images/plot.png").write_text("redrawn\n")
    for page in pages:
        (tmp_path / page).write_text("edited\n")
    assert results.current_commit() == clean
    (tmp_path / "code.py").write_text("changed\n")
    assert results.current_commit() == clean + "+changes"


def test_bf16_curve_draws_each_cpu_class_its_own_docs_plot():
    """bench/bf16_curve.py's default --plot: the AVX512-BF16 plot and the AMX one are both on docs/performance.md, and
    a run on one class must not redraw the other's (an AMX run had overwritten the Zen 4 plot)."""
    from bench.bf16_curve import default_plot

    names = {cls: default_plot(cls).name for cls in results.CLASSES}
    assert names["AVX512-BF16"] == "bf16-loss-curve.png" and names["AMX"] == "bf16-loss-curve-amx.png"
    assert len(set(names.values())) == len(names)
    page = (results.ROOT / "docs/performance.md").read_text()
    assert all(f"images/{names[c]}" in page and default_plot(c).is_file() for c in ("AVX512-BF16", "AMX"))
    # the AVX512-BF16 plot is the Zen 4's: a Zen 5 (the same flags) draws its own, which the page shows too
    assert default_plot("AVX512-BF16", "Zen 4") == default_plot("AVX512-BF16", None) == default_plot("AVX512-BF16")
    zen5 = default_plot("AVX512-BF16", "Zen 5")
    assert zen5.name == "bf16-loss-curve-zen5.png" and f"images/{zen5.name}" in page and zen5.is_file()
    assert default_plot("AMX", "Sapphire Rapids") == default_plot("AMX")  # one core drawn there so far
    assert default_plot("AVX2", "Zen 4").name == "bf16-loss-curve-avx2-zen4.png"


def test_the_train_runs_rows_note_the_thread_count_ours_ended_on(monkeypatch):
    """compare_hf's train-run: ours' steps choose their thread count as fit() does; the row's notes say the count
    they ended on (a row taken on fewer threads than the cores is then visible in the records)."""
    import torch
    from conftest import tiny_config

    from bench import compare_hf
    from models.gpt2 import GPT2LMHeadModel

    ids = torch.randint(0, 100, (2, 8))
    for setting, note in (("2", "ours' steps ended on 2 of 2 threads (fit's choice, timed)"), ("off", None)):
        monkeypatch.setenv("GPT2_TRAIN_THREADS", setting)
        step = compare_hf.make_run_step(GPT2LMHeadModel(tiny_config()), ids, bf16=False)
        for _ in range(2):
            step()
        assert compare_hf.thread_choice_note(step) == note
    assert compare_hf.thread_choice_note(lambda: 0.0) is None  # transformers' steps choose nothing


@pytest.mark.parametrize("vendor, family, model, core", [
    ("AuthenticAMD", 25, 0x01, "Zen 3"), ("AuthenticAMD", 25, 0x21, "Zen 3"), ("AuthenticAMD", 25, 0x11, "Zen 4"),
    ("AuthenticAMD", 25, 0x61, "Zen 4"), ("AuthenticAMD", 25, 0xA0, "Zen 4"), ("AuthenticAMD", 26, 0x02, "Zen 5"),
    ("AuthenticAMD", 26, 0x44, "Zen 5"), ("AuthenticAMD", 23, 0x31, None), ("GenuineIntel", 6, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0xCF, "Emerald Rapids"), ("GenuineIntel", 6, 0x6A, "Ice Lake"), ("GenuineIntel", 6, 0x99, None),
    ("GenuineIntel", 19, 0x01, None)])
def test_the_core_design_behind_a_model_name_that_does_not_say_it(vendor, family, model, core):
    """A cloud's cpuinfo says 'AMD EPYC' for a Zen 3, 4 and 5 alike: the family and model name the core (this host,
    2026-12-04: family 26 model 2, a Zen 5 with twice the Zen 4's bf16 GEMM on the same flags)."""
    from bench.machine import cpu_core, machine_header

    info = (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: AMD EPYC\nflags\t\t: avx2\n\nprocessor\t: 1\nvendor_id\t: {vendor}\ncpu family\t: 99\n")
    assert cpu_core(info) == {"core": core, "family": family, "model": model}
    named = f"{core}, " if core else ""
    assert machine_header(info).startswith(f"machine: AMD EPYC ({named}family {family} model {model}), ")
    assert cpu_core("model name : AMD EPYC\n") is None and cpu_core("") is None  # no family: nothing made up


def test_a_class_measured_on_two_cores_is_two_kinds_and_old_records_keep_their_core():
    """Records carry the core from 2026-12-04; older AVX512-BF16 'AMD EPYC' records are the Zen 4's and AVX2 ones the
    Zen 3's. A class with records from two cores splits into a kind a core (tables by `core=`, claims by label); a
    class from one core stays one kind under its class's name."""
    def on(core, ratio, date, cls="AMX", family=26):
        r = record(cls=cls, ratio=ratio, date=date)
        r["machine"]["cpu"] = "AMD EPYC"
        if core is not False:
            r["machine"].update(core=core, family=family, model=2)
        return r
    old, new = on(False, 1.13, "2026-11-29T10:00Z"), on("Zen 5", 1.47, "2026-12-04T16:00Z")
    for r in (old, new):
        r["machine"].update({"class": "AVX512-BF16", "flags": ["avx2", "avx512f", "avx512_bf16"]})
    amx = on(None, 1.48, "2026-12-03T10:00Z", family=6)
    recs = [old, new, amx]
    assert [report.record_core(r["machine"]) for r in recs] == ["Zen 4", "Zen 5", None]
    assert report.kinds(recs)[:3] == [("AMX", None, "AMX"), ("AVX512-BF16", "Zen 4", "AVX512-BF16 (Zen 4)"),
                                      ("AVX512-BF16", "Zen 5", "AVX512-BF16 (Zen 5)")]
    zen4, zen5 = (report.render(f"compare-hf class=AVX512-BF16 core={c}", recs) for c in ("Zen-4", "Zen-5"))
    assert "| 1.13x |" in zen4 and "1.47x" not in zen4 and "AMD EPYC (Zen 4), 2 cores" in zen4
    assert "| 1.47x |" in zen5 and "1.13x" not in zen5 and "AMD EPYC (Zen 5), 2 cores" in zen5
    both = report.render("compare-hf class=AVX512-BF16", recs)
    assert "| 1.47x |" in both and "1.13x-1.47x (2 runs)" in both  # no core: the class as before
    text, used = report._ratio_per_class("compare_hf", "forward fp32")(recs)
    assert text == ("1.48x transformers (AMX); 1.13x transformers (AVX512-BF16 (Zen 4)); "
                    "1.47x transformers (AVX512-BF16 (Zen 5))"), text
    assert report.kinds([old, amx])[1] == ("AVX512-BF16", None, "AVX512-BF16")  # one core: one kind, as before
    assert report.cpu_and_class(new["machine"]) == "AMD EPYC (Zen 5, AVX512-BF16)"
