"""What `castwise audit TARGET` audits: a builder function, or a model built from a local
transformers ``config.json`` on the meta device (no weights, no hub).

Forms: ``path/to/file.py:function`` and ``package.module:function`` (the function returns
``(model, inputs)``); ``path/to/config.json``, a folder holding one, or ``hf:PATH_OR_DIR``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from castwise.errors import TargetError

if TYPE_CHECKING:
    from torch import nn

FORMS = "module:function, path/file.py:function, path/config.json, hf:PATH_OR_DIR"
DEFAULT_SEQ_LEN = 128
_MAX_CONFIG_BYTES = 4 * 1024 * 1024  # model configs are a few KB: anything larger is not one


@contextlib.contextmanager
def working_dir_on_path() -> Iterator[None]:
    """The working directory first on ``sys.path`` (as ``python -m`` puts it) while a target loads
    and runs: `castwise audit pkg.mod:fn` from a project root finds ``pkg``. Removed after."""
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def is_config_target(target: str) -> bool:
    """``hf:...``, a ``.json`` file, or a folder with a ``config.json``."""
    if target.startswith("hf:") or target.endswith(".json"):
        return True
    return ":" not in target and (Path(target) / "config.json").is_file()


def load_target(target: str, *, seq_len: int | None = None) -> tuple[nn.Module, Any]:
    """The ``(model, inputs)`` a target names: a builder function's result, or a transformers
    model built from a config on the meta device with token ids of ``seq_len`` (default 128)."""
    if is_config_target(target):
        return load_config(target, DEFAULT_SEQ_LEN if seq_len is None else seq_len)
    if seq_len is not None:
        raise TargetError(
            f"--seq-len applies to config targets (path/config.json, hf:PATH_OR_DIR), not to "
            f"{target!r}: its function makes the inputs"
        )
    with working_dir_on_path():
        return _call_builder(target)


# -- builder functions --------------------------------------------------------------------------


def _split(target: str) -> tuple[str, str]:
    if ":" not in target:
        raise TargetError(f"target {target!r} names no function; valid forms: {FORMS}")
    where, _, func_name = target.rpartition(":")
    if not where or not func_name.isidentifier():
        raise TargetError(f"target {target!r}: {func_name!r} is not a function name; valid forms: {FORMS}")
    return where, func_name


def _import_file(target: str, where: str) -> ModuleType:
    path = Path(where)
    if not path.is_file():
        raise TargetError(f"target {target!r}: no file {where!r}")
    mod_name = f"castwise_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"target {target!r}: cannot load {where!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look their module up there
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(mod_name, None)
        raise TargetError(f"target {target!r}: importing {where} raised {_name(exc)}") from exc
    finally:
        sys.path.remove(folder)
    return module


def _import_module(target: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(where)
    except (Exception, SystemExit) as exc:
        raise TargetError(f"target {target!r}: cannot import module {where!r} ({_name(exc)})") from exc


def _name(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def _call_builder(target: str) -> tuple[nn.Module, Any]:
    from torch import nn

    where, func_name = _split(target)
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(target, where) if is_file else _import_module(target, where)
    func = getattr(module, func_name, None)
    if not callable(func):
        names = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise TargetError(
            f"target {target!r}: {where} has no function {func_name!r}; functions there: {', '.join(names) or '(none)'}"
        )
    try:
        result = func()
    except (Exception, SystemExit) as exc:
        raise TargetError(f"target {target!r}: {func_name}() raised {_name(exc)}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TargetError(
            f"target {target!r}: {func_name}() must return (model, inputs) with an nn.Module "
            f"first; {_what_came_back(result)}"
        )
    return result[0], result[1]


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _what_came_back(result: Any) -> str:
    """Say what is wrong with a builder's result, not only its type."""
    from torch import nn

    if not isinstance(result, tuple):
        hint = " (return model, inputs as a tuple)" if isinstance(result, (list, dict, nn.Module)) else ""
        return f"got {_kind(result)}{hint}"
    items = ", ".join(_kind(v) for v in result[:4]) + (", ..." if len(result) > 4 else "")
    if len(result) != 2:
        extra = " (put several inputs in one tuple or dict: model, (x, mask))" if len(result) > 2 else ""
        return f"got a tuple of {len(result)} items ({items}){extra}"
    if isinstance(result[1], nn.Module):
        return f"got ({items}): swap them, the model comes first"
    return f"got ({items}): the first item is a {type(result[0]).__name__}, not an nn.Module"


