"""``torch.compile``'d modules: the module the user wrote inside the compile wrapper.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds ``model`` as ``_orig_mod``
and shares its parameters. castwise works on the module the user wrote: a policy's selectors
name its modules (``keep[head]=f32``, not ``_orig_mod.head``), and so do findings. Read without
importing ``torch._dynamo`` (seconds to import).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class CompileOptions:
    """How the user compiled the model (what an audit compiles its copy with)."""

    fullgraph: bool = False
    dynamic: bool | None = None
    # the backend's name ("inductor", "aot_eager", a function's name); None: not known
    backend: str | None = "inductor"

    @property
    def inductor(self) -> bool:
        """Whether the program is Inductor's: its graphs are lowered after Inductor's decompositions."""
        return self.backend in _INDUCTOR


_INDUCTOR = frozenset({"inductor", "compile_fx"})  # torch.compile's default, and its function


def compiled_parts(model: nn.Module) -> tuple[nn.Module, CompileOptions] | None:
    """``(the module it compiled, its options)`` for a ``torch.compile``'d module, else None."""
    if type(model).__name__ != "OptimizedModule":
        return None
    orig = getattr(model, "_orig_mod", None)
    if not isinstance(orig, nn.Module):
        return None
    ctx = getattr(model, "dynamo_ctx", None)
    dynamic = getattr(ctx, "_dynamic", None)
    return orig, CompileOptions(
        bool(getattr(ctx, "fullgraph", False)), dynamic if isinstance(dynamic, bool) else None, _backend_name(ctx)
    )


def _backend_name(ctx: object) -> str | None:
    """The name of the backend the user compiled with: Dynamo wraps it (a frame converter over a
    debug wrapper) and the innermost keeps the name it was given."""
    backend = getattr(ctx, "callback", None)
    for _ in range(4):
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return name if isinstance(name, str) else None


def uncompiled(model: nn.Module) -> nn.Module:
    """The module the user wrote: ``model`` itself, or what its ``torch.compile`` wraps."""
    parts = compiled_parts(model)
    return uncompiled(parts[0]) if parts is not None else model


__all__ = ["CompileOptions", "compiled_parts", "uncompiled"]
