"""The op dtype-contract table: what each real kernel accepts and returns, by target device.

One module per op family (matmul, norm, attention, index, elementwise, no_kernel); this module
holds the table (op name -> rule), the lookup and the device deltas.

Fake kernels propagate dtypes but do not check them the way real kernels do (a fake
``linear(f32 input, bf16 weight)`` returns f32 where the real CPU and CUDA kernels raise). This
table closes that gap: :func:`check` says whether the real kernel on ``device`` would refuse
the dtypes it gets, worded like the real error, and :func:`result_dtype` says what it returns when
it accepts. Only metadata is read (dtype, shape, layout), never data, so it works on fake and meta
tensors. It is called for every op from a dispatch mode: a lookup is one dict hit on the
OpOverload, then a small function.

Where the rules come from:
- CPU: measured on real CPU kernels per CPU class (``Device.path``: oneDNN or native kernels, by
  the device's capabilities), pinned by tests/trace/test_contracts_differential.py and the
  recorded truth of each class (tests/trace/truth/, written by tests/trace/kernel_truth.py).
- CUDA: read from PyTorch's kernel sources (paths in the comments at each rule, under
  aten/src/ATen/native/); where CUDA shares the CPU code path the CPU measurement stands for both.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from castwise.devices import Device
from castwise.devices import get as get_device
from castwise.trace.contracts._base import Args, Kwargs, Rule, Violation, _NoPromotion, _viol, tensor_args
from castwise.trace.contracts.attention import (
    _native_mha,
    _sdpa,
    _sdpa_backward,
    _sdpa_cudnn,
    _sdpa_efficient,
    _sdpa_flash_cpu,
    _sdpa_flash_cuda,
    _sdpa_math,
    _sdpa_overrideable,
    _softmax,
    _softmax_backward,
    _softmax_dtype,
    _transformer_encoder_layer,
)
from castwise.trace.contracts.elementwise import (
    _cat,
    _comparison,
    _copy,
    _factory,
    _float_only,
    _float_unary,
    _gelu_backward,
    _inplace,
    _inplace_div,
    _lerp,
    _like,
    _mean,
    _no_tensor,
    _promoting,
    _reduce_sum,
    _same_as_self,
    _to,
    _to_long,
    _true_divide,
)
from castwise.trace.contracts.external import EXTERNAL, mixed_width
from castwise.trace.contracts.float8 import _scaled_mm
from castwise.trace.contracts.index import (
    _bincount,
    _embedding,
    _gather,
    _index,
    _index_add,
    _index_copy,
    _index_put,
    _index_select,
    _loss_input,
    _loss_same,
    _loss_target,
    _masked_fill,
    _masked_scatter,
    _nll_loss,
    _nll_loss_backward,
    _scatter,
    _where,
)
from castwise.trace.contracts.matmul import _addmm, _addmv, _baddbmm, _conv, _conv_backward, _conv_nobias, _linear, _mm
from castwise.trace.contracts.moe import _bitwise_not, _grouped_mm, _histc
from castwise.trace.contracts.no_kernel import (
    _NO_KERNEL,
    _complex_ctor,
    _histogram_bins_tensor,
    _no_kernel_rule,
    _rrelu,
)
from castwise.trace.contracts.norm import (
    _batch_norm,
    _batch_norm_backward,
    _group_norm_backward,
    _layer_group_norm,
    _layer_norm_backward,
    _rms_norm,
)

__all__ = ["Lookup", "Violation", "check", "is_covered", "lookup", "mixed_width", "result_dtype", "tensor_args"]

_TABLE: dict[str, Rule] = {}


def _words(text: str) -> list[str]:
    return text.split()


def _register(rule: Rule, *names: str) -> None:
    for n in names:
        _TABLE[n if n.startswith(("aten.", "prim.", "profiler.")) else f"aten.{n}"] = rule


_register(_mm, "mm", "bmm", "dot", "vdot", "mv", "matmul")
_register(_addmm, "addmm", "addmm_", "_addmm_activation", "addbmm", "addbmm_")
_register(_linear, "linear")
_register(_scaled_mm, "_scaled_mm")
_register(_baddbmm, "baddbmm", "baddbmm_")
_register(_addmv, "addmv", "addmv_")
_register(
    _conv,
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "_convolution_mode",
    "mkldnn_convolution",
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "thnn_conv2d",
    "slow_conv_transpose2d",
    "slow_conv_transpose3d",
    "cudnn_convolution_relu",
    "cudnn_convolution_add_relu",
    "miopen_convolution",
)
_register(_conv_nobias, "cudnn_convolution", "cudnn_convolution_transpose")
_register(_conv_backward, "convolution_backward")
_register(_layer_group_norm, "native_layer_norm", "layer_norm")
_register(_layer_group_norm, "native_group_norm", "group_norm")
_register(
    _batch_norm,
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",
    "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
    "cudnn_batch_norm",
    "miopen_batch_norm",
    "batch_norm",
)
_register(_layer_norm_backward, "native_layer_norm_backward")
_register(_group_norm_backward, "native_group_norm_backward")
_register(_batch_norm_backward, "native_batch_norm_backward")
_register(_rms_norm, "rms_norm", "_fused_rms_norm")
_register(_sdpa, "scaled_dot_product_attention")
_register(_sdpa_math, "_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps")
_register(_sdpa_flash_cpu, "_scaled_dot_product_flash_attention_for_cpu")
_register(_sdpa_flash_cuda, "_scaled_dot_product_flash_attention", "_flash_attention_forward")
_register(_sdpa_efficient, "_scaled_dot_product_efficient_attention", "_efficient_attention_forward")
_register(_sdpa_cudnn, "_scaled_dot_product_cudnn_attention")
_register(_sdpa_overrideable, "_scaled_dot_product_fused_attention_overrideable")
_register(_transformer_encoder_layer, "_transformer_encoder_layer_fwd")
_register(_native_mha, "_native_multi_head_attention")
_register(_softmax, "_softmax", "_log_softmax")
_register(_softmax_dtype, "_safe_softmax", "softmax", "log_softmax", "special_softmax", "special_log_softmax")
_register(
    _sdpa_backward,
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
)
_register(_softmax_backward, "_softmax_backward_data", "_log_softmax_backward_data")
_register(_embedding, "embedding")
_register(_embedding, "embedding_dense_backward", "embedding_backward")
_register(_index_put, "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put")
_register(_index, "index", "_unsafe_index")
_register(_masked_scatter, "masked_scatter", "masked_scatter_")
_register(_masked_fill, "masked_fill", "masked_fill_")
_register(_scatter, "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_")
_register(_gather, "gather")
_register(_index_select, "index_select")
_register(_index_copy, "index_copy", "index_copy_")
_register(_index_add, "index_add", "index_add_")
_register(_where, "where")
_register(_loss_input, "huber_loss", "mse_loss_backward", "smooth_l1_loss_backward")
_register(_loss_target, "binary_cross_entropy_with_logits")
_register(_loss_same, "binary_cross_entropy", "huber_loss_backward")
_register(_nll_loss, "nll_loss_forward", "nll_loss2d_forward")
_register(_nll_loss_backward, "nll_loss_backward", "nll_loss2d_backward")
_register(_gelu_backward, "gelu_backward")
_register(_promoting, "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div")
_register(_lerp, "lerp", "lerp_")
_register(
    _copy,
    "copy_",
    "copy",
    "_copy_from",
    "_copy_from_and_resize",
    "fill_",
    "fill",
    "zero_",
    "index_fill",
    "index_fill_",
    "masked_select",
    "take",
    "put_",
    "put",
)
_register(
    _inplace,
    "add_",
    "sub_",
    "mul_",
    "addcmul_",
    "addcdiv_",
    "clamp_",
    "clamp_min_",
    "clamp_max_",
    "pow_",
    "fmod_",
    "remainder_",
    "maximum_",
    "minimum_",
    "atan2_",
    "hypot_",
    "copysign_",
    "rsub_",
    "xlogy_",
    "bitwise_and_",
    "bitwise_or_",
    "bitwise_xor_",
    "logical_and_",
    "logical_or_",
    "floor_divide_",
)
_register(_inplace_div, "div_", "true_divide_")
_register(_true_divide, "div", "true_divide")
_register(
    _promoting,
    "add",
    "sub",
    "rsub",
    "mul",
    "addcmul",
    "addcdiv",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "pow",
    "atan2",
    "hypot",
    "remainder",
    "fmod",
    "floor_divide",
    "copysign",
    "xlogy",
    "clamp",
    "clamp_min",
    "clamp_max",
    "clip",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "threshold_backward",
    "silu_backward",
    "sigmoid_backward",
    "tanh_backward",
    "hardswish_backward",
    "hardsigmoid_backward",
    "leaky_relu_backward",
    "elu_backward",
    "softplus_backward",
    "mish_backward",
    "hardtanh_backward",
    "_prelu_kernel",
    "prelu",
    "heaviside",
    "nextafter",
    "logaddexp",
    "logaddexp2",
)
_register(
    _comparison,
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_xor",
    "logical_not",
    "isnan",
    "isinf",
    "isfinite",
    "isneginf",
    "isposinf",
    "signbit",
    "isclose",
    "equal",
    "any",
    "all",
)
_register(_cat, "cat", "stack", "hstack", "vstack", "_cat", "concat", "concatenate", "dstack")
_register(
    _float_unary,
    "sqrt",
    "rsqrt",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
    "sigmoid",
    "erf",
    "erfc",
    "erfinv",
    "reciprocal",
    "lgamma",
    "digamma",
    "sinc",
    "logit",
    "i0",
    "logsumexp",
)
_register(
    _float_only,
    "gelu",
    "gelu_",
    "silu",
    "silu_",
    "mish",
    "mish_",
    "hardswish",
    "hardswish_",
    "hardsigmoid",
    "hardsigmoid_",
    "elu",
    "elu_",
    "selu",
    "selu_",
    "celu",
    "celu_",
    "leaky_relu",
    "leaky_relu_",
    "softplus",
    "log_sigmoid_forward",
    "native_dropout",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "glu",
    "grid_sampler_2d",
    "native_dropout_backward",
    "normal_",
    "uniform_",
    "exponential_",
    "cauchy_",
    "log_normal_",
)
# dtype-neutral: views, layout and value-selection ops return their input's dtype
_NEUTRAL = """
    relu relu_ neg neg_ abs abs_ sign sgn floor ceil round trunc frac square clone contiguous detach
    detach_ alias lift_fresh lift_fresh_copy view _unsafe_view reshape _reshape_alias t t_ transpose
    transpose_ permute expand expand_as squeeze squeeze_ unsqueeze unsqueeze_ select slice split
    split_with_sizes unsafe_split chunk unbind narrow as_strided as_strided_ flatten unflatten
    movedim repeat repeat_interleave roll flip tril triu tril_ triu_ constant_pad_nd pad
    reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d diagonal view_as_real
    view_as_complex _conj conj resolve_conj resolve_neg hardtanh hardtanh_ threshold threshold_
    relu6 sort topk max_pool2d_with_indices max_pool1d max_pool2d max_pool3d_with_indices
    _adaptive_max_pool2d adaptive_max_pool2d cummax cummin kthvalue median nanmedian mode msort amax
    amin max min aminmax var std var_mean std_mean _unique2 unique_dim unique_consecutive
    upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_bilinear2d upsample_linear1d
    upsample_bicubic2d _upsample_nearest_exact2d avg_pool1d avg_pool2d
    _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_avg_pool1d slice_scatter
    select_scatter diagonal_scatter as_strided_scatter index_put_with_sort _nested_tensor_from_mask
    _nested_tensor_from_mask_left_aligned to_padded_tensor _nested_from_padded randint_like resize_
    resize_as_ set_ _to_dense unfold im2col col2im pixel_shuffle pixel_unshuffle channel_shuffle
    native_channel_shuffle bernoulli bernoulli_ geometric_ _unsafe_view_copy view_copy expand_copy permute_copy
    transpose_copy t_copy unsqueeze_copy squeeze_copy select_copy slice_copy split_copy alias_copy
    detach_copy diagonal_copy as_strided_copy unbind_copy _nested_view_from_buffer
    max_pool2d_with_indices_backward avg_pool2d_backward _adaptive_avg_pool2d_backward
    upsample_nearest2d_backward upsample_bilinear2d_backward reflection_pad2d_backward
    constant_pad_nd_backward slice_backward select_backward diagonal_backward unfold_backward
