"""Ops without a kernel for a dtype on a device (linalg, fft, cdist, special...): a data table and its rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import (
    _REDUCED,
    BF16,
    F16,
    F32,
    F64,
    TORCH_RELEASE,
    Args,
    Kwargs,
    Rule,
    _arg,
    _not_on_device,
    _sc,
    _viol,
)
from castwise.trace.contracts.elementwise import _float_only


@dataclass(frozen=True)
class _NoKernel:
    cpu: str | None  # message on CPU ("{sc}" is the dtype's scalar name), None: CPU accepts
    cuda: str | None  # message on CUDA, None: CUDA accepts
    cuda_half: bool = False  # CUDA accepts f16 (refuses only bf16)
    result: str = "same"  # "same" | "complex" | "real": result dtype from the input's
    arg: int = 0  # the argument whose dtype the kernel dispatches on


def _nk(cpu_kernel: str | None, cuda_kernel: str | None, **kw: Any) -> _NoKernel:
    def msg(kernel: str | None) -> str | None:
        return None if kernel is None else f"\"{kernel}\" not implemented for '{{sc}}'"

    return _NoKernel(msg(cpu_kernel), msg(cuda_kernel), **kw)


def _special(name: str) -> _NoKernel:
    # UnarySpecialOpsKernel.cu / the special-function .cu files: AT_DISPATCH_FLOATING_TYPES
    # "<name>_cuda" (verified for bessel_j0, erfcx, ndtri, zeta)
    return _nk(f"{name}_cpu", f"{name}_cuda")


_LOW_PRECISION = "{name}: Low precision dtypes not supported. Got {{sc}}"
_EPSILON = "This function doesn't handle types other than float and double"
_MKL_FFT = "MKL FFT doesn't support tensors of type: {sc}"
_CUFFT = "cuFFT doesn't support tensor of type: {sc}"

# keys: "aten.op" for every overload, "aten.op.overload" for one. CUDA kernel names of the
# factorisations are cuSOLVER's, as measured on an H100 build (torch 2.11); MAGMA builds name theirs.
_NO_KERNEL: dict[str, _NoKernel] = {
    "aten.linalg_qr": _nk("geqrf_cpu", "geqrf_cuda"),
    "aten.geqrf": _nk("geqrf_cpu", "geqrf_cuda"),
    "aten.linalg_householder_product": _nk("orgqr_cpu", "orgqr_cuda"),
    "aten.linalg_cholesky_ex": _nk("cholesky_cpu", "cholesky_cusolver"),
    "aten.cholesky_solve": _nk("cholesky_solve_cpu", "cholesky_cuda_potrs"),
    "aten._cholesky_solve_helper": _nk("cholesky_solve_cpu", "cholesky_cuda_potrs"),
    "aten.cholesky_inverse": _nk("cholesky_inverse_out_cpu", "cholesky_cuda_potri"),
    "aten.linalg_lu_factor_ex": _nk("lu_cpu", "lu_factor_cusolver"),
    "aten.linalg_lu": _nk("lu_cpu", "lu_factor_cusolver"),
    "aten._linalg_det": _nk("lu_cpu", "lu_factor_cusolver"),
    "aten._linalg_solve_ex": _nk("lu_cpu", "lu_factor_cusolver"),
    "aten.linalg_solve_triangular": _nk("triangular_solve_cpu", "triangular_solve_cuda"),
    "aten._linalg_svd": _nk("linalg_svd_cpu", "svd_cuda_gesvdjBatched"),
    "aten._linalg_eigh": _nk("linalg_eigh_cpu", "linalg_eigh_cuda"),
    "aten.linalg_eig": _nk("linalg_eig_out_cpu", "linalg_eig_cuda", result="complex"),
    "aten.linalg_ldl_factor_ex": _nk("ldl_factor_kernel_cpu", "ldl_factor_looped_cusolver"),
    "aten.linalg_inv_ex": _NoKernel(_LOW_PRECISION.format(name="linalg.inv"), _LOW_PRECISION.format(name="linalg.inv")),
    "aten._linalg_slogdet": _NoKernel(
        _LOW_PRECISION.format(name="linalg.slogdet"), _LOW_PRECISION.format(name="linalg.slogdet")
    ),
    "aten.linalg_lstsq": _NoKernel(_EPSILON, _EPSILON),
    "aten._cdist_forward": _nk("cdist", "cdist_cuda"),
    "aten._pdist_forward": _nk("pdist", "pdist_cuda"),
    "aten._ctc_loss": _nk("ctc_loss_cpu", "ctc_loss_cuda"),
    "aten.special_ndtri": _special("ndtri"),
    "aten.special_zeta": _special("zeta"),
    "aten.special_erfcx": _special("erfcx"),
    "aten.special_log_ndtr": _special("log_ndtr"),
    **{
        f"aten.special_{n}": _special(n)
        for n in (
            "bessel_j0",
            "bessel_j1",
            "bessel_y0",
            "bessel_y1",
            "modified_bessel_i0",
            "modified_bessel_i1",
            "modified_bessel_k0",
            "modified_bessel_k1",
            "scaled_modified_bessel_k0",
            "scaled_modified_bessel_k1",
            "spherical_bessel_j0",
            "airy_ai",
        )
    },
    # the polynomials' Tensor-Tensor overload only: the Scalar overloads put no tensor first
    **{
        f"aten.special_{n}.default": _special(n)
        for n in (
            "chebyshev_polynomial_t",
            "chebyshev_polynomial_u",
            "chebyshev_polynomial_v",
            "chebyshev_polynomial_w",
            "shifted_chebyshev_polynomial_t",
            "shifted_chebyshev_polynomial_u",
            "shifted_chebyshev_polynomial_v",
            "shifted_chebyshev_polynomial_w",
            "hermite_polynomial_h",
            "hermite_polynomial_he",
            "laguerre_polynomial_l",
            "legendre_polynomial_p",
        )
    },
    # histogramdd's CPU kernel only (no CUDA kernel at all); histogram with a bins tensor and histc
    # have bf16/f16 CPU kernels
    "aten.histogram.bin_ct": _nk("histogramdd", None),
    "aten._histogramdd_bin_edges": _nk("histogramdd", None),
    "aten._histogramdd_from_bin_cts": _nk("histogramdd", None),
    # CUDA kernels of these take Half and BFloat16 (AveragePool3d.cu, MultiMarginLoss.cu,
    # MultiLabelMarginCriterion.cu: AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16); the
    # antialiased upsampling and gamma kernels are taken to do the same, not read): CPU only
    "aten.avg_pool3d": _nk("avg_pool3d_out_frame", None),
    "aten.avg_pool3d_backward": _nk("avg_pool3d_backward_out_frame", None),
    "aten._upsample_bilinear2d_aa": _nk("compute_index_ranges_weights", None),
    "aten._upsample_bicubic2d_aa": _nk("compute_index_ranges_weights", None),
    "aten._upsample_bilinear2d_aa_backward": _nk("upsample_bilinear2d_aa_backward_cpu", None),
    "aten.multilabel_margin_loss_forward": _nk("multilabel_margin_loss_forward_out_frame", None),
    "aten.multilabel_margin_loss_backward": _nk("multilabel_margin_loss_backward_out_frame", None, arg=1),
    "aten.multi_margin_loss": _nk("multi_margin_loss_cpu_kernel", None),
    "aten._standard_gamma": _nk("gamma_cpu", None),
    "aten._standard_gamma_grad": _nk("_standard_gamma_grad_cpu", None),
    "aten.binomial": _nk("binomial_cpu", None),
    "aten._sample_dirichlet": _nk("dirichlet", None),
    "aten._fft_r2c": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True, result="complex"),
    "aten._fft_c2c": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True),
    "aten._fft_c2r": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True, result="real"),
}
_CPU_ONLY = ("aten.histogram.bin_ct", "aten._histogramdd_bin_edges", "aten._histogramdd_from_bin_cts")
_COMPLEX_OF = {F32: torch.complex64, F64: torch.complex128, F16: torch.complex32, BF16: torch.complex32}


def _cdist_uses_mm(args: Args, kwargs: Kwargs) -> bool:
    # Distance.cpp cdist_impl: p == 2 goes through _euclidean_dist (matmul, any float dtype) when
    # compute_mode is 1, or None/0 and either input has more than 25 rows; only the direct
    # kernel lacks bf16/f16
    x1, x2 = args[0], args[1]
    p = _arg(args, kwargs, 2, "p")
    mode = _arg(args, kwargs, 3, "compute_mode")
    if p != 2:
        return False
    return mode == 1 or (mode in (None, 0) and (x1.size(-2) > 25 or x2.size(-2) > 25))


def _fft_sizes_pow2(op: str, args: Args, kwargs: Kwargs) -> bool:
    x = args[0]
    dims = list(_arg(args, kwargs, 1, "dim"))
    sizes = [x.size(d) for d in dims]
    if op == "aten._fft_c2r" and sizes:
        sizes[-1] = int(_arg(args, kwargs, 3, "last_dim_size"))
    return all(s > 0 and s & (s - 1) == 0 for s in sizes)


def _no_kernel_rule(key: str, spec: _NoKernel) -> Rule:
    """The rule for one op of ``_NO_KERNEL``; the spec is bound here, so a call is no lookup."""
    cpu_only = key in _CPU_ONLY

    def rule(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
        x = args[spec.arg]
        if dev.kernels == "cuda" and cpu_only:
            return _not_on_device(op, args, kwargs, dev, ("cpu",), overload=key)
        # the complex FFTs name the value type: complex32 reads "Half"
        value = x.dtype.to_real() if x.dtype.is_complex else x.dtype
        if value in _REDUCED and not (op == "aten._cdist_forward" and _cdist_uses_mm(args, kwargs)):
            msg = spec.cuda if dev.kernels == "cuda" else spec.cpu
            if dev.kernels == "cuda" and spec.cuda_half and value == F16:
                if not _fft_sizes_pow2(op, args, kwargs):
                    return _viol(
                        op,
                        "unsupported",
                        "cuFFT only supports dimensions whose sizes are powers of two when computing in half precision",
                        args,
                        kwargs,
                        [x],
                        F32,
                    )
                msg = None
            if msg is not None:
                want = torch.complex64 if x.dtype.is_complex else F32
                return _viol(op, "unsupported", msg.format(sc=_sc(value)), args, kwargs, [x], want)
        if spec.result == "complex":
            return _COMPLEX_OF.get(x.dtype, x.dtype)
        if spec.result == "real" and x.dtype.is_complex:
            return value
        return x.dtype

    return rule


def _rrelu(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: only the training path samples noise, in a kernel without Half
    x = args[0]
    if dev.kernels == "cpu" and x.dtype == F16 and _arg(args, kwargs, 4, "training", False):
        return _viol(
            op, "unsupported", "\"rrelu_with_noise_out_cpu\" not implemented for 'Half'", args, kwargs, [x], F32
        )
    return _float_only(op, args, kwargs, dev)


_COMPLEX_PARTS = (F16, F32, F64)


def _histogram_bins_tensor(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    """histogram with a tensor of bin edges: CPU kernels for every float dtype, none on CUDA
    (measured, H100)."""
    bad = _not_on_device(op, args, kwargs, dev, ("cpu",), overload="aten.histogram.bins_tensor")
    return bad or args[0].dtype


def _complex_ctor(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # TensorFactories.cpp complex_check_dtype, device-agnostic (CPU measured): Half, Float or
    # Double parts (no bf16: there is no bf16 complex type), both of one dtype
    a, b = args[0], args[1]
    # measured: no Half polar kernel on CUDA (H100), nor on CPU before torch 2.14 (2.12.1, 2.13.0)
    if op == "aten.polar" and a.dtype == F16 and (dev.kernels == "cuda" or TORCH_RELEASE < (2, 14)):
        kernel = f"polar_{dev.kernels}"
        return _viol(op, "unsupported", f"\"{kernel}\" not implemented for 'Half'", args, kwargs, [a, b], F32)
    if a.dtype not in _COMPLEX_PARTS or b.dtype not in _COMPLEX_PARTS:
        return _viol(
            op,
            "unsupported",
            f"Expected both inputs to be Half, Float or Double tensors but got {_sc(a.dtype)} and {_sc(b.dtype)}",
            args,
            kwargs,
            [t for t in (a, b) if t.dtype not in _COMPLEX_PARTS],
            F32,
        )
    if a.dtype != b.dtype:
        return _viol(
            op,
            "mismatch",
            f"Expected object of scalar type {_sc(a.dtype)} but got scalar type {_sc(b.dtype)} for second argument",
            args,
            kwargs,
            [b],
            a.dtype,
        )
    return _COMPLEX_OF[a.dtype]


# ---------------------------------------------------------------------------------------------
# the table (keys: "aten.op" for every overload, or "aten.op.overload" for one)
