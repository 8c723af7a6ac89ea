"""CLI targets: ``path/to/file.py:function`` or ``package.module:function`` returning (model, inputs)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from castwise.errors import TargetError


def load_target(target: str) -> tuple[nn.Module, Any]:
    """Load ``path/to/file.py:function`` or ``package.module:function`` and call it: (model, inputs)."""
    if ":" not in target:
        raise TargetError(f"target {target!r} names no function; valid forms: module:function, path/file.py:function")
    where, _, func_name = target.rpartition(":")
    if not where or not func_name.isidentifier():
        raise TargetError(f"target {target!r}: {func_name!r} is not a function name; valid forms: module:function, "
                          "path/file.py:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"target {target!r}: no file {where!r}")
        mod_name = f"castwise_target_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"target {target!r}: cannot load {where!r} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look their module up there
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise TargetError(f"target {target!r}: importing {where} raised {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise TargetError(f"target {target!r}: cannot import module {where!r} ({type(exc).__name__}: {exc})") \
                from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise TargetError(f"target {target!r}: {where} has no function {func_name!r}; functions there: "
                          f"{', '.join(names) or '(none)'}")
    try:
        result = func()
    except Exception as exc:
        raise TargetError(f"target {target!r}: {func_name}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TargetError(f"target {target!r}: {func_name}() must return (model, inputs) with an nn.Module, got "
                          f"{type(result).__name__}")
    return result[0], result[1]
