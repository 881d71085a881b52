"""The tables of README.md and docs/*.md that hold measured figures, generated from bench/results/*.jsonl.

    python -m bench.report            # rewrite every marked table from the records
    python -m bench.report --check    # exit 1, naming each table, where a page differs from what the records give
    python -m bench.report --show "compare-hf class=AMX"   # print one table

A generated table sits between two markers in a page; everything between them is replaced:

    <!-- results: compare-hf class=AVX512-BF16 -->
    | row | ... |
    <!-- /results -->

Tables (the spec after `results:`):
- `machines`: each CPU measured, with its GEMM and memory-read figures (compare_hf's header), ranges over runs.
- `compare-hf class=<CPU class>` or `compare-hf device=cuda`: bench/compare_hf.py's rows, the latest run of each row
  on that class, with the range of its ratio over every run there, the date, load and commit.
- `commands`: the README's two commands (bench/commands.py), the latest per CPU class.
- `claims`: the README's Results, one row per claim (CLAIMS below), each naming its machine.
- `engines class=<CPU class>`: bench/compare_engines.py's engines side by side, quiet and with a busy core.
- `mutation`: bench/mutation.py's mutation score per module, the latest run of each.
- `bench=<name> [class=<CPU class>]`: every row of one benchmark, the latest of each, in the order first recorded.
A figure typed by hand into a generated table is overwritten by the next `python -m bench.report` and fails
`--check` (tests/test_results.py runs it), so the pages cannot drift from the records.
"""
from __future__ import annotations

import argparse
import difflib
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.compare_engines import ENGINES, FIXED_THREADS, TARGETS  # noqa: E402  (the engines' order; their targets)
from bench.results import CLASSES, LEGACY_CORES, load  # noqa: E402

PAGES = ("README.md", "docs/*.md")
MARK = re.compile(r"(<!-- results: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)

# compare_hf's rows in the order a reader wants them, with what each measures
COMPARE_ROWS = {
    "train fp32": "training step fp32, 4 x 128, torch's AdamW for both",
    "train bf16": "training step, bf16 autocast",
    "train loss after 20 steps, fp32 vs bf16": "loss after 20 steps, fp32 against bf16 autocast",
    "train as run 4x128 fp32": "training step fp32 4 x 128 as each runs it (ours: fit's fused AdamW; transformers: "
                               "Trainer's torch fused AdamW)",
    "train as run 4x128 bf16": "training step bf16 4 x 128 as each runs it (ours: `--dtype bf16-weights`; "
                               "transformers: autocast)",
    "train as run 8x256 fp32": "training step fp32 8 x 256 as each runs it",
    "train as run 8x256 bf16": "training step bf16 8 x 256 as each runs it",
    "forward fp32": "inference forward fp32, 8 x 128",
    "forward bf16": "inference forward, bf16 weights",
    "generate b1 fp32": "greedy batch 1 fp32, 16-token prompt + 64 new",
    "generate b1 bf16": "greedy batch 1, bf16 weights",
    "generate b1 int8": "greedy batch 1, int8 weights (`quantize=\"int8\"`)",
    "generate b8 fp32": "greedy batch 8 fp32, left-padded",
    "generate b8 bf16": "greedy batch 8, bf16 weights",
    "sample b1 fp32": "sampling batch 1 fp32 (top-p 0.9, T 0.8)",
    "beam4 b1 fp32": "beam search, 4 beams, fp32",
    "ttft p512 fp32": "time to first token, 512-token prompt (1/s)",
}


# ---- formatting ---------------------------------------------------------------------------------------------------

def num(x: float | None) -> str:
    """Three significant figures or so: 1146, 262.0 -> 262, 40.9, 2.81, 0.330, 2.3e-06."""
    if x is None:
        return ""
    a = abs(x)
    if a >= 100 or a == 0:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 0.01:
        return f"{x:.3f}"
    return f"{x:.1e}"


def span(values: list[float], fmt=num) -> str:
    """'351-427' over several runs, '420' for one; empty for none."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def percent(x: float) -> str:
    return f"{x:.2f}%"


def times(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def over_runs(runs: list[dict], value, fmt) -> str:
    """The range of a value over the quiet runs ('1.05x-1.15x (3 runs)'), and how many busy runs are left out."""
    calm = [r for r in runs if quiet(r)]
    busy = len(runs) - len(calm)
    shown = span([value(r) for r in calm or runs], fmt)
    text = f"{shown} ({len(calm)} runs)" if len(calm) > 1 else ("one run" if calm else f"{shown} (busy)")
    return text + (f"; {busy} busy run{'s' if busy > 1 else ''} apart" if busy and calm else "")


def when(r: dict) -> str:
    """The date (and time where recorded), the load and the commit of a record."""
    date = r["date"].replace("T", " ").replace("Z", " UTC")
    load = f", load {r['load']:.1f}" + ("" if quiet(r) else " (busy)") if r.get("load") is not None else ""
    commit = f", {r['commit']}" if r.get("commit") else ", commit not recorded"
    return f"{date}{load}{commit}" + (" (transcribed)" if r.get("source") == "transcribed" else "")


def record_core(m: dict) -> str | None:
    """The core design a record's machine has: its own "core" where it carries one; an older "AMD EPYC" record,
    LEGACY_CORES' for its class (a Zen 5 runs bf16 at twice a Zen 4's: the machines table tells them apart)."""
    if "family" in m:
        return m.get("core")
    return LEGACY_CORES.get(m.get("class")) if m.get("cpu") == "AMD EPYC" else None


def _unnamed_core(m: dict) -> str | None:
    """record_core(m) where the CPU's model name does not already say it, else None."""
    core = record_core(m)
    return core if core and core not in m["cpu"] else None


