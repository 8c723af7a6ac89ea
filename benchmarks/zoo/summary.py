"""Tables and failure patterns from per-case records (evaluate()'s dicts), for both benchmarks."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from benchmarks.zoo.scoring import still_empty

Record = dict[str, Any]


def _slots(record: Record) -> list[str]:
    return [x for x in record["score"]["empty_slots"] if still_empty(x)]


def _ratio(a: int, b: int) -> str:
    return f"{a}/{b} ({a / b:.1%})" if b else f"{a}/0 (-)"


def metrics(records: list[Record]) -> dict[str, Any]:
    """The acceptance numbers over ``records`` (scored cases only)."""
    scored = [r for r in records if "score" in r]
    s = [r["score"] for r in scored]
    failed = [r for r in scored if r["score"]["real_failed"]]
    detected = [r for r in failed if r["score"]["detected"]]
    some_pass = [r for r in scored if "ok" in r["score"]["real"].values()]
    fixes = [r for r in detected if r["fix"] is not None]
    verified = [r for r in fixes if r["fix"]["verified"]]
    shares = [r["fix"]["low_share"] for r in verified if r["fix"]["low_share"] is not None]
    return {
        "cases": len(scored),
        "agree": sum(1 for x in s if not x["crash"] and not x["missed"] and not x["false_alarm_modes"]),
        "harness_errors": sum(1 for r in records if "harness_error" in r),
        "skipped": sum(1 for r in records if "skipped" in r),
        "real_failures": len(failed),
        "detected": len(detected),
        "false_alarm_cases": sum(1 for r in some_pass if r["score"]["false_alarm_modes"]),
        "cases_with_a_passing_mode": len(some_pass),
        "crashes": sum(1 for x in s if x["crash"]),
        "origin_right": sum(1 for r in detected if r["score"]["origin_right"]),
        "origin_checked": sum(1 for r in detected if r["score"]["origin_right"] is not None),
        "empty_slot_cases": sum(1 for r in scored if _slots(r)),
        "fix_verified": len(verified),
        "low_share_measured": len(shares),
        "low_share_ge_half": sum(1 for v in shares if v >= 0.5),
        "low_share_mean": (sum(shares) / len(shares)) if shares else None,
        "incomplete": sum(1 for x in s if x["incomplete"]),
        "incomplete_ok": sum(1 for x in s if x["incomplete_ok"]),
        "audit_seconds_mean": (sum(r["audit"]["seconds"] for r in scored) / len(scored)) if scored else None,
    }


def _row(name: str, m: dict[str, Any]) -> str:
    def pct(a: int, b: int) -> str:
        return f"{a / b:6.1%}" if b else "     -"

    return (
        f"{name:<26} {m['cases']:>5} {pct(m['agree'], m['cases'])} {m['real_failures']:>5} "
        f"{pct(m['detected'], m['real_failures'])} "
        f"{m['false_alarm_cases']:>5} {pct(m['origin_right'], m['origin_checked'])} "
        f"{pct(m['fix_verified'], m['detected'])} "
        f"{pct(m['low_share_ge_half'], m['low_share_measured'])} {m['crashes']:>5} {m['incomplete']:>5} "
        f"{m['incomplete_ok']:>5} {m['empty_slot_cases']:>5}"
    )


HEADER = (
    f"{'':<26} {'cases':>5} {'agree':>6} {'fail':>5} {'detect':>6} {'false':>5} {'origin':>6} {'fix':>6} "
    f"{'lp>=50':>6} {'crash':>5} {'incpl':>5} {'inc-ok':>5} {'empty':>5}"
)


def _group_key(record: Record, group_by: str) -> str:
    case = record["case"]
    if group_by == "library":
        from benchmarks.zoo.models import REGISTRY

        return REGISTRY[case["model"]].library
    return str(case[group_by])


def _norm(text: str) -> str:
    text = re.sub(r"`[^`]*`", "`X`", text)
    text = re.sub(r"'[^']*'", "'X'", text)
    return re.sub(r"\d+", "N", text)[:110]


def _said(record: Record) -> str:
    audit = record["audit"]
    if audit["status"] != "done":
        return f"{audit['status']}: {audit['message'][:200]}"
    errors = [f for f in audit["findings"] if f["level"] == "error"] or audit["findings"]
    if not errors:
        return "ok, no findings"
    f = errors[0]
    return f"{f['code']} at {f['module']!r} origin {f['origin']!r} modes {f['modes']}: {f['message'][:220]}"


def _real_said(record: Record) -> str:
    return "; ".join(f"{m}: {r['status']} {r['message'][:160]}".rstrip() for m, r in record["real"].items())


def patterns(records: list[Record]) -> dict[str, dict[str, list[Record]]]:
    """Failures grouped by kind, then by a pattern key (fault class + normalised text)."""
    out: dict[str, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "harness_error" in r:
            out["harness error"][_norm(r["harness_error"])].append(r)
            continue
        if "score" not in r:
            continue
        s, fault = r["score"], r["case"]["fault"] or r["case"]["situation"]
        first_real = next((x["message"] for x in r["real"].values() if x["status"] == "dtype_error"), "")
        codes = ",".join(sorted({f["code"] for f in r["audit"]["findings"] if f["level"] == "error"})) or "no error"
        if s["crash"]:
            out["audit crash/timeout"][_norm(r["audit"]["message"])].append(r)
        elif s["missed"]:
            tag = "incomplete" if s["incomplete"] else codes
            out["missed real failure"][f"{fault} [{tag}] {_norm(first_real)}"].append(r)
        if s["false_alarm_modes"]:
            out["false alarm"][f"{fault} [{codes}]"].append(r)
        if s["origin_right"] is False:
            out["origin wrong"][f"{fault} [{codes}]"].append(r)
        if s["incomplete_ok"]:
            out["incomplete but ok"][fault].append(r)
        if _slots(r):
            out["empty slot"][_norm(_slots(r)[0])].append(r)
        fix = r.get("fix")
        if s["detected"] and fix is not None and not fix["verified"]:
            out["fix not verified"][f"{fault} [{codes}] {_norm(fix['why'])[:80]}"].append(r)
    return out


def print_patterns(records: list[Record], examples: int = 3, top: int = 6) -> None:
    for kind, groups in patterns(records).items():
        total = sum(len(v) for v in groups.values())
        print(f"\n## {kind}: {total} case(s)")
        for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]:
            print(f"- {len(items)} x {key}")
            for r in items[:examples]:
                if not r.get("case"):
                    print(f"    {r.get('trace', '')[-300:]}")
                    continue
                c, p = r["case"], r.get("planted") or {}
                print(f"    {c['model']} / {c['situation']} / {p.get('description', c['fault'])} (seed {c['seed']})")
                print(f"      audit: {_said(r)}")
                print(f"      real:  {_real_said(r)}")
                fix = r.get("fix")
                if fix and not fix["verified"]:
                    print(f"      fix:   {fix['policy']!r} -> {fix['why'][:200]}")


def print_summary(records: list[Record], group_by: str = "fault", examples: int = 3) -> dict[str, Any]:
    """Print the per-group table, the totals and the failure patterns; return the numbers."""
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r.get("case"):
            groups[_group_key(r, group_by)].append(r)
    print(HEADER)
    per_group = {}
    for name in sorted(groups):
        per_group[name] = metrics(groups[name])
        print(_row(name, per_group[name]))
    total = metrics(records)
    print(_row("all", total))
    print()
    print(f"audit agrees with real run:    {_ratio(total['agree'], total['cases'])}")
    print(f"real failures detected:        {_ratio(total['detected'], total['real_failures'])}")
    print(f"false alarms (cases):          {_ratio(total['false_alarm_cases'], total['cases_with_a_passing_mode'])}")
    print(f"audit crashes/timeouts:        {_ratio(total['crashes'], total['cases'])}")
    print(f"origin right (of detected):    {_ratio(total['origin_right'], total['origin_checked'])}")
    print(f"cases with an empty slot:      {_ratio(total['empty_slot_cases'], total['cases'])}")
    print(f"verified fix (of detected):    {_ratio(total['fix_verified'], total['detected'])}")
    mean = total["low_share_mean"]
    print(
        f"fixes keeping >=50% low-prec:  {_ratio(total['low_share_ge_half'], total['low_share_measured'])}"
        f"  (mean share {mean:.1%})"
        if mean is not None
        else "fixes keeping >=50% low-prec:  -"
    )
    print(
        f"incomplete audits:             {_ratio(total['incomplete'], total['cases'])}; "
        f"incomplete but ok: {total['incomplete_ok']}"
    )
    print(
        f"harness errors: {total['harness_errors']}; skipped: {total['skipped']}; "
        f"mean audit time {total['audit_seconds_mean'] or 0:.2f} s"
    )
    codes = Counter(f["code"] for r in records if "audit" in r for f in r["audit"]["findings"])
    print("finding codes seen:", ", ".join(f"{c} x{n}" for c, n in codes.most_common()))
    print_patterns(records, examples)
    return {"total": total, "groups": per_group}
