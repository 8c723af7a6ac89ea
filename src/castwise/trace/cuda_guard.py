"""A stand-in CUDA device guard for simulated CUDA where torch has no working one.

Autograd records, for every tensor it keeps a gradient edge for, the stream of the tensor's
device, which it asks the device's guard (``InputMetadata``, ``getDeviceGuardImpl(cuda)``). A
CPU-only build has no CUDA guard: the ``TORCH_CHECK`` fails inside a C++ path that cannot pass
the error on, and the process dies with SIGABRT at the first fake CUDA op that needs a gradient
("PyTorch is not linked with support for cuda devices"). A CUDA build without a usable GPU asks
the driver instead (torch >= 2.13's ``FakeTensorMode`` swaps in a no-op guard, older ones do not).

The stand-in is the no-op guard torch registers for the meta device, placed in the CUDA slot of
c10's guard registry for the duration of a simulated-CUDA run and taken out again after. No
CUDA runtime is touched. castwise never runs the autograd engine on simulated CUDA
(trace/backward.py), the one other user of those streams. Where the registry cannot be reached
(a build whose libc10 does not export it), a CUDA build from 2.13 on uses torch's own no-op guard;
other builds stop with a castwise error before any fake CUDA tensor needs a guard, never abort.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

import torch

from castwise.errors import CudaSimulationError

# c10::DeviceType values (an ABI-stable enum: serialised by torch.save and TorchScript)
_CPU, _CUDA, _META = 0, 1, 14
# c10::impl::device_guard_impl_registry, an array of std::atomic<const DeviceGuardImplInterface*>
_REGISTRY_SYMBOL = "_ZN3c104impl26device_guard_impl_registryE"


def _library() -> str:
    name = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
    return os.path.join(os.path.dirname(torch.__file__), "lib", name)


def guard_registry() -> ctypes.Array[ctypes.c_void_p] | None:
    """c10's guard registry (slots up to the meta device's), or None where it cannot be reached."""
    try:
        lib = ctypes.CDLL(_library())  # already loaded by torch: the same copy, not a second one
        head = ctypes.c_void_p.in_dll(lib, _REGISTRY_SYMBOL)
    except (OSError, ValueError):
        return None
    slots = (ctypes.c_void_p * (_META + 1)).from_address(ctypes.addressof(head))
    # torch registers guards for the CPU and meta devices at load: without both, this is not the registry
    return slots if slots[_CPU] and slots[_META] else None


def needs_stand_in() -> bool:
    """Whether simulated CUDA needs the stand-in: no CUDA device torch can use (a CPU-only build,
    or a CUDA build on a machine without a GPU or driver)."""
    return not torch.cuda.is_available()


@contextlib.contextmanager
def stand_in_guard() -> Iterator[None]:
    """Within: fake CUDA tensors can carry gradients on any torch build. The registry slot is
    restored on exit, also on an exception."""
    if not needs_stand_in():
        yield
        return
    slots = guard_registry()
    if slots is None and torch.cuda._is_compiled() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        # a CUDA build (>= 2.13) swaps in its own no-op guard when it has no device: use that one
        torch._C._ensureCUDADeviceGuardSet()
        yield
        return
    if slots is None:
        raise CudaSimulationError(
            f"torch {torch.__version__} has no usable CUDA device guard "
            f"({'a CPU-only build' if not torch.cuda._is_compiled() else 'no CUDA device'}), and castwise "
            "cannot reach c10's guard registry in this build to stand in for it, so it cannot simulate "
            "a CUDA device here; audit with device='cpu' (CPU kernels and autocast rules), or audit for "
            "CUDA with a Linux or macOS torch build, whose registry castwise reaches (no GPU needed)"
        )
    previous = slots[_CUDA]
    slots[_CUDA] = slots[_META]
    try:
        yield
    finally:
        slots[_CUDA] = previous
