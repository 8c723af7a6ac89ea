"""CW117 complex-made-real: A complex tensor was cast to a real dtype, which drops its imaginary part."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import fmt_tensor, name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Origin, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW117",
    name="complex-made-real",
    category="UNCONVERTED_TENSOR_OR_BUFFER",
    severity="warning",
    summary="A complex tensor was cast to a real dtype, which drops its imaginary part.",
    detects=(
        "A `.to(dtype)`, `type_as`, `.float()` or a `copy_` into a real tensor received a complex tensor "
        "(a RoPE `freqs_cis` table, an FFT result) and made it real."
    ),
    why=(
        "torch keeps the real part and only warns ('Casting complex values to real discards the imaginary "
        "part'): nothing raises, and what follows computes with cos(theta) where it meant e^(i theta). A "
        "rotary table cast with the activations (`freqs_cis.type_as(x)`) trains a model with broken "
        "positions. `module.to(dtype)` does the same to complex buffers, so Lightning's `*-true` and a "
        "hand `model.to(torch.bfloat16)` make a complex `freqs_cis` buffer real."
    ),
    example="freqs_cis = freqs_cis.type_as(xq)  # complex64 -> bf16: the imaginary part is gone",
    fix=(
        "Keep the complex tensor complex: cast the real view instead (`torch.view_as_real(z).to(dtype)`), "
        "compute with it in complex64 and cast the result back (`view_as_real(...).type_as(x)`), or keep a "
        "complex buffer out of the module's cast (non-persistent and recomputed)."
    ),
)


def _origin(n: Any) -> Origin | None:
    prov = n.origin
    return prov.origin() if prov is not None else None


def _converted(session: Session) -> list[Finding]:
    """Complex parameters/buffers the policy's own conversion made real: ``module.to(dtype)`` as
    Lightning's ``*-true`` plugins run it (convert_module), before any step; one finding per tensor."""
    seen: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {}
    for r in session.runs:
        for module, name, before, after in r.casts:
            if before.is_complex and not after.is_complex:
                owner = r.copy.get_submodule(module)
                kind = "buffer" if name in owner._buffers else "param"
                shown = fmt_tensor(name_of(before), tuple(getattr(owner, name).shape))
                entry = seen.setdefault((module, name), (kind, shown, after, []))
                if r.mode not in entry[3]:
                    entry[3].append(r.mode)
    out: list[Finding] = []
    for (module, name), (kind, shown, after, modes) in seen.items():
        tensor = f"{module}.{name}" if module else name
        out.append(
            Finding(
                code="CW117",
                module=module,
                op=None,
                origin=Origin(module=module or None, tensor=f"{kind} {tensor}"),
                modes=tuple(m for m in ("train", "eval") if m in modes),
                message=(
                    f"the policy converts the model as `module.to({short_of(after)})` does, which casts the complex "
                    f"{kind} {tensor} {shown} to {short_of(after)}: the imaginary part is dropped before the first "
                    "step and nothing raises (Lightning's `*-true` precision plugins convert the model this way, "
                    "in convert_module; castwise's own presets keep complex tensors complex)."
                ),
                fix=(
                    f"Keep {tensor} out of the conversion: `module.to` casts every registered parameter and buffer, "
                    "so hold it as a plain attribute (moved with the device by hand), or register its real view "
                    "(`torch.view_as_real`) and take `torch.view_as_complex(...float())` where it is used."
                ),
            )
        )
    return out


def _scan(session: Session) -> list[Finding]:
    # one finding per (module, generalized) and cast line: repeated blocks say it once
    seen: dict[tuple[str, str | None], tuple[Any, list[str]]] = {}
    for r in session.runs:
        for n in r.trace.observed.get("complex_to_real", ()):
            line = n.cast.source if n.cast is not None else None
            entry = seen.setdefault((generalize(n.module), line), (n, []))
            if r.mode not in entry[1]:
                entry[1].append(r.mode)
    out = _converted(session)
    for n, modes in seen.values():
        line = n.cast.source if n.cast is not None else None
        came = f" ({n.origin.describe()})" if n.origin is not None else ""
        at = f" at {line}" if line else ""
        out.append(
            Finding(
                code="CW117",
                module=n.module,
                op=n.op,
                origin=_origin(n),
                modes=tuple(m for m in ("train", "eval") if m in modes),
                source=line,
                message=(
                    f"{where(n.module)} casts a complex tensor {fmt_tensor(name_of(n.src), n.shape)}{came} to "
                    f"{short_of(n.dst)} by {n.op}{at}: the imaginary part is dropped and nothing raises."
                ),
                fix=(
                    f"Keep it {short_of(n.src)}: cast the real view (`torch.view_as_real(z).to(dtype)`) or compute "
                    "in complex and cast the real result back (`torch.view_as_real(out).type_as(x)`)."
                ),
            )
        )
    return out


RULE = AuditRule(META, scan=_scan)