def cpu_name(m: dict) -> str:
    core = _unnamed_core(m)
    return f"{m['cpu']} ({core})" if core else m["cpu"]


def cpu_and_class(m: dict) -> str:
    core = _unnamed_core(m)
    return f"{m['cpu']} ({core + ', ' if core else ''}{m['class']})"


def machine_name(m: dict) -> str:
    if m.get("device", "cpu") != "cpu":
        return f"{m['device']} (host: {m['cpu']}, {m['cores']} cores)"
    return f"{m['class']}: {cpu_name(m)}, {m['cores']} cores"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


# ---- selecting records --------------------------------------------------------------------------------------------

def matching(records: list[dict], bench: str | None = None, row: str | None = None, cls: str | None = None,
             device: str | None = None, core: str | None = None) -> list[dict]:
    out = []
    for r in records:
        m = r["machine"]
        on_cpu = m.get("device", "cpu") == "cpu"
        if bench and r["bench"] != bench or row and r["row"] != row:
            continue
        if device == "cuda" and on_cpu or device in (None, "cpu") and not on_cpu:
            continue
        if cls and m.get("class") != cls or core and record_core(m) != core:
            continue
        out.append(r)
    return out


def kinds(records: list[dict]) -> list[tuple[str, str | None, str]]:
    """(class, core, label) for each kind of CPU the CPU records come from, in CLASSES' order: a class measured on one
    core design is one kind (core None: every record of the class; label the class), a class measured on several is
    one kind a core ("AVX512-BF16 (Zen 5)"), since the same flags run at different speeds on them."""
    cores: dict[str, set] = {}
    for r in records:
        m = r["machine"]
        if m.get("device", "cpu") == "cpu" and m.get("class") in CLASSES:
            cores.setdefault(m["class"], set()).add(record_core(m))
    out = []
    for cls in CLASSES:
        found = sorted(cores.get(cls, ()), key=lambda c: c or "")
        if len(found) <= 1:
            out.append((cls, None, cls))
        else:
            out += [(cls, core, f"{cls} ({core or 'core unknown'})") for core in found]
    return out


def kind_label(m: dict, found: list[tuple[str, str | None, str]]) -> str:
    """The label of the kind (of `found`, kinds()' answer) a record's machine is of."""
    return next((label for cls, core, label in found
                 if m.get("class") == cls and (core is None or record_core(m) == core)), m.get("class", ""))


def quiet(r: dict) -> bool:
    """Measured alone: the load average at most the cores + 1 (the benchmark's own threads count in it). A busier
    run stays a record, but a table's headline row is the latest quiet one where there is one."""
    return r.get("load") is None or r["load"] <= (r["machine"].get("cores") or 1) + 1


def latest(records: list[dict]) -> dict | None:
    """The most recent quiet record (by date; the later line on a tie), else the most recent one."""
    best = None
    for r in [r for r in records if quiet(r)] or records:
        if best is None or r["date"] >= best["date"]:
            best = r
    return best


def best_other(values: dict) -> tuple[str | None, float | None]:
    others = {k: v for k, v in values.items() if k.startswith(("hf", "best transformers", "transformers"))}
    if not others:
        return None, None
    key = max(others, key=others.get)
    return key, others[key]


# ---- tables -------------------------------------------------------------------------------------------------------

def machines(records: list[dict], **_) -> str:
    seen: dict[tuple, list[dict]] = {}
    for r in matching(records, bench="compare_hf", row="machine"):
        seen.setdefault((CLASSES.index(r["machine"]["class"]), cpu_name(r["machine"])), []).append(r)
    rows = []
    for (_, cpu), rs in sorted(seen.items()):
        m = rs[-1]["machine"]
        dates = sorted({r["date"][:10] for r in rs})
        rows.append([m["class"], f"{cpu}, {m['cores']} cores", " ".join(m["flags"]) or "-",
                     span([r["values"].get("fp32 GEMM GFLOP/s") for r in rs]),
                     span([r["values"].get("bf16 GEMM GFLOP/s") for r in rs]),
                     span([r["values"].get("reads GB/s") for r in rs]),
                     f"{len(rs)} ({', '.join(dates)})"])
    return table(["class", "CPU", "flags", "fp32 GEMM GFLOP/s", "bf16 GEMM GFLOP/s", "memory reads GB/s",
                  "runs (dates)"], rows)


