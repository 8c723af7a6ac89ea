"""The training recipes as users write them: code around a zoo model, not a castwise policy.

Every wrapper is an ordinary ``nn.Module`` (deep-copyable, as the audit copies what it is given)
whose forward takes the zoo model's inputs unchanged. The autocast device is read from the
inputs at call time (``x.device.type``), as the diffusers and Accelerate scripts do, so the
same code runs under a real CPU run and a simulated-CUDA audit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from castwise.stories import call, first_tensor


def device_type(args: Any, kwargs: Any) -> str:
    """The device of the first tensor input (what ``x.device.type`` says in a user's script)."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


class OwnAutocast(nn.Module):
    """``with torch.autocast(device_type=x.device.type, dtype=...)`` around the model's forward."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type(args, kwargs), dtype=self.dtype):
            return self.model(*args, **kwargs)


class AccelerateAutocast(nn.Module):
    """What ``Accelerator(mixed_precision=...).prepare(model)`` does to the forward: the forward
    under ``torch.autocast`` (Accelerate's ``get_mixed_precision_context_manager``), its outputs
    converted back to f32 by ``accelerate.utils.convert_outputs_to_fp32``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from accelerate.utils import convert_outputs_to_fp32

        def run(*a: Any, **k: Any) -> Any:
            with torch.autocast(device_type=device_type(a, k), dtype=self.dtype):
                return self.model(*a, **k)

        return convert_outputs_to_fp32(run)(*args, **kwargs)


class CheckpointBlock(nn.Module):
    """A block run under ``torch.utils.checkpoint.checkpoint`` in training (keyword arguments
    bound with ``functools.partial``, as Hugging Face does for the reentrant mode)."""

    def __init__(self, block: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.block(*args, **kwargs)
        fn = functools.partial(self.block, **kwargs)
        return checkpoint(fn, *args, use_reentrant=self.use_reentrant)

    def __getattr__(self, name: str) -> Any:
        # the model's own code reads attributes of its blocks (``layer.attention_type``)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)


def block_lists(model: nn.Module) -> list[nn.Module]:
    """The outermost ModuleLists / Sequentials whose entries are blocks (modules with children)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in found):
            continue
        is_list = isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0
        if is_list and all(any(True for _ in child.children()) for child in module):
            found.append((name, module))
    return [module for _, module in found]


def checkpoint_blocks(model: nn.Module, use_reentrant: bool) -> int:
    """Wrap every block of ``model`` in ``CheckpointBlock``; returns how many."""
    count = 0
    for blocks in block_lists(model):
        for i, child in enumerate(list(blocks)):
            blocks[i] = CheckpointBlock(child, use_reentrant)
            count += 1
    return count


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    """The step's loss: an f32 sum of the first output (the zoo's real run does the same)."""
    out = first_tensor(call(model, batch))
    assert out is not None, "the model returned no tensor"
    return out.float().sum()
