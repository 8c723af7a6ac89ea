"""Truth per CPU class: the differential cases measured on real kernels, recorded per torch release.

The contract table models each CPU class (``castwise.devices``: ``cpu:avx2``, ``cpu:avx512``, ...)
by the kernel paths its capabilities choose. What those kernels really do is measured here, on
the machine this runs on, and written to ``tests/trace/truth/torch-<major.minor>-<class>.json``;
tests/trace/test_contracts_differential.py checks the table against every recorded class on
any machine, and against the live kernels of this machine's own class.

Run it on a machine of the class to record (``python -m tests.trace.kernel_truth``), or emulate a
lower class on a higher one: torch picks its kernels from ATen's dispatch level and oneDNN's ISA,
and both can be capped (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), so an AVX-512 machine
runs exactly the kernels an AVX2 machine runs (``--emulate cpu:avx2``). The recording refuses to
write when the capped process does not report the requested class.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TRUTH_DIR = Path(__file__).parent / "truth"

# the environment that caps a CPU's kernels to those of a lower class
EMULATE: dict[str, dict[str, str]] = {
    "cpu:avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # an AMX machine without its AMX and AVX512-FP16 (oneDNN's cap also turns off torch's
    # mkldnn f16 check): an AVX-512 CPU with bf16 (checked against 2.14's record of a real one)
    "cpu:avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}
# which classes a host class can emulate (its own kernels capped): lower ISA levels only
CAN_EMULATE: dict[str, tuple[str, ...]] = {"cpu:avx512": ("cpu:avx2",), "cpu:amx": ("cpu:avx2", "cpu:avx512")}


def torch_minor() -> str:
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def truth_path(variant: str, minor: str | None = None) -> Path:
    return TRUTH_DIR / f"torch-{minor or torch_minor()}-{variant.replace(':', '-')}.json"


def recorded() -> dict[str, dict[str, Any]]:
    """The recorded truth for this torch release, by CPU class."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(TRUTH_DIR.glob(f"torch-{torch_minor()}-cpu-*.json")):
        data = json.loads(path.read_text())
        out[data["variant"]] = data
    return out


def measure() -> dict[str, Any]:
    """Every differential case run on this process's real CPU kernels."""
    import torch

    from castwise import devices

    from .contract_cases import all_cases, run_detail

    cases: dict[str, Any] = {}
    for case in all_cases():
        outcome, message = run_detail(case)
        cases[case.id] = {"outcome": str(outcome), "message": message}
    caps = devices.host_cpu().caps
    assert caps is not None
    return {
        "torch": torch.__version__,
        "variant": devices.host_variant(),
        "caps": {"isa": caps.isa, "onednn_bf16": caps.onednn_bf16, "onednn_f16": caps.onednn_f16},
        "cases": cases,
    }


def measure_emulated(variant: str) -> dict[str, Any]:
    """``measure()`` in a child process whose kernels are capped to ``variant``'s."""
    env = {**os.environ, **EMULATE[variant]}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.trace.kernel_truth", "--print"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    data: dict[str, Any] = json.loads(done.stdout)
    if data["variant"] != variant:
        raise RuntimeError(f"capping this machine's kernels gave class {data['variant']!r}, not {variant!r}")
    return data


def _dumps(data: dict[str, Any]) -> str:
    """One line per case, so a re-recording's diff shows the cases that changed."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(data["cases"].items())]
    body = json.dumps(head, sort_keys=True)[:-1]
    return body + ', "cases": {\n' + ",\n".join(lines) + "\n}}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulate", choices=sorted(EMULATE), help="record a lower CPU class on this machine")
    parser.add_argument("--print", action="store_true", help="print the measurement as JSON, write nothing")
    ns = parser.parse_args(argv)
    data = measure_emulated(ns.emulate) if ns.emulate else measure()
    if ns.print:
        json.dump(data, sys.stdout)
        return 0
    if data["variant"] is None:
        print(f"this CPU ({data['caps']}) matches no registered class: register one in castwise.devices first")
        return 1
    path = truth_path(data["variant"])
    path.parent.mkdir(exist_ok=True)
    path.write_text(_dumps(data))
    print(f"wrote {path} ({len(data['cases'])} cases, {data['variant']}, torch {data['torch']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
