"""Real runs with every module call recorded: inputs, outputs, output gradients, autocast state.

One forward (and backward in train mode) of a prepared copy, with forward hooks on every
module. Each call keeps clones of its floating inputs and outputs (in-place ops later in the
model must not change what was recorded), the call that was running around it (its parent),
and the autocast state it was called under, so that one module can later be run alone on the
reference's inputs exactly as it ran inside the model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from castwise import _autocast
from castwise.run import Inputs, map_tensors, tensors_of


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating tensors of a nested structure, in the tree's order."""
    return [t for t in tensors_of(obj) if t.is_floating_point()]


def _saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == t.dtype or not t.is_floating_point():
        return t
    if torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        # saturate: a value past the narrower range is the producer's overflow, which this
        # module must not be charged with (the producer is, when it runs alone)
        limit = torch.finfo(dtype).max
        t = t.clamp(-limit, limit)
    return t.to(dtype)  # to what the policy's run had here, so the module runs as it did


def cast_like(obj: Any, like: Any) -> Any:
    """``obj``'s floating tensors cast to the dtypes of the tensors at the same place in ``like``
    (the same leaf of the same tree); where ``like`` has no tensor, ``obj``'s stays as it is."""
    leaves, spec = pytree.tree_flatten(obj)
    likes = pytree.tree_leaves(like)[: len(leaves)]
    return pytree.tree_unflatten(
        [
            _saturating_cast(x, y.dtype)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point()
            else x
            for x, y in itertools.zip_longest(leaves, likes)
        ],
        spec,
    )


def _clone(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())


@dataclass
class Call:
    """One call of one module in a recorded run."""

    index: int
    name: str
    module: nn.Module
    parent: int | None
    args: Any
    kwargs: dict[str, Any]
    autocast: _autocast.AutocastState
    out: Any = None
    done: int = -1  # when it returned, counted over the run's calls (callees before callers)
    grads: list[torch.Tensor | None] = field(default_factory=list)  # d loss / d each floating output


@dataclass
class Recording:
    calls: list[Call]
    output: Any
    loss: torch.Tensor | None
    param_grads: dict[str, torch.Tensor]  # qualified parameter name -> gradient (float32)


def call_model(model: nn.Module, inputs: Any) -> Any:
    return Inputs.of(inputs).call(model)  # the one rule of what the inputs mean (castwise.run)


def _loss_tensor(out: Any) -> torch.Tensor | None:
    """The model's own loss: a ``loss`` field (transformers' outputs, a dict) or a scalar output."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 and out.is_floating_point() else None
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def returns_loss(output: Any) -> bool:
    """Whether the model returned its own loss (else compare and tune measure its outputs)."""
    return _loss_tensor(output) is not None


def projection(output: Any, seed: int = 1234) -> list[torch.Tensor]:
    """Fixed random directions (one per floating output) for a loss when the model has none."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device) for t in float_tensors(output)]


def loss_scale(output: Any) -> float:
    """The typical size of the projection loss (its standard deviation over directions): a
    relative loss error against a projection that happens to be near zero would mean nothing.
    0 when the model returns its own loss."""
    if _loss_tensor(output) is not None:
        return 0.0
    total = sum(float(t.detach().float().pow(2).sum()) / max(t.numel(), 1) for t in float_tensors(output))
    return math.sqrt(total)


def loss_of(output: Any, directions: list[torch.Tensor]) -> torch.Tensor:
    """The model's own ``loss`` when it returns one, else a float32 random projection of its
    outputs (a loss whose gradient is not constant, unlike a plain sum)."""
    own = _loss_tensor(output)
    if own is not None:
        return own.float()
    tensors = float_tensors(output)
    # float32 reduction: the loss itself is not what is compared
    parts = [(t.float() * d).sum() / math.sqrt(max(t.numel(), 1)) for t, d in zip(tensors, directions, strict=False)]
    return torch.stack(parts).sum()


class _Recorder:
    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.calls: list[Call] = []
        self.stack: list[int] = []
        self.finished = 0
        self.handles: list[Any] = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post, with_kwargs=True, always_call=True))

    def pre(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        call = Call(
            len(self.calls),
            self.names.get(id(module), "?"),
            module,
            self.stack[-1] if self.stack else None,
            _clone(args),
            _clone(kwargs),
            _autocast.AutocastState.capture(),
        )
        self.calls.append(call)
        self.stack.append(call.index)

    def post(self, module: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if not self.stack:
            return
        call = self.calls[self.stack.pop()]
        call.out = _clone(out)
        call.done, self.finished = self.finished, self.finished + 1
        outs = float_tensors(out)
        call.grads = [None] * len(outs)
        for i, t in enumerate(outs):
            if t.requires_grad:
                t.register_hook(self._grad_hook(call, i))  # type: ignore[no-untyped-call]

    @staticmethod
    def _grad_hook(call: Call, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            call.grads[i] = grad.detach().float()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def seed_all(seed: int) -> None:
    """Seed the generators a run draws from (CPU, and CUDA where it is in use); cheaper than
    torch.manual_seed, which also seeds every other backend."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(seed)  # type: ignore[no-untyped-call]


def record(
    model: nn.Module, inputs: Inputs, mode: str, directions: list[torch.Tensor] | None, seed: int
) -> tuple[Recording, list[torch.Tensor]]:
    """Run ``model`` once (train: forward and backward of the loss), recording every call."""
    seed_all(seed)
    recorder = _Recorder(model)
    try:
        with torch.set_grad_enabled(mode == "train"):
            output = call_model(model, inputs)
            dirs = directions if directions is not None else projection(output)
            loss = loss_of(output, dirs)
            if mode == "train" and loss.requires_grad:
                loss.backward()  # type: ignore[no-untyped-call]
    finally:
        recorder.remove()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return Recording(recorder.calls, _clone(output), loss.detach().float(), grads), dirs
