"""Regrade the real public submissions of bench/grading_real_manifest.json and compare with the hand verdicts.

    python bench/grading_real.py --mirror /work/.mirror                       # agreement table + runs/grading_real.json
    python bench/grading_real.py --mirror /work/.mirror --batch-jobs 2        # + a Gradescope-export batch, per minute
    /tmp/venv24/bin/python bench/grading_real.py --mirror /work/.mirror       # in a fresh venv made as the README says

Each submission is extracted from the mirror at its pinned commit (Python files only: the repositories' data and
checkpoints are never needed, and some of their blobs are absent from a mirror) into a temporary folder, graded by
one warm Grader (the time per submission is the grader's own), and every component's hand verdict (correct / wrong /
not implemented) is compared with the points the grader gave the rubric parts that grade that component.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# component -> (check, parts): the rubric parts that grade it; a part the rubric lacks falls back to the whole check
PARTS = {
    "attention": ("attention", None),
    "layer_add": ("layer", ("add",)),
    "layer_forward": ("layer", ("forward", "training")),
    "embed": ("embed", None),
    "model_forward": ("model", ("forward",)),
    "hidden_state_to_token": ("model", ("hidden_state_to_token",)),
    "from_pretrained": ("from_pretrained", None),
    "adamw": ("adamw", None),
}


def extract(mirror: Path, entry: dict, dest: Path) -> Path:
    git = mirror / entry["repo"].replace("/", "+") / "repo"
    if not git.is_dir():
        raise FileNotFoundError(f"{git} not found: fetch github:{entry['repo']} first")
    names = subprocess.run(["git", "--git-dir", str(git), "ls-tree", "-r", "--name-only", entry["commit"]],
                           check=True, capture_output=True, text=True).stdout.split("\n")
    files = [n for n in names if n.endswith((".py", ".yml", ".txt")) and not n.startswith("data/")]
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(git), "archive", entry["commit"], "--", *files],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def component_verdict(report: dict, component: str) -> tuple[str, str]:
    """(verdict, why) of the grader for one component: correct when its parts got full points."""
    check, parts = PARTS[component]
    c = next((c for c in report["checks"] if c["name"] == check), None)
    if c is None:
        return "not graded", f"no {check} check in the report"
    chosen = [p for p in c["parts"] if parts is None or p["name"] in parts] or c["parts"]
    if all(p["points"] >= p["max"] - 1e-9 for p in chosen):
        return "correct", ""
    if all(p["status"] == "not implemented" for p in chosen):
        verdict = "not implemented"
    else:
        verdict = "wrong"
    why = "; ".join(f"{p['name']} {p['points']:g}/{p['max']:g} {p['status']}: {p['message']}"[:300]
                    for p in chosen if p["points"] < p["max"] - 1e-9)
    if c.get("diagnosis"):
        why += f" [diagnosis: {c['diagnosis']}]"
    return verdict, why


def agree(hand: str, grader: str) -> bool:
    return (hand == "correct") == (grader == "correct")


def export_layout(subs: dict[str, Path], dest: Path) -> Path:
    """Gradescope's "Export Submissions" layout of the extracted submissions (made-up ids; the code is real)."""
    import yaml

    dest.mkdir(parents=True)
    meta = {}
    for i, (name, folder) in enumerate(sorted(subs.items())):
        sub = f"submission_{100000 + i}"
        os.symlink(folder, dest / sub)
        meta[sub] = {":submitters": [{":name": name.split("+")[0], ":sid": str(9000 + i), ":email": f"s{i}@example.edu"}],
                     ":created_at": "2026-02-23 12:00:00.000000000 -0800", ":score": 0.0}
    (dest / "submission_metadata.yml").write_text(yaml.safe_dump(meta, sort_keys=True))
    return dest


