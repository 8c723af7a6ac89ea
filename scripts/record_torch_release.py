"""Record one torch release's autocast lists from its own dispatch table (issue 36).

Run inside a venv of torch X.Y (needs torch only, not castwise; a CPU-only build works: it still
registers the AutocastCUDA kernels)::

    python scripts/record_torch_release.py            # writes src/castwise/_releases/torch_X_Y.json
    python scripts/record_torch_release.py --out F    # or to F

Every op that has a kernel under ``AutocastCUDA`` / ``AutocastCPU`` is probed, not parsed from the
source: it is called on fake tensors of that device under autocast (bf16), and a dispatch mode
below autocast records what autocast handed on (the probe stops there, no kernel runs). All f32
tensors handed on as bf16: ``lower_precision_fp``; bf16 tensors handed on as f32:
``fp32``; bf16 tensors with ``dtype=torch.float32`` added: ``fp32_set_opt_dtype`` (the op's own
dtype argument; ``fp32_append_dtype`` when autocast calls another overload); mixed bf16/f32
handed on as f32 only: ``promote``; autocast's own refusal: ``banned``. An op whose arguments the
probe cannot build is listed under ``unprobed`` with the error, never guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}
LOW = torch.bfloat16


class _Seen(Exception):
    """Raised by the spy at the first op autocast hands on: what it handed on."""

    def __init__(self, op: str, leaves: list[Any]) -> None:
        super().__init__(op)
        self.op = op
        self.leaves = leaves


class _Spy(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # autocast asks the device and casts (_to_copy) before it calls the op: let those run
        if func.namespace == "prim" or func is torch.ops.aten._to_copy.default:
            return func(*args, **kwargs)
        raise _Seen(str(func.name()), list(tree_leaves((args, kwargs))))


# shapes tried in turn (tensors, int lists): composite ops check shapes before they dispatch
SHAPES = (((2, 2), [2]), ((2,), [2]), ((1, 2, 2, 2), [2, 2]), ((1, 2, 2, 2, 2), [2, 2, 2]), ((3, 3), [3]))


def _value(typ: str, make: Any, ints: list[int]) -> Any:
    """A value of schema type ``typ`` (tensors from ``make(i)``); the probe never runs a kernel,
    so values only need to pass the schema and any checks before the first dispatched op."""
    optional = typ.startswith("Optional[")
    base = typ[len("Optional[") : -1] if optional else typ
    # the schema's Python spelling: List[Optional[Tensor]], List[int]...
    base = base.replace("Optional[Tensor]", "Tensor?")
    if base.startswith("List["):
        base = base[len("List[") : -1] + "[]"
    if base == "Tensor":
        return make()
    if base in ("Tensor[]", "Tensor?[]"):
        return [make(), make()]
    if base in ("int", "SymInt"):
        return 1
    if base.startswith(("int[", "SymInt[")):
        return list(ints)
    if base == "float":
        return 1.0
    if base.startswith("float["):
        return [1.0]
    if base == "bool":
        return False
    if base.startswith("bool["):
        return [True, True, True]
    if base in ("Scalar", "number"):
        return 1
    if base == "str":
        return "none"
    if base == "str[]":
        return ["none"]
    if optional:
        return None
    raise TypeError(f"no probe value for schema type {typ}")


def _call(op: Any, device: str, dtypes: list[torch.dtype], fake: FakeTensorMode) -> _Seen | str:
    """Call ``op`` under autocast on fake tensors of ``dtypes`` (in order, the last repeated),
    in each of ``SHAPES`` until autocast hands it on."""
    outcome: _Seen | str = "no shape fits"
    for shape, ints in SHAPES:
        outcome = _call_shaped(op, device, dtypes, fake, shape, ints)
        if isinstance(outcome, _Seen) or "unsafe to autocast" in outcome:
            return outcome
    return outcome


def _call_shaped(
    op: Any, device: str, dtypes: list[torch.dtype], fake: FakeTensorMode, shape: tuple[int, ...], ints: list[int]
) -> _Seen | str:
    made: list[torch.Tensor] = []

    def make() -> torch.Tensor:
        dtype = dtypes[min(len(made), len(dtypes) - 1)]
        with fake:
            t = torch.ones(shape, device=device, dtype=dtype)
        made.append(t)
        return t

    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in op._schema.arguments:
        typ = str(a.type)
        if a.has_default_value() and "Tensor" not in typ:
            continue  # its default: dtype=None is what autocast reads
        try:
            value = _value(typ, make, ints)
        except TypeError as e:  # a schema type the probe cannot build: unprobed, said why
            return str(e)
        (kwargs.__setitem__(a.name, value) if a.kwarg_only else args.append(value))
    try:
        with fake, _Spy():
            op(*args, **kwargs)
    except _Seen as seen:
        return seen
    except Exception as e:  # the probe's outcome, recorded as text
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ran without handing on"


def _floats(seen: _Seen) -> set[torch.dtype]:
    return {x.dtype for x in seen.leaves if isinstance(x, torch.Tensor) and x.is_floating_point()}


def classify(op: Any, name: str, device: str, fake: FakeTensorMode) -> tuple[str, str]:
    """(category, note) of one op's autocast kernel on ``device``."""
    f32 = _call(op, device, [torch.float32], fake)
    if isinstance(f32, str):
        return ("banned", f32) if "unsafe to autocast" in f32 else ("unprobed", f32)
    if _floats(f32) == {LOW}:
        return "lower_precision_fp", ""
    low = _call(op, device, [LOW], fake)
    if isinstance(low, str):
        return "unprobed", low
    if torch.float32 in _floats(low):
        return "fp32", ""
    if torch.float32 in low.leaves:  # autocast added dtype=torch.float32
        same = low.op.split(".")[0] == name.split(".")[0] and low.op == name
        return ("fp32_set_opt_dtype" if same else "fp32_append_dtype"), ""
    mixed = _call(op, device, [LOW, torch.float32], fake)
    if isinstance(mixed, _Seen) and _floats(mixed) == {torch.float32}:
        return "promote", ""
    return "unprobed", "no cast observed"


def _op(name: str) -> Any:
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), base), overload or "default")


def record() -> dict[str, Any]:
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    out: dict[str, Any] = {"torch": torch.__version__, "release": release, "autocast": {}}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    before = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in KEYS}
    try:
        for device, key in KEYS.items():
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, LOW)
            lists: dict[str, Any] = {}
            for name in sorted(torch._C._dispatch_get_registrations_for_dispatch_key(key)):
                category, note = classify(_op(name), name, device, fake)
                if category == "unprobed":
                    lists.setdefault("unprobed", {})[name] = note
                else:
                    lists.setdefault(category, []).append(name)
            out["autocast"][device] = lists
            torch.set_autocast_enabled(device, False)
    finally:
        for d, (enabled, dtype) in before.items():
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    data = record()
    out = ns.out or Path(__file__).resolve().parents[1] / "src/castwise/_releases" / (
        "torch_" + data["release"].replace(".", "_") + ".json"
    )
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    counts = {d: {c: len(v) for c, v in lists.items()} for d, lists in data["autocast"].items()}
    print(f"torch {data['torch']}: {counts} -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