def compare_row(r: dict, runs: list[dict]) -> list[str]:
    values, unit = r["values"], r["unit"]
    if r["row"].startswith("train loss"):
        diff = r.get("difference")
        return [COMPARE_ROWS.get(r["row"], r["row"]), f"fp32 {values['fp32']:.4f}, bf16 {values['bf16']:.4f}", "",
                f"{100 * diff:.2f}% apart" if diff is not None else "", r.get("target") or "",
                {True: "yes", False: "no", None: ""}[r.get("met")],
                over_runs(runs, lambda x: 100 * x["difference"] if x.get("difference") is not None else None, percent),
                r.get("notes") or "", when(r)]
    ours = values.get("ours", values.get("ours-int8"))
    other_key, other = best_other(values)
    ratio = times(r.get("ratio"))
    extra = [f"{times(r['vs_ours_fp32'])} ours fp32" if r.get("vs_ours_fp32") else "",
             f"{times(r['vs_hf_fp32'])} transformers fp32" if r.get("vs_hf_fp32") else ""]
    ratio = "; ".join(x for x in [ratio, *extra] if x)
    return [COMPARE_ROWS.get(r["row"], r["row"]), f"{num(ours)} {unit}" if ours is not None else "",
            f"{num(other)}" + (f" ({other_key[3:]})" if other_key.startswith("hf-") else "") if other is not None else "",
            ratio, r.get("target") or "", {True: "yes", False: "no", None: ""}[r.get("met")],
            over_runs(runs, lambda x: x.get("ratio"), times),
            r.get("notes") or "", when(r)]


def compare_hf(records: list[dict], cls: str | None = None, device: str | None = None, core: str | None = None,
               **_) -> str:
    chosen = matching(records, bench="compare_hf", cls=cls, device=device or "cpu", core=core)
    rows = []
    for name in COMPARE_ROWS:
        runs = [r for r in chosen if r["row"] == name]
        if runs:
            rows.append(compare_row(latest(runs), runs))
        busy = [r for r in chosen if r.get("busy") and r["row"].startswith(name + ", ")]
        for suffix in sorted({r["row"][len(name):] for r in busy}):  # the same row with busy processes beside it
            runs = [r for r in busy if r["row"] == name + suffix]
            rows.append([COMPARE_ROWS[name] + suffix, *compare_row(latest(runs), runs)[1:]])
    if not rows:
        return f"(no compare_hf records for {cls or device} yet: run `python bench/compare_hf.py` there)\n"
    machine = latest(chosen)["machine"]
    return (f"Machine: {machine_name(machine)}; torch {machine['torch']}, {machine['threads']} threads.\n\n"
            + table(["row (gpt2 124M)", "ours", "transformers (best)", "ratio", "target", "met?", "ratio over runs",
                     "notes", "date, load, commit"], rows))


def runs_of_commit(records: list[dict], latest: dict) -> str:
    """' (N runs: a-b)' of the wall times of the runs at `latest`'s commit (a range over other code is no spread);
    empty for one run."""
    walls = [r["values"]["wall s"] for r in records if r.get("commit") == latest.get("commit")]
    return f" ({len(walls)} runs: {span(walls, minutes)})" if len(walls) > 1 else ""


def commands(records: list[dict], **_) -> str:
    rows = []
    for cls, core, label in kinds(records):
        main = matching(records, bench="commands", row="main job", cls=cls, core=core)
        suite = matching(records, bench="commands", row="test suite", cls=cls, core=core)
        if not main and not suite:
            continue
        cells = [label]
        m = latest(main)
        if m:
            v = m["values"]
            val = f"; val {v['val']:.4f}" if "val" in v else ""
            runs = runs_of_commit(main, m)
            cells.append(f"**{minutes(v['wall s'])}**, {v['ms/step']:.1f} ms/step, {v['peak RSS MB']:.0f} MB peak RSS"
                         f"{val}{runs}; {when(m)}")
        else:
            cells.append("not measured")
        s = latest(suite)
        if s:
            v = s["values"]
            skipped = f", {v['skipped']:.0f} skipped" if "skipped" in v else ""
            runs = runs_of_commit(suite, s)
            cells.append(f"{minutes(v['wall s'])}, {v.get('passed', 0):.0f} passed{skipped}{runs}; {when(s)}")
        else:
            cells.append("not measured")
        cells.append((m or s)["machine"]["cpu"])
        rows.append(cells)
    return table(["CPU class", "main job (encoding, 2000 steps, 8 evaluations, checkpoints, a sample)",
                  "tests (`ruff check . && python -m pytest -q`)", "CPU"], rows)


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def one_bench(records: list[dict], bench: str, cls: str | None = None, device: str | None = None,
              core: str | None = None, **_) -> str:
    chosen = matching(records, bench=bench, cls=cls, device=device or "cpu", core=core)
    order = list(dict.fromkeys(r["row"] for r in chosen))
    rows = []
    for name in order:
        runs = [r for r in chosen if r["row"] == name]
        r = latest(runs)
        values = ", ".join(f"{k} {num(v)}" for k, v in r["values"].items())
        rows.append([name, f"{values} ({r['unit']})", times(r.get("ratio")) + (f" {r['ratio_of']}" if r.get("ratio_of")
                     else ""), over_runs(runs, lambda x: x.get("ratio"), times),
                     r.get("notes") or "", f"{machine_name(r['machine'])}; {when(r)}"])
    if not rows:
        return f"(no {bench} records{' for ' + cls if cls else ''} yet)\n"
    return table(["row", "values", "ratio", "ratio over runs", "notes", "machine; date, load, commit"], rows)


