"""Numerics for models too large to run whole: one repeated block at a time.

The model's repeated blocks (the children of its ``ModuleList``s of one class: transformer
layers) are run one at a time on the inputs the model itself hands them; everything else (the
"skeleton": embeddings, final norm, head, loss) runs as usual. A block may live on the meta
device: it is materialised just before it runs, from a weights source (a ``.safetensors`` file,
read one tensor at a time, or a state dict) or by its own deterministic initialisation, and put
back on the meta device right after, so at most one block's weights are in memory.

In train mode the forward pass runs each block without autograd and hands the next part of the
model a leaf holding its outputs; the skeleton's backward then leaves the gradient of every
block's outputs on those leaves. Blocks then run backward last to first: materialised again,
their forward recomputed (not recorded twice), their backward recorded, and the gradient of
their inputs passed on into the skeleton. The values are those of a whole-model run (the same
ops on the same inputs), in a different order.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from castwise.distributed.plan import repeated_children
from castwise.errors import AuditError
from castwise.run import Inputs
from castwise.trace.attribution import Attribution
from castwise.trace.fake import on_meta
from castwise.trace.observers import Observer, pick_loss
from castwise.trace.tracer import Tracer, traced

Weights = str | Path | Mapping[str, torch.Tensor] | None


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: children of every ``ModuleList`` holding two or more modules of one
    class with parameters, outermost lists only (a layer's own list of experts stays in it)."""
    return repeated_children(model, (nn.ModuleList,))


class Source:
    """Where a block's weights come from: a safetensors file (opened lazily, tensor by tensor), a
    state dict, or the module's own initialisation seeded by its name (the same values each run)."""

    def __init__(self, model: nn.Module, weights: Weights) -> None:
        self.model = model
        self.state: Mapping[str, torch.Tensor] | None = None
        self.file: Any = None
        self.keys: set[str] = set()
        if isinstance(weights, (str, Path)):
            path = Path(weights)
            if path.suffix != ".safetensors" or not path.is_file():
                raise AuditError(
                    f"weights={str(weights)!r}: not a .safetensors file; valid: a .safetensors path, a state "
                    "dict, or None (deterministic initialisation)"
                )
            from safetensors import safe_open

            self.file = safe_open(str(path), framework="pt")
            self.keys = set(self.file.keys())
        elif weights is not None:
            if not isinstance(weights, Mapping):
                raise AuditError(
                    f"weights is a {type(weights).__name__}; valid: a .safetensors path, a state dict, or None "
                    "(deterministic initialisation)"
                )
            self.state = weights
            self.keys = set(weights)
        self.what = (
            f"weights from {Path(str(weights)).name}"
            if self.file is not None
            else "weights from the given state dict"
            if self.state is not None
            else "deterministic initialisation (values of a fresh model, not a checkpoint's)"
        )

    def tensor(self, key: str) -> torch.Tensor:
        if self.file is not None:
            got: torch.Tensor = self.file.get_tensor(key)
            return got
        assert self.state is not None  # only called with a source of weights (not user input)
        return self.state[key]

    def fill(self, prefix: str, module: nn.Module, device: str) -> None:
        """Materialise ``module`` (named ``prefix`` in the model) on ``device``."""
        module.to_empty(device=device, recurse=True)
        for name, sub in module.named_modules():
            self.fill_own(f"{prefix}.{name}" if name else prefix, sub)

    def fill_own(self, prefix: str, module: nn.Module) -> None:
        """``module``'s own parameters and buffers (its children apart) from the source. A buffer a
        checkpoint does not hold (non-persistent: rotary frequencies) is the module's own init."""
        own = [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
        keys = {n: f"{prefix}.{n}" if prefix else n for n, _ in own}
        missing = [n for n, _ in own if (self.file is None and self.state is None) or keys[n] not in self.keys]
        if missing:
            volatile = module._non_persistent_buffers_set
            if self.file is not None or self.state is not None:
                lost = sorted(keys[n] for n in missing if n not in volatile)
                if lost:
                    raise AuditError(f"the weights have no {', '.join(lost)}; give the model's own checkpoint")
            self._init(prefix, _Own(module))
        with torch.no_grad():
            for n, t in own:
                if n not in missing:
                    t.copy_(self.tensor(keys[n]))

    def _init(self, prefix: str, module: nn.Module) -> None:
        seed = int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:4], "little")
        own: Any = getattr(self.model, "_init_weights", None)  # transformers' per-module initialisation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for sub in module.modules():
                reset: Any = own if callable(own) else getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset(sub) if reset is own else reset()


