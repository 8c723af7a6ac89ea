"""castwise: mixed precision in PyTorch, made boring.

``import castwise`` is light: nothing here imports torch until you touch an API that needs
it (``Policy``, ``apply``, ``audit``, ``diagnose``). ``explain`` and ``lint_config`` never do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (modules are named so that none shadows a function)
_LAZY: dict[str, str] = {
    "Policy": "castwise.policy",
    "ModuleRule": "castwise.policy",
    "apply": "castwise.applied",
    "Applied": "castwise.applied",
    "audit": "castwise.auditor",
    "explain": "castwise.diagnosis.explain",
    "Explanation": "castwise.diagnosis.explain",
    "diagnose": "castwise.diagnosis.context",
    "lint_config": "castwise.lint",
    "locate_nonfinite": "castwise.numerics.locate",
    "forecast": "castwise.numerics.forecast",
    "watch": "castwise.numerics.watch",
    "Report": "castwise.report",
    "Finding": "castwise.report",
    "Origin": "castwise.report",
    "CastwiseError": "castwise.errors",
    "PolicyError": "castwise.errors",
    "RuleError": "castwise.errors",
    "ApplyError": "castwise.errors",
    "AuditError": "castwise.errors",
    "ConfigError": "castwise.errors",
    "TargetError": "castwise.errors",
    "compare": "castwise.numerics.compare",
    "tune": "castwise.numerics.tune",
    "Tuned": "castwise.numerics.tune",
}

__all__ = [
    "Applied",
    "ApplyError",
    "AuditError",
    "CastwiseError",
    "ConfigError",
    "Explanation",
    "Finding",
    "ModuleRule",
    "Origin",
    "Policy",
    "PolicyError",
    "Report",
    "RuleError",
    "TargetError",
    "Tuned",
    "__version__",
    "apply",
    "audit",
    "compare",
    "diagnose",
    "explain",
    "forecast",
    "lint_config",
    "locate_nonfinite",
    "tune",
    "watch",
]

if TYPE_CHECKING:
    from castwise.applied import Applied, apply
    from castwise.auditor import audit
    from castwise.diagnosis.context import diagnose
    from castwise.diagnosis.explain import Explanation, explain
    from castwise.errors import (
        ApplyError,
        AuditError,
        CastwiseError,
        ConfigError,
        PolicyError,
        RuleError,
        TargetError,
    )
    from castwise.lint import lint_config
    from castwise.numerics.compare import compare
    from castwise.numerics.forecast import forecast
    from castwise.numerics.locate import locate_nonfinite
    from castwise.numerics.tune import Tuned, tune
    from castwise.numerics.watch import watch
    from castwise.policy import ModuleRule, Policy
    from castwise.report import Finding, Origin, Report


def __getattr__(name: str) -> Any:
    if name in ("export", "fsdp2"):  # castwise.fsdp2.fully_shard(...) with only `import castwise`
        return importlib.import_module(f"castwise.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'castwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
