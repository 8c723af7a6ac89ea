"""Unit tests of the dtype-contract table: the API's edges, culprits, and the CUDA rules.

The CPU rules are pinned against real kernels by test_contracts_differential.py. The CUDA rules
cannot run here (no GPU), so these tests pin where CUDA differs from CPU, as derived from
PyTorch's kernel sources (see the comments in castwise/trace/contracts.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from castwise.trace.contracts import Violation, check, is_covered, result_dtype, tensor_args

aten = torch.ops.aten
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def m(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    """A meta tensor: any read of its data would raise, so the table must use metadata only."""
    return torch.empty(shape, dtype=dtype, device="meta")


def both(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
    kwargs = kwargs or {}
    return check(func, args, kwargs, "cpu"), check(func, args, kwargs, "cuda")


# --- API ------------------------------------------------------------------------------------


def test_tensor_args_flattens_lists_and_kwargs_in_order() -> None:
    a, i, v, mask = m(4, 3), m(2, dtype=torch.int64), m(2, 3), m(3, 3)
    assert tensor_args((a, [i, None], v, 2.0), {"attn_mask": mask}) == [a, i, v, mask]


def test_culprit_indices_point_into_tensor_args() -> None:
    q = m(1, 2, 3, 4, dtype=BF16)
    mask = m(3, 3, dtype=F16)
    args, kwargs = (q, q, q, 0.0, False), {"attn_mask": mask}
    v = check(aten._scaled_dot_product_flash_attention_for_cpu.default, args, kwargs, "cpu")
    assert isinstance(v, Violation) and v.kind == "mask"
    assert [tensor_args(args, kwargs)[i] for i in v.culprits] == [mask]
    assert v.expected == "bfloat16"

    s, idx, values = m(4, 3, dtype=BF16), m(2, dtype=torch.int64), m(2, 3)
    v = check(aten.index_put_.default, (s, [idx], values), {}, "cpu")
    assert v is not None and v.kind == "index" and v.culprits == (2,) and v.expected == "bfloat16"


def test_result_dtype_is_none_when_refused_or_unknown() -> None:
    a, b = m(2, 3), m(3, 2, dtype=BF16)
    assert result_dtype(aten.mm.default, (a, b), {}, "cpu") is None
    assert result_dtype(aten.mm.default, (a, a.t()), {}, "cpu") == F32
    assert result_dtype(aten.linalg_eigh.default, (m(3, 3),), {}, "cpu") is None
    assert check(aten.linalg_eigh.default, (m(3, 3),), {}, "cpu") is None


def test_is_covered() -> None:
    assert is_covered(aten.addmm.default)
    assert is_covered(aten.view.default)  # dtype-neutral ops count
    assert is_covered(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert is_covered(aten.max.other) and is_covered(aten.max.dim)
    assert not is_covered(aten.linalg_eigh.default)
    assert not is_covered(torch.ops.higher_order.cond)  # not an OpOverload: no crash, not covered


def test_unmodelled_arguments_make_no_claim() -> None:
    # an out= overload passes its output as a kwarg the rule ignores; a malformed call must not
    # crash the tracer's hot path
    assert check(aten.mm.default, (m(2, 2),), {}, "cpu") is None


def test_float8_promotion_is_refused_like_the_kernels_do() -> None:
    f8 = torch.float8_e4m3fn
    a, b = torch.zeros(2, dtype=f8), torch.zeros(2, dtype=BF16)
    with pytest.raises(RuntimeError) as real:
        torch.cat([a, b])
    v = check(aten.cat.default, ([a, b],), {}, "cpu")
    assert v is not None and v.kind == "unsupported" and v.culprits == (0,)
    assert v.message == str(real.value).splitlines()[0]
    assert check(aten.add.Tensor, (m(2, dtype=f8), m(2, dtype=BF16)), {}, "cuda") is not None
    assert result_dtype(aten.cat.default, ([a, a],), {}, "cpu") == f8


def test_works_on_fake_tensors_inside_a_dispatch_mode() -> None:
    """The table closes the measured gap: fake linear(f32, bf16 weight) returns f32."""
    seen: list[Violation] = []

    class Checker(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            v = check(func, args, kwargs or {}, "cpu")
            if v is not None:
                seen.append(v)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        x = torch.randn(2, 4)
        w = torch.randn(3, 4, dtype=BF16)
        b = torch.randn(3, dtype=BF16)
        with Checker():
            out = F.linear(x, w, b)
    assert out.dtype == F32  # the fake kernel alone accepts it
    assert [v.op for v in seen] == ["aten.addmm"]
    assert seen[0].message == "mat1 and mat2 must have the same dtype, but got Float and BFloat16"
    assert seen[0].expected == "bfloat16"


def test_fake_cuda_tensors_on_a_cpu_only_machine() -> None:
    with FakeTensorMode():
        x = torch.empty(2, 4, device="cuda")
        w = torch.empty(4, dtype=BF16, device="cuda")
        v = check(aten.native_layer_norm.default, (x, [4], w, w, 1e-5), {}, "cuda")
    assert v is not None and v.message == "expected scalar type Float but found BFloat16"
    assert v.culprits == (1, 2)  # the same tensor passed as weight and bias is at fault twice


# --- culprits: which operand the report blames --------------------------------------------


def test_linear_blames_the_activation_when_the_weight_and_bias_agree() -> None:
    x, w, b = m(2, 4), m(3, 4, dtype=BF16), m(3, dtype=BF16)
    v = check(aten.linear.default, (x, w, b), {}, "cpu")
    assert v is not None and v.culprits == (0,) and v.expected == "bfloat16"
    v = check(aten.linear.default, (x, w), {}, "cpu")
    assert v is not None and v.message == "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"
    assert v.culprits == (0,)


def test_addmm_blames_a_bias_of_another_dtype() -> None:
    v = check(aten.addmm.default, (m(2), m(3, 3, dtype=BF16), m(3, 2, dtype=BF16)), {}, "cuda")
    assert v is not None and v.culprits == (0,) and v.expected == "bfloat16"
    assert v.message == "self and mat2 must have the same dtype, but got Float and BFloat16"


def test_attention_blames_q_and_k_against_v() -> None:
    # story 4's shape: a float32 q/k norm under CUDA autocast next to a bf16 v
    q, k, v_ = m(1, 2, 3, 4), m(1, 2, 3, 4), m(1, 2, 3, 4, dtype=BF16)
    v = check(aten.scaled_dot_product_attention.default, (q, k, v_), {}, "cuda")
    assert v is not None and v.culprits == (0, 1) and v.expected == "bfloat16"


def test_layer_norm_blames_parameters_cast_away_from_float32() -> None:
    # story 1: LayerNormFp32 upcasts its input, the whole model was cast to bf16
    x, w = m(2, 4), m(4, dtype=BF16)
    cpu, cuda = both(aten.native_layer_norm.default, (x, [4], w, w, 1e-5))
    assert cpu is not None and cpu.message == "mixed dtype (CPU): expect parameter to have scalar type of Float"
    assert cuda is not None and cuda.message == "expected scalar type Float but found BFloat16"
    assert cpu.culprits == cuda.culprits == (1, 2)
    assert cpu.expected == cuda.expected == "float32"
    assert cpu.kind == "norm"


def test_integer_true_division_in_place_blames_the_destination() -> None:
    a, b = m(3, dtype=torch.int64), m(3, dtype=torch.int64)
    v = check(aten.div_.Tensor, (a, b), {}, "cpu")
    assert v is not None and v.culprits == (0,) and v.expected == "float32"
    assert check(aten.div_.Tensor_mode, (a, b), {"rounding_mode": "floor"}, "cpu") is None


# --- CUDA rules (derived from kernel sources) ------------------------------------------------


def test_cuda_layer_and_group_norm_refuse_the_cpu_mixed_dtype_path() -> None:
    x, w = m(2, 4, dtype=BF16), m(4)
    cpu, cuda = both(aten.native_layer_norm.default, (x, [4], w, w, 1e-5))
    assert cpu is None and result_dtype(aten.native_layer_norm.default, (x, [4], w, w, 1e-5), {}, "cpu") == BF16
    assert cuda is not None and cuda.message == "expected scalar type BFloat16 but found Float"
    assert cuda.expected == "bfloat16"
    x3 = m(2, 4, 3, dtype=F16)
    cpu, cuda = both(aten.native_group_norm.default, (x3, w, w, 2, 4, 3, 2, 1e-5))
    assert cpu is None and cuda is not None and cuda.message == "expected scalar type Half but found Float"
    # f32 input with bf16 parameters: group_norm.cpp's mixed check runs on every device
    cuda = check(
        aten.native_group_norm.default, (m(2, 4, 3), m(4, dtype=BF16), m(4, dtype=BF16), 2, 4, 3, 2, 1e-5), {}, "cuda"
    )
    assert cuda is not None and cuda.message == "mixed dtype (CPU): expect parameter to have scalar type of Float"


def test_cuda_layer_norm_backward_wants_one_dtype() -> None:
    go, x, w = m(2, 4, dtype=BF16), m(2, 4, dtype=BF16), m(4)
    args = (go, x, [4], m(2, 1), m(2, 1), w, w, [True, True, True])
    cpu, cuda = both(aten.native_layer_norm_backward.default, args)
    assert cpu is None and cuda is not None and cuda.culprits == (4, 5)  # [go, x, mean, rstd, w, b]


def test_cuda_batch_norm_keeps_the_mixed_dtype_path() -> None:
    x, p = m(2, 4, 3, dtype=BF16), m(4)
    args = (x, p, p, p, p, False, 0.1, 1e-5)
    assert both(aten.native_batch_norm.default, args) == (None, None)
    assert result_dtype(aten.native_batch_norm.default, args, {}, "cuda") == BF16
    bad = (m(2, 4, 3), m(4, dtype=BF16), m(4, dtype=BF16), m(4), m(4), False, 0.1, 1e-5)
    cpu, cuda = both(aten.native_batch_norm.default, bad)
    assert cpu is not None and cuda is not None and cpu.culprits == cuda.culprits == (1, 2)


def test_cuda_batch_norm_backward_wants_running_stats_in_the_parameters_16_bit_dtype() -> None:
    # measured on an H100 and an H200 (torch 2.11): a bf16 BatchNorm2d whose running stats stayed
    # f32 (as DeepSpeed's and FSDP2's parameter casts leave it) runs forward, and its training
    # backward is refused; BatchNorm1d on (N, C) runs both
    x, w, stat = m(2, 4, 3, dtype=BF16), m(4, dtype=BF16), m(4)
    assert check(aten.native_batch_norm.default, (x, w, w, stat, stat, True, 0.1, 1e-5), {}, "cuda") is None
    saved = (m(4), m(4))

    def backward(x: torch.Tensor, w: torch.Tensor, stat: torch.Tensor, train: bool = True) -> Any:
        args = (x, x, w, stat, stat, *saved, train, 1e-5, [True, True, True])
        return check(aten.native_batch_norm_backward.default, args, {}, "cuda")

    refused = backward(x, w, stat)
    assert refused is not None and refused.message == "Expected running_mean to have type BFloat16 but got Float"
    assert backward(m(2, 4, dtype=BF16), w, stat) is None  # (N, C)
    assert backward(x, m(4), stat) is None  # the mixed path: f32 parameters and stats
    assert backward(x, w, m(4, dtype=BF16)) is None
    mixed = backward(x, m(4), m(4, dtype=BF16))  # the mixed path's f32 parameters, 16-bit stats
    assert mixed is not None and mixed.message == "Expected running_mean to have type Float but got BFloat16"


def test_cuda_convolution_wants_input_weight_and_bias_in_one_type() -> None:
    x, w, b = m(1, 2, 5), m(3, 2, 2), m(3, dtype=BF16)
    args = (x, w, b, [1], [0], [1], False, [0], 1)
    cpu, cuda = both(aten.convolution.default, args)
    assert cpu is None  # measured: the native f32 kernel adds a bias of any float dtype
    assert cuda is not None and cuda.culprits == (2,) and cuda.expected == "float32"
    assert cuda.message == "Input type (torch.cuda.FloatTensor) and bias type (CUDABFloat16Type) should be the same"
    cuda = check(aten.convolution.default, (m(1, 2, 5, dtype=F16), w, None, [1], [0], [1], False, [0], 1), {}, "cuda")
    assert cuda is not None
    assert cuda.message == (
        "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same"
    )


def test_cuda_convolution_backward_refuses_the_onednn_mixed_weight() -> None:
    go, x, w = m(1, 3, 4, dtype=BF16), m(1, 2, 5, dtype=BF16), m(3, 2, 2)
    args = (go, x, w, [3], [1], [0], [1], False, [0], 1, [True, True, True])
    func = aten.convolution_backward.default
    cuda = check(func, args, {}, "cuda")
    assert cuda is not None and cuda.culprits == (2,)
    # the CPU's answer is its kernel path's: oneDNN (AVX-512) takes the f32 weight, native (AVX2) does not
    assert check(func, args, {}, "cpu:avx512") is None
    avx2 = check(func, args, {}, "cpu:avx2")
    assert avx2 is not None and avx2.message == "expected scalar type BFloat16 but found Float"


def test_cuda_matmul_messages() -> None:
    a, b = m(2, 3), m(3, 2, dtype=F16)
    cpu, cuda = both(aten.mm.default, (a, b))
    assert cpu is not None and cpu.message == "expected m1 and m2 to have the same dtype, but got: float != c10::Half"
    assert cuda is not None
    assert cuda.message == "expected mat1 and mat2 to have the same dtype, but got: float != c10::Half"


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cuda_flash_attention_takes_half_types_only(dtype: torch.dtype) -> None:
    func = aten._scaled_dot_product_flash_attention.default
    q = m(1, 2, 3, 8, dtype=dtype)
    assert check(func, (q, q, q), {}, "cuda") is None
    assert result_dtype(func, (q, q, q), {}, "cuda") == dtype
    q32 = m(1, 2, 3, 8)
    v = check(func, (q32, q32, q32), {}, "cuda")
    assert v is not None and v.kind == "unsupported"
    assert v.message == "FlashAttention only support fp16 and bf16 data type"
    v = check(func, (q, q, q), {}, "cpu")  # no CPU kernel
    assert v is not None and v.kind == "unsupported" and v.message.startswith("Could not run")


def test_cuda_efficient_attention_takes_float32_and_a_bias_of_q_dtype() -> None:
    func = aten._scaled_dot_product_efficient_attention.default
    q = m(1, 2, 3, 8)
    assert result_dtype(func, (q, q, q, None, False), {}, "cuda") == F32
    v = check(func, (q, q, q, m(1, 2, 3, 3, dtype=BF16), False), {}, "cuda")
    assert v is not None and v.kind == "mask" and v.culprits == (3,) and v.expected == "float32"
    qb = m(1, 2, 3, 8, dtype=BF16)
    v = check(func, (q, q, qb, None, False), {}, "cuda")
    assert v is not None and v.kind == "mismatch"


def test_cuda_cudnn_attention_takes_half_types_only() -> None:
    func = aten._scaled_dot_product_cudnn_attention.default
    q = m(1, 2, 3, 8)
    v = check(func, (q, q, q, None, False), {}, "cuda")
    assert v is not None and v.kind == "unsupported" and v.culprits == (0, 1, 2)
    qb = m(1, 2, 3, 8, dtype=BF16)
    assert result_dtype(func, (qb, qb, qb, None, False), {}, "cuda") == BF16


def test_sdpa_mask_rules() -> None:
    q = m(1, 2, 3, 8, dtype=BF16)
    func = aten.scaled_dot_product_attention.default
    for mask_dtype in (torch.bool, BF16):
        assert both(func, (q, q, q, m(3, 3, dtype=mask_dtype))) == (None, None)
    # validate_sdpa_input (all devices) refuses a mask that is neither bool, float32 nor q's dtype
    cpu, cuda = both(func, (q, q, q, m(3, 3, dtype=F16)))
    assert cpu is not None and cuda is not None and cpu.message == cuda.message and cpu.kind == "mask"
    # a float32 mask with bf16 q passes validation and runs on CPU and on CUDA (measured on an
    # H100 with head sizes 4 and 16, tests/trace/test_contracts_cuda.py); the memory-efficient
    # kernel's own bias check applies only when it is called directly
    assert both(func, (q, q, q, m(3, 3))) == (None, None)
    eff = check(aten._scaled_dot_product_efficient_attention.default, (q, q, q, m(3, 3), False), {}, "cuda")
    assert eff is not None and eff.message == "invalid dtype for bias - should match query's dtype"
    assert eff.culprits == (3,) and eff.expected == "bfloat16"
    q32 = m(1, 2, 3, 8)
    assert both(func, (q32, q32, q32, m(3, 3))) == (None, None)


def test_cuda_softmax_half_to_float() -> None:
    x16, xb = m(2, 3, dtype=F16), m(2, 3, dtype=BF16)
    cpu, cuda = both(aten._softmax.default, (x16, -1, True))
    assert cpu is not None and cpu.message == "softmax with half to float conversion is not supported on CPU"
    assert cuda is None and result_dtype(aten._softmax.default, (x16, -1, True), {}, "cuda") == F32
    v = check(aten._softmax.default, (xb, -1, True), {}, "cuda")
    assert v is not None and v.message == "conversion is supported for Half type only"
    back = (m(2, 3), m(2, 3), -1, F16)
    cpu, cuda = both(aten._softmax_backward_data.default, back)
    assert cpu is not None and cuda is None
    assert result_dtype(aten._softmax_backward_data.default, back, {}, "cuda") == F16
    v = check(aten._softmax_backward_data.default, (m(2, 3), m(2, 3), -1, BF16), {}, "cuda")
    assert v is not None  # CUDA allows only the Half -> Float pair


def test_cuda_fused_encoder_layer_wants_norm_weights_in_the_activation_dtype() -> None:
    e, x = 4, m(2, 3, 4, dtype=BF16)

    def w(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return m(*shape, dtype=dtype)

    args = (
        x,
        e,
        2,
        w(12, e),
        w(12),
        w(e, e),
        w(e),
        False,
        False,
        1e-5,
        w(e, dtype=F32),
        w(e, dtype=F32),
        w(e, dtype=F32),
        w(e, dtype=F32),
        w(8, e),
        w(8),
        w(e, 8),
        w(e),
    )
    cpu, cuda = both(aten._transformer_encoder_layer_fwd.default, args)
    assert cpu is None and cuda is not None and cuda.kind == "norm" and cuda.culprits == (5, 6)


def test_cuda_fused_rms_norm_called_directly_wants_one_dtype() -> None:
    args = (m(2, 4, dtype=BF16), [4], m(4), 1e-6)
    cpu, cuda = both(aten._fused_rms_norm.default, args)
    assert cpu is None and cuda is not None and cuda.culprits == (1,)
    assert both(aten.rms_norm.default, args) == (None, None)  # the composite falls back


def test_cuda_embedding_message_names_the_cuda_type() -> None:
    v = check(aten.embedding.default, (m(5, 3), m(2)), {}, "cuda")
    assert v is not None and v.kind == "index" and "torch.cuda.FloatTensor" in v.message


# --- promotion and castability ------------------------------------------------------------


def test_promotion_follows_dim_categories() -> None:
    assert result_dtype(aten.add.Tensor, (m(3, dtype=BF16), m()), {}, "cpu") == BF16
    assert result_dtype(aten.add.Tensor, (m(3, dtype=torch.int64), m(dtype=F16)), {}, "cpu") == F16
    assert result_dtype(aten.add.Tensor, (m(3, dtype=torch.int64), 2.5), {}, "cpu") == F32
    assert result_dtype(aten.cat.default, ([m(2, dtype=BF16), m(2, dtype=F16)],), {}, "cuda") == F32
    assert result_dtype(aten.where.self, (m(3, dtype=torch.bool), m(3, dtype=BF16), m(dtype=F32)), {}, "cpu") == BF16


def test_in_place_ops_cast_float_results_but_not_into_integers() -> None:
    h = m(3, dtype=F16)
    assert check(aten.add_.Tensor, (h, m(3)), {}, "cpu") is None
    assert result_dtype(aten.add_.Tensor, (h, m(3)), {}, "cuda") == F16
    v = check(aten.mul_.Tensor, (m(3, dtype=torch.int64), m(3)), {}, "cuda")
    assert v is not None and v.message == "result type Float can't be cast to the desired output type Long"
    assert v.culprits == (1,) and v.expected == "int64"
    v = check(aten.lerp_.Scalar, (h, m(3), 0.5), {}, "cpu")
    assert v is not None and v.kind == "strict" and v.culprits == (1,) and v.expected == "float16"
    assert result_dtype(aten.copy_.default, (h, m(3)), {}, "cpu") == F16


# --- real models: every op they reach is covered, accepted, and its dtype predicted ---------


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 16)
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1)
        self.gn = torch.nn.GroupNorm(4, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.enc = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.1)
        self.ln = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # [b, t, c]
        x = self.bn(self.gn(self.conv(x.transpose(1, 2)))).transpose(1, 2)
        x = self.enc(F.gelu(x))
        q = self.ln(x).unflatten(-1, (2, 8)).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
        return F.log_softmax(self.head(F.silu(x)), -1)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.uncovered: set[str] = set()
        self.false_alarms: list[Violation] = []
        self.wrong_dtype: list[str] = []
        self.caught: list[tuple[Violation, str]] = []  # (the table's violation, the kernel's error)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not is_covered(func):
            self.uncovered.add(str(func))
        violation = check(func, args, kwargs, "cpu")
        predicted = result_dtype(func, args, kwargs, "cpu")
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:
            assert violation is not None, f"{func} raised {error} and the table did not predict it"
            self.caught.append((violation, str(error).splitlines()[0]))
            raise
        if violation is not None:  # the real kernel accepted: the table must not say otherwise
            self.false_alarms.append(violation)
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if predicted is not None and isinstance(first, torch.Tensor) and first.dtype != predicted:
            self.wrong_dtype.append(f"{func}: real {first.dtype}, table {predicted}")
        return out


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
def test_a_real_model_trace_is_covered_and_predicted(train: bool, autocast: bool) -> None:
    torch.manual_seed(0)
    model = _Tiny().train(train)
    ids = torch.randint(0, 11, (2, 6))
    recorder = _Recorder()
    with recorder, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        if train:
            model(ids).float().sum().backward()
        elif autocast:
            # story 3: in eval under no_grad the encoder layer takes its fused fast path, which
            # ignores CPU autocast; bf16 activations meet its f32 weights and the kernel refuses
            with torch.no_grad(), pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
                model(ids)
            [(violation, error)] = recorder.caught
            assert "BFloat16" in error
            assert violation.op == "aten._transformer_encoder_layer_fwd"
            assert violation.expected == "float32" and violation.culprits == (0,)  # the bf16 activations
        else:
            with torch.no_grad():
                model(ids)
    assert recorder.uncovered == set()
    assert recorder.false_alarms == []
    assert recorder.wrong_dtype == []


# --- no kernel for a reduced-precision dtype ------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_linalg_without_half_kernels_refuses_on_both_devices(dtype: torch.dtype) -> None:
    a = m(4, 4, dtype=dtype)
    cpu, cuda = both(aten.linalg_qr.default, (a,))
    assert cpu is not None and cuda is not None
    assert cpu.kind == cuda.kind == "unsupported"
    assert cpu.message == f"\"geqrf_cpu\" not implemented for '{'BFloat16' if dtype == BF16 else 'Half'}'"
    assert cuda.message.startswith('"geqrf_cuda" not implemented')
    assert cpu.expected == "float32" and cpu.culprits == (0,)
    assert result_dtype(aten.linalg_qr.default, (m(4, 4),), {}, "cuda") == F32


def test_cuda_fft_takes_half_with_power_of_two_sizes_but_never_bf16() -> None:
    r2c = aten._fft_r2c.default
    assert check(r2c, (m(8, dtype=BF16), [0], 0, True), {}, "cuda").message == (  # type: ignore[union-attr]
        "cuFFT doesn't support tensor of type: BFloat16"
    )
    assert check(r2c, (m(8, dtype=F16), [0], 0, True), {}, "cuda") is None
    assert result_dtype(r2c, (m(8, dtype=F16), [0], 0, True), {}, "cuda") == torch.complex32
    odd = check(r2c, (m(6, dtype=F16), [0], 0, True), {}, "cuda")
    assert odd is not None and "powers of two" in odd.message
    # CPU (MKL / pocketfft) has no f16 path at all
    assert check(r2c, (m(8, dtype=F16), [0], 0, True), {}, "cpu") is not None
    c2r = aten._fft_c2r.default
    assert check(c2r, (m(5, dtype=torch.complex32), [0], 0, 8), {}, "cuda") is None
    assert check(c2r, (m(5, dtype=torch.complex32), [0], 0, 6), {}, "cuda") is not None


def test_cdist_refuses_half_only_off_the_matmul_path() -> None:
    small = (m(3, 4, dtype=BF16), m(5, 4, dtype=BF16), 2.0, None)
    assert [v is not None for v in both(aten._cdist_forward.default, small)] == [True, True]
    big = (m(30, 4, dtype=BF16), m(30, 4, dtype=BF16), 2.0, None)
    assert both(aten._cdist_forward.default, big) == (None, None)
    cuda = check(aten._cdist_forward.default, small, {}, "cuda")
    assert cuda is not None and cuda.message == "\"cdist_cuda\" not implemented for 'BFloat16'"


def test_cuda_differs_where_its_kernels_take_half_types_or_do_not_exist() -> None:
    # Distributions.cu dispatches binomial and dirichlet with Half and BFloat16
    p = m(4, dtype=BF16)
    cpu, cuda = both(aten.binomial.default, (p, p))
    assert cpu is not None and cuda is None
    # histogram has no CUDA kernel in any dtype
    cuda_hist = check(aten.histogram.bin_ct, (m(8),), {}, "cuda")
    assert cuda_hist is not None and "'CUDA' backend" in cuda_hist.message
    assert check(aten.histogram.bin_ct, (m(8),), {}, "cpu") is None


def test_fake_kernels_accept_what_the_missing_kernel_refuses() -> None:
    # the gap these rules close: the meta function returns a bf16 result
    with FakeTensorMode():
        a = torch.empty(4, 4, dtype=BF16)
        q, _r = aten.linalg_qr.default(a)
        assert q.dtype == BF16
        assert check(aten.linalg_qr.default, (a,), {}, "cpu") is not None


def test_cuda_special_functions_and_cpu_only_gaps() -> None:
    x = m(4, dtype=BF16)
    cpu, cuda = both(aten.special_bessel_j0.default, (x,))
    assert cpu is not None and cpu.message == "\"bessel_j0_cpu\" not implemented for 'BFloat16'"
    assert cuda is not None and cuda.message == "\"bessel_j0_cuda\" not implemented for 'BFloat16'"
    # AveragePool3d.cu dispatches Half and BFloat16: only the CPU kernel lacks them
    pool = (m(1, 1, 4, 4, 4, dtype=F16), [2, 2, 2])
    cpu, cuda = both(aten.avg_pool3d.default, pool)
    assert cpu is not None and cpu.kind == "unsupported" and cuda is None
    assert result_dtype(aten.avg_pool3d.default, pool, {}, "cuda") == F16


def test_complex_from_parts_has_no_bf16_and_wants_one_dtype() -> None:
    cpu, cuda = both(aten.polar.default, (m(4, dtype=BF16), m(4, dtype=BF16)))
    assert cpu is not None and cuda is not None and cpu.kind == "unsupported"
    mixed = check(aten.complex.default, (m(4), m(4, dtype=F16)), {}, "cuda")
    assert mixed is not None and mixed.kind == "mismatch" and mixed.culprits == (1,)
    assert result_dtype(aten.complex.default, (m(4, dtype=F16), m(4, dtype=F16)), {}, "cpu") == torch.complex32
