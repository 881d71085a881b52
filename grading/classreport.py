"""The class report of a batch: one static page staff read at a glance, and a page per student.

    python -m grading --batch export.zip --csv scores.csv --report class/ --starter starter/
    # then open class/index.html (no server, no JavaScript)

Everything on the pages comes from the per-submission reports the batch kept (the same ones the CSV is made of):
the scores, the share of full / partial / zero per check and part, the bugs the grader named ranked by how many
students have each, the time per submission, the environment findings, the pairs of submissions whose own code is
alike (grading/similarity.py, with the starter as boilerplate) and, per student, the whole report. class.json holds
the numbers the pages show.
"""
from __future__ import annotations

import html
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from grading.report import stable_diagnosis

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; line-height: 1.4 }
h1 { font-size: 1.6em } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc }
table { border-collapse: collapse; margin: .5em 0 } td, th { border: 1px solid #ddd; padding: .2em .5em;
  text-align: left; vertical-align: top } th { background: #f4f4f4 } td.n { text-align: right }
.bad { color: #a00 } .ok { color: #070 } .muted { color: #777 } img { max-width: 100%; border: 1px solid #eee }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: .85em; white-space: pre-wrap }
mark { background: #ffe08a } .side { display: inline-block; width: 49%; vertical-align: top } .flag { color: #a00;
  font-weight: bold } .summary td { border: none; padding: .1em 1em .1em 0 }
"""


def _e(x) -> str:
    return html.escape(str(x))


def _slug(name: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "submission"
    slug, n = base, 1
    while slug.lower() in taken:
        n += 1
        slug = f"{base}-{n}"
    taken.add(slug.lower())
    return slug


def _page(title: str, body: str, up: str = "") -> str:
    back = f'<p><a href="{up}index.html">&larr; class report</a></p>' if up else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head><body>{back}{body}</body></html>\n")


def _table(header: list[str], rows: list[list[str]], attrs: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table {attrs}><tr>{head}</tr>{body}</table>"


def _td(x, cls: str = "") -> str:
    return f'<td class="{cls}">{x}</td>' if cls else f"<td>{x}</td>"


def _display(entry: dict) -> str:
    return entry.get("names") or entry["submission"]


def _part_state(part: dict) -> str:
    if part["status"] == "not implemented":
        return "not implemented"
    if part["points"] >= part["max"] - 1e-9:
        return "full"
    return "partial" if part["points"] > 0 else "zero"


# ---- what the pages show, from the records -------------------------------------------------------------------------

def summarise(records: list[dict]) -> dict:
    graded = [r for r in records if r.get("report")]
    scores = [r["report"]["score"] for r in graded]
    parts = {}  # "check.part" -> state -> count
    bugs = defaultdict(list)  # (check, key, text) -> students (slugs)
    unnamed = defaultdict(list)  # (check, verdict) -> students: points lost with no bug named
    env = defaultdict(list)
    for r in graded:
        for c in r["report"]["checks"]:
            for p in c["parts"]:
                counts = parts.setdefault(f"{c['name']}.{p['name']}", {"full": 0, "partial": 0, "zero": 0,
                                                                       "not implemented": 0, "max": p["max"]})
                counts[_part_state(p)] += 1
            key, text = c.get("diagnosis_key") or "", c.get("diagnosis") or ""
            if key:  # one named bug: grouped by its key, whatever numbers its text carries
                bugs[(c["name"], key, stable_diagnosis(c))].append(r["slug"])
            elif c["score"] < c["max_score"] - 1e-9:
                closest = re.search(r"closest: (.*?)(?:, max error [^)]*)?\)$", text)
                why = f"{c['verdict']}; no single bug matches (closest: {closest.group(1)})" if closest else \
                    c["verdict"]
                unnamed[(c["name"], why)].append(r["slug"])
        for finding in r["report"].get("environment", []):
            env[finding].append(r["slug"])
    seconds = sorted(r["report"]["seconds"] for r in graded)
    return {
        "submissions": len(records), "graded": len(graded), "errors": len(records) - len(graded),
        "max_score": max((r["report"]["max_score"] for r in graded), default=0),
        "mean": statistics.fmean(scores) if scores else 0, "median": statistics.median(scores) if scores else 0,
        "full_marks": sum(r["report"]["score"] >= r["report"]["max_score"] - 1e-9 for r in graded),
        "parts": parts,
        "bugs": sorted(([check, key, text, slugs] for (check, key, text), slugs in bugs.items()),
                       key=lambda b: (-len(b[3]), b[0], b[2])),
        "unnamed": sorted(([check, verdict, slugs] for (check, verdict), slugs in unnamed.items()),
                          key=lambda u: (-len(u[2]), u[0])),
        "environment": sorted(([f, slugs] for f, slugs in env.items()), key=lambda e: (-len(e[1]), e[0])),
        "seconds": {"median": statistics.median(seconds) if seconds else 0, "max": seconds[-1] if seconds else 0,
                    "total": sum(seconds)},
    }


def clusters(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The connected groups of a list of pairs, largest first, each sorted."""
    parent = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[root(a)] = root(b)
    groups = defaultdict(list)
    for x in parent:
        groups[root(x)].append(x)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g))


