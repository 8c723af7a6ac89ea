"""The zoo on real CUDA kernels: a simulated-CUDA audit (fake tensors, ``device="cuda"``, what a
user without a GPU gets) against the same model run for real on a CUDA device.

Every other zoo benchmark takes the real CPU run as the truth; this one checks the CUDA rules the
audit applies when it simulates a GPU. Cases: each zoo model in each situation, plus seeded
planted faults (``--faults N``, the fault-injection benchmark's cases). The scoring rule is the
zoo's (benchmarks/zoo/scoring.py) with "real run" meaning the CUDA run. A real run that fails for a
reason that is not a dtype error (a plain tensor attribute left on the CPU by ``.to("cuda")``,
say) is ``other_error`` and that mode is not scored.

    python benchmarks/bench_zoo_cuda.py [--situations bf16-mixed,16-true,...] [--models a,b]
        [--faults 200] [--heldout] [--compiled] [--shard i/n] [--out cuda.json]
    python benchmarks/bench_zoo_cuda.py --from a.json b.json   # summarise shards

``--compiled``: both sides compiled: the simulated-CUDA audit of ``torch.compile(model)`` (Dynamo
and AOTAutograd on fake tensors) against the policy's model compiled by ``torch.compile``
(Inductor, Triton kernels) and run on the GPU; Dynamo is reset between cases.

Needs a CUDA device (refuses to run without one).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmarks.zoo import models  # noqa: E402
from benchmarks.zoo.cases import Case, build_case, fault_case, quiet  # noqa: E402
from benchmarks.zoo.scoring import (  # noqa: E402
    MODES,
    RealOutcome,
    audit_outcome,
    first_line,
    real_compiled_run,
    real_run,
    score,
)
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

DEFAULT_SITUATIONS = "bf16-mixed,16-mixed,bf16-true,16-true,bf16-hand-norms-fp32,f16-hand"


def to_cuda(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    model = model.to("cuda")  # keeps each parameter's dtype: the situation's casts stay as planted
    return model, tree_map(lambda x: x.to("cuda") if isinstance(x, torch.Tensor) else x, inputs)


def real_cuda_run(case: Case, policy: str | None, mode: str, compiled: bool = False) -> RealOutcome:
    """The zoo's real run (``real_run``), on the CUDA device; ``compiled``: the policy applied,
    then ``torch.compile`` (Inductor) and that program run."""
    model, inputs, _ = build_case(case)
    model, inputs = to_cuda(model, inputs)
    outcome = (real_compiled_run if compiled else real_run)(model, inputs, policy, mode)
    try:
        torch.cuda.synchronize()  # an asynchronous kernel error surfaces here
    except RuntimeError as exc:
        return RealOutcome("other_error", f"{type(exc).__name__}: {first_line(exc)}")
    return outcome


def evaluate(case: Case, timeout: int, compiled: bool = False) -> dict[str, Any]:
    from benchmarks.zoo.situations import SITUATIONS

    policy = SITUATIONS[case.situation].policy
    model, inputs, planted = build_case(case)
    # what a user without a GPU runs
    audit = audit_outcome(model, inputs, policy, timeout, device="cuda", compiled=compiled)
    if compiled:
        torch._dynamo.reset()
    real = {mode: real_cuda_run(case, policy, mode, compiled) for mode in MODES}
    s = score(real, audit, planted.expected_origin if planted else None)
    codes = sorted({f.code for f in audit.findings if f.level == "error"})
    record = {"case": asdict(case), "real": {m: asdict(r) for m, r in real.items()}, "codes": codes, "score": asdict(s)}
    if compiled:
        record["compiled_graphs"] = audit.compiled_graphs
        record["orig_mod_named"] = audit.orig_mod_named
    return record


def summarise(records: list[dict[str, Any]]) -> None:
    scored = [r for r in records if "score" in r]
    failed = [r for r in scored if r["score"]["real_failed"]]
    detected = [r for r in failed if r["score"]["detected"]]
    passed_modes = sum(1 for r in scored for m in MODES if r["real"][m]["status"] == "ok")
    alarms = [r for r in scored if r["score"]["false_alarm_modes"]]
    crashes = [r for r in scored if r["score"]["crash"]]
    incomplete = [r for r in scored if r["score"]["incomplete"]]
    other = sum(1 for r in scored for m in MODES if r["real"][m]["status"] == "other_error")
    agree = [r for r in scored if not (r["score"]["missed"] or r["score"]["false_alarm_modes"] or r["score"]["crash"])]
    print(f"cases {len(scored)} (harness errors {len(records) - len(scored)}); agree {len(agree)}/{len(scored)}")
    print(f"real CUDA failures detected {len(detected)}/{len(failed)}")
    print(f"false alarms in {len(alarms)} cases ({passed_modes} modes passed for real)")
    print(f"crashes {len(crashes)}; incomplete {len(incomplete)}; modes not scored (non-dtype real error) {other}")
    compiled = [r for r in scored if "compiled_graphs" in r]
    if compiled:
        graphs = sum(1 for r in compiled if (r["compiled_graphs"] or 0) >= 1)
        named = sum(1 for r in compiled if r["orig_mod_named"])
        print(f"compiled audits {len(compiled)}: Dynamo compiled >= 1 graph in {graphs}; `_orig_mod` named in {named}")
    by_situation: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for r in scored:
        row = by_situation[r["case"]["fault"] or r["case"]["situation"]]
        row[0] += 1
        row[1] += r in agree
    for key, (n, ok) in sorted(by_situation.items()):
        print(f"  {key:<28} {ok}/{n}")
    for r in scored:
        s = r["score"]
        if s["missed"] or s["false_alarm_modes"] or s["crash"]:
            kind = "missed" if s["missed"] else "false alarm" if s["false_alarm_modes"] else "crash"
            real = "; ".join(f"{m}: {r['real'][m]['status']} {r['real'][m]['message'][:120]}" for m in MODES)
            print(f"  {kind}: {r['case']} codes={r['codes']} | {real}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--situations", default=DEFAULT_SITUATIONS)
    parser.add_argument("--models", help="comma-separated zoo model names (default: all installed)")
    parser.add_argument("--faults", type=int, default=0, help="also score this many planted faults")
    parser.add_argument("--heldout", action="store_true", help="held-out models and fault seeds")
    parser.add_argument("--compiled", action="store_true", help="audit and run torch.compile(model)")
    parser.add_argument("--timeout", type=int, default=120)
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th (parallel runs)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from", dest="source", nargs="+", type=Path, help="summarise saved --out files")
    opts = parser.parse_args(argv)
    if opts.source:
        summarise([r for path in opts.source for r in json.loads(path.read_text())])
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device; torch sees none on this machine (the CPU zoo: bench_audit_zoo.py)")
    quiet()
    names = opts.models.split(",") if opts.models else None
    zoo = [m.name for m in models.models(heldout=opts.heldout) if names is None or m.name in names]
    work = [Case(name, s, None, 0) for name in zoo for s in opts.situations.split(",") if s]
    work += [c for i in range(opts.faults) if (c := fault_case(i, opts.heldout)) is not None]
    index, count = (int(part) for part in opts.shard.split("/"))
    work = work[index::count]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {len(work)} cases", flush=True)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    for n, case in enumerate(work, 1):
        try:
            records.append(evaluate(case, opts.timeout, opts.compiled))
        except Exception as exc:  # a harness failure is reported, never hidden in a score
            records.append({"case": asdict(case), "harness_error": f"{type(exc).__name__}: {exc}"})
        if opts.out:  # after every case: a run stopped at its time limit keeps what it scored
            opts.out.write_text(json.dumps(records, indent=1))
        if n % 25 == 0:
            print(f"  {n}/{len(work)} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    summarise(records)
    print(f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
