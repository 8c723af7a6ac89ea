"""The study's rows (/tmp/field_rows.jsonl) as the markdown table of benchmarks/field_compiled.md."""

import json
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/field_rows.jsonl")]
truth: dict[tuple[str, str], list[str]] = defaultdict(list)
for r in rows:
    if "truth" in r:
        res = "ok" if r["ok"] else r["error"][:60]
        truth[(r["model"], r["recipe"])].append(f"{r['truth']}: {res}")
print(
    "| model | recipe | compile | device | verdict | compiled train: ops / bw graphs / breaks | compiled eval: ops / breaks | compiled error | `_orig_mod` | s | real CPU run |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "truth" in r:
        continue
    opts = ",".join(f"{k}={v}" for k, v in r["compile"].items()) or "default"
    t = "; ".join(truth.get((r["model"], r["recipe"]), [])) if r["device"] == "cpu" else "n/a (no GPU)"
    if "crash" in r:
        print(
            f"| {r['model']} | {r['recipe']} | {opts} | {r['device']} | CRASH {r['crash'][:80]} | | | | | {r['seconds']} | {t} |"
        )
        continue
    verdict = "errors: " + "; ".join(e[:60] for e in r["errors"]) if r["errors"] else "ok"
    c = r["compiled"]
    tr, ev = c.get("train", {}), c.get("eval", {})
    err = "; ".join(f"{m}: {s['error'][:70]}" for m, s in c.items() if s.get("error")) or "-"
    fw = " (fw under no_grad)" if tr.get("backward_untraced") else ""
    print(
        f"| {r['model']} | {r['recipe']} | {opts} | {r['device']} | {verdict} | {tr.get('ops_checked')} / "
        f"{tr.get('backward_graphs')} / {tr.get('breaks')}{fw} | {ev.get('ops_checked')} / {ev.get('breaks')} | {err} | "
        f"{'yes' if r['orig_mod'] else 'no'} | {r['seconds']} | {t} |"
    )
