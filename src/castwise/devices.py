"""Target devices as values: what the audit simulates, and which real kernels that device runs.

A :class:`Device` says which autocast rules apply (``autocast_type``), which family of real
kernels the contract table models for it (``kernels``), how its kernels name tensor types in
errors, its :class:`Capabilities` (the flags that choose a kernel *path* inside the family: a
CPU's instruction set and whether its oneDNN build takes bf16/f16, a GPU's compute capability),
and its *contract deltas*: per-op rules that replace the family's.

The registry is the one list of devices: every device choice in castwise (the CLI's ``--device``,
the audit's ``device=`` check, numerics) derives from :func:`names`. It holds

- ``cpu``: *this machine's* CPU, its capabilities read from the torch build at first use (the
  same model on an AVX2 and an AVX-512 CPU runs different convolution kernels);
- ``cpu:avx2``, ``cpu:avx512``, ``cpu:amx``: CPU classes to audit for another machine than this one;
- ``cuda`` (a current data-center GPU, H100-class) and ``cuda:a100``, ``cuda:l4``, ``cuda:t4``,
  ``cuda:v100``, ``cuda:b200``: simulated GPUs by compute capability;
- ``cuda:h200``, ``cuda:gb200``, ``cuda:sm120`` (``cuda:rtx5090``), ``cuda:mi300x``, ``cuda:mi355x``:
  GPU classes with their low-precision GEMMs spelled out (:class:`LowPrecision`: float8 flavour,
  MX and NVFP4 support, the shapes their kernels take; docs/devices.md cites each fact).

``cuda:0`` (a device index, as torch spells it) means ``cuda``. A new device or CPU class is one
:func:`register` call (CONTRIBUTING shows how, with its measured cases). Torch-free at import.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from castwise.errors import CastwiseError

KernelFamily = Literal["cpu", "cuda"]
# where one op's kernel comes from, inside a family: the contract rules branch on this
KernelPath = Literal["cpu.native", "cpu.onednn", "cuda.native", "cuda.cudnn"]

# a contract rule: (op name "aten.mm", args, kwargs, device) -> Violation | torch.dtype | None
ContractRule = Callable[[str, tuple[Any, ...], dict[str, Any], "Device"], Any]


@dataclass(frozen=True)
class Capabilities:
    """The flags that choose a kernel path on a device.

    CPU: ``isa`` is ATen's dispatch level (``torch.backends.cpu.get_cpu_capability()``: "AVX2",
    "AVX512", ...); ``onednn_bf16`` / ``onednn_f16``: whether a bf16 / f16 convolution (and
    gelu, RNN) goes to oneDNN, which is what torch asks (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
    AVX-512 cores for bf16, AVX512-FP16 or AMX-FP16 for f16); on a CPU without them the native
    kernels run, with other dtype rules. CUDA: ``sm``, the compute capability.
    ``measured``: the contract table's rules for this class were checked against its real
    kernels (tests/trace/truth/); otherwise they are read from torch's sources.
    """

    isa: str | None = None
    onednn_bf16: bool = False
    onednn_f16: bool = False
    sm: tuple[int, int] | None = None
    measured: bool = True

    def same_kernels(self, other: Capabilities) -> bool:
        """Whether both choose the same kernel paths (``measured`` aside)."""
        return (self.isa, self.onednn_bf16, self.onednn_f16, self.sm) == (
            other.isa,
            other.onednn_bf16,
            other.onednn_f16,
            other.sm,
        )

    def describe(self) -> str:
        if self.sm is not None:
            return f"compute capability {self.sm[0]}.{self.sm[1]}"
        onednn = [n for n, on in (("bf16", self.onednn_bf16), ("f16", self.onednn_f16)) if on]
        return f"{self.isa or 'unknown ISA'}, oneDNN {'/'.join(onednn) if onednn else 'f32 only'}"


@dataclass(frozen=True)
class LowPrecision:
    """The float8/float4 GEMMs a GPU class runs and the shapes its kernels take (docs/devices.md).

    ``fp8``: the float8 dtypes its GEMM operands may be (canonical names; MI300's are the FNUZ
    flavour, everyone else's the OCP one); ``mx``: the MX recipes (E8M0 scale per 32
    elements) it runs; ``nvfp4``: NVFP4 GEMMs (E2M1 in 16-element blocks, E4M3 scales);
    ``multiple``: what every float8 GEMM dim must be a multiple of; ``mx_k``: the reduction dim
    of an MX GEMM; ``fp4_multiple``: every dim of an NVFP4 GEMM; ``rocm``: a ROCm build's
    ``_scaled_mm``, which lacks CUDA's cuBLASLt-only checks (e5m2 x e5m2 is allowed there)."""

    fp8: tuple[str, ...] = ()
    mx: tuple[str, ...] = ()
    nvfp4: bool = False
    multiple: int = 16
    mx_k: int = 32
    fp4_multiple: int = 128
    rocm: bool = False

    def missing(self, recipe: str) -> str | None:
        """What this class lacks to run a policy's fp8 ``recipe`` ("tensorwise", "mxfp8", "nvfp4"...);
        None when it runs it."""
        if recipe == "nvfp4":
            return None if self.nvfp4 else "NVFP4 GEMMs"
        if recipe in ("mxfp8", "mxfp4"):
            return None if recipe in self.mx else f"{recipe.upper()} (MX block-scaled) GEMMs"
        return None if self.fp8 else "float8 GEMMs"


