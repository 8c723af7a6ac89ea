"""Score ``castwise explain`` on the report corpus, and time the CLI.

usage: python benchmarks/bench_explain.py [--split train|test|all] [--misses] [--json PATH]
       python benchmarks/bench_explain.py --cv K [--misses]

For each split: top-1 and top-3 accuracy, the precision of answers given with confidence >= 0.8,
how many answers were marked unsure, and a reliability table (per confidence bin: answers,
accuracy, mean confidence). ``--cv K`` scores K-fold cross-validation on the train split instead
(re-fitting per fold, temperature and confidence map cross-fitted): the numbers to work from,
since the test split is looked at only once, at the end. Then the latency of ``castwise explain``
as a user runs it (a fresh process reading a report on stdin), with a check that torch was not imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "explain" / "reports.jsonl"
sys.path.insert(0, str(ROOT / "src"))

from castwise.diagnosis.explain import explain  # noqa: E402

BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.8), (0.8, 0.9), (0.9, 1.01))
HIGH = 0.8


def score(rows: list[dict[str, Any]], misses: bool = False) -> dict[str, Any]:
    """The scores of a split; ``hits`` holds each report's (top-1, top-3) for scoring its parts."""
    n = len(rows)
    top1 = top3 = high = high_right = unsure = 0
    per_bin = {b: [0, 0, 0.0] for b in BINS}
    hits: list[tuple[bool, bool]] = []
    for r in rows:
        e = explain(r["text"])
        cands = [c.category for c in e.candidates]
        hit1 = e.category == r["category"]
        hits.append((hit1, r["category"] in cands[:3]))
        top1 += hit1
        top3 += hits[-1][1]
        unsure += e.unsure
        if e.confidence >= HIGH:
            high += 1
            high_right += hit1
        for lo, hi in BINS:
            if lo <= e.confidence < hi:
                per_bin[(lo, hi)][0] += 1
                per_bin[(lo, hi)][1] += hit1
                per_bin[(lo, hi)][2] += e.confidence
        if misses and not hit1:
            print(f"  miss {r['id']}: want {r['category']} got {e.category} {e.confidence:.2f} {cands[:3]}")
    return {
        "n": n,
        "top1": top1,
        "top3": top3,
        "high": high,
        "high_right": high_right,
        "unsure": unsure,
        "hits": hits,
        "bins": [
            {
                "bin": f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}",
                "n": v[0],
                "right": v[1],
                "mean_confidence": round(v[2] / v[0], 3) if v[0] else None,
            }
            for (lo, hi), v in per_bin.items()
        ],
    }


def latency(sample: str, runs: int = 7) -> dict[str, Any]:
    """Wall time of `python -m castwise explain -` on one report, and whether torch was imported."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    probe = (
        "import runpy, sys; sys.argv=['castwise','explain','-']\n"
        "try:\n    runpy.run_module('castwise', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_FREE', file=sys.stderr)"
    )
    times = []
    torch_free = True
    for _ in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", probe], input=sample, capture_output=True, text=True, env=env, check=False
        )
        times.append(time.perf_counter() - t0)
        torch_free = torch_free and "TORCH_FREE" in out.stderr
    return {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3), "torch_free": torch_free}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("train", "test", "all"), default="all")
    ap.add_argument("--misses", action="store_true", help="list the reports whose first answer is wrong")
    ap.add_argument("--json", help="write the numbers to this file")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--cv", type=int, metavar="K", help="K-fold cross-validation on the train split only")
    args = ap.parse_args()
    if args.cv:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from fit_explain import cross_validate

        cv = cross_validate(args.cv, args.misses)
        if args.json:
            Path(args.json).write_text(json.dumps({"cv": cv}, indent=1) + "\n", encoding="utf-8")
        return 0
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    result: dict[str, Any] = {}
    for split in ("train", "test"):
        if args.split not in (split, "all"):
            continue
        part = [r for r in rows if r["split"] == split]
        print(f"{split}: {len(part)} reports")
        s = score(part, args.misses)
        result[split] = s
        n = s["n"]
        prec = f"{s['high_right']}/{s['high']} ({100 * s['high_right'] / s['high']:.0f}%)" if s["high"] else "n/a"
        print(
            f"  top-1 {s['top1']}/{n} ({100 * s['top1'] / n:.1f}%)  top-3 {s['top3']}/{n} "
            f"({100 * s['top3'] / n:.1f}%)  confidence>=0.8: {prec} right  unsure: {s['unsure']}"
        )
        hits = s.pop("hits")
        for added in sorted({str(r.get("added", "")) for r in part}):
            group = [h for r, h in zip(part, hits, strict=True) if str(r.get("added", "")) == added]
            if len(group) < len(part):  # the reports added in each round, scored apart
                g1, g3 = sum(h[0] for h in group), sum(h[1] for h in group)
                print(
                    f"  added {added or 'before 2026-11-23'}: {len(group)} reports, top-1 {g1}/{len(group)} "
                    f"({100 * g1 / len(group):.1f}%), top-3 {g3}/{len(group)} ({100 * g3 / len(group):.1f}%)"
                )
        print("  reliability:  bin          n  right  accuracy  mean conf")
        for b in s["bins"]:
            if b["n"]:
                print(
                    f"                {b['bin']:<11} {b['n']:>3}  {b['right']:>5}  {b['right'] / b['n']:>8.2f}"
                    f"  {b['mean_confidence']:>9.2f}"
                )
    if not args.no_latency:
        # a report with a traceback: the CLI reads frames, signals and words, the slow path
        sample = next((r["text"] for r in rows if 'File "' in r["text"] and r["kind"] == "exception"), rows[0]["text"])
        lat = latency(sample)
        result["latency"] = lat
        print(
            f"castwise explain (fresh process): median {lat['median_s']} s, max {lat['max_s']} s, "
            f"torch {'not imported' if lat['torch_free'] else 'IMPORTED'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
