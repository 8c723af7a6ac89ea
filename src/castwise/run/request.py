"""``RunRequest``: the model, its inputs, the policy, the device, the mode and fake/real, checked
once with one wording (what was wrong, the valid options sorted, the fix) for every entry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from castwise import devices
from castwise.errors import AuditError, CastwiseError, PolicyError
from castwise.ledger.model import OptimizerSpec
from castwise.policy import Policy
from castwise.run.inputs import Inputs

AUDIT_MODES = ("both", "eval", "train")
RUN_MODES = ("eval", "train")  # a real run is one mode: numerics


@dataclass(frozen=True, eq=False)
class RunRequest:
    """One checked request: ``device`` a registered name, ``policy`` parsed (None: as it is)."""

    model: nn.Module
    inputs: Inputs
    policy: Policy | None
    device: str
    mode: str
    fake: bool
    torch_release: str | None = None  # autocast as this recorded torch release ran it (None: this torch)
    step: OptimizerSpec | None = None  # the audit's optimizer step after the train run's backward (the ledger)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", Inputs.of(self.inputs))  # a raw batch is parsed here, once

    def under(self, policy: Policy | None) -> RunRequest:
        return replace(self, policy=policy)

    @property
    def torch_device(self) -> str:
        """The torch device a real run uses ("cpu", "cuda")."""
        return devices.get(self.device).fake_device


def model_device(model: nn.Module) -> str:
    """Where the model lives: the device type of its first parameter or buffer ("cpu" for none,
    and for the meta device: a meta model is audited for, and materialised on, the CPU)."""
    for t in (*model.parameters(), *model.buffers()):
        return "cpu" if t.device.type == "meta" else t.device.type
    return "cpu"


def _valid(value: str, options: Sequence[str]) -> str:
    return f"{value} is not valid; valid: {', '.join(sorted(options))}"


def _device(device: Any, model: nn.Module) -> devices.Device:
    if device is None:
        where = model_device(model)
        try:
            return devices.get(where)
        except CastwiseError:
            raise AuditError(
                f"the model is on {where!r}; castwise simulates {', '.join(sorted(devices.names()))}: pass "
                "device='cpu' or device='cuda'"
            ) from None
    try:
        return devices.get(device)
    except CastwiseError:
        raise AuditError(_valid(f"device={device!r}", devices.names()) + " (or None: where the model is)") from None


def _policy(policy: Any) -> Policy | None:
    if policy is None:
        return None
    if not isinstance(policy, (str, Policy)):
        raise AuditError(f"policy must be a castwise.Policy, a policy string or None, not {type(policy).__name__}")
    try:
        return Policy.parse(policy)
    except PolicyError as exc:
        raise AuditError(f"policy: {exc}") from exc


def _check_real(what: str, model: nn.Module, target: devices.Device, meta_ok: bool) -> None:
    """A real run uses this machine's kernels: only a device this machine is, and values."""
    # the audit can run any device and size on fake tensors instead
    fake = f", or fake=True (the default) to audit {target.name}" if what == "audit" else ""
    if target.kernels == "cuda" and not torch.cuda.is_available():
        raise AuditError(
            f"{what} on real tensors runs on this machine, which has no CUDA device; pass device='cpu'{fake}"
        )
    here = devices.other_cpu(target)
    if here is not None and target.caps is not None:
        raise AuditError(
            f"{what} on real tensors runs this machine's CPU kernels ({here.describe()}), not those of "
            f"{target.name} ({target.caps.describe()}); pass device='cpu'{fake}"
        )
    from castwise.trace.fake import on_meta

    if not meta_ok and on_meta(model):
        raise AuditError(
            f"{type(model).__name__} is on the meta device: {what} on real tensors needs values; materialise it "
            f"first{fake or ', or pass a shrunk config'}"
        )


def check(
    what: str,
    model: Any,
    inputs: Any,
    *,
    policy: Any = None,
    device: Any = None,
    mode: Any = "both",
    fake: Any = True,
    modes: Sequence[str] = AUDIT_MODES,
    meta_ok: bool = False,
    applied_ok: bool = False,
    torch_release: Any = None,
) -> RunRequest:
    """The request of entry ``what`` ("audit", "locate_nonfinite"...) checked and normalised, or an
    AuditError naming what was wrong and the valid choices (``modes``: those the entry takes;
    ``meta_ok``: a layerwise run materialises meta weights itself; ``applied_ok``: the entry runs
    the user's model as it is, under ``castwise.apply`` too)."""
    if not isinstance(model, nn.Module):
        raise AuditError(
            f"{what} needs a torch.nn.Module, got {type(model).__name__}; pass the model and its inputs: "
            f"{what}(model, inputs, ...)"
        )
    if mode not in modes:
        raise AuditError(_valid(f"mode={mode!r}", modes))
    if not isinstance(fake, bool):
        raise AuditError(_valid(f"fake={fake!r}", ("False", "True")))
    target = _device(device, model)
    from castwise.applied import applied_to

    applied = None if applied_ok else applied_to(model)
    if applied is not None:
        # its forwards are wrapped by closures over this very object, which a copy would still call
        raise AuditError(
            f"{type(model).__name__} is under castwise.apply (policy {applied.policy}); pass the model as it "
            f"was before applying, with policy='{applied.policy}', or call .remove() on the Applied first"
        )
    pol = _policy(policy)
    if not fake:
        _check_real(what, model, target, meta_ok)
    from castwise._releases import parse_release

    release = None if torch_release is None else parse_release(torch_release)
    return RunRequest(model, Inputs.of(inputs), pol, target.name, str(mode), fake, release)
