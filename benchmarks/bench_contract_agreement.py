"""How well the dtype-contract table predicts real CPU kernels, next to fake kernels alone.

Runs every op x dtype case of tests/trace/contract_cases.py three ways: on real CPU tensors (the
truth), through the table (castwise.trace.contracts.check / result_dtype), and under
FakeTensorMode with no table. A case agrees when it predicts the real outcome: raise or not, and
the result dtype when it does not raise. Also prints the cost of one table lookup (the tracer
calls it for every op).

    python benchmarks/bench_contract_agreement.py [--family matmul] [--show-disagreements]
    python benchmarks/bench_contract_agreement.py --device cuda   # on a GPU machine: the CUDA rules
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the cases live with the tests

from tests.trace.contract_cases import Case, all_cases, predict, run_detail, run_fake  # noqa: E402


def _lookup_cost(cases: list[Case], repeat: int = 20) -> tuple[float, float]:
    """Mean microseconds of one check() + result_dtype() pair on prepared arguments, for ops the
    kernel accepts (the common case in a trace) and for ops it refuses."""
    from castwise.trace.contracts import check, result_dtype

    prepared = [(c.func, *c.make()) for c in cases]
    accepted = [p for p in prepared if check(p[0], p[1], p[2], "cpu") is None]
    refused = [p for p in prepared if check(p[0], p[1], p[2], "cpu") is not None]

    def cost(items: list[tuple[object, tuple[object, ...], dict[str, object]]]) -> float:
        if not items:
            return 0.0
        start = time.perf_counter()
        for _ in range(repeat):
            for func, args, kwargs in items:
                if check(func, args, kwargs, "cpu") is None:  # type: ignore[arg-type]
                    result_dtype(func, args, kwargs, "cpu")  # type: ignore[arg-type]
        return (time.perf_counter() - start) / (repeat * len(items)) * 1e6

    return cost(accepted), cost(refused)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", help="only cases of this family")
    parser.add_argument("--show-disagreements", action="store_true")
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="real kernels and table rules of this device"
    )
    opts = parser.parse_args(argv)
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device; torch sees none on this machine")

    cases = [c for c in all_cases() if opts.family is None or c.family == opts.family]
    per_family: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])  # cases, table, fake
    table_wrong: list[str] = []
    fake_wrong: list[str] = []
    start = time.perf_counter()
    for case in cases:
        real, message = run_detail(case, opts.device)
        table_ok = predict(case, opts.device) == real
        fake_ok = run_fake(case) == real
        row = per_family[case.family]
        row[0] += 1
        row[1] += table_ok
        row[2] += fake_ok
        if not table_ok:
            table_wrong.append(f"{case.id} (real: {real}{': ' + message if message else ''})")
        if not fake_ok:
            fake_wrong.append(case.id)
    elapsed = time.perf_counter() - start

    n = len(cases)
    table = n - len(table_wrong)
    fake = n - len(fake_wrong)
    print(f"{'family':<12} {'cases':>6} {'table':>8} {'fake':>8}")
    for family, (count, t_ok, f_ok) in sorted(per_family.items()):
        print(f"{family:<12} {count:>6} {t_ok / count:>8.1%} {f_ok / count:>8.1%}")
    print(f"{'all':<12} {n:>6} {table / n:>8.1%} {fake / n:>8.1%}")
    print(
        f"table agrees with real {opts.device.upper()} kernels on {table}/{n} cases ({table / n:.1%}); "
        f"fake kernels alone on {fake}/{n} ({fake / n:.1%})"
    )
    ok_us, bad_us = _lookup_cost(cases)
    print(
        f"three-way run of all cases: {elapsed:.1f} s; one table lookup (check + result_dtype): "
        f"{ok_us:.1f} us when the kernel accepts, {bad_us:.1f} us when it refuses"
    )
    if opts.show_disagreements:
        print("table disagrees:", "\n  ".join(["", *table_wrong]) if table_wrong else "none")
        print("fake disagrees:", ", ".join(fake_wrong) or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
