"""`castwise run SCRIPT`: a user's own training script, audited at each model's first forward.

The script runs as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, ``sys.path``, its
exit code). While it runs, ``nn.Module.__call__`` is wrapped: the first time a model is called
from outside any other module's forward (a *root* call), castwise audits a fake copy of it with
fake copies of the real arguments, in the precision the script runs it in (its own
``torch.autocast``, or that of the framework whose wrapper it called, Lightning Fabric's or
Accelerate's: see ``frameworks``; ``--policy`` replaces either), in train and eval mode, so a
crash only validation would meet is reported before the first training step runs. ``GradScaler.__init__``
is wrapped too: under f16 autocast the audit scales the loss only once the script has made an
enabled GradScaler. Each optimizer's first four steps are read through torch's global step hooks
(``castwise.ledger.runtime``): its ledger, CW150-CW154, CW232 under FSDP2. The user's model, inputs and every global
setting are left as they were; the wrappers are removed when the script ends.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from castwise import devices
from castwise._dtypes import short_of
from castwise.distributed.programs import Spec, signature
from castwise.errors import RunStopped
from castwise.integrations._steps import audit_or_skip, random_streams_kept
from castwise.integrations.frameworks import Framed, framed, framework_backward, preset_note
from castwise.integrations.imports import imported_as_on, imported_note
from castwise.integrations.ranks import Meeting
from castwise.ledger.runtime import StepProbe, watch_steps
from castwise.ledger.values import Ledger
from castwise.report import Report
from castwise.run import Inputs, model_device

__all__ = ["RunStopped", "Watcher", "ambient_policy", "run_script"]


@dataclass
class Watcher:
    """Audits each root module at its first call. ``policy`` None: the precision the script
    runs the model in; ``on_report`` sees each report as it is made."""

    policy: str | None = None
    device: str | None = None
    mode: str = "both"
    stop: bool = False
    on_report: Callable[[str, Report], None] | None = None
    reports: list[tuple[str, Report]] = field(default_factory=list)
    on_note: Callable[[str], None] | None = None
    notes: list[str] = field(default_factory=list)  # what castwise says of the run beside the reports
    _noted: bool = False
    _seen: set[int] = field(default_factory=set)
    _depth: int = 0
    _busy: bool = False
    scaled: bool = False  # an enabled GradScaler was made: the script scales its f16 loss
    ledgers: list[Ledger] = field(default_factory=list)  # each optimizer's, from its first steps
    _names: dict[int, str] = field(default_factory=dict)  # the script's models' parameters, by id
    _roots: list[nn.Module] = field(default_factory=list)  # the script's models (the ledger reads FSDP2's dtypes)
    meeting: Meeting | None = None  # torchrun / accelerate launch: the ranks' programs meet on rank 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[Watcher]:
        original = nn.Module.__call__
        scaler_init = torch.amp.GradScaler.__init__
        watcher = self

        # torch.cuda.amp's, Lightning's, Accelerate's and FSDP's scalers all init through this one
        def init_scaler(scaler: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> None:
            scaler_init(scaler, *args, **kwargs)
            watcher.scaled = watcher.scaled or scaler.is_enabled()

        def __call__(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if watcher._depth == 0 and not watcher._busy and id(module) not in watcher._seen:
                watcher._seen.add(id(module))
                watcher._first_call(module, args, kwargs)
            watcher._depth += 1
            try:
                return original(module, *args, **kwargs)
            finally:
                watcher._depth -= 1

        nn.Module.__call__ = __call__  # type: ignore[method-assign]
        torch.amp.GradScaler.__init__ = init_scaler  # type: ignore[method-assign,assignment]
        # each optimizer's first steps, read as the script takes them (the precision ledger)
        probe = StepProbe(names=lambda p: self._names.get(id(p)), on_ledger=self._ledger, modules=lambda: self._roots)
        try:
            with watch_steps(probe):
                yield self
        finally:
            nn.Module.__call__ = original  # type: ignore[method-assign]
            torch.amp.GradScaler.__init__ = scaler_init  # type: ignore[method-assign]

    def _first_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not any(isinstance(p, torch.Tensor) for p in module.parameters()):
            return  # nothing a dtype audit could check
        for n, p in module.named_parameters():  # what the ledger calls the optimizer's parameters
            self._names.setdefault(id(p), n)
        self._roots.append(module)
        from castwise.auditor import audit

        inputs = Inputs.called(args, kwargs)  # the call as the script made it
        # a framework's wrapper (Fabric, Accelerate): its user's module, under the policy that models it
        framework = framed(module)
        model = framework.audited(self.policy) if framework is not None else module
        policy = self.policy if self.policy is not None else self._policy_of(model, framework)
        self._note_presets()
        name = type(model).__name__

        def run_audit() -> Report | None:
            report = audit_or_skip(
                lambda: audit(model, inputs, policy=policy, device=self.device, mode=self.mode),
                f"{name} (castwise run)",
            )
            if report is not None and framework is not None:  # the precision the run used, and whence
                report.title = f"{report.title[:-1]}{framework.describe(self.policy)})"
                report.extra["framework"] = framework.to_dict(self.policy)
            return report

        self._busy = True  # the audit calls modules too: none of those is the script's first call
        try:
            # the script's random streams stay as they were, and its own dispatch modes do not see
            # the audit's ops (litgpt's measure_flops counts a meta model's FLOPs in a FlopCounterMode)
            with random_streams_kept(), framework_backward(framework), _disable_current_modes():
                if self.meeting is None:
                    report = run_audit()
                else:  # torchrun: audited once per distinct program, joined and printed by rank 0
                    report = self.meeting.audit(name, self._program(model, inputs, policy), run_audit)
        finally:
            self._busy = False
        if report is None:
            return
        if self.meeting is None:
            self.reports.append((name, report))
            if self.on_report is not None:
                self.on_report(name, report)
        if self.stop and report.errors:
            first = report.errors[0]
            raise RunStopped(f"castwise run --stop: {name}: {first.code} at `{first.module}`: {first.message}")

    def _program(self, model: nn.Module, inputs: Inputs, policy: str | None) -> str:
        """What makes two ranks' models the same program to audit (the meeting's fingerprint)."""
        handed = tuple(Spec(short_of(t.dtype), tuple(t.shape)) for t in inputs.tensors())
        return repr((signature(model, handed), policy, self.device, self.mode))

    def _ledger(self, ledger: Ledger) -> None:
        """An optimizer's ledger from the script's own first steps; shown as a report when it
        has findings (``ledgers``: every optimizer's, for the JSON)."""
        self.ledgers.append(ledger)
        if ledger.findings and self.on_report is not None:
            report = Report(findings=list(ledger.findings), title=f"castwise ledger of {ledger.source}")
            report.extra["ledger"] = ledger.to_dict()
            self.on_report(ledger.source, report)

    def _policy_of(self, model: nn.Module, framework: Framed | None) -> str | None:
        if framework is not None and framework.policy is not None:
            return framework.policy
        return ambient_policy(model_device(model), scaled=self.scaled)

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.on_note is not None:
            self.on_note(text)

    def _note_presets(self) -> None:
        """Once per run: a bare ``--policy`` preset that Lightning also has, where castwise's
        meaning differs from Lightning's and the script runs Lightning."""
        if self.policy is None or self._noted:
            return
        self._noted = True
        note = preset_note(self.policy)
        if note is not None:
            self.note(note)


def ambient_policy(device_type: str, *, scaled: bool = False) -> str | None:
    """The policy that runs a model as it is called now: the script's own autocast for the
    model's device type (weights left as they are), or None (no autocast: the model as it is).
    Under f16 autocast, loss scaling only where the script made a GradScaler (``scaled``)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype == torch.bfloat16:
        # the script's autocast casts nothing but at each op: no islands castwise would add
        return "bf16-mixed,keep_in_fp32=off"
    if dtype == torch.float16:
        return "16-mixed,keep_in_fp32=off" + ("" if scaled else ",loss_scale=off")
    return None


def run_script(target: str, argv: list[str], watcher: Watcher | None, *, module: bool = False) -> int:
    """Run ``target`` (a file, or a module with ``module=True``) as ``python`` would, with
    ``sys.argv = [target, *argv]``, under ``watcher`` (None: unwatched); its exit code."""
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.argv = [target, *argv]
    # python puts the script's folder first, and `python -m` the current directory (a package run
    # from its repository's root imports itself from there); castwise's own entry point put neither
    root = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    sys.path.insert(0, root)
    code = 0
    # a simulated GPU: the script's own modules choose at import what they would choose on it
    target_device = devices.get(watcher.device) if watcher is not None and watcher.device else None
    with imported_as_on(target_device, root) as own:
        try:
            with watcher.watching() if watcher is not None else contextlib.nullcontext():
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(os.path.abspath(target), run_name="__main__")  # __file__ absolute, as python's
        except SystemExit as exc:
            code = _exit_code(exc.code)
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            if own and watcher is not None and target_device is not None:
                watcher.note(imported_note(target_device, own))
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as python does with sys.exit("message")
    return 1
