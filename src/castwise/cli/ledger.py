"""`castwise ledger TARGET|CONFIG`: per parameter group, where each precision is kept.

A training configuration (DeepSpeed, TrainingArguments, torchtitan, Megatron script, Accelerate,
Lightning, SimpleTuner) is read without torch; a model target (the `castwise audit` syntax) gets
one real step of its optimizer on a copy, and ``optimizer.state`` is read as it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from castwise.cli import EXIT_FINDINGS, EXIT_OK, check_json_path, emit, guard, json_option, terminal_width
from castwise.errors import CastwiseError

_CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".toml", ".env", ".sh")


def _config_ledger(targets: tuple[str, ...]) -> Any:
    """The config ledger, or None where TARGET is not a training configuration."""
    from castwise.errors import ConfigError
    from castwise.ledger import ledger_from_config

    paths = [Path(t) for t in targets]
    if not all(p.is_file() and p.suffix.lower() in _CONFIG_SUFFIXES for p in paths):
        return None
    try:
        return ledger_from_config(list(targets) if len(targets) > 1 else targets[0])
    except ConfigError:
        if len(targets) == 1 and paths[0].suffix.lower() == ".json":
            return None  # a model's config.json: the audit's target syntax reads it
        raise


def _optimizer_class(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not isinstance(cls, type):
        raise CastwiseError(f"--optimizer {path!r}: not an importable class (e.g. torch.optim.AdamW)")
    return cls


def optimizer_options(optimizer: str | None, lr: float | None, kwargs: str | None) -> dict[str, Any]:
    """``--optimizer CLASS --lr X --optimizer-kwargs JSON`` as audit's keyword arguments ({} without
    --optimizer), or a CastwiseError saying what was wrong."""
    if optimizer is None:
        if lr is not None or kwargs is not None:
            raise CastwiseError("--lr and --optimizer-kwargs go with --optimizer CLASS (e.g. torch.optim.AdamW)")
        return {}
    extra = _kwargs(kwargs)
    return {
        "optimizer": _optimizer_class(optimizer),
        "optimizer_kwargs": {**({"lr": lr} if lr is not None else {}), **extra},
    }


def _kwargs(kwargs: str | None) -> dict[str, Any]:
    try:
        extra = json.loads(kwargs) if kwargs else {}
    except ValueError as exc:
        raise CastwiseError(f"--optimizer-kwargs: not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise CastwiseError('--optimizer-kwargs: give a JSON object, e.g. {"weight_decay": 0.1}')
    return extra


def _model_ledger(target: str, optimizer: str, lr: float, kwargs: str | None) -> Any:
    from castwise.cli.target import load_target
    from castwise.ledger.checks import ledger_with_findings
    from castwise.ledger.model import OptimizerSpec

    extra = _kwargs(kwargs)
    model, _ = load_target(target)
    names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    spec = OptimizerSpec(_optimizer_class(optimizer), ((names, {"lr": lr, **extra}),))
    return ledger_with_findings(model, spec, source=target)


def _checkpoint_ledger(
    targets: tuple[str, ...], against: tuple[str, ...], options: tuple[str, float, str | None]
) -> Any:
    """The ledger of a checkpoint file (None: TARGET is none), with CW155 against ``against``."""
    import dataclasses

    from castwise.ledger.checkpoint import CHECKPOINT_SUFFIXES, ledger_from_checkpoint, resume_findings

    if len(targets) != 1 or Path(targets[0]).suffix.lower() not in CHECKPOINT_SUFFIXES:
        if against:
            raise CastwiseError(f"--against goes with a checkpoint file ({', '.join(sorted(CHECKPOINT_SUFFIXES))})")
        return None
    result = ledger_from_checkpoint(targets[0])
    if against:
        target = _config_ledger(against)
        if target is None:
            if len(against) > 1:
                raise CastwiseError("--against: give one model target, or training configuration files")
            target = _model_ledger(against[0], *options)
        result = dataclasses.replace(result, findings=(*result.findings, *resume_findings(result, target)))
    return result


@click.command("ledger")
@click.argument("targets", nargs=-1, required=True)
@click.option("--optimizer", default="torch.optim.AdamW", show_default=True, help="Optimizer class (model targets).")
@click.option("--lr", default=1e-3, show_default=True, type=float, help="Learning rate of the step (model targets).")
@click.option("--optimizer-kwargs", default=None, metavar="JSON", help="More optimizer settings (model targets).")
@click.option(
    "--against",
    multiple=True,
    metavar="TARGET|CONFIG",
    help="With a checkpoint file: the run it resumes into; the fields a resume changes are named (CW155).",
)
@json_option("ledger")
def ledger(
    targets: tuple[str, ...],
    optimizer: str,
    lr: float,
    optimizer_kwargs: str | None,
    against: tuple[str, ...],
    json_path: str | None,
) -> int:
    """The precision ledger of training CONFIG files, a model TARGET and its optimizer, or a
    checkpoint file (torch.save / safetensors; --against the run it resumes into)."""

    def body() -> int:
        check_json_path(json_path)
        result = _checkpoint_ledger(targets, against, (optimizer, lr, optimizer_kwargs))
        if result is None:
            result = _config_ledger(targets)
        if result is None:
            if len(targets) > 1:
                raise CastwiseError("give one model target, or training configuration files")
            result = _model_ledger(targets[0], optimizer, lr, optimizer_kwargs)
        emit(result.render(terminal_width()), json.dumps(result.to_dict(), indent=2), json_path)
        return EXIT_FINDINGS if any(f.level == "error" for f in result.findings) else EXIT_OK

    return guard(body)
