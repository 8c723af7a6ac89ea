"""The recipe benchmark's tables: outcomes per recipe and device, planted-fault detection, and
each failing case class (recipe, device, outcome, codes) with its cases."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

OUTCOMES = ("ok", "false_error", "missed", "crash", "incomplete", "unscored")
Record = dict[str, Any]


def _halves(records: list[Record]) -> list[tuple[Record, str, Record]]:
    return [(r, d, h) for r in records if "halves" in r for d, h in r["halves"].items()]


def totals(records: list[Record]) -> dict[str, Any]:
    """The acceptance numbers: outcome counts per device, planted-fault detection and origin."""
    clean = [r for r in records if "halves" in r and r["case"]["fault"] is None]
    planted = [r for r in records if "halves" in r and r["case"]["fault"] is not None]
    by_device: dict[str, Counter[str]] = defaultdict(Counter)
    for _, device, half in _halves(clean):
        by_device[device][half["outcome"]] += 1
    # a plant into a recipe whose clean run already fails for real (diffusers' UNet under
    # Lightning's *-true) is not scored: the first error there is the recipe's own, not the plant's
    broken = {(r["case"]["model"], r["case"]["recipe"]) for r in clean if _real_failed(r)}
    on_broken = [r for r in planted if (r["case"]["model"], r["case"]["recipe"]) in broken]
    failed = [r for r in planted if r["halves"]["cpu"]["score"]["real_failed"] and r not in on_broken]
    detected = [r for r in failed if r["halves"]["cpu"]["score"]["detected"]]
    origin = [r for r in detected if r["halves"]["cpu"]["score"]["origin_right"]]
    planted_outcomes = Counter(r["halves"]["cpu"]["outcome"] for r in planted)
    same = [r["fit_same"] for r in records if "fit_same" in r]
    return {
        "cases": len(clean),
        "by_device": {d: dict(c) for d, c in by_device.items()},
        "harness_errors": sum(1 for r in records if "harness_error" in r),
        "not_applicable": sum(1 for r in records if "not_applicable" in r),
        "planted": len(planted),
        "planted_real_failures": len(failed),
        "planted_on_failing_recipes": len(on_broken),
        "planted_detected": len(detected),
        "planted_origin_right": len(origin),
        "planted_outcomes": dict(planted_outcomes),
        "lightning_fit_same": f"{sum(same)}/{len(same)}",
    }


def _real_failed(record: Record) -> bool:
    return any(r["status"] == "dtype_error" for r in record["real"].values())


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({a / b:.0%})" if b else "-"


def print_tables(records: list[Record]) -> dict[str, Any]:
    clean = [r for r in records if "halves" in r and r["case"]["fault"] is None]
    rows: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for r, device, half in _halves(clean):
        rows[(r["case"]["recipe"], device)][half["outcome"]] += 1
    print(f"\n{'recipe':<24} {'device':<6} {'cases':>5} " + " ".join(f"{o:>11}" for o in OUTCOMES))
    for (recipe, device), c in sorted(rows.items()):
        n = sum(c.values())
        print(f"{recipe:<24} {device:<6} {n:>5} " + " ".join(f"{c[o]:>11}" for o in OUTCOMES))
    t = totals(records)
    for device, c in sorted(t["by_device"].items()):
        n = sum(c.values())
        print(f"{'TOTAL':<24} {device:<6} {n:>5} " + " ".join(f"{c.get(o, 0):>11}" for o in OUTCOMES))
    if any(r.get("truth") == "cuda" for r in records):
        print("(cuda = simulated CUDA audit scored against the recipe run for real on the CUDA device)")
    else:
        print("(cuda = simulated CUDA audit scored against the real CPU run: false errors, crashes, incomplete only)")
    print(
        f"\nplanted faults (cpu): {t['planted']} cases ({t['planted_on_failing_recipes']} not scored: the recipe "
        f"fails without them), {t['planted_real_failures']} fail for real; "
        f"detected {_pct(t['planted_detected'], t['planted_real_failures'])}, "
        f"origin right {_pct(t['planted_origin_right'], t['planted_detected'])}; outcomes {t['planted_outcomes']}"
    )
    print(f"trainer fits (Lightning, HF) with the callback end with the same weights: {t['lightning_fit_same']}")
    print(f"harness errors {t['harness_errors']}, not applicable {t['not_applicable']}")
    print_failing_classes(records)
    return t


def failing_classes(records: list[Record]) -> dict[str, list[str]]:
    """Each failing case class (recipe / device / outcome / error codes) and its cases."""
    classes: dict[str, list[str]] = defaultdict(list)
    for r, device, half in _halves(records):
        if half["outcome"] in ("ok", "unscored"):
            continue
        codes = sorted({f["code"] for f in half["audit"]["findings"] if f["level"] == "error"})
        what = ",".join(codes) or half["audit"]["message"][:80]
        planted = " (planted)" if r["case"]["fault"] else ""
        key = f"{r['case']['recipe']} / {device} / {half['outcome']}{planted}: {what}"
        classes[key].append(r["case"]["model"] + (f"+{r['case']['fault']}" if r["case"]["fault"] else ""))
    return dict(sorted(classes.items()))


def print_failing_classes(records: list[Record]) -> None:
    classes = failing_classes(records)
    if classes:
        print("\nfailing case classes:")
    for key, cases in classes.items():
        print(f"  {key}  [{len(cases)}] {', '.join(cases[:8])}{' ...' if len(cases) > 8 else ''}")
    errors = [r for r in records if "harness_error" in r]
    for r in errors[:10]:
        print(f"  harness error: {r['harness_error'][:200]}")
