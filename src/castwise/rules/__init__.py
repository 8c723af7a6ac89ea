"""The diagnostic catalog: one registry, the single source of codes (torch-free).

Like ruff's rule catalog: every diagnosis has a stable code (``CW`` + three digits, never
reused), a kebab-case name for the pattern, a default severity, a root-cause category and one
page (what it detects, why it matters, an example, the fix). ``castwise rules`` lists them,
``castwise rules CODE`` prints a page.

Codes by range: CW1xx audit (dtype flow of a model), CW2xx lint-config (training
configurations), CW9xx the audit's own limits (what it could not check).
"""

from __future__ import annotations

import re
from typing import Any

from castwise.categories import CATEGORIES
from castwise.rules._rule import REGISTRY, SEVERITIES, Rule, Severity, get

__all__ = ["REGISTRY", "SEVERITIES", "Rule", "Severity", "all_rules", "get", "register", "unregister"]

_CODE = re.compile(r"^CW\d{3}$")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _catalog_modules() -> list[Rule]:
    """Every rule's entry: the audit's rule units, and each catalog module's ``RULES``."""
    import importlib
    import pkgutil

    from castwise.rules import audit as _audit

    found = [r.meta for r in _audit.rules().values()]
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        found.extend(getattr(importlib.import_module(f"{__name__}.{info.name}"), "RULES", ()))
    return found


def _check(rule: Rule, registry: dict[str, Rule] | None = None) -> None:
    """A broken catalog entry is a bug in castwise (or a plugin), not user input: fail loudly."""
    registry = REGISTRY if registry is None else registry
    if not _CODE.match(rule.code) or not _NAME.match(rule.name):
        raise RuntimeError(f"malformed rule code/name: {rule.code} {rule.name}")
    if rule.code in registry or any(r.name == rule.name for r in registry.values()):
        raise RuntimeError(f"duplicate rule code or name: {rule.code} {rule.name}")
    if rule.category is not None and rule.category not in CATEGORIES:
        raise RuntimeError(f"{rule.code}: unknown category {rule.category}")
    if rule.severity not in SEVERITIES:
        raise RuntimeError(f"{rule.code}: unknown severity {rule.severity}")


def _build() -> dict[str, Rule]:
    registry: dict[str, Rule] = {}
    for rule in _catalog_modules():
        _check(rule, registry)
        registry[rule.code] = rule
    return dict(sorted(registry.items()))


REGISTRY.update(_build())  # the table lives in _rule.py, where the values rules build can read it


def all_rules() -> list[Rule]:
    return list(REGISTRY.values())


def register(rule: Any) -> None:
    """Add an audit rule defined outside castwise (a ``castwise.rules.audit.AuditRule``: a plugin,
    or a test's toy rule) to the catalog and the audit."""
    from castwise.rules import audit as _audit

    _check(rule.meta)
    REGISTRY[rule.code] = rule.meta
    _audit.add(rule)


def unregister(code: str) -> None:
    """Take out a rule :func:`register` added."""
    from castwise.rules import audit as _audit

    if _audit.remove(code) is not None:
        REGISTRY.pop(code, None)
