"""Silent precision loss: planted cases modelled on real threads (LMs, ViTs, DiTs, MoE, hand-written
kernels) and look-alike controls that are fine, each with its truth measured for real on this CPU
and the audit scored against it.

Truth (benchmarks/silent/truth.py): the model run in f32 against the recipe as it really runs
(real bf16), and the same gap for the case's counterpart (a planted case's fix, a control's
bug twin). A planted case is confirmed silent loss when its gap is >= 4x its fix's; a control
measures small when its gap is <= 1/4 of its bug twin's.

Audit (benchmarks/silent/scoring.py): ``castwise.audit(model, inputs, policy=..., device=...)``
on fake tensors for each device (cpu, and cuda simulated); a planted case is found when a
CW140-CW149 finding names its op in its module (and, for origin, where the 16-bit came from);
a control is clean with no CW14x finding.

    python benchmarks/bench_silent.py [--cases a,b] [--kind planted|control] [--family lm,moe]
        [--devices cpu,cuda] [--no-truth] [--no-audit] [--fix] [--jobs J] [--out silent.json]

Fix (benchmarks/silent/fixcheck.py, ``--fix``): each device's audit's CW14x findings with their fixes
verified for real (``castwise.numerics.silent.verify_fixes``: the policy plus the finding's
clause against f32 on the case's inputs); a planted case's fix is verified when the finding at
its op says so; a control has nothing to verify.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.silent.cases import CASES, Case  # noqa: E402
from benchmarks.silent.fixcheck import fix_line, fix_summary, score_fix  # noqa: E402
from benchmarks.silent.scoring import score_audit  # noqa: E402
from benchmarks.silent.truth import RATIO, measure  # noqa: E402

DEVICES = ("cpu", "cuda")


def truth_of(case: Case) -> dict[str, Any]:
    gap = measure(case.build, case.metric, case.recipe, case.other)
    if case.kind == "planted":
        return {**gap.to_dict(), "confirmed": gap.ratio() >= RATIO}
    return {**gap.to_dict(), "small": gap.ratio() <= 1 / RATIO}


def evaluate(case: Case, devices: tuple[str, ...], truth: bool, audit: bool) -> dict[str, Any]:
    record: dict[str, Any] = {
        "case": case.name,
        "kind": case.kind,
        "family": case.family,
        "thread": case.thread,
        "policy": case.policy,
        "expect": None if case.expect is None else vars(case.expect),
    }
    if truth:
        record["truth"] = truth_of(case)
    if audit:
        record["audits"] = [score_audit(case, d).to_dict() for d in devices]
    return record


def _one(job: tuple[str, tuple[str, ...], bool, bool, bool]) -> dict[str, Any]:
    name, devices, truth, audit, fix = job
    warnings.filterwarnings("ignore")
    try:
        record = evaluate(CASES[name], devices, truth, audit)
        if fix and CASES[name].kind == "planted":
            record["fix"] = {d: score_fix(CASES[name], d) for d in devices}
        return record
    except Exception as exc:  # a harness failure is reported, never hidden in a score
        return {"case": name, "harness_error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1200:]}


def run(
    names: list[str], devices: tuple[str, ...], truth: bool, audit: bool, jobs: int, fix: bool = False
) -> list[dict[str, Any]]:
    work = [(n, devices, truth, audit, fix) for n in names]
    if jobs <= 1:
        return [_report(_one(w)) for w in work]
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=8) as pool:
        return [_report(r) for r in pool.imap(_one, work)]


def _report(r: dict[str, Any]) -> dict[str, Any]:
    """Print one case's line as it finishes."""
    if "harness_error" in r:
        print(f"  {r['case']:40s} HARNESS ERROR {r['harness_error']}", flush=True)
        return r
    parts = [f"  {r['case']:40s} {r['kind']:7s} {r['family']:6s}"]
    t = r.get("truth")
    if t is not None:
        verdict = (
            ("confirmed" if t["confirmed"] else "NOT confirmed")
            if "confirmed" in t
            else ("small" if t["small"] else "NOT small")
        )
        parts.append(f"{t['metric']} {t['recipe']:.3g} vs {t['other']:.3g} (x{t['ratio']:.1f}) {verdict}")
    for a in r.get("audits", []):
        if a["status"] != "done":
            parts.append(f"{a['device']}: crash")
        elif r["kind"] == "planted":
            parts.append(
                f"{a['device']}: op {'Y' if a['found_op'] else '-'} origin {'Y' if a['found_origin'] else '-'}"
            )
        else:
            parts.append(f"{a['device']}: {'clean' if a['clean'] else 'FLAGGED'}")
    for device, fix in r.get("fix", {}).items():
        parts.append(f"{device}: {fix_line(fix)}")
    print(" | ".join(parts), flush=True)
    return r


