"""`castwise audit TARGET --torch A,B`: every module whose dtype flow changes between two torch
releases' autocast, from their recorded lists (neither needs to be installed)."""

from __future__ import annotations

import json
from typing import Any

from castwise.cli import EXIT_OK, emit


def releases_of(value: str) -> tuple[str, ...]:
    """``--torch`` as one or two recorded releases, checked before the model loads."""
    from castwise._releases import TorchReleaseError, parse_release

    parts = tuple(parse_release(p) for p in value.split(","))
    if len(parts) > 2:
        raise TorchReleaseError(f"--torch {value}: one release (2.11) or two to compare (2.11,2.15), not {len(parts)}")
    return parts


def render(diff: dict[str, Any]) -> str:
    before, after = diff["releases"]
    head = f"castwise audit --torch {before},{after} (device {diff['device']})"
    lines = [head, "=" * len(head)]
    if not diff["modules"]:
        lines.append(f"no module's dtype flow changes between torch {before} and {after}")
    for m in diff["modules"]:
        old, new = m[before], m[after]
        lines.append(f"{m['module']} ({m['type']})")
        for side in ("inputs", "outputs"):
            if old[side] != new[side]:
                lines.append(
                    f"  {side}: {', '.join(old[side])} (torch {before}) -> {', '.join(new[side])} (torch {after})"
                )
    if diff["autocast"]:
        lines.append("")
        lines.append(f"autocast list changes on {diff['device']} ({before} -> {after}):")
        for op, (a, b) in diff["autocast"].items():
            lines.append(f"  {op}: {a or 'not listed'} -> {b or 'not listed'}")
    return "\n".join(lines)


def diff_main(
    model: Any,
    inputs: Any,
    pair: tuple[str, ...],
    policy: str | None,
    device: str | None,
    fake: bool,
    json_path: str | None,
) -> int:
    from castwise.auditor.entry import release_changes
    from castwise.run import check

    request = check("audit", model, inputs, policy=policy, device=device, fake=fake)
    diff = release_changes(request, pair[0], pair[1])
    emit(render(diff), json.dumps(diff, indent=1), json_path)
    return EXIT_OK