# README's Results: one row per claim. Each: the text, the page, and how to read the latest matching record(s).
def _ratio_per_class(bench: str, row: str, suffix: str = "transformers") -> callable:
    def read(records: list[dict]) -> tuple[str, list[dict]]:
        parts, used = [], []
        for cls, core, label in kinds(records):
            r = latest(matching(records, bench=bench, row=row, cls=cls, core=core))
            if r and r.get("ratio") is not None:
                parts.append(f"{times(r['ratio'])} {suffix} ({label})")
                used.append(r)
        return "; ".join(parts), used
    return read


def _values(bench: str, row: str, fmt: callable) -> callable:
    def read(records: list[dict]) -> tuple[str, list[dict]]:
        r = latest(matching(records, bench=bench, row=row))
        return (fmt(r), [r]) if r else ("", [])
    return read


def _latest(bench: str, row: str, fmt: callable) -> callable:
    def read(records: list[dict]) -> tuple[str, list[dict]]:
        r = latest(matching(records, bench=bench, row=row))
        return (fmt(r), [r]) if r else ("", [])
    return read


def _gemm_ratio(records: list[dict]) -> tuple[str, list[dict]]:
    parts, used = [], []
    for cls, core, label in kinds(records):
        runs = [r for r in matching(records, bench="compare_hf", row="machine", cls=cls, core=core)
                if r["values"].get("fp32 GEMM GFLOP/s") and r["values"].get("bf16 GEMM GFLOP/s")]
        if runs:
            ratios = [r["values"]["bf16 GEMM GFLOP/s"] / r["values"]["fp32 GEMM GFLOP/s"] for r in runs]
            parts.append(f"{span(ratios, times)} ({label})")
            used.append(latest(runs))
    return "; ".join(parts), used


def _v(r: dict, key: str, fmt: str = "{:g}") -> str:
    return fmt.format(r["values"][key])


def _latest_curves(records: list[dict], cls: str | None = None,
                   core: str | None = None) -> dict[tuple[str, str], dict]:
    """bench/bf16_curve.py's latest record of each precision compared with fp32, by (precision, CPU class): bf16
    runs on other units (or none) on each class."""
    runs: dict[tuple[str, str], list[dict]] = {}
    found = kinds(records)  # (once: each record's label is looked up in it)
    for r in matching(records, bench="bf16_curve", cls=cls, core=core):
        dtype = next(k for k in r["values"] if not k.startswith("fp32"))
        runs.setdefault((dtype, kind_label(r["machine"], found)), []).append(r)
    return {key: latest(rs) for key, rs in runs.items()}


def _curve_claim(records: list[dict]) -> tuple[str, list[dict]]:
    last = _latest_curves(records)
    parts = [f"{dtype} {r['values'][dtype]:.4f} vs fp32 {r['values']['fp32']:.4f} on {cls} "
             f"({'within' if r.get('met') else 'outside'} fp32's seed-to-seed {r['noise']:.4f})"
             for (dtype, cls), r in last.items()]
    return "; ".join(parts), list(last.values())


def bf16_curve(records: list[dict], cls: str | None = None, core: str | None = None, **_) -> str:
    """bench/bf16_curve.py: each precision's final loss over the whole val split against fp32's and its noise (the
    latest run of each)."""
    rows = []
    for (dtype, _), r in _latest_curves(records, cls, core).items():
        rows.append([dtype, f"{r['values'][dtype]:.4f}", f"{r['values']['fp32']:.4f}",
                     f"{r['values']['fp32 other seed']:.4f}", f"{r['difference']:.4f}", f"{r['noise']:.4f}",
                     {True: "yes", False: "no", None: ""}[r.get("met")], r.get("notes") or "",
                     f"{machine_name(r['machine'])}; {when(r)}"])
    if not rows:
        return f"(no bf16_curve records{' for ' + cls if cls else ''} yet: run `python bench/bf16_curve.py`)\n"
    return table(["precision", "val loss", "fp32, same seed", "fp32, another seed", "apart from fp32",
                  "fp32 seed to seed", "within noise?", "notes", "machine, date, load, commit"], rows)


def _engine_records(records: list[dict], busy: bool, cls: str | None = None,
                    core: str | None = None) -> dict[str, dict]:
    """The latest compare_engines decode record per engine (quiet runs, or runs with busy processes), of one CPU
    class where `cls` is given."""
    runs: dict[str, list[dict]] = {}
    for r in matching(records, bench="compare_engines", cls=cls, core=core):
        if r.get("kind") == "decode" and bool(r.get("busy")) == busy:
            runs.setdefault(r["engine"], []).append(r)
    return {e: latest(rs) for e, rs in runs.items()}


