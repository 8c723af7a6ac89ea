"""Models too large for this machine: a transformers ``config.json`` built with random weights,
with fewer layers when the full model does not fit (numerics need values, so no meta device)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from castwise.errors import TargetError

_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "encoder_layers", "decoder_layers")


def _budget() -> int:
    """Bytes of parameters (float32, with room for gradients and activations) this machine takes."""
    env = os.environ.get("CASTWISE_NUMERICS_MAX_BYTES")
    if env:
        return int(env)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return total // 8  # weights, gradients, activations and the float32 rerun side by side


def _build(config: Any) -> Any:
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except ValueError:
        return AutoModel.from_config(config)  # type: ignore[no-untyped-call]


def _param_bytes(config: Any) -> int:
    import torch

    with torch.device("meta"):
        model = _build(config)
    return int(sum(p.numel() for p in model.parameters())) * 4


def from_config(path: str) -> tuple[Any, Any, str]:
    """(model, inputs, how it was built) for a transformers config.json."""
    import torch
    from transformers import AutoConfig

    file = Path(path)
    if not file.is_file():
        raise TargetError(f"target {path!r}: no such config.json")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        config = AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as exc:
        raise TargetError(
            f"target {path!r}: not a transformers config ({exc}); valid: a config.json with "
            "model_type, or file.py:function"
        ) from exc
    full = _param_bytes(config)
    how = f"random weights from {file.name} (values are those of a fresh initialisation, not a checkpoint's)"
    keys = [k for k in _LAYER_KEYS if isinstance(getattr(config, k, None), int) and getattr(config, k) > 1]
    if full > _budget() and keys:
        layers = {k: getattr(config, k) for k in keys}
        per_layer = full / max(layers.values())
        keep = max(1, min(max(layers.values()), int(_budget() // max(per_layer, 1)) - 1))
        for k in keys:
            setattr(config, k, min(layers[k], keep))
        how = (
            f"shrunk config: {', '.join(f'{k} {v} -> {getattr(config, k)}' for k, v in layers.items())} "
            f"({full / 2**20:.0f} MiB of float32 weights does not fit this machine); " + how
        )
    torch.manual_seed(0)
    model = _build(config)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise TargetError(f"target {path!r}: the config has no vocab_size; pass file.py:function with inputs")
    ids = torch.randint(0, vocab, (1, 16))
    inputs: dict[str, Any] = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    elif type(model).__name__.endswith("ForCausalLM") or hasattr(model, "lm_head"):
        inputs["labels"] = ids
    return model, inputs, how