OCP_FP8 = ("float8_e4m3fn", "float8_e5m2")
FNUZ_FP8 = ("float8_e4m3fnuz", "float8_e5m2fnuz")


@dataclass(frozen=True)
class Device:
    """A target device castwise can audit for.

    ``name``: what users pass (``device="cuda"``, ``"cpu:avx2"``). ``autocast_type``: the autocast
    device type whose rules apply (CUDA autocast runs layer_norm in f32, CPU autocast does not).
    ``kernels``: the real-kernel family the contract table models. ``tensor_prefix``: how legacy
    tensor types print (``torch.cuda.FloatTensor``). ``label``: the name used in messages.
    ``fake_device``: the torch device fake tensors are made on (the simulated one).
    ``caps``: the capabilities that choose kernel paths (:meth:`path`); ``None`` only for the
    registry's ``cpu`` entry, which :func:`get` resolves to this machine's CPU.
    ``contracts``: per-op rules replacing the family's (keys like ``"aten.mm"``).
    """

    name: str
    autocast_type: str
    kernels: KernelFamily
    tensor_prefix: str
    label: str
    fake_device: str
    contracts: Mapping[str, ContractRule] = field(default_factory=lambda: MappingProxyType({}))
    caps: Capabilities | None = None
    summary: str = ""
    low: LowPrecision | None = None  # None: derived from the compute capability (``low_precision``)

    def __str__(self) -> str:
        return self.name

    @property
    def capability(self) -> tuple[int, int] | None:
        """The compute capability a simulated CUDA device reports to model code that asks
        (``torch.cuda.get_device_capability``; transformers' MoE picks its grouped GEMM by it)."""
        return self.caps.sm if self.caps is not None else None

    def runs_float8(self, mx: bool = False) -> bool:
        """Whether float8 GEMMs (``mx``: MX block-scaled ones) run here: on every CPU (its kernel takes
        any), on FP8 tensor cores from compute capability 8.9 (Ada, Hopper), MX from 10.0 (Blackwell);
        a class with its own ``low`` says so itself (MI355X runs MX at ROCm's capability 9.5)."""
        if self.kernels != "cuda" or self.capability is None:
            return True
        return self.low_precision().missing("mxfp8" if mx else "tensorwise") is None

    def low_precision(self) -> LowPrecision:
        """What low-precision GEMMs this device runs: the class's own, else by compute capability
        (every CPU kernel takes any float8 dtype and shape)."""
        if self.low is not None:
            return self.low
        sm = self.capability
        if self.kernels != "cuda" or sm is None:
            return LowPrecision(OCP_FP8 + FNUZ_FP8, ("mxfp8", "mxfp4"), True, 1, 1, 1)
        blackwell = sm >= (10, 0)
        return LowPrecision(OCP_FP8 if sm >= (8, 9) else (), ("mxfp8", "mxfp4") if blackwell else (), nvfp4=blackwell)

    def refuses_gemm(self, dtypes: tuple[str, str], k: int, mx: bool) -> tuple[str, str] | None:
        """(violation kind, message) when this class's float8 GEMM kernels refuse operands of
        ``dtypes`` (canonical names) over a reduction dim ``k`` (``mx``: E8M0 block scales); None
        when they take them. What the compute capability decides is the contract's own check."""
        if self.kernels != "cuda" or self.capability is None:
            return None
        low = self.low_precision()  # the class's own, else by capability (OCP float8 from sm 8.9)
        if not low.fp8:
            return None  # no float8 GEMMs at all: the contract's capability check says so
        if any(d.startswith("float4") for d in dtypes):
            k *= 2  # two E2M1 values a byte: the reduction dim in elements
            if not (("mxfp4" in low.mx) if mx else low.nvfp4):
                what, scales = ("MXFP4", "e8m0") if mx else ("NVFP4", "e4m3")
                return "fp8-device", (
                    f"{self.name} runs no {what} GEMMs (float4_e2m1fn_x2 operands with {scales} block scales: "
                    "Blackwell, sm 10.0+, and for MXFP4 gfx950)"
                )
        wrong = sorted({d for d in dtypes if d.startswith("float8") and d not in low.fp8})
        if wrong:
            return "fp8-flavour", (
                f"{self.name} takes float8 GEMM operands in {' and '.join(low.fp8)} only, not {', '.join(wrong)}"
            )
        if mx and k % low.mx_k:
            return "mx-shape", f"{self.name}'s MX GEMMs need the reduction dim a multiple of {low.mx_k}, got {k}"
        return None

    def legacy_type(self, scalar: str) -> str:
        """``legacy_type("FloatTensor")`` -> ``"torch.cuda.FloatTensor"`` on CUDA."""
        return f"{self.tensor_prefix}{scalar}"

    def path(self, dtype_name: str) -> KernelPath:
        """The kernel path a convolution-class op (conv, gelu, RNN: the ops torch sends to
        oneDNN/cuDNN by dtype and capability) takes for an input of ``dtype_name`` ("bfloat16")."""
        if self.kernels == "cuda":
            return "cuda.cudnn"
        caps = self.caps or Capabilities()
        if (dtype_name == "bfloat16" and caps.onednn_bf16) or (dtype_name == "float16" and caps.onednn_f16):
            return "cpu.onednn"
        return "cpu.native"

    def onednn_both_halves(self) -> bool:
        """Whether this CPU's oneDNN takes bf16 and f16 alike (AMX / AVX512-FP16): it then reorders
        between them, so ops that refuse a bf16/f16 mix on an AVX-512 CPU accept it (measured on a
        Sapphire Rapids-class Xeon, torch 2.11 and 2.14)."""
        caps = self.caps or Capabilities()
        return self.kernels != "cuda" and caps.onednn_bf16 and caps.onednn_f16