def _engines_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """Per CPU class: ours fp32, int8, w8a8, int4 and w4a8 against the engines of their targets, quiet."""
    pairs = list(TARGETS.items())
    classes, used = [], []
    for cls, core, label in kinds(records):
        last, parts = _engine_records(records, busy=False, cls=cls, core=core), []
        for ours, others in pairs:
            if ours in last and all(o in last for o in others):
                rate = last[ours]["values"][ours]
                against = ", ".join(f"{times(rate / last[o]['values'][o])} {o}" for o in others)
                parts.append(f"{ours[5:]} {num(rate)} tokens/s: {against}")
                used += [last[ours]] + [last[o] for o in others]
        if parts:
            classes.append(f"{label}: " + "; ".join(parts))
    return " / ".join(classes), used


def _busy_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """Per CPU class: ours fp32 with one busy process, against its quiet speed and ONNX Runtime's under that load."""
    parts, used = [], []
    for cls, core, label in kinds(records):
        busy = _engine_records(records, busy=True, cls=cls, core=core)
        quiet = _engine_records(records, busy=False, cls=cls, core=core)
        if not all(e in busy for e in ("ours-fp32", "ort-fp32")) or "ours-fp32" not in quiet:
            continue
        rate = busy["ours-fp32"]["values"]["ours-fp32"]
        parts.append(f"fp32 {num(rate)} tokens/s, {100 * rate / quiet['ours-fp32']['values']['ours-fp32']:.0f}% of "
                     f"quiet; {times(rate / busy['ort-fp32']['values']['ort-fp32'])} ONNX Runtime fp32 under the "
                     f"same load ({label})")
        used += [busy["ours-fp32"], busy["ort-fp32"], quiet["ours-fp32"]]
    return "; ".join(parts), used


def _threads_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """Per CPU class: ours fp32 with the thread choice against the same with the thread count fixed, quiet and with
    a busy core: the decode steps (bench/compare_engines.py's "thread choice" rows) and, where recorded, a long
    prompt's blocks (its "prompt thread choice" rows)."""
    parts, used = [], []
    for cls, core, label in kinds(records):
        found = []
        for kind, what in (("threads", "decode"), ("prompt-threads", "prompt")):
            runs = {busy: [r for r in matching(records, bench="compare_engines", cls=cls, core=core)
                           if r.get("kind") == kind and bool(r.get("busy")) == busy] for busy in (False, True)}
            last = {busy: latest(rs) for busy, rs in runs.items() if rs}
            if last:
                texts = [f"{times(r['ratio'])} {'with a core busy' if busy else 'quiet'}"
                         for busy, r in sorted(last.items())]
                tokens = next(iter(last.values())).get("tokens_in")
                found.append((f"{what} {tokens}" if tokens else what, texts, last))
        if not found:
            continue
        threads = next(iter(found[0][2].values())).get("threads")
        if [what for what, _, _ in found] == ["decode"]:  # (records from before the prompt's choice)
            parts.append(f"{label}: " + ", ".join(found[0][1]) + f" (against {threads} threads fixed)")
        else:
            parts.append(f"{label}: " + "; ".join(f"{what} " + ", ".join(texts) for what, texts, _ in found)
                         + f" (against {threads} threads fixed)")
        used += [r for _, _, last in found for r in last.values()]
    return "; ".join(parts), used


def _train_threads_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """Per CPU class and dtype: fit's thread choice against each fixed count (bench/train_threads.py), quiet and
    with a core busy."""
    parts, used = [], []
    for cls, core, label in kinds(records):
        texts = []
        for dtype in ("fp32", "bf16"):
            runs = {busy: [r for r in matching(records, bench="train_threads", cls=cls, core=core)
                           if r["row"].startswith(f"fine-tune sst gpt2 {dtype}") and bool(r.get("busy")) == busy]
                    for busy in (False, True)}
            last = {busy: latest(rs) for busy, rs in runs.items() if rs}
            if not last:
                continue
            said = []
            for busy, r in sorted(last.items()):
                fixed = {int(k.split()[1]): v for k, v in r["values"].items() if k.startswith("fixed ")}
                said.append(("with a core busy " if busy else "quiet ") + ", ".join(
                    f"{times(r['values']['choice'] / v)} {n} thread{'s' if n > 1 else ''}"
                    for n, v in sorted(fixed.items(), reverse=True)))
            texts.append(f"{dtype} " + "; ".join(said))
            used += list(last.values())
        if texts:
            parts.append(f"{label}: " + "; ".join(texts))
    return "; ".join(parts), used


