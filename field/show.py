import json
import sys

for l in sys.stdin:
    try:
        r = json.loads(l)
    except Exception:
        print(l.rstrip())
        continue
    c = r.get("compiled", {})
    print(
        r["model"],
        r["recipe"],
        r.get("compile"),
        r["device"],
        r.get("truth", ""),
        "ok" if r.get("ok") else r.get("error", ""),
        r.get("seconds"),
        r.get("crash", ""),
        r.get("errors", ""),
        r.get("warnings", ""),
        {m: (s["ops_checked"], s["backward_graphs"], s["error"], s["breaks"]) for m, s in c.items()},
        r.get("orig_mod", ""),
    )
