"""The per-module rows a numerics report adds to ``to_dict()["numerics"]`` (DESIGN.md), which the
HTML report charts (``castwise.report._html_numerics``): one dict per module, in the order the
run first reached it. Torch-free: built from the report's summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from castwise.report import Report


@dataclass
class RowsReport(Report):
    """A Report with per-module rows (``numerics``), kept in ``to_dict()["numerics"]``."""

    numerics: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["numerics"] = self.numerics
        return out


def fmt_err(x: Any) -> str:
    """An error in a text table: ``-`` (none), ``inf`` (a float or the JSON rows' string), else 2 digits."""
    if x is None:
        return "-"
    if x == "inf" or (isinstance(x, float) and math.isinf(x)):
        return "inf"
    return f"{float(x):.2e}"


def where(name: str) -> str:
    return f"`{name}`" if name else "the model itself"


def forecast_rows(modules: dict[str, dict[str, dict[str, Any]]], target: str) -> list[dict[str, Any]]:
    """From forecast's ``summary["numerics"]["modules"]`` (module -> phase -> ranges): ``absmax``
    is the larger of the activations' and gradients' (what the target must hold), ``dtype`` the
    target (the chart's limit), and each phase's numbers beside it."""
    rows = []
    for module, phases in modules.items():
        fwd, bwd = phases.get("forward", {}), phases.get("backward", {})
        row: dict[str, Any] = {
            "module": module,
            "dtype": target,
            "absmax": max(fwd.get("absmax", 0.0), bwd.get("absmax", 0.0)),
            "activation_absmax": fwd.get("absmax"),
            "gradient_absmax": bwd.get("absmax"),
            "activation_flush_share": fwd.get("flush_share"),
            "gradient_flush_share": bwd.get("flush_share"),
            "overflow_ops": sum(int(p.get("overflow_ops", 0)) for p in phases.values()),
        }
        rows.append(row)
    return rows


def locate_rows(modules: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """From locate's ``summary["numerics"]["modules"]`` (the producer's module -> what it made):
    the producer, marked ``first_nonfinite``, with its inputs' largest magnitude against its dtype."""
    rows = []
    for module, info in modules.items():
        ins = [i.get("absmax", 0.0) for i in info.get("inputs", [])]
        rows.append(
            {
                "module": module,
                "op": info.get("op"),
                "phase": info.get("phase"),
                "verdict": info.get("verdict"),
                "dtype": info.get("limits", {}).get("dtype"),
                "absmax": max(ins, default=0.0),
                "output_nan": info.get("output", {}).get("nan"),
                "output_inf": info.get("output", {}).get("inf"),
                "first_nonfinite": True,
            }
        )
    return rows
