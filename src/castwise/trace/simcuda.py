"""The simulated CUDA device: what model code learns when it asks torch about the GPU.

A fake audit on ``device="cuda"`` runs the model on fake CUDA tensors, usually on a machine with
no GPU. Code asks the CUDA runtime questions whose answers choose the dtype path:
``torch.autocast("cuda")`` disables itself when ``torch.cuda.is_available()`` is False,
``torch.utils.checkpoint`` re-enters autocast through it to recompute, and models branch on
``is_bf16_supported()`` or the compute capability. While :func:`simulated_cuda` is entered those
queries answer as the simulated device would, one GPU of ``Device.capability`` (an H100 for
``"cuda"``); the CUDA random generator is emulated per device (fake tensors draw no random
numbers: ``fork_rng`` and checkpoint only save and restore its state). Nothing here reaches the
real CUDA runtime, and every attribute patched is put back on exit, also on exceptions.

``torch.cuda.is_initialized`` and ``torch.accelerator`` keep answering for this machine: torch's
own FakeTensor asks them whether it may initialise the real device (and checkpoint then saves
only the CPU random state, as on a GPU machine whose CUDA context is not yet made). So does
``FakeTensorMode.avoid_device_init``, which torch computes from ``torch.cuda.is_available()``: told
"a GPU is there", a fake ``torch.tensor(data, device="cuda")`` would copy its data to the real
device (on this machine: "Found no NVIDIA driver", which Dynamo's fake propagation raises), or
come out on the meta device under the stand-in guard.
"""

from __future__ import annotations

import contextlib
import secrets
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import unset_fake_temporarily

from castwise.devices import Device
from castwise.trace.cuda_guard import stand_in_guard

# this machine's own answer, taken before a simulation patches torch.cuda: torch's real
# is_available() reads torch.cuda.device_count, which the simulation answers
_host_answer: bool | None = None

_MIB = 1024 * 1024
_DEFAULT_SEED = 67280421310721  # CUDA's default generator seed (c10 default_rng_seed_val)


def host_has_cuda() -> bool:
    """Whether this machine really has a usable CUDA device (the simulation's answer aside)."""
    return _host_answer if _host_answer is not None else bool(torch.cuda.is_available())


@dataclass(frozen=True)
class SimulatedDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for the simulated GPU: the attributes of
    torch's ``_CudaDeviceProperties`` (a C type that cannot be built without a device)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    shared_memory_per_block_optin: int
    L2_cache_size: int  # torch's attribute names, as code reads them
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    max_threads_per_multi_processor: int = 2048
    max_threads_per_block: int = 1024
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_multiprocessor: int = 228 * 1024
    clock_rate: int = 1_980_000
    memory_clock_rate: int = 2_619_000
    memory_bus_width: int = 5120
    gcnArchName: str = "NVIDIA"  # ROCm's arch name: only torch's HIP paths read it
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // _MIB}MB, multi_processor_count={self.multi_processor_count}, "
            f"L2_cache_size={self.L2_cache_size // _MIB}MB) (simulated by castwise)"
        )


# (name, memory in MiB, SMs, opt-in shared memory per block in KiB, L2 in MiB): a representative
# GPU of each compute capability, from the vendors' data sheets
_GPUS: dict[tuple[int, int], tuple[str, int, int, int, int]] = {
    (7, 0): ("Tesla V100-SXM2-32GB", 32_501, 80, 96, 6),
    (7, 5): ("Tesla T4", 15_095, 40, 64, 4),
    (8, 0): ("NVIDIA A100-SXM4-80GB", 81_051, 108, 163, 40),
    (8, 9): ("NVIDIA L4", 22_563, 58, 99, 48),
    (9, 0): ("NVIDIA H100 80GB HBM3", 81_559, 132, 227, 50),
    (10, 0): ("NVIDIA B200", 183_359, 148, 227, 126),
}


def properties_of(capability: tuple[int, int]) -> SimulatedDeviceProperties:
    """The properties a GPU of ``capability`` reports (an unlisted one: an H100's, renamed)."""
    name, mib, sms, smem_kib, l2_mib = _GPUS.get(capability, _GPUS[(9, 0)])
    if capability not in _GPUS:
        name = f"simulated CUDA device (sm_{capability[0]}{capability[1]})"
    return SimulatedDeviceProperties(
        name, capability[0], capability[1], mib * _MIB, sms, smem_kib * 1024, l2_mib * _MIB
    )


def _index(device: Any, count: int) -> int:
    """The device index ``device`` names (``None``, ``"cuda"``: the current one, 0), checked as
    torch checks it."""
    if device is None:
        return 0
    if isinstance(device, int):
        idx = device
    else:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {dev}")
        idx = 0 if dev.index is None else dev.index
    if not 0 <= idx < count:
        raise AssertionError("Invalid device id")  # torch's own words and type for a bad index
    return idx


