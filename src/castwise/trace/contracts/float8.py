"""Contracts for float8 GEMMs: ``aten._scaled_mm``, what torchao's Float8Linear and MX layers call.

CUDA, read from aten/src/ATen/native/cuda/Blas.cpp (``_scaled_mm_out_cuda``, torch 2.14):

- the GPU must have FP8 tensor cores: compute capability 8.9 (Ada) or 9.0+ ("torch._scaled_mm is
  only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+"); block
  scales in ``float8_e8m0fnu`` (the MX formats) need 10.0 (Blackwell);
- every GEMM dimension is a multiple of 16: mat1's trailing dim, both of mat2's. Forward that is
  the Linear's in/out features; the backward's weight-gradient GEMM (``grad_out.t() @ input``)
  multiplies over the batch's tokens, so their count must be one too (pytorch/ao issue 3111);
- two e5m2 operands are refused (cuBLASLt has no e5m2 x e5m2 GEMM); a ROCm build skips this check.

Measured on an H200 (sm 9.0, torch 2.11; tests/trace/truth/scaled_mm_h200.json): every shape and
format case above, the messages word for word; MX scales there fail in cuBLASLt
(CUBLAS_STATUS_NOT_SUPPORTED). The result is ``out_dtype`` (default: mat1's dtype). CPU
(measured, torch 2.14): the kernel takes any shape and both float8 formats, so it only names the
result dtype. Violations carry their own kinds, read by CW131 (``fp8-shape``) and CW132
(``fp8-device``).
"""

from __future__ import annotations

from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import Args, Kwargs, _arg, _viol

MULTIPLE = 16


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(int(s)) for s in t.shape)


def _scaled_mm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    a, b = args[0], args[1]
    out = _arg(args, kwargs, 6, "out_dtype") or a.dtype
    if dev.kernels != "cuda":
        return out
    scale_a = _arg(args, kwargs, 2, "scale_a")
    mx = isinstance(scale_a, torch.Tensor) and "e8m0" in str(scale_a.dtype)
    sm = dev.capability
    if sm is not None and not dev.runs_float8(mx):
        if mx:
            msg = "MX block-scaled float8 GEMMs need CUDA devices with compute capability >= 10.0"
        else:
            msg = (
                "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, "
                "or ROCm MI300+"
            )
        msg += f"; {dev.name} is {sm[0]}.{sm[1]}"
        return _viol(op, "fp8-device", msg, args, kwargs, [a, b], None)
    refused = dev.refuses_gemm((str(a.dtype)[6:], str(b.dtype)[6:]), int(a.shape[-1]), mx)  # the class's own rules
    if refused is not None:
        return _viol(op, refused[0], refused[1], args, kwargs, [a, b], None)
    if a.dim() == 2 and b.dim() == 2:
        if a.shape[1] % MULTIPLE:
            msg = f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: ({_shape(a)})."
            return _viol(op, "fp8-shape", msg, args, kwargs, [a], None)
        if b.shape[0] % MULTIPLE or b.shape[1] % MULTIPLE:
            msg = f"mat2 shape ({_shape(b)}) must be divisible by 16"
            return _viol(op, "fp8-shape", msg, args, kwargs, [b], None)
    # torch's Blas.cpp checks this under `#ifndef USE_ROCM` only (pytorch#148228): ROCm's hipBLASLt
    # multiplies two e5m2 operands
    rocm = dev.low is not None and dev.low.rocm
    if a.dtype == b.dtype == torch.float8_e5m2 and not rocm:
        msg = "Multiplication of two Float8_e5m2 matrices is not supported"
        return _viol(op, "fp8-device", msg, args, kwargs, [a, b], None)
    return out
