"""Target devices as values: what the audit simulates, and how that device's kernels word errors.

A :class:`Device` says which autocast rules apply (``autocast_type``), which family of real
kernels the contract table models for it (``kernels``), how its kernels name tensor types in
errors, and its *contract deltas*: per-op rules that replace the family's. The registry holds
``cpu`` and ``cuda``; a new device is one :func:`register` call with its deltas, nothing else.
Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from castwise.errors import CastwiseError

KernelFamily = Literal["cpu", "cuda"]

# a contract rule: (op name "aten.mm", args, kwargs, device) -> Violation | torch.dtype | None
ContractRule = Callable[[str, tuple[Any, ...], dict[str, Any], "Device"], Any]


@dataclass(frozen=True)
class Device:
    """A target device castwise can audit for.

    ``name``: what users pass (``device="cuda"``). ``autocast_type``: the autocast device type
    whose rules apply (CUDA autocast runs layer_norm in f32, CPU autocast does not).
    ``kernels``: the real-kernel family the contract table models. ``tensor_prefix``: how legacy
    tensor types print (``torch.cuda.FloatTensor``). ``label``: the name used in messages.
    ``contracts``: per-op rules replacing the family's (keys like ``"aten.mm"``).
    ``fake_device``: the torch device fake tensors are made on (the simulated one).
    ``capability``: the compute capability a simulated CUDA device reports to model code that asks
    (``torch.cuda.get_device_capability``; transformers' MoE picks its grouped GEMM by it).
    """

    name: str
    autocast_type: str
    kernels: KernelFamily
    tensor_prefix: str
    label: str
    fake_device: str
    contracts: Mapping[str, ContractRule] = field(default_factory=lambda: MappingProxyType({}))
    capability: tuple[int, int] | None = None

    def __str__(self) -> str:
        return self.name

    def legacy_type(self, scalar: str) -> str:
        """``legacy_type("FloatTensor")`` -> ``"torch.cuda.FloatTensor"`` on CUDA."""
        return f"{self.tensor_prefix}{scalar}"


_REGISTRY: dict[str, Device] = {}


def register(device: Device) -> Device:
    """Add a device (or replace one of the same name); returns it."""
    _REGISTRY[device.name] = device
    return device


def unregister(name: str) -> None:
    """Remove a registered device (tests register toy devices and take them out again)."""
    if name in ("cpu", "cuda"):
        raise CastwiseError(f"the built-in device {name!r} cannot be removed")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered device names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(device: str | Device) -> Device:
    """The registered device named ``device``; an unknown name is refused with the valid ones."""
    if isinstance(device, Device):
        return device
    found = _REGISTRY.get(str(device).split(":")[0])
    if found is None:
        raise CastwiseError(
            f"device {device!r} is not one castwise can simulate; valid: {', '.join(names())} "
            "(castwise.devices.register adds one)"
        )
    return found


CPU = register(
    Device("cpu", autocast_type="cpu", kernels="cpu", tensor_prefix="torch.", label="CPU", fake_device="cpu")
)
CUDA = register(
    Device(
        "cuda",
        autocast_type="cuda",
        kernels="cuda",
        tensor_prefix="torch.cuda.",
        label="CUDA",
        fake_device="cuda",
        capability=(9, 0),
    )
)  # an H100: what MoE training runs on