def _race_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """bench/speedrun.py against nanoGPT: per CPU class, the fastest recipe of the latest race (its records share a
    date) and its time against nanoGPT's."""
    parts, used = [], []
    for cls, core, label in kinds(records):
        runs = [r for r in matching(records, bench="speedrun", cls=cls, core=core)
                if r["row"].startswith("time to nanogpt's val loss: ") and r.get("ratio") is not None
                and not r["row"].endswith((": nanogpt", ": baseline"))]
        if not runs:
            continue
        last = latest(runs)["date"]
        r = min((r for r in runs if r["date"] == last), key=lambda r: r["ratio"])
        parts.append(f"{label}: {r['row'].rsplit(': ', 1)[1]} in {times(r['ratio'])} nanoGPT's training time "
                     f"({_v(r, 'seconds to target', '{:.1f}')} vs {_v(r, 'nanogpt s', '{:.1f}')} s)")
        used.append(r)
    return "; ".join(parts), used


def _llmc_claim(records: list[dict]) -> tuple[str, list[dict]]:
    """bench/compare_llmc.py, per CPU class, quiet: ours' fp32 and bf16 steps against llm.c's fp32 trainer, with
    the fp32 losses' agreement."""
    parts, used = [], []
    for cls, core, label in kinds(records):
        said = []
        for dtype in ("fp32", "bf16"):
            r = latest(matching(records, bench="compare_llmc", row=f"train step gpt2 4x64 {dtype} vs llm.c fp32",
                                cls=cls, core=core))
            if r:
                agree = re.search(r"losses step by step within (\S+) of llm.c's", r.get("notes") or "")
                said.append(f"{dtype} {times(r['ratio'])}" + (f" (losses within {agree[1]} of llm.c's)" if agree and
                                                                dtype == "fp32" else ""))
                used.append(r)
        if said:
            parts.append(f"{label}: " + ", ".join(said))
    return "; ".join(parts), used


CLAIMS = [
    ("parity: logits vs transformers, random-init gpt2 ([parity](docs/parity.md))",
     _latest("parity", "gpt2 random init", lambda r: f"max logits difference {_v(r, 'logits max diff', '{:.1e}')}; "
             f"every layer within {_v(r, 'hidden max relative', '{:.1e}')} relative; {r['notes']}")),
    ("inference forward fp32, gpt2 8 x 128 ([performance](docs/performance.md))",
     _ratio_per_class("compare_hf", "forward fp32")),
    ("inference forward, bf16 weights", _ratio_per_class("compare_hf", "forward bf16", "transformers bf16")),
    ("training step fp32, gpt2 4 x 128", _ratio_per_class("compare_hf", "train fp32")),
    ("training step bf16 autocast", _ratio_per_class("compare_hf", "train bf16", "transformers bf16")),
    ("training step fp32 as each runs it, gpt2 4 x 128 (fit's fused AdamW; Trainer's torch fused AdamW)",
     _ratio_per_class("compare_hf", "train as run 4x128 fp32")),
    ("training step bf16 as each runs it, gpt2 4 x 128 (`--dtype bf16-weights`; transformers' autocast)",
     _ratio_per_class("compare_hf", "train as run 4x128 bf16", "transformers bf16")),
    ("bf16 pretraining loss against fp32's, 2000 steps ([curve](docs/performance.md#bf16-training))",
     _curve_claim),
    ("greedy generation fp32, batch 1", _ratio_per_class("compare_hf", "generate b1 fp32")),
    ("greedy generation fp32, batch 8", _ratio_per_class("compare_hf", "generate b8 fp32")),
    ("greedy generation, bf16 weights, batch 8",
     _ratio_per_class("compare_hf", "generate b8 bf16", "transformers bf16")),
    ("greedy batch 1, int8 weights ([int8](docs/cpu-decoding.md#weight-only-int8-decoding))",
     _ratio_per_class("compare_hf", "generate b1 int8", "transformers fp32")),
    ("beam search, 4 beams", _ratio_per_class("compare_hf", "beam4 b1 fp32")),
    ("greedy batch 1 against ONNX Runtime and llama.cpp ([engines](docs/cpu-decoding.md#against-the-cpu-engines))",
     _engines_claim),
    ("the same with one core busy (another process spinning on it)", _busy_claim),
    ("the thread choice against a fixed thread count, fp32 (decode batch 1; a prompt's blocks)", _threads_claim),
    ("the training steps' thread choice against fixed thread counts, gpt2 fine-tuning ([performance](docs/performance.md"
     "#training-beside-a-busy-core))", _train_threads_claim),
    ("time to first token, 512-token prompt", _ratio_per_class("compare_hf", "ttft p512 fp32")),
    ("bf16 GEMM against fp32 ([machines](docs/performance.md#machines))", _gemm_ratio),
    ("AdamW step over gpt2's 124M parameters ([variants](docs/variants.md#adamw))",
     _latest("optimizer", "AdamW step, 124.4M float32 parameters (148 tensors)",
             lambda r: f"{times(r['ratio'])} `torch.optim.AdamW(foreach=True)`'s time" + (
                 f"; `AdamW(fused=True)` {times(r['fused_vs_torch_fused'])} `torch.optim.AdamW(fused=True)`'s"
                 if r.get("fused_vs_torch_fused") else ""))),
    ("pretraining, nanoGPT's CPU configuration, 2000 steps ([pretraining](docs/pretraining.md))",
     _latest("pretrain_shakespeare", "wall to final val loss, nanoGPT's CPU configuration",
             lambda r: f"{_v(r, 'ours s (best)', '{:.1f}')} s vs nanoGPT's {_v(r, 'nanoGPT s', '{:.1f}')} s; whole-split "
                       f"val {_v(r, 'val (whole split)', '{:.4f}')} vs {_v(r, 'nanoGPT val', '{:.4f}')}")),
    ("the race: nanoGPT's loss with the modern variants, the fastest recipe", _race_claim),
    ("gpt2 training steps against llm.c's C trainer (fp32), 4 x 64, the same weights, batch and AdamW "
     "([performance](docs/performance.md#training-against-llmc))", _llmc_claim),
    ("sonnets, dev chrF ([tasks](docs/tasks.md#sonnet-generation))",
     _latest("tasks", "sonnets, dev chrF, 4 x 256 BPE model pretrained here",
             lambda r: f"{_v(r, 'chrF', '{:.2f}')} ({r['notes']})")),
    ("LoRA r=8 vs full fine-tuning, gpt2 ([lora](docs/lora.md))",
     _latest("lora", "gpt2 LoRA r=8 vs full fine-tuning, 8 x 64",
             lambda r: f"{100 * r['ratio']:.2f}% of the gradient + AdamW memory; step "
                       f"{r['values']['step s full'] / r['values']['step s LoRA']:.2f}x faster")),
    ("the lecture's losses, `--preset lecture` ([learning path](docs/learning-path.md))",
     _latest("ladder", "the lecture's losses, --preset lecture", lambda r: r["notes"])),
    ("grading 29 real submissions ([grading](docs/grading.md))",
     _latest("grading_real", "components agreeing with a hand reading, 29 real submissions",
             lambda r: f"{_v(r, 'agree', '{:.0f}')} of {_v(r, 'components', '{:.0f}')} components agree with a hand "
                       f"reading ({100 * r['ratio']:.1f}%); median {_v(r, 'median s per submission', '{:.1f}')} s a "
                       "submission")),
    ("grading a class of 200 submissions ([grading](docs/grading.md))",
     _latest("grading_class", "a class of 200 submissions, --jobs 2",
             lambda r: f"{minutes(r['values']['seconds'])} with `--jobs 2` ({_v(r, 'per minute', '{:.1f}')} a minute), "
                       f"peak {r['values']['peak MB'] / 1000:.1f} GB")),
]