# ---- plots ---------------------------------------------------------------------------------------------------------

def _plots(out: Path, records: list[dict], summary: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    graded = [r for r in records if r.get("report")]
    made = []
    if graded:
        top = summary["max_score"] or 1
        fig, ax = plt.subplots(figsize=(7, 2.8), dpi=110)
        ax.hist([r["report"]["score"] for r in graded], bins=min(20, max(5, len(graded))), range=(0, top),
                color="#4a7ab5", edgecolor="white")
        ax.set_xlabel(f"score (of {top:g})")
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("submissions")
        ax.set_title(f"Scores of {len(graded)} submissions (median {summary['median']:g})")
        fig.tight_layout()
        fig.savefig(out / "scores.png")
        plt.close(fig)
        made.append("scores.png")

        names = list(summary["parts"])
        states = [("full", "#3a9d5d"), ("partial", "#e0b040"), ("zero", "#c8503c"), ("not implemented", "#9a9a9a")]
        fig, ax = plt.subplots(figsize=(7, 0.28 * len(names) + 1.2), dpi=110)
        left = [0.0] * len(names)
        for state, colour in states:
            share = [summary["parts"][n][state] / len(graded) for n in names]
            ax.barh(names, share, left=left, color=colour, label=state)
            left = [a + b for a, b in zip(left, share)]
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of submissions")
        ax.legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        ax.tick_params(axis="y", labelsize=8)
        fig.tight_layout()
        fig.savefig(out / "parts.png")
        plt.close(fig)
        made.append("parts.png")

        fig, ax = plt.subplots(figsize=(7, 2.5), dpi=110)
        ax.hist([r["report"]["seconds"] for r in graded], bins=20, color="#7a6ab5", edgecolor="white")
        ax.set_xlabel("seconds to grade (one submission, all its checks)")
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("submissions")
        fig.tight_layout()
        fig.savefig(out / "seconds.png")
        plt.close(fig)
        made.append("seconds.png")
    return made


# ---- pages ---------------------------------------------------------------------------------------------------------

def _links(slugs: list[str], names: dict) -> str:
    return ", ".join(f'<a href="students/{s}.html">{_e(names[s])}</a>' for s in slugs)


def student_page(r: dict) -> str:
    e, report = r["entry"], r.get("report")
    body = [f"<h1>{_e(_display(e))}</h1>", '<table class="summary">']
    for finding in r.get("dynamic", []):  # code made at run time: the similarity check cannot see it
        body.append(f'<p class="bad">finding: {_e(finding)}: code run from a string or a file, which the similarity '
                    "check cannot compare; read it</p>")
    if r.get("unread"):
        body.append(f'<p class="muted">.py files the similarity check did not read (over 256 KiB, or past the '
                    f"budget per submission): {_e(', '.join(r['unread'][:10]))}"
                    + (f" and {len(r['unread']) - 10} more" if len(r["unread"]) > 10 else "") + "</p>")
    for label, value in (("submission", e["submission"]), ("student ids", e.get("sids", "")),
                         ("emails", e.get("emails", "")), ("graded", r.get("graded_at", "")),
                         ("report key", r.get("key", ""))):
        if value:
            body.append(f"<tr><td>{label}</td><td>{_e(value)}</td></tr>")
    body.append("</table>")
    if not report:
        body.append(f'<p class="bad">Not graded: {_e(r.get("error", ""))}</p>')
        return _page(_display(e), "".join(body), "../")
    body.append(f"<p><b>{report['score']:g} / {report['max_score']:g}</b> in {report['seconds']:.1f} s</p>")
    rows = [[_td(_e(c["name"])), _td(f"{c['score']:g}", "n"), _td(f"{c['max_score']:g}", "n"),
             _td(_e(c["verdict"]), "ok" if c["verdict"] == "pass" else "bad"), _td(_e(c["diagnosis"] or "-"))]
            for c in report["checks"]]
    body.append(_table(["check", "points", "max", "verdict", "diagnosis"], rows))
    for finding in report.get("environment", []):
        body.append(f'<p class="bad">{_e(finding)}</p>')
    for c in report["checks"]:
        body.append(f'<h2 id="{_e(c["name"])}">{_e(c["name"])}: {c["score"]:g} / {c["max_score"]:g}</h2>')
        prow = []
        for p in c["parts"]:
            err = p.get("error")
            err = "" if err is None or err == float("inf") else f"{err:.3g}"
            prow.append([_td(_e(p["name"])), _td(f"{p['points']:g}", "n"), _td(f"{p['max']:g}", "n"),
                         _td(_e(p["status"])), _td(err, "n"), _td(_e(p["message"]))])
        body.append(_table(["part", "points", "max", "status", "max error", "message"], prow))
        if c["diagnosis"]:
            body.append(f"<p><b>Diagnosis:</b> {_e(c['diagnosis'])}</p>")
        notes = list(dict.fromkeys(c["messages"])) + [f"info (no points): {i}" for i in c["info"]]
        if notes:
            body.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
        if c["output"].strip():
            body.append(f"<details><summary>output of the submission's code</summary><pre>{_e(c['output'][-4000:])}"
                        "</pre></details>")
    return _page(_display(e), "".join(body), "../")


def pair_page(pair, names: dict, slugs: dict) -> str:
    a, b = slugs[pair.a], slugs[pair.b]
    body = [f'<h1>Similar pair: <a href="../students/{a}.html">{_e(names[a])}</a> and '
            f'<a href="../students/{b}.html">{_e(names[b])}</a></h1>',
            f"<p>share {pair.share:.0%}: {pair.matched_a} of {_e(names[a])}'s {pair.own_a} characters of own code and "
            f"{pair.matched_b} of {_e(names[b])}'s {pair.own_b} are found in the other's files (normalised code: "
            "names, strings, comments and layout do not count; the starter's code is left out). Marked below: the "
            "matched code of each file pair, largest first; lines far from a match are cut (...).</p>"]
    for f in pair.files:
        body.append(f"<h2>{_e(f.file_a)} &harr; {_e(f.file_b)} ({f.chars} characters)</h2>"
                    f'<div class="side"><b>{_e(names[a])}</b><pre>{f.html_a}</pre></div> '
                    f'<div class="side"><b>{_e(names[b])}</b><pre>{f.html_b}</pre></div>')
    return _page(f"{names[a]} / {names[b]}", "".join(body), "../")


def write_class_report(out: Path, records: list[dict], checks, starter=None, meta: dict | None = None) -> Path:
    """Write out/index.html, out/students/*.html, out/pairs/*.html, the PNGs and class.json; returns index.html."""
    from grading.similarity import BUDGET, CHARS, MAX_FILE, SHARE, similar_pairs

    out = Path(out)
    (out / "students").mkdir(parents=True, exist_ok=True)
    (out / "pairs").mkdir(exist_ok=True)
    for old in [*(out / "students").glob("*.html"), *(out / "pairs").glob("*.html")]:
        old.unlink()  # a rerun with fewer students or pairs leaves no stale page
    taken, names, slug_of = set(), {}, {}
    for r in records:
        r["slug"] = _slug(r["entry"]["submission"], taken)
        names[r["slug"]] = _display(r["entry"])
        slug_of[r["entry"]["submission"]] = r["slug"]
    summary = summarise(records)
    plots = _plots(out, records, summary)
    # the folder each record was graded from (its layout's); a refused or unreadable entry has none and is left out
    folders = {r["entry"]["submission"]: Path(r["entry"]["layout"]) for r in records if r["entry"].get("layout")}
    pairs, own, given = similar_pairs(folders, Path(starter) if starter else None, progress=True)
    from grading.similarity import dynamic_code, python_files

    for r in records:
        if r["entry"].get("layout"):
            try:
                r["dynamic"] = dynamic_code(Path(r["entry"]["layout"]))
                r["unread"] = python_files(Path(r["entry"]["layout"]))[1]
            except Exception as exc:  # noqa: BLE001  (one unreadable submission is not the report's end)
                r["dynamic"] = [f"its files could not be read for this ({type(exc).__name__})"]
    for r in records:
        (out / "students" / f"{r['slug']}.html").write_text(student_page(r))
    flagged = [p for p in pairs if p.flagged]
    page_of = {id(p): f"pairs/{i + 1}.html" for i, p in enumerate(flagged)}
    for p in flagged:
        (out / page_of[id(p)]).write_text(pair_page(p, names, slug_of))

    meta = meta or {}
    graded = summary["graded"]
    body = ["<h1>Class report</h1>", '<table class="summary">']
    facts = [("submissions", f"{summary['submissions']} ({graded} graded"
              + (f', <span class="bad">{summary["errors"]} not graded: see below</span>' if summary["errors"] else "")
              + ")"),
             ("score", f"median {summary['median']:g}, mean {summary['mean']:.1f} of {summary['max_score']:g}; "
                       f"{summary['full_marks']} with full marks"),
             ("time", f"median {summary['seconds']['median']:.1f} s per submission, max "
                      f"{summary['seconds']['max']:.1f} s"
              + (f"; this run graded {meta['graded']} in {meta['seconds']:.0f} s with --jobs {meta['jobs']} and took "
                 f"{meta['reused']} from an earlier run" if "graded" in meta else "")),
             ("grader", f"{_e(meta.get('grader', ''))}; checks {', '.join(checks)}; CSV {_e(meta.get('csv', ''))}")]
    body += [f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in facts] + ["</table>"]
    if "scores.png" in plots:
        body.append('<img src="scores.png" alt="score histogram">')

    body.append("<h2>Bugs the grader named, by how many students have each</h2>")
    if summary["bugs"]:
        rows = [[_td(_e(text)), _td(_e(check)), _td(f"{len(slugs)} ({len(slugs) / max(graded, 1):.0%})", "n"),
                 _td(_links(slugs, names))] for check, _key, text, slugs in summary["bugs"]]
        body.append(_table(["bug", "check", "students", "who"], rows))
    else:
        body.append("<p>None.</p>")
    if summary["unnamed"]:
        body.append("<p>Points lost where no single bug was named (the student pages say what failed):</p>")
        rows = [[_td(_e(check)), _td(_e(verdict)), _td(f"{len(slugs)}", "n"), _td(_links(slugs, names))]
                for check, verdict, slugs in summary["unnamed"]]
        body.append(_table(["check", "what", "students", "who"], rows))

    body.append("<h2>Each check and part: full, partial, zero, not implemented</h2>")
    if "parts.png" in plots:
        body.append('<img src="parts.png" alt="share of full, partial and zero per part">')
    rows = [[_td(_e(n)), _td(f"{c['max']:g}", "n")] + [_td(c[s], "n") for s in ("full", "partial", "zero",
                                                                              "not implemented")]
            for n, c in summary["parts"].items()]
    body.append(_table(["check.part", "points", "full", "partial", "zero", "not implemented"], rows))

    body.append("<h2>Similar submissions</h2>")
    body.append(f"<p>Pairs whose own code is alike (copydetect's winnowing). Left out as given: {_e(given)}. "
                f"Flagged: share &ge; {SHARE:.0%} and &ge; {CHARS} matched characters. The share is the larger side's fraction of its own code found in the other's files. A flag points a "
                "person at both sides' code; it is not a verdict (see docs/grading.md for the limits).</p>")
    rows = []
    for p in pairs:
        a, b = slug_of[p.a], slug_of[p.b]
        label = f'<a href="{page_of[id(p)]}">flagged: read both</a>' if p.flagged else "-"
        if p.skipped_a or p.skipped_b:  # what the fingerprints did not see, on the pair's line
            label += (f' <span class="muted">(.py files not read, over {MAX_FILE >> 10} KiB or past the '
                      f"{BUDGET >> 10} KiB per submission: {p.skipped_a} / {p.skipped_b})</span>")
        rows.append([_td(_links([a], names)), _td(_links([b], names)), _td(f"{p.share:.0%}", "n"),
                     _td(p.chars, "n"), _td(f"{p.own_a} / {p.own_b}", "n"), _td(label, "flag" if p.flagged else "")])
    body.append(_table(["submission", "submission", "share", "matched chars", "own chars", ""], rows, 'id="pairs"')
                if rows else "<p>No pair shares any code beyond the starter.</p>")
    if pairs:
        body.append(f'<p class="muted">{len(flagged)} flagged; the closest unflagged pairs are listed for scale.</p>')
    groups = clusters([(slug_of[p.a], slug_of[p.b]) for p in flagged])
    if groups:
        body.append(f"<p>The flagged pairs join {len(groups)} group(s) of submissions (each linked to another in its "
                    "group by a flagged pair), largest first:</p><ul>"
                    + "".join(f"<li>{len(g)}: {_links(g, names)}</li>" for g in groups) + "</ul>")

    body.append("<h2>Environment findings</h2>")
    if summary["environment"]:
        rows = [[_td(_e(f)), _td(len(slugs), "n"), _td(_links(slugs, names))] for f, slugs in summary["environment"]]
        body.append(_table(["finding", "students", "who"], rows))
    else:
        body.append("<p>None: every submission imported only the course's environment.</p>")

    body.append("<h2>Time per submission</h2>")
    if "seconds.png" in plots:
        body.append('<img src="seconds.png" alt="seconds per submission">')

    body.append("<h2>Students</h2>")
    rows = []
    for r in sorted(records, key=lambda r: _display(r["entry"]).lower()):
        rep = r.get("report")
        score = {c["name"]: c["score"] for c in rep["checks"]} if rep else {}
        rows.append([_td(_links([r["slug"]], names)), _td(_e(r["entry"].get("sids", ""))),
                     _td(f"{rep['score']:g}" if rep else "", "n score"),
                     _td(f"{rep['max_score']:g}" if rep else "", "n max"),
                     *[_td(f"{score[c]:g}" if c in score else "", f"n check-{c}") for c in checks],
                     _td(f"{rep['seconds']:.1f}" if rep else "", "n"),
                     _td(_e(r.get("error", "")) if not rep else "", "bad")])
    body.append(_table(["student", "ids", "score", "max", *checks, "seconds", "error"], rows, 'id="students"'))

    (out / "index.html").write_text(_page("Class report", "".join(body)))
    data = {"summary": summary, "meta": meta, "similarity_given": given, "groups": groups,
            "pairs": [p.to_dict() for p in pairs], "own_chars": own,
            "students": {r["slug"]: {"submission": r["entry"]["submission"], "names": r["entry"].get("names", ""),
                                     "score": r["report"]["score"] if r.get("report") else None,
                                     "error": r.get("error", ""), "dynamic_code": r.get("dynamic", [])}
                         for r in records}}
    (out / "class.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return out / "index.html"
