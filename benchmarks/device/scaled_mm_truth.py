"""Real torch._scaled_mm outcomes on this machine's GPU, as JSON: the truth the float8 contract
(castwise/trace/contracts/float8.py) is checked against (tests/trace/truth/scaled_mm_h200.json).

    python benchmarks/device/scaled_mm_truth.py OUT.json     # on a CUDA machine
"""

from __future__ import annotations

import json
import sys

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CASES = [
    (16, 32, 16, "e4m3", "e4m3"),
    (7, 32, 16, "e4m3", "e4m3"),  # M (mat1's rows) odd
    (14, 32, 16, "e4m3", "e4m3"),
    (16, 24, 16, "e4m3", "e4m3"),  # K
    (16, 32, 8, "e4m3", "e4m3"),  # N
    (16, 32, 24, "e4m3", "e4m3"),
    (64, 14, 32, "e4m3", "e5m2"),  # the weight gradient's GEMM over 14 tokens (hybrid recipe)
    (64, 16, 32, "e4m3", "e5m2"),
    (16, 32, 16, "e5m2", "e5m2"),
    (16, 32, 16, "e4m3", "e5m2"),
    (16, 32, 16, "e5m2", "e4m3"),
]
DT = {"e4m3": E4M3, "e5m2": E5M2}


def run(m: int, k: int, n: int, da: str, db: str) -> dict[str, object]:
    a = torch.randn(m, k, device="cuda").to(DT[da])
    b = torch.randn(n, k, device="cuda").to(DT[db]).t()
    one = torch.tensor(1.0, device="cuda")
    try:
        out = torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return {"m": m, "k": k, "n": n, "a": da, "b": db, "ok": True, "dtype": str(out.dtype)}
    except Exception as exc:  # the kernel's refusal is the data
        return {"m": m, "k": k, "n": n, "a": da, "b": db, "ok": False, "error": str(exc).splitlines()[0]}


def mx() -> dict[str, object]:
    a = torch.randn(128, 128, device="cuda").to(E4M3)
    b = torch.randn(128, 128, device="cuda").to(E4M3).t()
    scale = torch.ones(128, 4, device="cuda").to(torch.float8_e8m0fnu)
    try:
        torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return {"mx": True, "ok": True}
    except Exception as exc:
        return {"mx": True, "ok": False, "error": str(exc).splitlines()[0]}


if __name__ == "__main__":
    cap = torch.cuda.get_device_capability()
    rows = [run(*c) for c in CASES] + [mx()]
    doc = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "sm": list(cap), "cases": rows}
    text = json.dumps(doc, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