""".split()  # noqa: SIM905  (a word list reads better than 200 quoted names)
_register(_same_as_self, *_NEUTRAL)
_register(
    _like,
    *_words(
        """
    empty_like zeros_like ones_like rand_like randn_like full_like new_empty new_zeros new_ones
    new_full new_empty_strided
"""
    ),
)
_register(_like, "_to_copy")
_register(_to, "to", "type_as")
_register(
    _factory,
    *_words(
        """
    empty zeros ones full rand randn randint randperm arange linspace logspace scalar_tensor
    empty_strided eye tensor _efficientzerotensor zeros_symint
"""
    ),
)
_register(_reduce_sum, "sum", "nansum", "cumsum", "prod", "cumsum_", "cumprod", "trace")
_register(_like, "norm", "linalg_vector_norm", "_linalg_vector_norm", "frobenius_norm", "nanmean")
_register(_mean, "mean")
_register(_to_long, "argmax", "argmin", "nonzero", "argsort", "bucketize", "searchsorted", "count_nonzero")
_register(_promoting, "max.other", "min.other")
for _key, _spec in _NO_KERNEL.items():
    _register(_no_kernel_rule(_key, _spec), _key)
_register(_rrelu, "rrelu_with_noise")
_register(_same_as_self, "histogram")  # bin counts in the input's dtype (bin_ct is above)
_register(_histogram_bins_tensor, "histogram.bins_tensor")
_register(_histc, "histc")
_register(_bincount, "bincount")
_register(_bitwise_not, "bitwise_not", "bitwise_not_")
_register(_grouped_mm, "_grouped_mm")
_register(_complex_ctor, "polar", "complex")
_register(
    _no_tensor,
    *_words(
        """
    _local_scalar_dense sym_size sym_stride sym_numel sym_storage_offset is_same_size _assert_async
    _assert_tensor_metadata _functional_assert_async record_stream _assert_scalar
    sym_constrain_range_for_size _print prim.device prim.layout profiler._record_function_enter
    profiler._record_function_enter_new profiler._record_function_exit