def summarise(results: list[dict[str, Any]], devices: tuple[str, ...]) -> dict[str, Any]:
    ok = [r for r in results if "harness_error" not in r]
    planted = [r for r in ok if r["kind"] == "planted"]
    controls = [r for r in ok if r["kind"] == "control"]
    summary: dict[str, Any] = {
        "planted": len(planted),
        "controls": len(controls),
        "harness_errors": len(results) - len(ok),
    }
    if all("truth" in r for r in ok):
        summary["truth_confirmed"] = sum(r["truth"]["confirmed"] for r in planted)
        summary["controls_small"] = sum(r["truth"]["small"] for r in controls)
    for device in devices if all("audits" in r for r in ok) else ():

        def audit_of(r: dict[str, Any], d: str = device) -> dict[str, Any]:
            return next(a for a in r["audits"] if a["device"] == d)

        # a planted case whose op the device's autocast keeps 16-bit is a control there (silence is right)
        here = [r for r in planted if device in r["expect"]["devices"]]
        quiet = controls + [r for r in planted if device not in r["expect"]["devices"]]
        summary[device] = {
            "planted": len(here),
            "controls": len(quiet),
            "found_op": sum(audit_of(r)["found_op"] for r in here),
            "found_origin": sum(audit_of(r)["found_origin"] for r in here),
            "controls_clean": sum(audit_of(r)["status"] == "done" and audit_of(r)["clean"] for r in quiet),
            "crashes": sum(audit_of(r)["status"] != "done" for r in ok),
        }
    if any("fix" in r for r in planted):
        fixes = [r["fix"] for r in planted if "fix" in r]
        summary["fix"] = {d: fix_summary([f[d] for f in fixes]) for d in devices}
        summary["fix"]["any"] = fix_summary([max(f.values(), key=lambda x: x["verified"]) for f in fixes])
    return summary


def print_summary(s: dict[str, Any], devices: tuple[str, ...]) -> None:
    n, m = s["planted"], s["controls"]
    truth = (
        f"truth confirmed {s['truth_confirmed']}/{n} (controls measured small {s['controls_small']}/{m})"
        if "truth_confirmed" in s
        else "truth not measured"
    )
    for d in devices:
        if d in s:
            a = s[d]
            n, m = a["planted"], a["controls"]
            print(
                f"{d}: planted found {a['found_op']}/{n} at op, origin {a['found_origin']}/{n}, "
                f"controls clean {a['controls_clean']}/{m}, {truth}"
                + (f"; {a['crashes']} audit crash(es)" if a["crashes"] else "")
            )
    if not any(d in s for d in devices):
        print(f"audit not run; {truth}")
    for d, f in s.get("fix", {}).items():
        head = f"{d} audit's findings" if d != "any" else "either device's"
        print(
            f"fix verified ({head}; real CPU runs against f32, >= 4x lower error): {f['verified']}/{f['cases']} planted"
        )
    if s["harness_errors"]:
        print(f"{s['harness_errors']} harness error(s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", help=f"comma-separated case names (default: all {len(CASES)})")
    parser.add_argument("--kind", choices=["planted", "control"], help="only planted cases or only controls")
    parser.add_argument(
        "--family", help="comma-separated, from: " + ", ".join(sorted({c.family for c in CASES.values()}))
    )
    parser.add_argument("--devices", default=",".join(DEVICES), help=f"audit devices, from: {', '.join(DEVICES)}")
    parser.add_argument("--no-truth", action="store_true", help="skip the real f32 vs bf16 runs")
    parser.add_argument("--no-audit", action="store_true", help="only measure the truth")
    parser.add_argument("--fix", action="store_true", help="verify each planted case's fix for real (a column)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the per-case results (gaps, findings) as JSON here")
    opts = parser.parse_args(argv)

    names = opts.cases.split(",") if opts.cases else list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(sorted(CASES))}")
    devices = tuple(opts.devices.split(","))
    bad = sorted(set(devices) - set(DEVICES))
    if bad:
        parser.error(f"unknown device(s) {', '.join(bad)}; valid: {', '.join(DEVICES)}")
    families = set(opts.family.split(",")) if opts.family else None
    names = [
        n
        for n in names
        if (opts.kind is None or CASES[n].kind == opts.kind) and (families is None or CASES[n].family in families)
    ]
    start = time.perf_counter()
    results = run(names, devices, not opts.no_truth, not opts.no_audit, opts.jobs, opts.fix)
    print(f"silent: {len(results)} cases, {time.perf_counter() - start:.0f} s with {opts.jobs} job(s)")
    summary = summarise(results, devices)
    print_summary(summary, devices)
    if opts.out is not None:
        opts.out.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
        print(f"per-case results: {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