_REGISTRY: dict[str, Device] = {}
_BUILT_IN: set[str] = set()
_HOST: list[Device] = []  # this machine's CPU, resolved once


def register(device: Device) -> Device:
    """Add a device (or replace one of the same name); returns it."""
    _REGISTRY[device.name] = device
    _LOOKUP_CACHE.clear()
    return device


def unregister(name: str) -> None:
    """Remove a registered device (tests register toy devices and take them out again)."""
    if name in _BUILT_IN:
        raise CastwiseError(f"the built-in device {name!r} cannot be removed")
    _REGISTRY.pop(name, None)
    _LOOKUP_CACHE.clear()


def autocast_types() -> tuple[str, ...]:
    """The autocast device types of the registered devices ("cpu", "cuda"), sorted."""
    return tuple(sorted({d.autocast_type for d in _REGISTRY.values()}))


def names() -> tuple[str, ...]:
    """The registered device names, sorted."""
    return tuple(sorted(_REGISTRY))


_LOOKUP_CACHE: dict[str, Device] = {}
_INDEX = re.compile(r"^(?P<base>[a-z_]+):\d+$")  # "cuda:0": a device index, not a variant


def get(device: str | Device) -> Device:
    """The registered device named ``device`` (``cuda:0`` means ``cuda``; ``cpu`` is this
    machine's CPU); an unknown name is refused with the valid ones."""
    if isinstance(device, Device):
        return host_cpu() if device.caps is None and device.name == "cpu" else device
    key = str(device)
    hit = _LOOKUP_CACHE.get(key)
    if hit is not None:
        return hit
    index = _INDEX.match(key)
    found = _REGISTRY.get(index.group("base") if index else key)
    if found is None:
        raise CastwiseError(
            f"device {device!r} is not one castwise can simulate; valid: {', '.join(names())} "
            "(castwise.devices.register adds one)"
        )
    if found.caps is None and found.name == "cpu":
        found = host_cpu()
    _LOOKUP_CACHE[key] = found
    return found


def host_caps() -> Capabilities:
    """This machine's CPU capabilities, as the installed torch build dispatches (imports torch)."""
    import torch

    isa = str(torch.backends.cpu.get_cpu_capability())
    onednn = bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)  # type: ignore[no-untyped-call]

    def supported(probe: str) -> bool:
        fn = getattr(torch.ops.mkldnn, probe, None)  # absent from builds without oneDNN
        return bool(onednn and fn is not None and fn())

    bf16, f16 = supported("_is_mkldnn_bf16_supported"), supported("_is_mkldnn_fp16_supported")
    caps = Capabilities(isa=isa, onednn_bf16=bf16, onednn_f16=f16)
    known = [d.caps for d in _REGISTRY.values() if d.kernels == "cpu" and d.caps is not None]
    return replace(caps, measured=any(k.measured and k.same_kernels(caps) for k in known))


def host_cpu() -> Device:
    """The ``cpu`` device with this machine's capabilities (what a real CPU run here does)."""
    if not _HOST:
        _HOST.append(replace(CPU, caps=host_caps()))
    return _HOST[0]


