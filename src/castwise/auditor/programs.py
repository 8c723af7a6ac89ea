"""``castwise.audit`` of a pipeline- or expert-parallel mesh: one audit per distinct rank program.

castwise.distributed.programs reads the programs (one per coordinate of the pp / ep mesh dim)
and says which are the same; each distinct one is audited as any model (FSDP2 / TP view included),
stage k on what stage k-1 sends (or on its declared receive buffer), with its collectives
recorded. The report holds every program's findings, each naming the ranks that run it, the
findings between programs (CW174 send/recv, CW175 collectives), and ``extra["programs"]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from castwise._dtypes import canonical, to_torch
from castwise.distributed import programs as rp
from castwise.report import Report


def audit_programs(obj: Any, inputs: Any, audit: Callable[..., Report], **options: Any) -> Report:
    """Audit each distinct rank program of ``obj`` (see ``castwise.distributed.programs``) with
    ``audit`` (castwise.audit, passed in: it is the package above this module) and ``options``."""
    layout = rp.read(obj)
    done: dict[tuple[Any, ...], tuple[rp.Program, Report, rp.Collectives]] = {}
    groups: dict[tuple[Any, ...], list[rp.Program]] = {}
    sent: dict[int, rp.Spec] = {}
    first_module: dict[int, str] = {}
    handed: rp.Spec | None = None
    for program in layout.programs:
        receives = program.receives
        if layout.dim == "pp" and program.index > 0 and receives is None and handed is not None:
            receives = (handed,)  # no declared buffer: it receives what the stage before sends
        given = layout.dim != "pp" or program.index == 0 or not receives  # run on the user's inputs
        key = rp.signature(program.module, None if given else receives)
        groups.setdefault(key, []).append(program)
        if key not in done:
            args = inputs if given else _tensors(receives or ())
            seen = rp.Collectives()
            with rp.recording(seen):
                report = audit(program.module, args, **options)
            done[key] = (program, report, seen)
        report = done[key][1]
        out = _root_output(report)
        if out is not None:
            sent[program.index] = out
            handed = out
        first_module[program.index] = _first_module(program.module)
    modes = tuple(dict.fromkeys(r.mode for _p, rep, _s in done.values() for r in rep.runs))
    merged = Report(title=f"castwise audit of {layout.title}: {len(done)} distinct rank programs")
    merged.extra["mesh"] = layout.title
    merged.extra["programs"] = []
    by_program: list[tuple[rp.Program, rp.Collectives]] = []
    said: dict[tuple[str, str | None, str], tuple[Any, list[tuple[str, list[int]]]]] = {}
    for key, (rep_program, report, seen) in done.items():
        members = groups[key]
        ranks = sorted(r for p in members for r in p.ranks)
        merged.extra["programs"].append(
            {
                layout.dim: [p.index for p in members],
                "ranks": len(ranks),
                "first_ranks": ranks[:8],
                "title": report.title,
                "runs": [r.to_dict() for r in report.runs],
                "ops_traced": report.summary.get("ops_traced"),
                "findings": [f.code for f in report.findings],
                "collectives": seen.to_list() + list(report.extra.get("collectives", [])),
            }
        )
        which = f"{layout.dim}={','.join(str(p.index) for p in members)}"
        for f in report.findings:
            said.setdefault((f.code, f.module, f.message), (f, []))[1].append((which, ranks))
        merged.runs += [r for r in report.runs if r not in merged.runs]
        whole = replace(rep_program, ranks=tuple(ranks))
        by_program.append((whole, seen))
    for f, where in said.values():  # a finding of several programs: said once, for all their ranks
        ranks = sorted(r for _w, rs in where for r in rs)
        shown = "; ".join(w for w, _r in where)
        merged.findings.append(replace(f, message=f"{f.message} [{shown}: {rp.ranks_text(ranks)}]"))
    merged.findings = [
        *rp.p2p_findings(layout, sent, first_module, modes),
        *rp.collective_findings(by_program, layout.dim, modes),
        *merged.findings,
    ]
    merged.extra["p2p"] = [
        {"from": a.index, "to": b.index, "send": str(sent[a.index]), "recv": str((b.receives or (sent[a.index],))[0])}
        for a, b in itertools.pairwise(layout.programs)
        if layout.dim == "pp" and a.index in sent
    ]
    return merged


def _tensors(specs: tuple[rp.Spec, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(s.shape, dtype=to_torch(canonical(s.dtype) or s.dtype)) for s in specs)


def _root_output(report: Report) -> rp.Spec | None:
    root = next((m for m in report.summary.get("modules", []) if m.get("name") == ""), None)
    outs = root.get("outputs") if root else None
    return rp.spec_of(outs[0]) if outs else None


def _first_module(module: torch.nn.Module) -> str:
    """The first named child with parameters: where a received activation enters the stage."""
    return next((n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))), "")