def claims(records: list[dict], **_) -> str:
    rows = []
    for text, read in CLAIMS:
        result, used = read(records)
        if not used:
            continue
        machines_ = "; ".join(dict.fromkeys(
            f"{cpu_and_class(r['machine'])}, {r['date'][:10]}" if r["machine"]["class"] != "other"
            else f"CPU not recorded, {r['date'][:10]}" for r in used))
        rows.append([text, result, machines_])
    return table(["what", "result", "machine, date"], rows)


ENGINE_FORMATS = {"ours": "ours", "hf": "transformers", "ort": "ONNX Runtime", "llama": "llama.cpp"}


def engines(records: list[dict], cls: str | None = None, core: str | None = None, **_) -> str:
    """bench/compare_engines.py on one CPU class: per engine, greedy batch-1 decoding on a quiet machine (its share of
    its own bandwidth limit, against ours fp32, its tokens against transformers fp32), the same with busy processes
    beside it, the time to the first token of the decode rows' 16-token prompt and the prefill time; then the runs
    it comes from."""
    chosen = [r for r in matching(records, bench="compare_engines", cls=cls, core=core) if "engine" in r]
    order = {e: i for i, e in enumerate(ENGINES)}  # the bench's own order; an engine it no longer has, last
    names = sorted(dict.fromkeys(r["engine"] for r in chosen), key=lambda e: order.get(e, len(order)))
    pick = {}
    for r in chosen:
        pick.setdefault((r["engine"], r["kind"], bool(r.get("busy"))), []).append(r)
    last = {key: latest(runs) for key, runs in pick.items()}
    base = last.get(("ours-fp32", "decode", False))
    rows, used = [], []
    for e in names:
        calm, busy, pre, first = (last.get((e, "decode", False)), last.get((e, "decode", True)),
                                  last.get((e, "prefill", False)), last.get((e, "first-token", False)))
        used += [r for r in (calm, busy, pre, first) if r]
        rate = calm["values"][e] if calm else None
        spread = ""
        if calm and calm.get("seconds"):  # the rounds' rates: the median's tokens over each round's time
            middle = statistics.median(calm["seconds"])
            spread = f"{num(rate * middle / max(calm['seconds']))}-{num(rate * middle / min(calm['seconds']))}"
        vs = times(rate / base["values"]["ours-fp32"]) if calm and base else ""
        busy_text = ""
        if busy:
            busy_text = num(busy["values"][e]) + (f" ({100 * busy['values'][e] / rate:.0f}% of quiet)" if rate else "")
        family, _, fmt = e.partition("-")
        if e == FIXED_THREADS:
            fmt = f"fp32, {(calm or busy or {}).get('threads', 'all')} threads every step"
        rows.append([ENGINE_FORMATS.get(family, family), fmt, num(rate), spread,
                     f"{100 * calm['share']:.0f}%" if calm else "", vs, calm["tokens"] if calm else "", busy_text,
                     num(1e3 * first["values"][e]) if first else "", num(pre["values"][e]) if pre else ""])
    if not rows:
        return f"(no compare_engines records{' for ' + cls if cls else ''} yet)\n"
    runs = sorted({f"{machine_name(r['machine'])}; {when(r)}" + (f"; {r['busy']} busy" if r.get("busy") else "")
                   for r in used})
    return table(["engine", "format", "tokens/s", "range over rounds", "of its bandwidth limit", "vs ours fp32",
                  "greedy tokens vs transformers fp32", "tokens/s, one core busy", "first token, 16-token prompt (ms)",
                  "prefill 512 (s)"], rows) + "\n" + \
        "".join(f"- {run}\n" for run in runs)