def materialise_skeleton(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], source: Source, device: str
) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]:
    """Every module outside the blocks that is on the meta device, on ``device``; returns what to
    put back (the caller's model is left on the meta device as it came)."""
    inside = {id(m) for _, b in blocks for m in b.modules()}
    saved = []
    made: dict[int, nn.Parameter] = {}  # a tied weight (a head and its embedding) stays one tensor
    for name, module in model.named_modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if id(module) in inside or not any(t is not None and t.device.type == "meta" for t in own):
            continue
        saved.append((module, dict(module._parameters), dict(module._buffers)))
        for pname, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                module._parameters[pname] = made[id(p)]
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[bname] = torch.empty_like(b, device=device)
        source.fill_own(name, module)
    return saved


def restore_skeleton(saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]) -> None:
    for module, params, buffers in saved:
        module._parameters.update(params)
        module._buffers.update(buffers)


class _Own(nn.Module):
    """A module's own parameters only (its children are initialised on their own)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.__dict__["inner"] = module

    def modules(self) -> Iterator[nn.Module]:  # type: ignore[override]
        yield self.__dict__["inner"]


@dataclass
class BlockCall:
    name: str
    block: nn.Module
    args: Any  # (args, kwargs) as the model handed them
    forward: Callable[..., Any]  # the block's own forward (the stand-in replaces it for the run)
    rng: torch.Tensor  # the CPU random state it ran with: its recomputation draws the same dropout
    leaves: list[torch.Tensor] = field(default_factory=list)  # the outputs handed on, as leaves


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _is_cache(x: Any) -> bool:
    """A transformers key/value cache: the forward pass filled it with this block's keys and
    values already, so the recomputation runs without it (on the whole sequence, the same values)."""
    utils = sys.modules.get("transformers.cache_utils")
    return utils is not None and isinstance(x, utils.Cache)


@contextlib.contextmanager
def _modes_off() -> Iterator[None]:
    """Outside the tracer's dispatch mode: materialising weights is not the model's computation."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


