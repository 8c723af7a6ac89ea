"""The policy changes a finding's fix text offers (``keep[...]=f32``, ``out[...]=bf16``), checked.

``suggested_policy`` is verified by a re-audit; a fix text may offer a clause of its own. Each
error finding that offers one says whether it was verified: when the suggested policy holds the
clause (its re-audit ran with it), or a re-audit under the user's policy (the preset for the
model's dtype when it had none) with the clause added no longer finds that error there; not
verified otherwise (a few re-audits at most). A clause that selects only
modules whose forward never ran (the model reads their tensors directly: a RoPE table's module,
whose ``get_embed()`` its parent calls) cannot work, whatever a re-audit would say: an island
casts its module's inputs and output, and that module has none; the text says so.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from castwise.auditor.context import RunRecord
from castwise.auditor.session import run_request
from castwise.errors import CastwiseError
from castwise.policy import Policy
from castwise.report import Finding, Report
from castwise.rules.audit._text import is_ancestor
from castwise.run import RunRequest

_CLAUSE = re.compile(r"`((?:keep|out)\[[^\]`]+\]=\w+)`")


def _rule(clause: str) -> Any:
    try:
        return Policy.parse(f"32-true,{clause}").rules[0]
    except (CastwiseError, IndexError):
        return None  # a placeholder (`keep[<module>]=f32`): nothing to check


def _idle(rule: Any, model: nn.Module, ran: set[str]) -> str | None:
    """The first module the rule selects when none of them (nor anything inside them) ran an
    op; None when one ran, or the rule selects nothing."""
    selected: list[str] = [name for name, m in model.named_modules() if name and rule.matches(name, m)]
    if not selected or any(is_ancestor(s, m) for s in selected for m in ran):
        return None
    return selected[0]


@dataclasses.dataclass
class _Reaudit:
    """Re-audits of the user's audit with clauses added, at most ``budget`` of them."""

    request: RunRequest
    budget: int = 2
    done: dict[tuple[Any, ...], Report | None] = dataclasses.field(default_factory=dict)

    def fixes(self, f: Finding, rules: tuple[Any, ...]) -> bool:
        if rules not in self.done:
            if len(self.done) >= self.budget:
                return False
            self.done[rules] = self._audit(rules)
        again = self.done[rules]
        if again is None or any(x.code == "CW902" for x in again.findings):
            return False  # refused, or a run cut short: it verifies nothing
        return not any(x.code == f.code and x.module == f.module for x in again.errors)

    def _audit(self, rules: tuple[Any, ...]) -> Report | None:
        from castwise.auditor.suggest import _base_policy, _compute_dtype

        req = self.request
        base = _base_policy(req.policy, _compute_dtype(req.model, req.policy))
        try:
            again, _runs = run_request(req.under(base.with_rules(*rules)))
        except CastwiseError:
            return None
        return again


def check_offered(request: RunRequest, report: Report, runs: list[RunRecord]) -> Report:
    """Each finding's offered clauses checked (``fix_verified`` in its JSON, a note in its fix
    text); returns the report, updated."""
    ran = {m for r in runs for m, *_ in r.trace.ops}
    suggested = tuple(report.suggested_policy.rules) if report.suggested_policy is not None else ()
    reaudit = _Reaudit(request)
    model = request.model
    out: list[Finding] = []
    for f in report.findings:
        rules = [(c, r) for c in dict.fromkeys(_CLAUSE.findall(f.fix or "")) if (r := _rule(c)) is not None]
        idle = [(c, m) for c, r in rules if (m := _idle(r, model, ran)) is not None]
        if idle:
            clause, module = idle[0]
            note = (
                f" Not `{clause}`: the forward of `{module}` never runs (the model reads its tensors "
                "directly), so an island there casts nothing; cast them where they are read"
                + (", or apply the suggested policy." if report.suggested_policy is not None else ".")
            )
            verified = False
        elif rules and f.level == "error":
            offered = tuple(r for _c, r in rules)
            verified = all(r in suggested for r in offered) or reaudit.fixes(f, offered)
            note = " (verified by a re-audit)" if verified else " (not verified by a re-audit)"
        else:
            out.append(f)
            continue
        details = (*f.details, ("fix_verified", verified))
        out.append(dataclasses.replace(f, fix=(f.fix or "") + note, details=details))
    report.findings = out
    return report
