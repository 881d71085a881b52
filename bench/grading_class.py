"""A class-sized batch from the real public submissions: the class report, similarity, time, memory, kill -9.

    python bench/grading_class.py --mirror /work/.mirror --report runs/class_real      # the real corpus + 2 disguised copies
    python bench/grading_class.py --mirror /work/.mirror --size 200 --jobs 1,2 --kill  # timing, peak memory, kill -9

The real corpus is bench/grading_real_manifest.json (extracted from a mirror of each repository as
bench/grading_real.py does); its starter (the manifest's "starter": the handout's first commit) is the similarity
table's boilerplate. `--disguise` names submissions to copy through grading/disguise.py (locals renamed, functions
reordered, comments rewritten): each copy must be flagged against its original, and no pair of submissions from
different repositories may be (the same student's repository at two commits is one author, and may be).

`--size N` fills the class up to N submissions with copies of the real ones, each with one file of its own (a note),
so every copy is graded (identical files would be graded once) and scores as its original. Each `--jobs` value
grades the class once, from an empty reports folder: minutes, submissions per minute and the peak memory of the
batch's whole process tree (sampled every 0.2 s). `--kill` then starts the last `--jobs` run again, kills it with
SIGKILL at a random point (uniform over 20-80% of the uninterrupted run's grading time), reruns the same command and checks
that the CSV equals the uninterrupted one (the seconds column aside) and that batch.log shows each submission graded
once. Results go to --out (JSON) and the terminal.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grading_real import extract  # noqa: E402
from bench.machine import machine_header, print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402


def tree_rss(pid: int) -> int:
    """Resident memory (bytes) of pid and all its descendants."""
    children, rss = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            pages = int((d / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
        rss[int(d.name)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def run_batch(args_list: list[str], kill_after: float | None = None) -> dict:
    """Run python -m grading ARGS in its own session; sample memory; kill it (and its workers) after kill_after s."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "grading", *args_list], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        if kill_after is not None and time.monotonic() - start > kill_after:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    out = proc.communicate()[0]
    return {"seconds": time.monotonic() - start, "peak_mb": peak / 2**20, "exit": proc.returncode, "output": out}


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=str(ROOT / "bench" / "grading_real_manifest.json"))
    p.add_argument("--mirror", required=True, help="folder of git mirrors named owner+name/repo (fetch's /work/.mirror)")
    p.add_argument("--disguise", default="jerryxyj+cs224n_gpt,Or4ng3-3+cs224n_gpt",
                   help="comma-separated submissions to add a disguised copy of")
    p.add_argument("--size", type=int, default=0, help="fill the class up to this many submissions with copies")
    p.add_argument("--jobs", default="2", help="comma-separated --jobs values, one timed run each")
    p.add_argument("--kill", action="store_true", help="then kill -9 a run at a random point and rerun it")
    p.add_argument("--report", help="write the class report of the (last) run here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "grading_class.json"))
    args = p.parse_args(argv)
    print_machine_header()
    manifest = json.loads(Path(args.manifest).read_text())
    tmp = Path(tempfile.mkdtemp(prefix="grading-class-"))
    mirror = Path(args.mirror)
    subs = tmp / "subs"
    repo_of = {}
    for e in manifest["submissions"]:
        extract(mirror, e, subs / e["name"])
        repo_of[e["name"]] = e["repo"]
    starter = extract(mirror, manifest["starter"], tmp / "starter")
    for name in filter(None, args.disguise.split(",")):
        from grading.disguise import disguise

        disguise(subs / name, subs / f"copy-of-{name}")
        repo_of[f"copy-of-{name}"] = f"disguised copy of {repo_of[name]}"
    real = sorted(repo_of)
    rng = random.Random(args.seed)
    i = 0
    while len(repo_of) < args.size:
        src = real[i % len(real)]
        i += 1
        dst = subs / f"{src}~{i}"
        shutil.copytree(subs / src, dst, symlinks=True)  # as extracted: a repository's links stay links
        (dst / "NOTE.txt").write_text(f"copy {i} of {src}\n")
        repo_of[dst.name] = repo_of[src]
    n = len(repo_of)
    print(f"class: {n} submissions ({len(manifest['submissions'])} real, "
          f"{len(real) - len(manifest['submissions'])} disguised copies, {n - len(real)} copies with a note); starter {manifest['starter']['repo']}@{manifest['starter']['commit'][:7]}")
    result = {"machine": machine_header(), "submissions": n, "runs": [], "load_before": os.getloadavg()}
    last = None
    for jobs in [int(j) for j in args.jobs.split(",")]:
        csv_path = tmp / f"jobs{jobs}.csv"
        cmd = ["--batch", str(subs), "--csv", str(csv_path), "--jobs", str(jobs)]
        if args.report and jobs == int(args.jobs.split(",")[-1]):
            cmd += ["--report", args.report, "--starter", str(starter)]
        load = os.getloadavg()[0]
        run = run_batch(cmd)
        run.update(jobs=jobs, load_before=load, load_after=os.getloadavg()[0], per_minute=n / (run["seconds"] / 60))
        graded = re.search(r"(\d+) graded in ([\d.]+) s", run["output"])
        run["grading_s"] = float(graded.group(2)) if graded else None  # the rest: start-up, CSV, the class report
        print(f"--jobs {jobs}: {n} submissions in {run['seconds'] / 60:.1f} min ({run['per_minute']:.1f} per minute; "
              f"grading {run['grading_s'] or 0:.0f} s, the rest start-up, CSV" + (" and the class report" if
              "--report" in cmd else "") + f"), peak memory of the batch's processes {run['peak_mb']:.0f} MB, exit "
              f"{run['exit']}, load {load:.2f} -> {run['load_after']:.2f}")
        if run["exit"]:
            print(run["output"][-3000:])
            return 1
        result["runs"].append({k: v for k, v in run.items() if k != "output"})
        rec = Recorder("grading_class")
        rec.add(f"a class of {n} submissions, --jobs {jobs}" + (", with the class report" if "--report" in cmd else ""),
                {"seconds": run["seconds"], "per minute": run["per_minute"], "peak MB": run["peak_mb"]},
                "s, submissions per minute, MB")
        rec.write()
        last = (jobs, cmd, csv_path, run["grading_s"] or run["seconds"])
    if args.report:
        data = json.loads((Path(args.report) / "class.json").read_text())
        flagged = [(p["a"], p["b"], p["share"], p["chars"]) for p in data["pairs"] if p["flagged"]]
        def author(s):
            return repo_of.get(s, s).replace("disguised copy of ", "")
        independent = [f for f in flagged if author(f[0]) != author(f[1])]
        copies = [name for name in real if name.startswith("copy-of-")]
        caught = [c for c in copies if any({c, c[len("copy-of-"):]} == {a, b} for a, b, *_ in flagged)]
        print(f"similarity: {len(flagged)} pairs flagged; disguised copies flagged against their original: "
              f"{len(caught)}/{len(copies)}; pairs of different authors flagged: {len(independent)}")
        shown = [f for f in flagged if f in independent or f[0] in copies or f[1] in copies]
        for a, b, share, chars in shown[:12]:
            print(f"  flagged {a} / {b}: share {share:.0%}, {chars} matched characters")
        print(f"  ({len(data['groups'])} groups of flagged submissions; the copies with a note are flagged against "
              "their original, as they should be)")
        result["similarity"] = {"flagged": flagged, "copies_caught": caught, "copies": copies,
                                "independent_flagged": independent, "given": data.get("similarity_given")}
    if args.kill and last:
        jobs, cmd, whole_csv, seconds = last
        cut_csv = tmp / "cut.csv"
        cut_cmd = [str(cut_csv) if c == str(whole_csv) else c for c in cmd]
        if "--report" in cut_cmd:  # the report is not what this measures
            k = cut_cmd.index("--report")
            del cut_cmd[k:k + 4]
        at = rng.uniform(0.2, 0.8) * seconds
        killed = run_batch(cut_cmd, kill_after=at)
        store = tmp / "cut-reports"
        done = len(list(store.glob("*.json")))
        rerun = run_batch(cut_cmd)
        log = (store / "batch.log").read_text().splitlines()
        graded = [line.split("submission=")[1].split()[0] for line in log if " graded " in line]
        twice = sorted({g for g in graded if graded.count(g) > 1})
        cut_rows, whole_rows = rows(cut_csv), rows(whole_csv)
        same = cut_rows == whole_rows
        differ = [f"{a['submission']} ({', '.join(k for k in a if a[k] != b.get(k))})"
                  for a, b in zip(cut_rows, whole_rows) if a != b]
        print(f"kill -9 after {at:.0f} s ({done} reports written), rerun: {rerun['seconds']:.0f} s, exit "
              f"{rerun['exit']}; CSV equal to the uninterrupted run's (seconds aside): {same}"
              + (f" (rows differing: {differ})" if differ else "")
              + f"; submissions graded: {len(graded)} of {n}, graded twice: {twice or 'none'}")
        result["kill"] = {"after_s": at, "killed_run_exit": killed["exit"], "reports_before_rerun": done, "rerun_s": rerun["seconds"],
                          "rerun_exit": rerun["exit"], "csv_equal": same, "rows_differing": differ,
                          "graded": len(graded), "graded_twice": twice}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