"""
    ),
)
_TABLE.update(EXTERNAL)  # kernels outside aten, keyed by the op name their package registers

_CACHE: dict[int, tuple[Any, tuple[Rule, str] | None]] = {}
_STRICT = os.environ.get("CASTWISE_STRICT_CONTRACTS") == "1"  # tests: a rule that raises is a bug
# rules that only name the result dtype: they never refuse, so a check can skip them
_NEVER_REFUSE: frozenset[Rule] = frozenset({_same_as_self, _comparison, _like, _to_long, _no_tensor})


def _rule(func: torch._ops.OpOverload) -> tuple[Rule, str] | None:
    # keyed by id: an OpOverload's __hash__ is Python code, and this runs for every op (the func
    # is kept in the value, so its id is never reused)
    hit = _CACHE.get(id(func))
    if hit is not None:
        return hit[1]
    entry: tuple[Rule, str] | None = None
    try:
        packet = f"{func.namespace}.{func._opname}"
        rule = _TABLE.get(f"{packet}.{func._overloadname}") or _TABLE.get(packet)
        if rule is not None:
            entry = (rule, packet)
    except AttributeError:  # not an OpOverload (e.g. a HigherOrderOperator)
        pass
    _CACHE[id(func)] = (func, entry)
    return entry


class Lookup:
    """One op's contract on one device, looked up once: the rule (the device's own if it has
    one), the op's name, whether the table covers the op and whether the rule can refuse."""

    __slots__ = ("covered", "device", "name", "refuses", "rule")

    def __init__(self, rule: Rule | None, name: str, device: Device, covered: bool) -> None:
        self.rule = rule
        self.name = name
        self.device = device
        self.covered = covered  # the family table knows the op (a device delta alone does not count)
        self.refuses = rule is not None and rule not in _NEVER_REFUSE

    def outcome(self, args: Args, kwargs: Kwargs) -> Any:
        """A Violation (the kernel refuses), the result dtype (it accepts), or None (no claim)."""
        if self.rule is None:
            return None
        return _apply(self.rule, self.name, args, kwargs, self.device)

    def check(self, args: Args, kwargs: Kwargs) -> Violation | None:
        """The violation the real kernel would raise, or None."""
        if not self.refuses:
            return None
        out = self.outcome(args, kwargs)
        return out if isinstance(out, Violation) else None