class _Rng:
    """The CUDA generators' states, one per simulated device. A state is what the caller handed
    in (or a Philox-shaped 16 bytes: seed, offset): callers only save and restore it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.seeds = [_DEFAULT_SEED] * count
        self.states: list[torch.Tensor | None] = [None] * count

    def get_rng_state(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        idx = _index(device, self.count)
        saved = self.states[idx]
        # copied and made outside the fake mode: a real state stays real, as the generator's is
        with unset_fake_temporarily():
            if saved is not None:
                return saved.clone()
            raw = self.seeds[idx].to_bytes(8, "little") + bytes(8)
            return torch.tensor(list(raw), dtype=torch.uint8)

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        with unset_fake_temporarily():
            self.states[_index(device, self.count)] = new_state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.count)]

    def set_rng_state_all(self, new_states: Iterable[torch.Tensor]) -> None:
        for i, state in enumerate(new_states):
            self.set_rng_state(state, i)

    def manual_seed(self, seed: int) -> None:
        self.seeds[0], self.states[0] = int(seed), None

    def manual_seed_all(self, seed: int) -> None:
        self.seeds, self.states = [int(seed)] * self.count, [None] * self.count

    def seed(self) -> None:
        self.manual_seed(secrets.randbits(63))  # not Python's global stream: the caller's

    def seed_all(self) -> None:
        self.manual_seed_all(secrets.randbits(63))

    def initial_seed(self) -> int:
        return self.seeds[0]


class _Gpu:
    """The answers of the ``torch.cuda`` functions :data:`PATCHED` names, for one simulated GPU
    of ``capability`` (methods named as the functions they stand in for)."""

    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability
        self.count = 1
        self.props = properties_of(capability)
        self.rng = _Rng(self.count)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        _index(device, self.count)

    def _exchange_device(self, device: int) -> int:
        # torch.cuda.device(i) enters and leaves through these: the previous index, -1 for none
        return -1 if device < 0 else _index(device, self.count)

    _maybe_exchange_device = _exchange_device

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        _index(device, self.count)
        return self.capability

    def get_device_properties(self, device: Any = None) -> SimulatedDeviceProperties:
        _index(device, self.count)
        return self.props

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # native from sm_80; torch answers True for older GPUs too, which emulate it
        return self.capability >= (8, 0) or including_emulation

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        total = self.get_device_properties(device).total_memory
        return total, total

    def synchronize(self, device: Any = None) -> None:
        _index(device, self.count)  # fake kernels finish at once

    def is_current_stream_capturing(self) -> bool:
        return False  # no CUDA graph is captured in an audit


PATCHED = (
    *(name for name in vars(_Gpu) if not name.startswith("__")),
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
)


def _answers(capability: tuple[int, int]) -> dict[str, Callable[..., Any]]:
    """The replacement of each function in :data:`PATCHED` for a GPU of ``capability``."""
    gpu = _Gpu(capability)
    return {name: getattr(gpu, name) if hasattr(gpu, name) else getattr(gpu.rng, name) for name in PATCHED}


@contextlib.contextmanager
def answering_as(device: Device) -> Iterator[None]:
    """Only ``torch.cuda``'s answers about the GPU (is_available, capability, properties, bf16
    support...) as the simulated ``device`` gives them, restored on exit; no fake-tensor setting.
    A device of other kernels, or without a capability: nothing changes."""
    if device.kernels != "cuda" or device.capability is None:
        yield
        return
    with _patched(torch.cuda, _answers(device.capability)):
        yield


@contextlib.contextmanager
def _patched(module: types.ModuleType, answers: dict[str, Callable[..., Any]]) -> Iterator[None]:
    originals = {name: getattr(module, name) for name in answers}
    try:
        for name, answer in answers.items():
            setattr(module, name, answer)
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def _host_default_type() -> str:
    """What torch's checkpoint finds as its default device type on this machine (its lazy
    default: the current accelerator, else "cpu"): a value cached from it, not set by the user's
    code (``DefaultDeviceType.set_device_type``, as far as castwise can tell), which a checkpoint
    of a block whose tensors all come as keyword arguments reads for the device whose autocast it
    recomputes under. On a GPU machine that is "cuda"."""
    acc = torch.accelerator.current_accelerator(True)
    return acc.type if acc is not None else "cpu"


@contextlib.contextmanager
def host_device_init() -> Iterator[None]:
    """``FakeTensorMode.avoid_device_init`` answering for this machine, not for a simulated GPU
    (``torch.cuda.is_available()`` says True while one is simulated): fake tensors, the audit's
    and those of the modes torch makes itself (Dynamo's, AOTAutograd's), never initialise a
    device this machine lacks, nor move a constant there for real. torch asks once per op; the
    answer is taken once, on entry."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    avoid = not host_has_cuda()
    saved = FakeTensorMode.__dict__["avoid_device_init"]
    FakeTensorMode.avoid_device_init = property(lambda self: avoid)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        FakeTensorMode.avoid_device_init = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def simulated_cuda(device: Device) -> Iterator[None]:
    """While a fake audit simulates ``device`` (a CUDA one), code that asks torch about the GPU
    gets the simulated GPU's answers (a device of other kernels, or without a capability:
    nothing changes). Restored on exit, also on exceptions."""
    global _host_answer
    if device.kernels != "cuda" or device.capability is None:
        yield
        return
    # checkpoint caches the default device type the first time it is asked: what it caches
    # under the simulation must not outlive it, and what this machine cached before (a CPU run's
    # "cpu") is not what a GPU machine answers
    default_type = torch.utils.checkpoint.DefaultDeviceType._default_device_type
    outer_host, _host_answer = _host_answer, host_has_cuda()
    try:
        if default_type is not None and default_type == _host_default_type():
            torch.utils.checkpoint.DefaultDeviceType._default_device_type = None
        # the guard first, while torch still gives this machine's answer (cuda_guard.py: fake CUDA
        # tensors carry gradients on CPU-only builds too)
        with stand_in_guard(), host_device_init(), _patched(torch.cuda, _answers(device.capability)):
            yield
    finally:
        _host_answer = outer_host
        torch.utils.checkpoint.DefaultDeviceType._default_device_type = default_type
