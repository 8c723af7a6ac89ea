"""The audit's rules: one module per code (``cw101.py`` ...), each defining ``RULE``.

A new rule is its module here, a fixture (tests/rules/fixtures) and its page (the ``meta``
fields): the catalog and the audit find it by itself. Where checks overlap, the first in
``PRECEDENCE`` that answers wins; a rule whose checks are not listed here goes before the key
its ``before`` names (the catch-all ``CW110`` by default).

Precedence, and why:
0. CW132 / CW131 a float8 GEMM the GPU cannot run / a shape it refuses: their own violation kinds.
1. CW111 no kernel for a dtype at all: nothing to cast "to the other side".
2. CW112 backward: gradients, whatever the forward looked like.
   CW114 a module turned autocast off around the op: the region, not the operands.
   CW115 a user hook changed the dtype: the hook, not the layers around it.
3. CW113 a module's own weights cast by hand: the weights are the odd ones, not the inputs.
4. CW103 a fused fast path: the kernel, not the operands, is the problem.
   CW116 an integer (or bool) operand made floating: the index, not a precision clash (a
   model input's float mask or ids stay with CW108 / CW110.embedding, which speak for them).
5. CW108 a mask: its own fix (dtype=q.dtype, or bool).
6. CW110.embedding float indices into an embedding.
7. CW107 ops that never promote (index_put, scatter, lerp...).
8. CW101 float32 made inside a module meeting its own low-precision weights.
9. CW104 / CW102 / CW105 / CW106 by the culprit's provenance (autocast, fp32 module, input,
   created tensor).
10. CW109 a norm's statistics, then the catch-all CW110.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from castwise.rules.audit._base import AuditRule, Check

PRECEDENCE: tuple[str, ...] = (
    "CW132",
    "CW131",
    "CW111",
    "CW112",
    "CW114",
    "CW115",
    "CW113",
    "CW103",
    "CW116",
    "CW108",
    "CW110.embedding",
    "CW107",
    "CW101",
    "CW104",
    "CW102",
    "CW105",
    "CW106",
    "CW109",
    "CW110",
)

_RULES: dict[str, AuditRule] | None = None


def rules() -> dict[str, AuditRule]:
    """Every audit rule by code, from the modules of this package (imported once)."""
    global _RULES
    if _RULES is None:
        found: dict[str, AuditRule] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            rule = getattr(module, "RULE", None)
            if isinstance(rule, AuditRule):
                found[rule.code] = rule
        _RULES = found
    return _RULES


def add(rule: AuditRule) -> None:
    """Add a rule defined outside this package to the audit (``castwise.rules.register`` also
    puts it in the catalog: use that)."""
    rules()[rule.code] = rule
    ordered_checks.cache_clear()


def remove(code: str) -> AuditRule | None:
    found = rules().pop(code, None)
    ordered_checks.cache_clear()
    return found


@functools.cache
def ordered_checks() -> tuple[Check, ...]:
    """The event checks in precedence order (cached: ``add`` and ``remove`` clear it)."""
    checks = {c.key: c for r in rules().values() for c in r.checks}
    order = [k for k in PRECEDENCE if k in checks]
    for r in rules().values():
        for c in r.checks:
            if c.key not in order:
                at = order.index(r.before) if r.before in order else len(order)
                order.insert(at, c.key)
    return tuple(checks[k] for k in order)


__all__ = ["PRECEDENCE", "AuditRule", "Check", "add", "ordered_checks", "remove", "rules"]