_LOOKUPS: dict[tuple[int, int], tuple[Any, Lookup]] = {}


def lookup(func: torch._ops.OpOverload, device: Device | str) -> Lookup:
    """The contract of ``func`` on ``device``, cached per (op, device)."""
    dev = get_device(device)
    key = (id(func), id(dev))
    hit = _LOOKUPS.get(key)
    if hit is not None and hit[0][1] is dev:
        return hit[1]
    entry = _rule(func)
    covered = entry is not None
    if dev.contracts and entry is not None:
        # the device's own rule for this op replaces its kernel family's
        entry = (dev.contracts.get(entry[1], entry[0]), entry[1])
    elif dev.contracts:
        entry = _delta_rule(func, dev)
    found = Lookup(entry[0], entry[1], dev, covered) if entry is not None else Lookup(None, "", dev, covered)
    _LOOKUPS[key] = ((func, dev), found)  # both kept: their ids are never reused
    return found


def _apply(rule: Rule, name: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    args, kwargs = tuple(args), dict(kwargs or {})
    try:
        return rule(name, args, kwargs, dev)
    except _NoPromotion as e:
        float8 = [d for d in e.dtypes if d.itemsize == 1 and d.is_floating_point] or list(e.dtypes)
        culprits = [t for t in tensor_args(args, kwargs) if t.dtype in float8]
        return _viol(name, "unsupported", str(e), args, kwargs, culprits, None)
    except (IndexError, AttributeError, TypeError, KeyError, ValueError, StopIteration):
        # an overload whose arguments the rule does not model (e.g. an out= variant): no claim,
        # and never an exception on the tracer's hot path; tests run strict, so a rule bug shows
        if _STRICT:
            raise
        return None


def _outcome(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, device: Device | str) -> Any:
    return lookup(func, device).outcome(args, kwargs)


def _delta_rule(func: torch._ops.OpOverload, dev: Device) -> tuple[Rule, str] | None:
    """A device delta for an op the family table does not know."""
    try:
        packet = f"{func.namespace}.{func._opname}"
    except AttributeError:
        return None
    rule = dev.contracts.get(f"{packet}.{func._overloadname}") or dev.contracts.get(packet)
    return (rule, packet) if rule is not None else None


def check(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, device: Device | str) -> Violation | None:
    """The violation the real kernel on ``device`` (a Device or a registered name) would raise, or None."""
    return lookup(func, device).check(args, kwargs)


def result_dtype(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, device: Device | str) -> torch.dtype | None:
    """The dtype of the (first) tensor the real kernel returns when it accepts; None when the op is
    not in the table or the kernel refuses."""
    out = _outcome(func, args, kwargs, device)
    return out if isinstance(out, torch.dtype) else None


def is_covered(func: torch._ops.OpOverload) -> bool:
    """True if the table knows this op (dtype-agnostic view/metadata ops count as covered)."""
    return _rule(func) is not None
