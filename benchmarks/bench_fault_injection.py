"""Fault injection: seeded dtype faults planted at random depth in the zoo's real models, each
audited on fake tensors and scored against its own real CPU run.

Scoring rule (benchmarks/zoo/scoring.py has the details):
- a real failure = the real CPU run under the same policy (``castwise.apply``; the hand-cast model
  as it is when there is none) raises a dtype error: train mode (forward + backward) or eval mode
  (``eval()`` under no_grad);
- detected = the audit reports an error finding (not the CW901/CW902 "could not check" warnings)
  in a mode where the real run failed; a false alarm = an error finding in a mode where it passed;
- origin right = the first detecting finding's ``origin.module`` (or one of its ``culprit_modules``)
  equals or lies inside the planted module (for a shared Parameter: the module the user changed);
- empty slot = an interpolation left empty in a message, fix or origin (``receives , which``);
- verified fix = under the suggested policy, applied with ``castwise.apply`` to a fresh build,
  the REAL CPU run passes in both modes; or, where no policy can express it, a code fix castwise
  verified by a re-audit (a hook's result cast back) applied to a fresh build by the harness's
  own code (scoring.hooks_cast_back) and the REAL run passes in both modes; its low-precision
  share = the fraction of matmul/conv/attention FLOPs (torch's flop formulas) that ran in the
  dtype the user asked for;
- incomplete = the audit could not check the whole model; an incomplete audit is never ``ok``.
Nothing is special-cased per model or fault: the same rule scores every case.

    python benchmarks/bench_fault_injection.py [--limit N] [--jobs J] [--heldout] [--out results.json]
        [--classes index_put_mismatch,qkv_mismatch] [--compiled [--real-compiled]]

``--classes`` keeps, of the fault indices ``--start`` .. ``--start + --limit``, those of the named
classes: the same cases (model, situation, seed) an unfiltered run scores for them.
``--compiled`` audits ``torch.compile(model)`` instead: the same cases and the same scoring (the
real runs stay eager), plus how many audits compiled a graph and how many named `_orig_mod`.
``--real-compiled`` takes the truth from the compiled program instead: the policy applied, then
``torch.compile`` (Inductor, this CPU) run in each mode, what a user of the compiled model meets.
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

from benchmarks.zoo.cases import Case, evaluate, fault_case, fault_class, quiet  # noqa: E402
from benchmarks.zoo.faults import FAULTS  # noqa: E402
from benchmarks.zoo.summary import print_summary  # noqa: E402


def _one(job: tuple[int, bool, int, bool, bool]) -> dict[str, Any]:
    index, heldout, timeout, compiled, real_compiled = job
    quiet()
    try:
        case = fault_case(index, heldout)
        if case is None:
            return {"index": index, "skipped": "no model has a place for this fault"}
        record = evaluate(case, timeout=timeout, compiled=compiled, real_compiled=real_compiled)
    except Exception as exc:  # a harness failure is reported, never hidden in a score
        return {
            "index": index,
            "harness_error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(limit=4)[-1200:],
        }
    record["index"] = index
    return record


def run(
    indices: list[int],
    heldout: bool,
    jobs: int,
    timeout: int,
    progress: bool = True,
    compiled: bool = False,
    real_compiled: bool = False,
) -> list[dict[str, Any]]:
    work = [(i, heldout, timeout, compiled, real_compiled) for i in indices]
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    if jobs <= 1:
        iterator: Any = map(_one, work)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=40)
        iterator = pool.imap_unordered(_one, work, chunksize=1)
    try:
        for n, record in enumerate(iterator, 1):
            results.append(record)
            if progress and n % 25 == 0:
                print(f"  {n}/{len(work)} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return sorted(results, key=lambda r: int(r["index"]))


def compiled_summary(results: list[dict[str, Any]]) -> dict[str, int]:
    """Of the compiled audits that ran: how many compiled >= 1 graph, how many named `_orig_mod`."""
    audits = [r["audit"] for r in results if r.get("audit", {}).get("status") == "done"]
    out = {
        "audits": len(audits),
        "compiled_a_graph": sum(1 for a in audits if (a.get("compiled_graphs") or 0) >= 1),
        "orig_mod_named": sum(1 for a in audits if a.get("orig_mod_named")),
    }
    print(
        f"compiled audits: {out['audits']}; Dynamo compiled >= 1 graph in {out['compiled_a_graph']}; "
        f"`_orig_mod` in a name in {out['orig_mod_named']}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--limit", type=int, default=1000, help="number of faults (default 1000)")
    parser.add_argument("--start", type=int, default=0, help="first fault index (to split a run)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--heldout", action="store_true", help="score the held-out models and seeds")
    parser.add_argument(
        "--classes",
        help=f"comma-separated fault classes to keep (of the indices in range), from: {', '.join(sorted(FAULTS))}",
    )
    parser.add_argument(
        "--compiled", action="store_true", help="audit torch.compile(model) (Dynamo runs during each audit)"
    )
    parser.add_argument(
        "--real-compiled",
        action="store_true",
        help="with --compiled: the truth is the compiled program run for real (Inductor), not the eager one",
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per audit before it counts as a crash")
    parser.add_argument("--out", type=Path, help="write the per-fault results as JSON here")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        nargs="+",
        help="summarise saved --out files (a split run) instead of running",
    )
    parser.add_argument("--examples", type=int, default=3, help="examples printed per failure pattern")
    opts = parser.parse_args(argv)

    if opts.source is not None:
        print_summary(
            [r for path in opts.source for r in json.loads(path.read_text())["results"]],
            group_by="fault",
            examples=opts.examples,
        )
        return 0
    indices = list(range(opts.start, opts.start + opts.limit))
    if opts.classes:
        wanted = {c.strip() for c in opts.classes.split(",") if c.strip()}
        unknown = sorted(wanted - set(FAULTS))
        if unknown:
            parser.error(f"unknown fault class(es) {', '.join(unknown)}; valid: {', '.join(sorted(FAULTS))}")
        indices = [i for i in indices if fault_class(i) in wanted]
    start = time.perf_counter()
    if opts.real_compiled and not opts.compiled:
        parser.error("--real-compiled scores compiled audits: add --compiled")
    results = run(
        indices, opts.heldout, opts.jobs, opts.timeout, compiled=opts.compiled, real_compiled=opts.real_compiled
    )
    elapsed = time.perf_counter() - start
    print(
        f"fault injection: {len(results)} faults ({'held-out' if opts.heldout else 'tuning'} models and seeds), "
        f"{elapsed:.0f} s with {opts.jobs} job(s)"
    )
    summary = print_summary(results, group_by="fault", examples=opts.examples)
    if opts.compiled:
        summary["compiled"] = compiled_summary(results)
    if opts.out is not None:
        opts.out.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
        print(f"per-fault results: {opts.out}")
    return 0


__all__ = ["Case", "main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
