"""Truth per CPU class for ``nn.LSTM`` in 16-bit: does the real run raise, by policy and mode.

oneDNN's CPU LSTM (``aten.mkldnn_rnn_layer``) depends on more than the operands' dtypes: torch
picks it by the input's dtype before autocast casts it, and the f16 primitive the AMX class has is
for inference (grad disabled) only. So the op-level differential cases (contract_cases.py) cannot
hold it; this measures the whole module the way an audit runs it: ``*-mixed`` is CPU autocast over
an f32 model, ``*-true`` the model and its input cast; ``eval`` runs under no_grad, ``train`` with
grad and a backward.

``python -m tests.trace.rnn_truth`` prints this process's measurement; ``--record`` writes this
machine's class and every class it can emulate (kernel_truth.EMULATE) into
``truth/rnn-torch-<release>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .kernel_truth import CAN_EMULATE, EMULATE, TRUTH_DIR, torch_minor

POLICIES = ("16-mixed", "16-true", "bf16-mixed", "bf16-true")
MODES = ("eval", "train")


def record_path(minor: str | None = None) -> Path:
    return TRUTH_DIR / f"rnn-torch-{minor or torch_minor()}.json"


def build() -> tuple[Any, Any]:
    """A two-layer LSTM and its input (the second layer is fed by the first's 16-bit output)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.LSTM(16, 32, num_layers=2, batch_first=True), torch.randn(2, 7, 16)


def run_real(policy: str, mode: str) -> str:
    """Whether ``policy`` in ``mode`` runs on this process's real CPU kernels: "ok" or "raise"."""
    import torch

    dtype = torch.float16 if policy.startswith("16") else torch.bfloat16
    model, x = build()
    try:
        with torch.set_grad_enabled(mode == "train"):
            if policy.endswith("mixed"):
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x)[0]
            else:
                out = model.to(dtype)(x.to(dtype))[0]
            if mode == "train":
                out.float().sum().backward()
    except RuntimeError:
        return "raise"
    return "ok"


def measure() -> dict[str, Any]:
    from castwise import devices

    cases = {f"{p}/{m}": run_real(p, m) for p in POLICIES for m in MODES}
    return {"variant": devices.host_variant(), "cases": cases}


def measure_emulated(variant: str) -> dict[str, Any]:
    """``measure()`` in a child process whose kernels are capped to ``variant``'s."""
    env = {**os.environ, **EMULATE[variant]}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.trace.rnn_truth"], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    data: dict[str, Any] = json.loads(done.stdout)
    if data["variant"] != variant:
        raise RuntimeError(f"capping this machine's kernels gave class {data['variant']!r}, not {variant!r}")
    return data


def recorded() -> dict[str, dict[str, str]]:
    """The recorded truth for this torch release, by CPU class (empty when none was recorded)."""
    path = record_path()
    if not path.exists():
        return {}
    found: dict[str, dict[str, str]] = json.loads(path.read_text())["classes"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="record this class and those it can emulate")
    ns = parser.parse_args(argv)
    here = measure()
    if not ns.record:
        json.dump(here, sys.stdout)
        return 0
    if here["variant"] is None:
        print("this CPU matches no registered class: register one in castwise.devices first")
        return 1
    import torch

    classes = {here["variant"]: here["cases"]}
    for variant in CAN_EMULATE.get(here["variant"], ()):
        classes[variant] = measure_emulated(variant)["cases"]
    data = {"torch": torch.__version__, "measured_on": here["variant"], "classes": classes}
    record_path().write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
