"""Entering and restoring autocast state, also for a device this machine does not have.

``torch.autocast("cuda")`` disables itself when CUDA is not available, but the CUDA autocast
state can be set directly: fake CUDA tensors then dispatch through CUDA's autocast rules, which
is how castwise audits a CUDA run on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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
    try:
        torch.set_autocast_enabled(device_type, enabled)
        if enabled and dtype is not None:
            torch.set_autocast_dtype(device_type, dtype)
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        # restored here, not by a call: under torch.compile, after a graph break inside the block
        # the block runs eagerly, Dynamo compiles the frame of each function it calls, and a graph
        # that sets the autocast state is refused by AOTAutograd (BackendCompilerFailed)
        for device, was_enabled, was_dtype in before.enabled:
            torch.set_autocast_enabled(device, was_enabled)
            torch.set_autocast_dtype(device, was_dtype)
        torch.set_autocast_cache_enabled(before.cache)
