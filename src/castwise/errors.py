"""castwise's exceptions: one base, one subclass per kind of bad input or failure."""

from __future__ import annotations


class CastwiseError(Exception):
    """Base of every error castwise raises on purpose."""


class PolicyError(CastwiseError, ValueError):
    """A precision policy string or value is malformed or contradicts itself."""


class RuleError(PolicyError):
    """Module rules of a policy are malformed, or two rules disagree on one module."""


class ApplyError(CastwiseError):
    """`apply` cannot manage a model's dtypes (e.g. quantised weights)."""


class AuditError(CastwiseError):
    """An audit was asked for something it cannot do (bad mode, device, inputs)."""


class CudaSimulationError(AuditError):
    """A fake-tensor audit cannot simulate a CUDA device with this torch build."""


class TargetError(CastwiseError):
    """A CLI target (`file.py:function` or `module:function`) cannot be loaded."""


class ConfigError(CastwiseError):
    """A training configuration file cannot be read."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        where = path if path is not None else ""
        if line is not None:
            where = f"{where}:{line}" if where else f"line {line}"
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        self.line = line


class BrowserError(CastwiseError):
    """Chromium is missing or did not answer."""


class HtmlWriteError(CastwiseError):
    """The HTML report could not be written where asked."""


class ExportError(CastwiseError):
    """A policy says something the target's configuration cannot (and ``strict=True``)."""


class RunStopped(CastwiseError):
    """``castwise run --stop``: the audit of a model found an error, and the script was stopped."""


class ShardError(CastwiseError):
    """``castwise.fsdp2`` cannot shard a model as asked (no process group, a bad unit, ...)."""
