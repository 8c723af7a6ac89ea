"""The common ways users run a model in low precision: by hand (``model.to(bf16)``, a norm kept
float32, inputs left float32) or through a policy (``bf16-mixed`` autocast, ``16-true``...).

A situation turns a float32 ``(model, inputs)`` into what the user runs, and says which policy
(if any) the audit and the real run use: a hand-cast model runs with no policy, exactly as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

BF16, F16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Situation:
    name: str
    policy: str | None  # for castwise.audit and castwise.apply; None: the model as it is
    low: torch.dtype | None  # the low-precision dtype the user asked for; None: float32 throughout
    hand_dtype: torch.dtype | None = None  # model.to(hand_dtype) by hand
    cast_inputs: bool = True  # the user casts floating inputs to hand_dtype too
    norms_fp32: bool = False  # every normalisation layer kept float32 by hand (the OpenCLIP pattern)

    def prepare(self, model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
        if self.hand_dtype is None:
            return model, inputs
        dtype = self.hand_dtype
        model.to(dtype)
        if self.norms_fp32:
            for module in model.modules():
                if is_norm(module):
                    module.float()
        if self.cast_inputs:
            inputs = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)
        return model, inputs

    @property
    def hand(self) -> bool:
        return self.hand_dtype is not None


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer of any library (LayerNorm, GroupNorm, BatchNorm2d, LlamaRMSNorm...)."""
    return "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False))


SITUATIONS: dict[str, Situation] = {
    s.name: s
    for s in (
        Situation("32-true", None, None),
        Situation("bf16-hand", None, BF16, hand_dtype=BF16),
        Situation("f16-hand", None, F16, hand_dtype=F16),
        Situation("bf16-hand-norms-fp32", None, BF16, hand_dtype=BF16, norms_fp32=True),
        Situation("bf16-hand-inputs-fp32", None, BF16, hand_dtype=BF16, cast_inputs=False),
        Situation("bf16-mixed", "bf16-mixed", BF16),
        Situation("16-mixed", "16-mixed", F16),
        Situation("bf16-true", "bf16-true", BF16),
        Situation("16-true", "16-true", F16),
    )
}

HAND_LOW = ("bf16-hand", "f16-hand")
MIXED = ("bf16-mixed", "16-mixed")
TRUE = ("bf16-true", "16-true")