# -- transformers configs ------------------------------------------------------------------------


def _config_file(target: str) -> Path:
    where = target.removeprefix("hf:")
    path = Path(where)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise TargetError(f"target {target!r}: the folder {where!r} has no config.json; valid forms: {FORMS}")
    elif not path.is_file():
        raise TargetError(
            f"target {target!r}: no file {where!r} (castwise reads local configs only, nothing "
            "from the hub: download the config.json first)"
        )
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise TargetError(f"target {target!r}: {str(path)!r} is over 4 MiB; a model config.json is a few KB")
    return path


def _read_config(target: str, path: Path) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise TargetError(
            f"target {target!r}: building a model from a config needs transformers: pip install transformers"
        ) from None
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TargetError(
            f"target {target!r}: {str(path)!r} is not a transformers model config "
            f'({type(exc).__name__}: {first}); it needs a "model_type" such as "llama"'
        ) from None


# The Auto class for an architecture outside transformers (custom code), by its name's suffix.
_HEADS = (
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    ("ForMaskedLM", "AutoModelForMaskedLM"),
)


def _build_model(target: str, config: Any) -> nn.Module:
    """The architecture the config names (``architectures``: the CausalLM, Seq2SeqLM, MaskedLM...
    head), else the bare ``AutoModel``, built on the meta device: no weight memory."""
    import torch
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    cls: Any = next((c for c in (getattr(transformers, a, None) for a in archs) if isinstance(c, type)), None)
    try:
        with torch.device("meta"):
            if cls is not None:
                return cls._from_config(config)  # type: ignore[no-any-return]
            auto = next((name for suffix, name in _HEADS for a in archs if a.endswith(suffix)), "AutoModel")
            return getattr(transformers, auto).from_config(config)  # type: ignore[no-any-return]
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TargetError(
            f"target {target!r}: transformers cannot build {archs or config.model_type} from this "
            f"config ({type(exc).__name__}: {first})"
        ) from None


def _image_size(vision: Any) -> tuple[int, int] | None:
    size = getattr(vision, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return None


def _inputs(target: str, config: Any, model: nn.Module, seq_len: int) -> dict[str, Any]:
    """Batch 1: token ids of ``seq_len`` (decoder ids too for encoder-decoders), pixel values of
    the config's image size; real CPU tensors, so id values are known to the audit."""
    import torch

    params = [p for p in inspect.signature(model.forward).parameters if p not in ("self", "args", "kwargs")]
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    vocab = getattr(text, "vocab_size", None)
    inputs: dict[str, Any] = {}
    if isinstance(vocab, int) and vocab > 4:
        # ids away from the usual special tokens (0-3: pad, bos, eos, unk), deterministic
        ids = torch.arange(seq_len, dtype=torch.long).remainder(vocab - 4).add(4).unsqueeze(0)
        if "input_ids" in params:
            inputs["input_ids"] = ids
        if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids.clone()
    size = _image_size(vision)
    if size is not None and "pixel_values" in params:
        channels = int(getattr(vision, "num_channels", 3))
        inputs["pixel_values"] = torch.zeros(1, channels, *size)
    if not params or params[0] not in inputs:
        raise TargetError(
            f"target {target!r}: castwise makes token ids and pixel values from a config, but "
            f"{type(model).__name__}.forward takes {params[0] if params else 'nothing'!r} first; write a "
            "builder function returning (model, inputs) and audit file.py:function"
        )
    return inputs


def load_config(target: str, seq_len: int) -> tuple[nn.Module, dict[str, Any]]:
    """A transformers model from a local config on the meta device, and its inputs."""
    if seq_len < 1:
        raise TargetError(f"--seq-len {seq_len}: give a length of at least 1")
    path = _config_file(target)
    config = _read_config(target, path)
    model = _build_model(target, config)
    return model, _inputs(target, config, model, seq_len)


__all__ = ["DEFAULT_SEQ_LEN", "FORMS", "is_config_target", "load_config", "load_target", "working_dir_on_path"]
