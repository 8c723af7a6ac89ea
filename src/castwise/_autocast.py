"""Entering and restoring autocast state, also for a device this machine does not have.

``torch.autocast("cuda")`` disables itself when CUDA is not available, but the CUDA autocast
state can be set directly: fake CUDA tensors then dispatch through CUDA's autocast rules, which
is how castwise audits a CUDA run on a CPU-only machine.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from castwise import _releases as releases
from castwise.devices import autocast_types

DEVICE_TYPES = autocast_types()  # the device types of the built-in devices


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of every device type castwise simulates."""

    enabled: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in DEVICE_TYPES),
            torch.is_autocast_cache_enabled(),
        )

    def restore(self) -> None:
        for device, enabled, dtype in self.enabled:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache)

    def enabled_for(self, device: str) -> torch.dtype | None:
        for d, enabled, dtype in self.enabled:
            if d == device and enabled:
                return dtype
        return None


# the autocast blocks castwise has entered and not left, innermost last: (device type, the dtype
# autocast casts to, None when the block turns it off). A module's forward wrapper (a policy's
# root, an island) enters its block after the module's forward pre-hooks ran, where the tracer
# reads autocast, and torch's state cannot be read from inside dispatch (an autocast kernel
# excludes its key, which reads as "off"): the tracer reads this log instead.
ENTERED: list[tuple[str, torch.dtype | None]] = []


def entered_since(depth: int, device_type: str) -> tuple[bool, torch.dtype | None]:
    """Whether a block for ``device_type`` was entered after the log had ``depth`` entries, and
    the innermost one's dtype (None: autocast off in it)."""
    for device, dtype in reversed(ENTERED[depth:]):
        if device == device_type:
            return True, dtype
    return False, None


@contextmanager
def autocast(device_type: str, dtype: torch.dtype | None, enabled: bool = True) -> Iterator[None]:
    """Like ``torch.autocast(device_type, dtype)``, but sets the state directly so it also works
    for ``"cuda"`` without a GPU (for fake CUDA tensors). ``enabled=False`` turns autocast off
    for that device (an fp32 island). Restores the previous state on exit, also on error."""
    if device_type not in DEVICE_TYPES:
        # other device types (mps, xpu...) go through torch's own context manager
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            yield
        return
    before = AutocastState.capture()
    torch.autocast_increment_nesting()
    depth = len(ENTERED)
    try:
        torch.set_autocast_enabled(device_type, enabled)
        if enabled and dtype is not None:
            torch.set_autocast_dtype(device_type, dtype)
        ENTERED.append((device_type, torch.get_autocast_dtype(device_type) if enabled else None))
        yield
    finally:
        del ENTERED[depth:]
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        # restored here, not by a call: under torch.compile, after a graph break inside the block
        # the block runs eagerly, Dynamo compiles the frame of each function it calls, and a graph
        # that sets the autocast state is refused by AOTAutograd (BackendCompilerFailed)
        for device, was_enabled, was_dtype in before.enabled:
            torch.set_autocast_enabled(device, was_enabled)
            torch.set_autocast_dtype(device, was_dtype)
        torch.set_autocast_cache_enabled(before.cache)


_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}


def _eligible(x: object, device: str) -> bool:
    # autocast's own test (is_eligible in ATen's autocast_mode.h): a floating tensor of that
    # device, f64 never cast
    return (
        isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device and x.dtype != torch.float64
    )


def _cast_to(args: Any, dtype: torch.dtype, device: str) -> Any:
    return tree_map(lambda x: x.to(dtype) if _eligible(x, device) and x.dtype != dtype else x, args)


def _kernel(op: Any, category: str, device: str) -> Callable[..., Any]:
    """What autocast does for ``category`` on ``device``: cast the eligible inputs, then call the
    op with autocast excluded (ATen's wrappers hold the same ExcludeDispatchKeyGuard)."""
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEYS[device]))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(key):
            if category == "banned":
                raise RuntimeError(f"{op.name()} is unsafe to autocast (as in the emulated torch release)")
            if category == "lower_precision_fp":
                dtype = torch.get_autocast_dtype(device)
            elif category == "promote":
                leaves = [x for x in tree_leaves((args, kwargs)) if _eligible(x, device)]
                dtype = (
                    torch.float32 if any(x.dtype == torch.float32 for x in leaves) else torch.get_autocast_dtype(device)
                )
            else:  # fp32 and the dtype-argument kinds: f32 inputs give the op's f32 result
                dtype = torch.float32
            args, kwargs = _cast_to((args, kwargs), dtype, device)
            return op(*args, **kwargs)

    return kernel


def _aten_op(name: str) -> Any:
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@contextmanager
def emulated(release: str | None) -> Iterator[None]:
    """Autocast as torch ``release`` ran it ("2.11"; None: as this torch does): each op whose
    recorded category differs from this release's gets that release's autocast kernel (or none)
    for the run, and this torch's own kernels come back on exit."""
    running = releases.release_of(torch.__version__)
    if release is None or release == running:
        yield
        return
    if running not in releases.recorded():
        raise releases.TorchReleaseError(
            f"torch={release!r}: this torch ({torch.__version__}) has no recorded autocast lists to compare with; "
            f"record it with scripts/record_torch_release.py, or use a torch of {', '.join(releases.recorded())}"
        )
    here, there = releases.load(running), releases.load(release)
    lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # undone by _destroy()
    try:
        for device, key in _KEYS.items():
            for name, (_now, then) in here.changed(there, device).items():
                try:
                    op = _aten_op(name)
                except AttributeError:
                    continue  # an op this torch does not have: no model here can call it
                impl = torch.library.fallthrough_kernel if then is None else _kernel(op, then, device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
                    lib.impl(name.removeprefix("aten::"), impl, key)  # type: ignore[no-untyped-call]
        yield
    finally:
        lib._destroy()  # type: ignore[no-untyped-call]
