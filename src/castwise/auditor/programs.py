"""``castwise.audit`` of a pipeline- or expert-parallel mesh: one audit per distinct rank program.

castwise.distributed.programs reads the programs (one per coordinate of the pp / ep mesh dim)
and says which are the same; each distinct one is audited as any model (FSDP2 / TP view included),
stage k on what stage k-1 sends (or on its declared receive buffer), with its collectives
recorded. The report holds every program's findings, each naming the ranks that run it, the
findings between programs (CW174 send/recv, CW175 collectives), and ``extra["programs"]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from castwise._dtypes import canonical, to_torch
from castwise.distributed import programs as rp
from castwise.report import Finding, Report, Run


def audit_programs(obj: Any, inputs: Any, audit: Callable[..., Report], **options: Any) -> Report:
    """Audit each distinct rank program of ``obj`` (see ``castwise.distributed.programs``) with
    ``audit`` (castwise.audit, passed in: it is the package above this module) and ``options``."""
    layout = rp.read(obj)
    done: dict[tuple[Any, ...], tuple[rp.Program, Report, rp.Collectives]] = {}
    groups: dict[tuple[Any, ...], list[rp.Program]] = {}
    sent: dict[int, tuple[rp.Spec, ...]] = {}
    first_module: dict[int, str] = {}
    handed: tuple[rp.Spec, ...] | None = None
    for program in layout.programs:
        receives = program.receives
        if layout.dim == "pp" and program.index > 0 and receives is None and handed is not None:
            receives = handed  # no declared buffer: it receives what the stage before sends
        given = layout.dim != "pp" or program.index == 0 or not receives  # run on the user's inputs
        key = rp.signature(program.module, None if given else receives)
        groups.setdefault(key, []).append(program)
        if key not in done:
            args = inputs if given else _tensors(receives or ())
            seen = rp.Collectives()
            with rp.recording(seen), rp.one_program():
                report = audit(program.module, args, **options)
            done[key] = (program, report, seen)
        report = done[key][1]
        out = _root_outputs(report)
        if out:
            sent[program.index] = out
            handed = out
        first_module[program.index] = _first_module(program.module)
    modes = tuple(dict.fromkeys(r.mode for _p, rep, _s in done.values() for r in rep.runs))
    merged = Report(title=f"castwise audit of {layout.title}: {len(done)} distinct rank programs")
    merged.extra["mesh"] = layout.title
    merged.extra["programs"] = []
    by_program: list[tuple[rp.Program, rp.Collectives]] = []
    parts: list[tuple[str, list[int], Report]] = []
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
        parts.append((f"{layout.dim}={','.join(str(p.index) for p in members)}", ranks, report))
        whole = replace(rep_program, ranks=tuple(ranks))
        by_program.append((whole, seen))
    merged.runs = joined_runs([report for _w, _r, report in parts])
    merged.findings = [
        *rp.p2p_findings(layout, sent, first_module, modes),
        *rp.collective_findings(by_program, layout.dim, modes),
        *said_for_ranks(parts),
    ]
    merged.extra["p2p"] = [
        {"from": a.index, "to": b.index, "send": _specs(sent[a.index]), "recv": _specs(b.receives or sent[a.index])}
        for a, b in itertools.pairwise(layout.programs)
        if layout.dim == "pp" and a.index in sent
    ]
    return merged


def said_for_ranks(parts: Sequence[tuple[str, Sequence[int], Report]]) -> list[Finding]:
    """The findings of the programs' reports (``(label, ranks, report)``, one per distinct
    program), each said once for the ranks of every program that has it: its message ends
    ``[pp=1,2: ranks 4-11]`` (``[rank 1]`` with no label), its details gain ``ranks``."""
    said: dict[tuple[str, str | None, str], tuple[Finding, list[tuple[str, list[int]]]]] = {}
    for which, ranks, report in parts:
        for f in report.findings:
            said.setdefault((f.code, f.module, f.message), (f, []))[1].append((which, list(ranks)))
    out: list[Finding] = []
    for f, where in said.values():
        ranks = sorted(r for _w, rs in where for r in rs)
        shown = "; ".join(w for w, _r in where if w)
        where_text = f"{shown}: {rp.ranks_text(ranks)}" if shown else rp.ranks_text(ranks)
        details = f.details if any(k == "ranks" for k, _v in f.details) else (*f.details, ("ranks", ranks))
        out.append(replace(f, message=f"{f.message} [{where_text}]", details=details))
    return out


_WORST = {"ok": 0, "error": 1, "incomplete": 2}


def joined_runs(reports: Sequence[Report]) -> list[Run]:
    """The programs' runs, one per mode / device / policy / kind, with the worst status among
    them ("eval on cpu: error" where one program's eval run failed, not "ok, error")."""
    joined: dict[tuple[Any, ...], Run] = {}
    for report in reports:
        for run in report.runs:
            key = (run.mode, run.device, run.policy, run.kind)
            seen = joined.get(key)
            if seen is None or _WORST[run.status] > _WORST[seen.status]:
                joined[key] = run
    return list(joined.values())


def merge_ranks(parts: Sequence[tuple[Sequence[int], Report]], world: int) -> Report:
    """One report for the programs the ranks of a launched job ran (``castwise run`` under
    torchrun): ``parts`` holds each distinct program's ranks and report. One program on every rank
    (DDP replicas): its report, the title saying so; several: each finding names its ranks."""
    parts = sorted(parts, key=lambda p: min(p[0]))
    first = parts[0][1]
    ran = sorted(r for ranks, _r in parts for r in ranks)
    missing = sorted(set(range(world)) - set(ran))
    gap = f"; {rp.ranks_text(missing)} reported nothing" if missing else ""
    if len(parts) == 1:
        merged = replace(first, findings=list(first.findings), extra=dict(first.extra))
        merged.title = f"{first.title} - the same program on {rp.ranks_text(ran)} of {world}{gap}"
    else:
        merged = Report(
            findings=said_for_ranks([("", ranks, r) for ranks, r in parts]),
            runs=joined_runs([r for _ranks, r in parts]),
            summary=first.summary,
            title=f"{first.title} - {len(parts)} distinct rank programs over {world} ranks{gap}",
        )
    merged.extra["programs"] = [
        {"ranks": list(ranks), "title": r.title, "findings": [f.code for f in r.findings]} for ranks, r in parts
    ]
    return merged


def _tensors(specs: tuple[rp.Spec, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(s.shape, dtype=to_torch(canonical(s.dtype) or s.dtype)) for s in specs)


def _root_outputs(report: Report) -> tuple[rp.Spec, ...]:
    """What the program returns (every tensor of a tuple: a stage sends each to the next)."""
    root = next((m for m in report.summary.get("modules", []) if m.get("name") == ""), None)
    specs = (rp.spec_of(text) for text in (root.get("outputs") or [] if root else []))
    return tuple(s for s in specs if s is not None)


def _specs(specs: tuple[rp.Spec, ...]) -> str:
    return ", ".join(str(s) for s in specs)


def _first_module(module: torch.nn.Module) -> str:
    """The first named child with parameters: where a received activation enters the stage."""
    return next((n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))), "")