def cpu() -> str:
    flags = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model} ({os.cpu_count()} cores; {' '.join(wanted) or 'no avx2'})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=str(ROOT / "bench" / "grading_real_manifest.json"), help="submissions + hand verdicts")
    p.add_argument("--mirror", required=True, help="folder of git mirrors named owner+name/repo (fetch's /work/.mirror)")
    p.add_argument("--out", default=str(ROOT / "runs" / "grading_real.json"), help="where the JSON result goes")
    p.add_argument("--only", default="", help="comma-separated submission names (default: all)")
    p.add_argument("--batch-jobs", type=int, default=0, help="also time python -m grading --batch on an export with --jobs N")
    args = p.parse_args(argv)
    from bench.machine import print_machine_header
    print_machine_header()

    from grading.environment import GraderEnvironmentError, check_environment
    from grading.grader import Grader

    try:
        check_environment()
    except GraderEnvironmentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    manifest = json.loads(Path(args.manifest).read_text())
    entries = [e for e in manifest["submissions"] if not args.only or e["name"] in args.only.split(",")]
    components = manifest["components"]
    tmp = tempfile.TemporaryDirectory(prefix="grading-real-")
    results, subs = [], {}
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").is_file() else []
    with Grader() as grader:
        for e in entries:
            folder = extract(Path(args.mirror), e, Path(tmp.name) / e["name"])
            subs[e["name"]] = folder
            from grading.gradescope import find_layout

            start = time.monotonic()
            report = grader.grade(find_layout(folder) or folder).to_dict()
            wall = time.monotonic() - start
            row = {"name": e["name"], "repo": e["repo"], "commit": e["commit"], "score": report["score"],
                   "max_score": report["max_score"], "seconds": round(wall, 2), "environment": report.get("environment", []),
                   "components": {}}
            for comp in components:
                verdict, why = component_verdict(report, comp)
                row["components"][comp] = {"hand": e["verdicts"][comp], "grader": verdict,
                                           "agree": agree(e["verdicts"][comp], verdict), "why": why}
            results.append(row)
            bad = [c for c, v in row["components"].items() if not v["agree"]]
            print(f"{e['name']:<42} {report['score']:>5g}/{report['max_score']:g}  {wall:5.1f} s  "
                  f"{'disagree: ' + ', '.join(bad) if bad else 'agrees'}", flush=True)
    table = []
    for comp in components:
        rows = [r["components"][comp] for r in results]
        table.append({"component": comp, "n": len(rows), "agree": sum(r["agree"] for r in rows)})
    total = sum(t["agree"] for t in table), sum(t["n"] for t in table)
    seconds = sorted(r["seconds"] for r in results)
    print(f"\nCPU: {cpu()}; load before: {' '.join(load)}; after: "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3]) if load else '?'}")
    print(f"{'component':<24}{'agree':>8}{'of':>5}{'%':>7}")
    for t in table:
        print(f"{t['component']:<24}{t['agree']:>8}{t['n']:>5}{100 * t['agree'] / max(t['n'], 1):>7.1f}")
    print(f"{'all':<24}{total[0]:>8}{total[1]:>5}{100 * total[0] / max(total[1], 1):>7.1f}")
    if seconds:
        print(f"seconds per submission: median {seconds[len(seconds) // 2]:.1f}, max {seconds[-1]:.1f} "
              f"(one warm grader, {len(seconds)} submissions)")
    print("\ndisagreements:")
    for r in results:
        for comp, v in r["components"].items():
            if not v["agree"]:
                print(f"  {r['name']} {comp}: hand {v['hand']}, grader {v['grader']}: {v['why'][:400]}")
    out = {"cpu": cpu(), "load_before": load, "manifest": args.manifest, "agreement": table,
           "total": {"agree": total[0], "n": total[1]}, "submissions": results}
    from bench.results import Recorder

    rec = Recorder("grading_real")
    if total[1]:
        rec.add(f"components agreeing with a hand reading, {len(results)} real submissions",
                {"agree": total[0], "components": total[1], "median s per submission": seconds[len(seconds) // 2]},
                "components, s", ratio=total[0] / total[1], ratio_of="share of components agreeing",
                notes=f"manifest {Path(args.manifest).name}")
    if args.batch_jobs:
        export = export_layout(subs, Path(tmp.name) / "export")
        csv_path = Path(args.out).with_suffix(".csv")
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "grading", "--batch", str(export), "--csv", str(csv_path),
                               "--jobs", str(args.batch_jobs)], cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        out["batch"] = {"jobs": args.batch_jobs, "submissions": len(subs), "seconds": round(wall, 1),
                        "per_minute": round(len(subs) / (wall / 60), 2), "exit": proc.returncode, "csv": str(csv_path),
                        "load_after": Path("/proc/loadavg").read_text().split()[:3]}
        print(f"\nbatch (Gradescope export layout, --jobs {args.batch_jobs}): {len(subs)} submissions in {wall:.1f} s "
              f"= {out['batch']['per_minute']} per minute (process start included); exit {proc.returncode}; {csv_path}")
        if proc.returncode:
            print(proc.stderr[-2000:])
        else:
            rec.add(f"batch of {len(subs)} submissions, --jobs {args.batch_jobs}", {
                "seconds": wall, "per minute": len(subs) / (wall / 60)}, "s, submissions per minute")
    rec.write()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