def mutation(records: list[dict], **_) -> str:
    """bench/mutation.py: the latest run of each module (a run stopped at its budget shows its untested mutants)."""
    chosen = matching(records, bench="mutation")
    rows = []
    for name in dict.fromkeys(r["row"] for r in chosen):
        # the latest; of runs in the same minute, the last appended
        r = max(reversed([x for x in chosen if x["row"] == name]), key=lambda x: x["date"])
        v = r["values"]
        count = lambda k: str(round(v.get(k, 0)))  # noqa: E731
        untested = round(v.get("not checked", 0))
        share = f"{r['ratio']:.1%}" if r.get("ratio") is not None else ""
        rows.append([f"`{name}`", str(round(sum(v.values()))), count("killed"), count("survived"), count("equivalent"),
                     str(round(v.get("timeout", 0) + v.get("segfault", 0))),
                     count("no tests"), count("skipped"),
                     share + (f" ({untested} not checked; {r['killed_share_tested']:.1%} of those tested)"
                              if untested and r.get("killed_share_tested") is not None else ""),
                     (minutes(r["seconds"]) if r.get("seconds") is not None else "")
                     + (f" (+ {r['checked_before']} mutants tested by an earlier run"
                        + (f"; {r['retested']} of them, survivors, tested again with new tests" if r.get("retested")
                           else "") + ")" if r.get("checked_before") else ""),
                     f"{machine_name(r['machine'])}; {when(r)}"])
    if not rows:
        return "(no mutation records yet: run `python bench/mutation.py`)\n"
    return table(["module", "mutants", "killed", "survived", "equivalent", "timeout or crash", "no tests", "skipped",
                  "killed share",
                  "run time", "machine; date, load, commit"], rows)


TABLES = {"machines": machines, "compare-hf": compare_hf, "commands": commands, "claims": claims, "engines": engines,
          "mutation": mutation, "bf16-curve": bf16_curve}


def render(spec: str, records: list[dict]) -> str:
    """The table for a marker's spec ('compare-hf class=AMX', 'bench=optimizer', ...)."""
    words = spec.split()
    options = dict(w.split("=", 1) for w in words if "=" in w)
    names = [w for w in words if "=" not in w]
    kwargs = {"cls": options.get("class"), "device": options.get("device"),
              "core": options["core"].replace("-", " ") if "core" in options else None}  # core=Zen-5: "Zen 5"
    if not names and "bench" in options:
        return one_bench(records, options["bench"], **kwargs)
    if len(names) != 1 or names[0] not in TABLES:
        raise ValueError(f"unknown results table {spec!r}: expected one of {sorted(TABLES)} or bench=<name>")
    return TABLES[names[0]](records, **kwargs)


def pages(root: Path = ROOT) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def regenerate(text: str, records: list[dict]) -> str:
    return MARK.sub(lambda m: m.group(1) + render(m.group("spec"), records) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page's table differs")
    parser.add_argument("--show", metavar="SPEC", help="print the table of one spec and exit")
    parser.add_argument("--results", type=Path, default=None, help="the records' folder (default bench/results)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project whose pages are read")
    args = parser.parse_args(argv)
    records = load(args.results)
    if args.show:
        print(render(args.show, records), end="")
        return 0
    stale = []
    for page in pages(args.root):
        text = page.read_text()
        new = regenerate(text, records)
        if new == text:
            continue
        if args.check:
            diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(page), "from bench/results", lineterm="",
                                        n=0)
            stale.append(f"{page.relative_to(args.root)}:\n" + "\n".join(list(diff)[:40]))
        else:
            page.write_text(new)
            print(f"rewrote the tables of {page.relative_to(args.root)}")
    if stale:
        print("these pages' generated tables differ from bench/results (run `python -m bench.report`; a figure in a "
              "generated table is never edited by hand):\n" + "\n\n".join(stale), file=sys.stderr)
        return 1
    if args.check:
        print(f"every generated table matches bench/results ({len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
