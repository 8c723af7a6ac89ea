"""``torch.compile``'d modules: the module the user wrote inside the compile wrapper.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds ``model`` as ``_orig_mod``
and shares its parameters. castwise works on the module the user wrote: a policy's selectors
name its modules (``keep[head]=f32``, not ``_orig_mod.head``), and so do findings. Read without
importing ``torch._dynamo`` (seconds to import).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class CompileOptions:
    """How the user compiled the model (what an audit compiles its copy with)."""

    fullgraph: bool = False
    dynamic: bool | None = None
    # the backend's name ("inductor", "aot_eager", a function's name); None: not known
    backend: str | None = "inductor"
    # the modules compiled on their own (``block.compile()``, ``layers[i] = torch.compile(b)``), by
    # the user's names; empty: the whole model
    blocks: tuple[str, ...] = ()

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
    return orig, _options(getattr(model, "dynamo_ctx", None))


def _options(ctx: object) -> CompileOptions:
    """The options of one ``torch.compile`` call, read off its context (Dynamo's OptimizeContext)."""
    dynamic = getattr(ctx, "_dynamic", None)
    return CompileOptions(
        bool(getattr(ctx, "fullgraph", False)), dynamic if isinstance(dynamic, bool) else None, _backend_name(ctx)
    )


def _in_place(module: nn.Module) -> CompileOptions | None:
    """The options of ``module.compile()`` (nn.Module.compile: ``torch.compile(self._call_impl)``
    kept as ``_compiled_call_impl``), None when it was not compiled in place. The compiled function
    holds its context in its closure (torch/_dynamo/eval_frame.py, ``_TorchDynamoContext.__call__``)."""
    fn = module.__dict__.get("_compiled_call_impl")
    if fn is None:
        return None
    cells = getattr(fn, "__closure__", None) or ()
    ctx = next((c.cell_contents for c in cells if type(c.cell_contents).__name__.endswith("OptimizeContext")), None)
    return _options(ctx)


def compiled_blocks(model: nn.Module) -> tuple[tuple[str, CompileOptions], ...]:
    """The modules of ``model`` compiled on their own, by the user's names (``_orig_mod`` left
    out), outermost first, none inside another: ``""`` when the root was compiled in place."""
    found: list[tuple[str, CompileOptions]] = []

    def walk(module: nn.Module, name: str) -> None:
        parts = compiled_parts(module)
        options = parts[1] if parts is not None else _in_place(module)
        if options is not None:
            found.append((name, options))
            return
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, f"{name}.{child_name}" if name else child_name)

    walk(model, "")
    return tuple(found)


def user_view(model: nn.Module) -> nn.Module:
    """``model`` without the compile wrappers inside it: an ``OptimizedModule`` child replaced by
    the module it compiled, a module compiled in place without its compiled call. Modules on the
    way to one are new objects sharing every tensor and untouched child; ``model`` is unchanged
    (its copy would otherwise call the user's own modules through the compiled functions)."""
    model = uncompiled(model)
    inner = {id(c): _viewed(c) for c in model._modules.values() if c is not None}
    changed = any(inner[id(c)] is not c for c in model._modules.values() if c is not None)
    if not changed and _in_place(model) is None:
        return model
    view: nn.Module = object.__new__(type(model))
    state = dict(model.__dict__)
    children = model._modules.items()
    state["_modules"] = type(model._modules)((n, None if c is None else inner[id(c)]) for n, c in children)
    if "_compiled_call_impl" in state:
        state["_compiled_call_impl"] = None
    for key, value in state.items():
        if isinstance(value, types.MethodType) and value.__self__ is model:
            state[key] = types.MethodType(value.__func__, view)  # an instance's own forward: the view's
    view.__dict__.update(state)
    return view


def _viewed(module: nn.Module) -> nn.Module:
    return user_view(module) if compiled_parts(module) is not None or _has_compiled(module) else module


def _has_compiled(module: nn.Module) -> bool:
    return any(compiled_parts(m) is not None or _in_place(m) is not None for m in module.modules())


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


__all__ = ["CompileOptions", "compiled_blocks", "compiled_parts", "uncompiled", "user_view"]