class Runner:
    """Runs the model with its blocks one at a time under ``tracer`` (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        source: Source,
        device: str,
        pause: Callable[[bool], None],
    ) -> None:
        self.model, self.blocks, self.source, self.device = model, blocks, source, device
        self.pause = pause  # stops the observers recording (a recomputed forward is not recorded twice)
        self.calls: list[BlockCall] = []
        self.at: Attribution | None = None  # the run's, while it runs
        self.lazy = {name: on_meta(b) for name, b in blocks}

    def _load(self, name: str, block: nn.Module) -> None:
        if self.lazy[name]:
            with _modes_off():
                self.source.fill(name, block, self.device)

    def _free(self, name: str, block: nn.Module) -> None:
        if self.lazy[name]:
            with _modes_off():
                block.to("meta")

    def _stand_in(self, name: str, block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run_block(*args: Any, **kwargs: Any) -> Any:
            if self.at is not None:
                # the block runs without autograd: its inputs' autograd nodes are tagged with the
                # module that made them here, as a whole-model run tags them where it reads them
                self.at.tag_outputs((args, kwargs))
            self._load(name, block)
            rng = torch.get_rng_state()
            try:
                with torch.no_grad():
                    out = forward(*args, **kwargs)
            finally:
                self._free(name, block)
            if not torch.is_grad_enabled():
                return out
            call = BlockCall(name, block, (args, kwargs), forward, rng)
            self.calls.append(call)

            def leaf(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    held = t.detach().requires_grad_()
                    call.leaves.append(held)
                    return held
                return t

            return tree_map(leaf, out)

        return run_block

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = []
        for name, block in self.blocks:
            forward = block.forward
            saved.append((block, "forward" in block.__dict__, forward))
            block.forward = self._stand_in(name, block, forward)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for block, own, forward in saved:
                if own:
                    block.forward = forward  # type: ignore[method-assign]
                else:
                    del block.forward

    def backward(self, at: Attribution, out: Any) -> None:
        """The skeleton's backward from the loss, then each block's, last to first."""
        loss = pick_loss(out)
        if loss is None:
            return
        at.begin_backward()
        loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
        for call in reversed(self.calls):
            self._block_backward(at, call)

    def _block_backward(self, at: Attribution, call: BlockCall) -> None:
        if all(t.grad is None for t in call.leaves):
            return
        args, kwargs = call.args
        originals = [t for t in _floats((args, kwargs)) if t.requires_grad]
        fresh = {id(t): t.detach().requires_grad_() for t in originals}
        args2, kwargs2 = tree_map(
            lambda x: fresh.get(id(x), x) if isinstance(x, torch.Tensor) else None if _is_cache(x) else x,
            (args, kwargs),
        )
        self._load(call.name, call.block)
        try:
            self.pause(True)
            stand_in = call.block.forward
            call.block.forward = call.forward  # type: ignore[method-assign]
            try:
                with at.recomputing(), torch.enable_grad(), torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(call.rng)
                    out = call.block(*args2, **kwargs2)
            finally:
                call.block.forward = stand_in  # type: ignore[method-assign]
                self.pause(False)
            at.end_forward(out)
            wanted = [
                (o, leaf.grad)
                for o, leaf in zip(_floats(out), call.leaves, strict=True)
                if o.requires_grad and leaf.grad is not None
            ]
            torch.autograd.backward([o for o, _ in wanted], [g for _, g in wanted])
        finally:
            self._free(call.name, call.block)
        back = [(t, fresh[id(t)].grad) for t in originals if fresh[id(t)].grad is not None]
        if back:
            torch.autograd.backward([t for t, _ in back], [g for _, g in back], retain_graph=True)


def run_layerwise(
    model: nn.Module,
    wrapper: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    device: str,
    observers: list[Observer],
    runner: Runner,
) -> tuple[Any, BaseException | None]:
    """The model run (forward, and backward in train mode) with its blocks one at a time; the
    model's error, if any, is returned (as the eager run records it)."""
    tracer = Tracer(model, device, fake=False, record_ops=False, observers=observers)
    wrapper.train(mode == "train")
    out: Any = None
    grad = torch.enable_grad() if mode == "train" else torch.no_grad()
    # the model's own error is recorded by the run: the report says the run is incomplete
    with traced(tracer) as run, runner.installed(), grad:
        runner.at = run.at
        out = wrapper(*args, **kwargs)
        if mode == "train":
            run.at.end_forward(out)
            runner.backward(run.at, out)
    runner.at = None
    return out, run.trace.error


@dataclass(frozen=True)
class Plan:
    layerwise: bool
    weights: Any


def too_large(model: nn.Module, width: int = 4) -> bool:
    """Whether the model's float32 weights (``width`` bytes each) pass what this machine takes (see ``shrink``)."""
    from castwise.numerics.shrink import _budget

    return sum(p.numel() for p in model.parameters()) * width > _budget()


def run(
    model: nn.Module, inputs: Inputs, mode: str, device: str, observer: Any, weights: Weights
) -> tuple[BaseException | None, dict[str, Any]]:
    """The layerwise run of ``model`` under ``observer``: (the model's error or None, how it ran)."""
    blocks = blocks_of(model)
    source = Source(model, weights)
    runner = Runner(model, blocks, source, device, lambda on: setattr(observer, "paused", on))
    saved = materialise_skeleton(model, blocks, source, device)
    try:
        _out, error = run_layerwise(model, model, inputs.args, inputs.kwargs, mode, device, [observer], runner)
    finally:
        restore_skeleton(saved)
    lazy = [name for name, lazy in runner.lazy.items() if lazy]
    how = {
        "blocks": len(blocks),
        "first": blocks[0][0],
        "last": blocks[-1][0],
        "materialised": (
            f"{len(lazy)} blocks one at a time, {source.what}" if lazy else "no: the weights were in memory"
        ),
        "note": "each block ran alone on the inputs the model handed it (forward, then backward last to first)",
    }
    return error, how