def other_cpu(device: Device) -> Capabilities | None:
    """This machine's CPU capabilities when ``device`` is a CPU class this machine is not (its
    kernels are not the ones a real run here executes); None otherwise."""
    here = host_cpu().caps
    if device.kernels != "cpu" or device.caps is None or here is None or device.caps.same_kernels(here):
        return None
    return here


def host_variant() -> str | None:
    """The registered CPU class this machine belongs to (``cpu:avx512``), if one matches."""
    caps = host_cpu().caps
    for name in names():
        dev = _REGISTRY[name]
        if dev.kernels == "cpu" and dev.caps is not None and caps is not None and dev.caps.same_kernels(caps):
            return name
    return None


def _builtin(device: Device) -> Device:
    _BUILT_IN.add(device.name)
    return register(device)


def _cpu_class(name: str, summary: str, caps: Capabilities) -> Device:
    return _builtin(replace(CPU, name=name, caps=caps, summary=summary))


def _gpu(name: str, summary: str, sm: tuple[int, int], low: LowPrecision | None = None) -> Device:
    return _builtin(replace(CUDA, name=name, caps=Capabilities(sm=sm, measured=False), summary=summary, low=low))


def alias(name: str, of: str) -> Device:
    """Register ``name`` as another name of the device ``of`` (``cuda:rtx5090`` for ``cuda:sm120``)."""
    return _builtin(replace(_REGISTRY[of], name=name))


CPU = _builtin(
    Device(
        "cpu",
        autocast_type="cpu",
        kernels="cpu",
        tensor_prefix="torch.",
        label="CPU",
        fake_device="cpu",
        summary="this machine's CPU",
    )
)
CUDA = _builtin(
    Device(
        "cuda",
        autocast_type="cuda",
        kernels="cuda",
        tensor_prefix="torch.cuda.",
        label="CUDA",
        fake_device="cuda",
        caps=Capabilities(sm=(9, 0), measured=False),
        summary="a current data-center GPU (H100-class, sm 9.0)",
    )
)
_cpu_class("cpu:avx2", "an AVX2 CPU (no AVX-512): bf16/f16 convolutions on native kernels", Capabilities("AVX2"))
_cpu_class(
    "cpu:avx512",
    "an AVX-512 CPU: bf16 convolutions on oneDNN, f16 on native kernels",
    Capabilities("AVX512", onednn_bf16=True),
)
_cpu_class(
    "cpu:amx",
    "an AVX-512 CPU with AMX-FP16 or AVX512-FP16 (Sapphire Rapids and later): bf16 and f16 on oneDNN",
    Capabilities("AVX512", onednn_bf16=True, onednn_f16=True),
)
_gpu("cuda:b200", "a Blackwell GPU (sm 10.0)", (10, 0))
_gpu("cuda:a100", "an A100-class GPU (sm 8.0)", (8, 0))
_gpu("cuda:l4", "an L4 / Ada GPU (sm 8.9)", (8, 9))
_gpu("cuda:t4", "a T4-class GPU (sm 7.5, no bf16 tensor cores)", (7, 5))
_gpu("cuda:v100", "a V100-class GPU (sm 7.0, no bf16 tensor cores)", (7, 0))
# the 2026 classes: each fact cited in docs/devices.md. Capability as torch reports it (ROCm: the
# gfx arch, gfx942 -> 9.4, gfx950 -> 9.5)
_BLACKWELL = LowPrecision(OCP_FP8, ("mxfp8", "mxfp4"), nvfp4=True)
_gpu("cuda:h200", "an H200 (Hopper, sm 9.0): float8 e4m3fn/e5m2, no MX, no FP4", (9, 0), LowPrecision(OCP_FP8))
_gpu("cuda:gb200", "a GB200's Blackwell GPU (sm 10.0): float8, MXFP8, MXFP4, NVFP4", (10, 0), _BLACKWELL)
_gpu("cuda:sm120", "an RTX 50-series / RTX PRO Blackwell GPU (sm 12.0): float8, MX, NVFP4", (12, 0), _BLACKWELL)
alias("cuda:rtx5090", "cuda:sm120")
_gpu(
    "cuda:mi300x",
    "an AMD MI300X (gfx942, ROCm): float8 in the FNUZ flavour (e4m3fnuz, e5m2fnuz), no MX, no FP4",
    (9, 4),
    LowPrecision(FNUZ_FP8, rocm=True),
)
_gpu(
    "cuda:mi355x",
    "an AMD MI355X (gfx950, ROCm): OCP float8 (e4m3fn, e5m2), MXFP8 and MXFP4 (K a multiple of 128), no NVFP4",
    (9, 5),
    LowPrecision(OCP_FP8, ("mxfp8", "mxfp4"), mx_k=128, rocm=True),
)
