"""The zoo: every model x the common hand-cast and autocast situations, the fake audit against
the real CPU run of the same model under the same policy.

The scoring rule is the fault-injection benchmark's (benchmarks/zoo/scoring.py): a real failure
is a dtype error in the real CPU run (train: forward + backward; eval: no_grad), detected is an
error finding (not CW901/CW902) in a mode where it failed, a false alarm is one where it passed;
a suggested policy is verified by the real run of a fresh build under it. "agree": no crash, no
missed failure, no false alarm. Also: audits that could not check the whole model (incomplete;
never ok), crashes and time.

    python benchmarks/bench_audit_zoo.py [--heldout | --all] [--situations bf16-mixed,16-true]
        [--models llama,gpt2] [--limit N] [--jobs J] [--by situation|library|model] [--out zoo.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.zoo import models  # noqa: E402
from benchmarks.zoo.cases import Case, evaluate, quiet  # noqa: E402
from benchmarks.zoo.situations import SITUATIONS  # noqa: E402
from benchmarks.zoo.summary import print_summary  # noqa: E402


def _one(job: tuple[Case, int]) -> dict[str, Any]:
    case, timeout = job
    quiet()
    try:
        return evaluate(case, timeout=timeout)
    except Exception as exc:  # a harness failure is reported, never hidden in a score
        return {
            "case": None,
            "harness_error": f"{case}: {type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(limit=4)[-1200:],
        }


def cases(heldout: bool | None, situations: list[str], names: list[str] | None) -> list[Case]:
    zoo = [m.name for m in models.models(heldout=heldout) if names is None or m.name in names]
    return [Case(name, situation, None, 0) for name in zoo for situation in situations]


def run(work: list[Case], jobs: int, timeout: int) -> list[dict[str, Any]]:
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    pool = multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=40) if jobs > 1 else None
    iterator: Any = pool.imap(_one, [(c, timeout) for c in work]) if pool else map(_one, [(c, timeout) for c in work])
    try:
        for n, record in enumerate(iterator, 1):
            results.append(record)
            if n % 25 == 0:
                print(f"  {n}/{len(work)} audits, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--heldout", action="store_true", help="only the held-out models")
    which.add_argument("--all", action="store_true", help="tuning and held-out models")
    parser.add_argument(
        "--situations", default=",".join(SITUATIONS), help=f"comma-separated, from: {', '.join(sorted(SITUATIONS))}"
    )
    parser.add_argument("--models", help="comma-separated model names (default: the whole zoo)")
    parser.add_argument("--limit", type=int, help="at most this many audits")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per audit before it counts as a crash")
    parser.add_argument("--by", default="situation", choices=["situation", "library", "model"])
    parser.add_argument("--out", type=Path, help="write the per-audit results as JSON here")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        nargs="+",
        help="summarise saved --out files (a split run) instead of running",
    )
    opts = parser.parse_args(argv)

    if opts.source is not None:
        print_summary([r for path in opts.source for r in json.loads(path.read_text())["results"]], group_by=opts.by)
        return 0
    situations = opts.situations.split(",")
    unknown = sorted(set(situations) - set(SITUATIONS))
    if unknown:
        parser.error(f"unknown situation(s) {', '.join(unknown)}; valid: {', '.join(sorted(SITUATIONS))}")
    heldout = None if opts.all else bool(opts.heldout)
    work = cases(heldout, situations, opts.models.split(",") if opts.models else None)[: opts.limit]
    start = time.perf_counter()
    results = run(work, opts.jobs, opts.timeout)
    n_models = len({c.model for c in work})
    print(
        f"zoo: {len(results)} audits ({n_models} models x {len(situations)} situations), "
        f"{time.perf_counter() - start:.0f} s with {opts.jobs} job(s)"
    )
    summary = print_summary(results, group_by=opts.by)
    if opts.out is not None:
        opts.out.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
        print(f"per-audit results: {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
