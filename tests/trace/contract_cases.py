"""Op x dtype cases for the differential test of the dtype-contract table.

Each case calls one aten overload (as it reaches a dispatch mode) on tiny tensors. The same case
runs three ways: on real CPU tensors (the truth), through the table (``check``/``result_dtype``)
and under FakeTensorMode (for comparison). Shared by tests/trace/test_contracts_differential.py
and benchmarks/bench_contract_agreement.py.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
I64, I32, U8, BOOL = torch.int64, torch.int32, torch.uint8, torch.bool
FLOATS = (F32, BF16, F16)
SHORT = {F32: "f32", BF16: "bf16", F16: "f16", F64: "f64", I64: "i64", I32: "i32", U8: "u8", BOOL: "b8"}

Builder = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class Case:
    id: str
    family: str
    func: torch._ops.OpOverload
    make: Builder


@dataclass(frozen=True)
class Outcome:
    raised: bool
    dtype: torch.dtype | None  # dtype of the first tensor result when it did not raise

    def __str__(self) -> str:
        return "raise" if self.raised else SHORT.get(self.dtype, str(self.dtype)) if self.dtype else "ok"


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def t(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values in the dtype (floats), small non-negative ints, or a bool pattern."""
    g = _gen()
    if dtype == BOOL:
        return torch.rand(shape, generator=g) > 0.3
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 2, shape, generator=g).to(dtype)


def idx(shape: tuple[int, ...], high: int, dtype: torch.dtype = I64) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen()).to(dtype)


def tag(*dtypes: torch.dtype | None) -> str:
    return "-".join("none" if d is None else SHORT[d] for d in dtypes)


def first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    return None


_TARGET = ["cpu"]  # the device the case's arguments are being built for (see _saved)


@contextlib.contextmanager
def building_for(device: str) -> Iterator[None]:
    """Build a case's arguments as they would reach ``device``'s kernel."""
    _TARGET[0] = device
    try:
        yield
    finally:
        _TARGET[0] = "cpu"


def make_for(case: Case, device: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    with building_for(device):
        return case.make()


def run(case: Case, device: str = "cpu") -> Outcome:
    """The real outcome on ``device`` (CPU unless a GPU test asks for "cuda")."""
    return run_detail(case, device)[0]


def on_device(value: Any, device: str) -> Any:
    """The case's arguments (tensors and device arguments of factory ops) moved to ``device``."""
    from torch.utils._pytree import tree_map

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, torch.device) and x.type == "cpu":
            return torch.device(device)
        return x

    return tree_map(move, value)


def run_detail(case: Case, device: str = "cpu") -> tuple[Outcome, str | None]:
    """The real outcome and, when it raises, the first line of the kernel's message."""
    args, kwargs = make_for(case, device)
    if device != "cpu":
        args, kwargs = on_device((args, kwargs), device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation warnings (uint8 masks) are not outcomes
            out = case.func(*args, **kwargs)
        if device != "cpu":
            torch.cuda.synchronize()  # an asynchronous kernel error surfaces here, not later
    except (RuntimeError, TypeError, ValueError, NotImplementedError, IndexError) as e:
        if "device-side assert" in str(e):  # the CUDA context is gone: every later case would "raise"
            raise RuntimeError(f"{case.id}: a device-side assert ended the CUDA context; fix the case") from e
        return Outcome(True, None), str(e).splitlines()[0] if str(e) else type(e).__name__
    first = first_tensor(out)
    return Outcome(False, None if first is None else first.dtype), None


def run_fake(case: Case) -> Outcome:
    """The outcome of the same call on fake tensors (fake kernels / meta functions alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    args, kwargs = case.make()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # the fake path logs a traceback for every meta function that raises: keep the output readable
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        fargs, fkwargs = tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        with mode:
            out = case.func(*fargs, **fkwargs)
    except Exception:  # the fake path raises many kinds (unsupported op, data-dependent, ...)
        return Outcome(True, None)
    finally:
        log.setLevel(level)
    first = first_tensor(out)
    return Outcome(False, None if first is None else first.dtype)


def predict(case: Case, device: Any = "cpu") -> Outcome:
    """What the contract table says for ``device`` (a registered name or a Device)."""
    from castwise.devices import get
    from castwise.trace.contracts import check, result_dtype

    dev = get(device)
    args, kwargs = make_for(case, dev.kernels)
    if check(case.func, args, kwargs, dev) is not None:
        return Outcome(True, None)
    return Outcome(False, result_dtype(case.func, args, kwargs, dev))


# ---------------------------------------------------------------------------------------------


def _matmul() -> Iterator[Case]:
    two = {
        "mm": (aten.mm.default, (2, 3), (3, 2)),
        "bmm": (aten.bmm.default, (2, 2, 3), (2, 3, 2)),
        "mv": (aten.mv.default, (2, 3), (3,)),
        "dot": (aten.dot.default, (3,), (3,)),
        "vdot": (aten.vdot.default, (3,), (3,)),
    }
    for name, (func, sa, sb) in two.items():
        for a, b in itertools.product(FLOATS, FLOATS):
            yield Case(
                f"{name}[{tag(a, b)}]",
                "matmul",
                func,
                lambda func=func, sa=sa, sb=sb, a=a, b=b: ((t(sa, a), t(sb, b)), {}),
            )
    yield Case("mm[f64-f32]", "matmul", aten.mm.default, lambda: ((t((2, 3), F64), t((3, 2), F32)), {}))
    yield Case("mm[i64-i64]", "matmul", aten.mm.default, lambda: ((t((2, 3), I64), t((3, 2), I64)), {}))
    three = {
        "addmm": (aten.addmm.default, (2,), (3, 3), (3, 2)),
        "addmm2d": (aten.addmm.default, (3, 2), (3, 3), (3, 2)),
        "addmv": (aten.addmv.default, (2,), (2, 3), (3,)),
        "baddbmm": (aten.baddbmm.default, (2, 2, 2), (2, 2, 3), (2, 3, 2)),
        "addbmm": (aten.addbmm.default, (2, 2), (2, 2, 3), (2, 3, 2)),
        "addmm_act": (aten._addmm_activation.default, (2,), (3, 3), (3, 2)),
    }
    for name, (func, s0, s1, s2) in three.items():
        for c, a, b in itertools.product(FLOATS, FLOATS, FLOATS):
            if name in ("addbmm", "addmm_act") and len({c, a, b}) == 3:
                continue
            yield Case(
                f"{name}[{tag(c, a, b)}]",
                "matmul",
                func,
                lambda func=func, s0=s0, s1=s1, s2=s2, c=c, a=a, b=b: ((t(s0, c), t(s1, a), t(s2, b)), {}),
            )
    for x, w, b in ((F32, BF16, BF16), (BF16, F32, F32), (BF16, BF16, F32), (F16, F16, F16), (BF16, BF16, None)):
        yield Case(
            f"linear3d[{tag(x, w, b)}]",
            "matmul",
            aten.linear.default,
            lambda x=x, w=w, b=b: ((t((2, 5, 3), x), t((4, 3), w), None if b is None else t((4,), b)), {}),
        )
    for x, w, b in itertools.product(FLOATS, FLOATS, (*FLOATS, None)):
        yield Case(
            f"linear[{tag(x, w, b)}]",
            "matmul",
            aten.linear.default,
            lambda x=x, w=w, b=b: ((t((2, 3), x), t((4, 3), w), None if b is None else t((4,), b)), {}),
        )


def _conv() -> Iterator[Case]:
    for x, w, b in itertools.product(FLOATS, FLOATS, (*FLOATS, None)):
        yield Case(
            f"convolution[{tag(x, w, b)}]",
            "conv",
            aten.convolution.default,
            lambda x=x, w=w, b=b: (
                (t((1, 2, 5), x), t((3, 2, 2), w), None if b is None else t((3,), b), [1], [0], [1], False, [0], 1),
                {},
            ),
        )
    for x, b in itertools.product(FLOATS, FLOATS):
        yield Case(
            f"conv2d_bias[{tag(x, x, b)}]",
            "conv",
            aten.convolution.default,
            lambda x=x, b=b: (
                (t((1, 2, 4, 4), x), t((3, 2, 2, 2), x), t((3,), b), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
                {},
            ),
        )
    for x, w in itertools.product(FLOATS, FLOATS):
        yield Case(
            f"conv_transpose2d[{tag(x, w)}]",
            "conv",
            aten.convolution.default,
            lambda x=x, w=w: (
                (t((1, 2, 3, 3), x), t((2, 3, 2, 2), w), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
                {},
            ),
        )
        yield Case(
            f"_convolution[{tag(x, w)}]",
            "conv",
            aten._convolution.default,
            lambda x=x, w=w: (
                (
                    t((1, 2, 4, 4), x),
                    t((3, 2, 2, 2), w),
                    t((3,), w),
                    [1, 1],
                    [0, 0],
                    [1, 1],
                    False,
                    [0, 0],
                    1,
                    False,
                    False,
                    True,
                    True,
                ),
                {},
            ),
        )
    for go, x, w in itertools.product(FLOATS, FLOATS, FLOATS):
        yield Case(
            f"convolution_backward[{tag(go, x, w)}]",
            "backward",
            aten.convolution_backward.default,
            lambda go=go, x=x, w=w: (
                (
                    t((1, 3, 4), go),
                    t((1, 2, 5), x),
                    t((3, 2, 2), w),
                    [3],
                    [1],
                    [0],
                    [1],
                    False,
                    [0],
                    1,
                    [True, True, True],
                ),
                {},
            ),
        )


def _saved(
    forward: Callable[[torch.dtype], Any], w: torch.dtype, x: torch.dtype, acc_on_cuda: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics a forward saves for its backward: from the forward with the weight's dtype
    when the kernel accepts it (as autograd would), else from a forward in x's dtype. Built for a
    CUDA run, layer and batch norm statistics are float32 for 16-bit inputs, as CUDA's forward
    saves them in the accumulate type (the CPU forward saves them in the input's dtype)."""
    try:
        out = forward(w)
    except RuntimeError:
        out = forward(x)
    mean, rstd = out[1], out[2]
    if acc_on_cuda and _TARGET[0] == "cuda" and mean.dtype in (BF16, F16):
        return mean.float(), rstd.float()  # the accumulate type CUDA's forward saves in
    return mean, rstd


def _norms() -> Iterator[Case]:
    for x, w, b in itertools.product(FLOATS, (*FLOATS, None), (*FLOATS, None)):
        if (w is None) != (b is None) and b is not None:
            continue
        yield Case(
            f"native_layer_norm[{tag(x, w, b)}]",
            "norm",
            aten.native_layer_norm.default,
            lambda x=x, w=w, b=b: (
                (t((2, 4), x), [4], None if w is None else t((4,), w), None if b is None else t((4,), b), 1e-5),
                {},
            ),
        )
    for x, w, b in itertools.product(FLOATS, (*FLOATS, None), (*FLOATS, None)):
        if (w is None) != (b is None):
            continue
        yield Case(
            f"native_group_norm[{tag(x, w, b)}]",
            "norm",
            aten.native_group_norm.default,
            lambda x=x, w=w, b=b: (
                (
                    t((2, 4, 3), x),
                    None if w is None else t((4,), w),
                    None if b is None else t((4,), b),
                    2,
                    4,
                    3,
                    2,
                    1e-5,
                ),
                {},
            ),
        )
    for x, w, s, training in itertools.product(FLOATS, FLOATS, FLOATS, (False, True)):
        yield Case(
            f"native_batch_norm[{tag(x, w, s)}-{'train' if training else 'eval'}]",
            "norm",
            aten.native_batch_norm.default,
            lambda x=x, w=w, s=s, training=training: (
                (t((2, 4, 3), x), t((4,), w), t((4,), w), t((4,), s), t((4,), s).abs() + 1, training, 0.1, 1e-5),
                {},
            ),
        )
    for x, w in itertools.product(FLOATS, FLOATS):
        yield Case(
            f"_native_batch_norm_legit_no_training[{tag(x, w)}]",
            "norm",
            aten._native_batch_norm_legit_no_training.default,
            lambda x=x, w=w: (
                (t((2, 4, 3), x), t((4,), w), t((4,), w), t((4,), w), t((4,), w).abs() + 1, 0.1, 1e-5),
                {},
            ),
        )
        yield Case(
            f"_native_batch_norm_legit.no_stats[{tag(x, w)}]",
            "norm",
            aten._native_batch_norm_legit.no_stats,
            lambda x=x, w=w: ((t((2, 4, 3), x), t((4,), w), t((4,), w), True, 0.1, 1e-5), {}),
        )
        yield Case(
            f"native_batch_norm[{tag(x)}-noaffine-{tag(w)}stats]",
            "norm",
            aten.native_batch_norm.default,
            lambda x=x, w=w: ((t((2, 4, 3), x), None, None, t((4,), w), t((4,), w).abs() + 1, False, 0.1, 1e-5), {}),
        )
    for x, w in itertools.product(FLOATS, (*FLOATS, None)):
        yield Case(
            f"rms_norm[{tag(x, w)}]",
            "norm",
            aten.rms_norm.default,
            lambda x=x, w=w: ((t((2, 4), x), [4], None if w is None else t((4,), w), 1e-5), {}),
        )
        yield Case(
            f"_fused_rms_norm[{tag(x, w)}]",
            "norm",
            aten._fused_rms_norm.default,
            lambda x=x, w=w: ((t((2, 4), x), [4], None if w is None else t((4,), w), 1e-5), {}),
        )
    # backward: mean/rstd as the forward on x's dtype produces them
    for go, x, w in itertools.product(FLOATS, FLOATS, FLOATS):

        def make_ln(go: torch.dtype = go, x: torch.dtype = x, w: torch.dtype = w) -> tuple[tuple[Any, ...], dict]:
            xs = t((2, 4), x)
            mean, rstd = _saved(lambda p: aten.native_layer_norm.default(xs, [4], t((4,), p), t((4,), p), 1e-5), w, x)
            return (t((2, 4), go), xs, [4], mean, rstd, t((4,), w), t((4,), w), [True, True, True]), {}

        yield Case(
            f"native_layer_norm_backward[{tag(go, x, w)}]", "backward", aten.native_layer_norm_backward.default, make_ln
        )
    for go, x, w in itertools.product(FLOATS, FLOATS, FLOATS):
        if len({go, x, w}) == 3:
            continue

        def make_gn(go: torch.dtype = go, x: torch.dtype = x, w: torch.dtype = w) -> tuple[tuple[Any, ...], dict]:
            xs = t((2, 4, 3), x)
            mean, rstd = _saved(
                lambda p: aten.native_group_norm.default(xs, t((4,), p), t((4,), p), 2, 4, 3, 2, 1e-5),
                w,
                x,
                acc_on_cuda=False,
            )
            return (t((2, 4, 3), go), xs, mean, rstd, t((4,), w), 2, 4, 3, 2, [True, True, True]), {}

        yield Case(
            f"native_group_norm_backward[{tag(go, x, w)}]", "backward", aten.native_group_norm_backward.default, make_gn
        )

        def make_bn(go: torch.dtype = go, x: torch.dtype = x, w: torch.dtype = w) -> tuple[tuple[Any, ...], dict]:
            xs = t((2, 4, 3), x)
            sm, si = _saved(
                lambda p: aten.native_batch_norm.default(xs, t((4,), p), t((4,), p), None, None, True, 0.1, 1e-5), w, x
            )
            return (t((2, 4, 3), go), xs, t((4,), w), None, None, sm, si, True, 1e-5, [True, True, True]), {}

        yield Case(
            f"native_batch_norm_backward[{tag(go, x, w)}]", "backward", aten.native_batch_norm_backward.default, make_bn
        )

    # training's backward with running statistics (what nn.BatchNorm's backward gets), on a
    # spatial and a (N, C) input: CUDA refuses stats outside 16-bit parameters' dtype on the first
    for x, w, s, dims in itertools.product((BF16, F16), FLOATS, FLOATS, (2, 3)):

        def make_bns(x: torch.dtype = x, w: torch.dtype = w, s: torch.dtype = s, dims: int = dims) -> tuple[Any, ...]:
            shape = (2, 4, 3)[:dims]
            xs = t(shape, x)
            sm, si = _saved(
                lambda p: aten.native_batch_norm.default(xs, t((4,), p), t((4,), p), None, None, True, 0.1, 1e-5), w, x
            )
            stats = (t((4,), s), t((4,), s).abs() + 0.5)
            return (t(shape, x), xs, t((4,), w), *stats, sm, si, True, 1e-5, [True, True, True]), {}

        yield Case(
            f"native_batch_norm_backward_stats[{tag(x, w, s)}-{dims}d]",
            "backward",
            aten.native_batch_norm_backward.default,
            make_bns,
        )


def _attention() -> Iterator[Case]:
    shape = (1, 2, 3, 4)
    masks = (BOOL, *FLOATS)
    sdpa = {
        "sdpa_flash_cpu": aten._scaled_dot_product_flash_attention_for_cpu.default,
        "sdpa_math": aten._scaled_dot_product_attention_math.default,
        "sdpa": aten.scaled_dot_product_attention.default,
    }
    for name, func in sdpa.items():
        for q, k, v in itertools.product(FLOATS, FLOATS, FLOATS):
            if name != "sdpa_math" and len({q, k, v}) == 3:
                continue
            yield Case(
                f"{name}[{tag(q, k, v)}]",
                "sdpa",
                func,
                lambda func=func, q=q, k=k, v=v: ((t(shape, q), t(shape, k), t(shape, v)), {}),
            )
        for q, m in itertools.product(FLOATS, masks):
            if name == "sdpa_flash_cpu":
                yield Case(
                    f"{name}[{tag(q, q, q)}-mask-{tag(m)}]",
                    "sdpa",
                    func,
                    lambda func=func, q=q, m=m: (
                        (t(shape, q), t(shape, q), t(shape, q), 0.0, False),
                        {"attn_mask": t((3, 3), m)},
                    ),
                )
            else:
                yield Case(
                    f"{name}[{tag(q, q, q)}-mask-{tag(m)}]",
                    "sdpa",
                    func,
                    lambda func=func, q=q, m=m: ((t(shape, q), t(shape, q), t(shape, q), t((3, 3), m)), {}),
                )
        yield Case(
            f"{name}[f32-mask-i64]",
            "sdpa",
            func,
            lambda func=func: ((t(shape, F32), t(shape, F32), t(shape, F32)), {"attn_mask": t((3, 3), I64)}),
        )
    # a head size the CUDA memory-efficient kernel takes (a multiple of 8): with a mask in another
    # float dtype it is the efficient kernel, not math, that gets the call
    wide = (1, 2, 8, 16)
    for q, m in itertools.product((BF16, F16), FLOATS):
        yield Case(
            f"sdpa-head16[{tag(q, q, q)}-mask-{tag(m)}]",
            "sdpa",
            aten.scaled_dot_product_attention.default,
            lambda q=q, m=m: ((t(wide, q), t(wide, q), t(wide, q), t((8, 8), m)), {}),
        )
    for x, w in itertools.product(FLOATS, FLOATS):

        def make_tel(x: torch.dtype = x, w: torch.dtype = w) -> tuple[tuple[Any, ...], dict]:
            e = 4
            return (
                t((2, 3, e), x),
                e,
                2,
                t((3 * e, e), w),
                t((3 * e,), w),
                t((e, e), w),
                t((e,), w),
                False,
                False,
                1e-5,
                t((e,), w),
                t((e,), w),
                t((e,), w),
                t((e,), w),
                t((8, e), w),
                t((8,), w),
                t((e, 8), w),
                t((e,), w),
            ), {}

        yield Case(
            f"_transformer_encoder_layer_fwd[{tag(x, w)}]",
            "fused",
            aten._transformer_encoder_layer_fwd.default,
            make_tel,
        )

        def make_mha(x: torch.dtype = x, w: torch.dtype = w) -> tuple[tuple[Any, ...], dict]:
            e = 4
            q = t((2, 3, e), x)
            return (q, q, q, e, 2, t((3 * e, e), w), t((3 * e,), w), t((e, e), w), t((e,), w), None, False), {}

        yield Case(
            f"_native_multi_head_attention[{tag(x, w)}]", "fused", aten._native_multi_head_attention.default, make_mha
        )

    def make_tel_norm32(x: torch.dtype = BF16) -> tuple[tuple[Any, ...], dict]:
        e = 4
        return (
            t((2, 3, e), x),
            e,
            2,
            t((3 * e, e), x),
            t((3 * e,), x),
            t((e, e), x),
            t((e,), x),
            False,
            False,
            1e-5,
            t((e,), F32),
            t((e,), F32),
            t((e,), F32),
            t((e,), F32),
            t((8, e), x),
            t((8,), x),
            t((e, 8), x),
            t((e,), x),
        ), {}

    yield Case(
        "_transformer_encoder_layer_fwd[bf16-norms-f32]",
        "fused",
        aten._transformer_encoder_layer_fwd.default,
        make_tel_norm32,
    )
    for x in FLOATS:
        for half_to_float in (False, True):
            for name, func in (("_softmax", aten._softmax.default), ("_log_softmax", aten._log_softmax.default)):
                yield Case(
                    f"{name}[{tag(x)}-h2f={int(half_to_float)}]",
                    "softmax",
                    func,
                    lambda func=func, x=x, h=half_to_float: ((t((2, 3), x), -1, h), {}),
                )
    for go, out, indt in itertools.product(FLOATS, FLOATS, FLOATS):
        if len({go, out, indt}) == 3:
            continue
        yield Case(
            f"_softmax_backward_data[{tag(go, out, indt)}]",
            "backward",
            aten._softmax_backward_data.default,
            lambda go=go, out=out, indt=indt: ((t((2, 3), go), t((2, 3), out), -1, indt), {}),
        )


def _embedding_index() -> Iterator[Case]:
    for w, i in itertools.product(FLOATS, (I64, I32, F32, U8)):
        yield Case(
            f"embedding[{tag(w, i)}]",
            "embedding",
            aten.embedding.default,
            lambda w=w, i=i: ((t((5, 3), w), idx((2,), 5, i)), {}),
        )
    for g, i in itertools.product(FLOATS, (I64, I32)):
        yield Case(
            f"embedding_dense_backward[{tag(g, i)}]",
            "backward",
            aten.embedding_dense_backward.default,
            lambda g=g, i=i: ((t((2, 3), g), idx((2,), 5, i), 5, -1, False), {}),
        )
    for s, v in itertools.product(FLOATS, FLOATS):
        yield Case(
            f"index_put[{tag(s, v)}]",
            "index",
            aten.index_put.default,
            lambda s=s, v=v: ((t((4, 3), s), [idx((2,), 4)], t((2, 3), v)), {}),
        )
        yield Case(
            f"index_put_[{tag(s, v)}]",
            "index",
            aten.index_put_.default,
            lambda s=s, v=v: ((t((4, 3), s), [idx((2,), 4)], t((2, 3), v), True), {}),
        )
        yield Case(
            f"masked_scatter[{tag(s, v)}]",
            "index",
            aten.masked_scatter.default,
            lambda s=s, v=v: ((t((4, 3), s), t((4, 3), BOOL), t((4, 3), v)), {}),
        )
        yield Case(
            f"scatter.src[{tag(s, v)}]",
            "index",
            aten.scatter.src,
            lambda s=s, v=v: ((t((4, 3), s), 0, idx((2, 3), 4), t((2, 3), v)), {}),
        )
        yield Case(
            f"scatter_add[{tag(s, v)}]",
            "index",
            aten.scatter_add.default,
            lambda s=s, v=v: ((t((4, 3), s), 0, idx((2, 3), 4), t((2, 3), v)), {}),
        )
        yield Case(
            f"index_copy[{tag(s, v)}]",
            "index",
            aten.index_copy.default,
            lambda s=s, v=v: ((t((4, 3), s), 0, torch.tensor([0, 2]), t((2, 3), v)), {}),
        )
        yield Case(
            f"index_add[{tag(s, v)}]",
            "index",
            aten.index_add.default,
            lambda s=s, v=v: ((t((4, 3), s), 0, torch.tensor([0, 2]), t((2, 3), v)), {}),
        )
        yield Case(
            f"masked_fill.Tensor[{tag(s, v)}]",
            "index",
            aten.masked_fill.Tensor,
            lambda s=s, v=v: ((t((4, 3), s), t((4, 3), BOOL), t((), v)), {}),
        )
    for s in FLOATS:
        yield Case(
            f"index_put[{tag(s)}-i64-values]",
            "index",
            aten.index_put.default,
            lambda s=s: ((t((4, 3), s), [idx((2,), 4)], t((2, 3), I64)), {}),
        )
    yield Case(
        "masked_scatter[f32-u8mask]",
        "index",
        aten.masked_scatter.default,
        lambda: ((t((4, 3), F32), t((4, 3), U8), t((4, 3), F32)), {}),
    )
    yield Case(
        "masked_fill.Scalar[f32-u8mask]",
        "index",
        aten.masked_fill.Scalar,
        lambda: ((t((4, 3), F32), t((4, 3), U8), 0.0), {}),
    )
    yield Case(
        "masked_fill.Scalar[bf16-boolmask]",
        "index",
        aten.masked_fill.Scalar,
        lambda: ((t((4, 3), BF16), t((4, 3), BOOL), -1e4), {}),
    )
    yield Case(
        "scatter.src[f32-i32index]",
        "index",
        aten.scatter.src,
        lambda: ((t((4, 3), F32), 0, idx((2, 3), 4, I32), t((2, 3), F32)), {}),
    )
    yield Case(
        "gather[f32-i32index]", "index", aten.gather.default, lambda: ((t((4, 3), F32), 0, idx((2, 3), 4, I32)), {})
    )
    yield Case(
        "gather[bf16-i64index]", "index", aten.gather.default, lambda: ((t((4, 3), BF16), 0, idx((2, 3), 4)), {})
    )
    yield Case(
        "index_select[f16-i32index]",
        "index",
        aten.index_select.default,
        lambda: ((t((4, 3), F16), 0, idx((2,), 4, I32)), {}),
    )
    yield Case(
        "index_select[f16-f32index]",
        "index",
        aten.index_select.default,
        lambda: ((t((4, 3), F16), 0, t((2,), F32)), {}),
    )
    for i in (I64, I32, BOOL, F32):
        yield Case(
            f"index.Tensor[bf16-{tag(i)}index]",
            "index",
            aten.index.Tensor,
            lambda i=i: ((t((4, 3), BF16), [idx((4,), 2, i) if i != F32 else t((4,), F32)]), {}),
        )


def _bincount() -> Iterator[Case]:
    # a MoE router's tokens per expert: integer ids only, weights read as f32 or f64
    for i in (I64, I32, U8, BOOL, F32, BF16):
        yield Case(f"bincount[{tag(i)}]", "index", aten.bincount.default, lambda i=i: ((t((8,), i),), {}))
    for w in (F32, BF16, F16, F64, I64):
        yield Case(
            f"bincount[i64-{tag(w)}weights]",
            "index",
            aten.bincount.default,
            lambda w=w: ((idx((8,), 4), t((8,), w)), {"minlength": 4}),
        )


def _inplace() -> Iterator[Case]:
    selfs = (F16, BF16, F32, I64)
    unary_other = {
        "add_": aten.add_.Tensor,
        "sub_": aten.sub_.Tensor,
        "mul_": aten.mul_.Tensor,
        "div_": aten.div_.Tensor,
        "copy_": aten.copy_.default,
        "maximum_out": None,
    }
    for name, func in unary_other.items():
        if func is None:
            continue
        for s, o in itertools.product(selfs, FLOATS):
            yield Case(
                f"{name}[{tag(s, o)}]", "inplace", func, lambda func=func, s=s, o=o: ((t((2, 3), s), t((2, 3), o)), {})
            )
    for s, o in itertools.product(selfs, FLOATS):
        yield Case(
            f"lerp_.Scalar[{tag(s, o)}]",
            "inplace",
            aten.lerp_.Scalar,
            lambda s=s, o=o: ((t((2, 3), s), t((2, 3), o), 0.5), {}),
        )
        yield Case(
            f"addcmul_[{tag(s, o)}]",
            "inplace",
            aten.addcmul_.default,
            lambda s=s, o=o: ((t((2, 3), s), t((2, 3), o), t((2, 3), o)), {"value": 0.5}),
        )
        yield Case(
            f"addcdiv_[{tag(s, o)}]",
            "inplace",
            aten.addcdiv_.default,
            lambda s=s, o=o: ((t((2, 3), s), t((2, 3), o), t((2, 3), o).abs() + 1), {"value": 0.5}),
        )
        yield Case(
            f"add_0dim[{tag(s, o)}]", "inplace", aten.add_.Tensor, lambda s=s, o=o: ((t((2, 3), s), t((), o)), {})
        )
    for s, o in itertools.product((F16, BF16), (F32,)):
        yield Case(
            f"clamp_.Tensor[{tag(s, o)}]",
            "inplace",
            aten.clamp_.Tensor,
            lambda s=s, o=o: ((t((2, 3), s), t((2, 3), o)), {}),
        )
        yield Case(
            f"lerp_.Tensor[{tag(s, s, o)}]",
            "inplace",
            aten.lerp_.Tensor,
            lambda s=s, o=o: ((t((2, 3), s), t((2, 3), s), t((2, 3), o)), {}),
        )
    yield Case("add_[b8-f32]", "inplace", aten.add_.Tensor, lambda: ((t((2, 3), BOOL), t((2, 3), F32)), {}))
    yield Case("mul_[i64-i32]", "inplace", aten.mul_.Tensor, lambda: ((t((2, 3), I64), t((2, 3), I32)), {}))
    yield Case("div_[i64-i64]", "inplace", aten.div_.Tensor, lambda: ((t((2, 3), I64), t((2, 3), I64) + 1), {}))
    yield Case("add_.Scalar[i64-float]", "inplace", aten.add_.Scalar, lambda: ((t((2, 3), I64), 0.5), {}))
    yield Case("mul_.Scalar[bf16-float]", "inplace", aten.mul_.Scalar, lambda: ((t((2, 3), BF16), 0.5), {}))


def _promotion() -> Iterator[Case]:
    for a, b in itertools.product(FLOATS, FLOATS):
        yield Case(
            f"cat[{tag(a, b)}]", "promotion", aten.cat.default, lambda a=a, b=b: (([t((2, 3), a), t((1, 3), b)],), {})
        )
        yield Case(
            f"stack[{tag(a, b)}]",
            "promotion",
            aten.stack.default,
            lambda a=a, b=b: (([t((2, 3), a), t((2, 3), b)],), {}),
        )
        yield Case(
            f"where.self[{tag(a, b)}]",
            "promotion",
            aten.where.self,
            lambda a=a, b=b: ((t((2, 3), BOOL), t((2, 3), a), t((2, 3), b)), {}),
        )
        yield Case(
            f"lerp.Scalar[{tag(a, b)}]",
            "promotion",
            aten.lerp.Scalar,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), b), 0.3), {}),
        )
        yield Case(
            f"lerp.Tensor[{tag(a, a, b)}]",
            "promotion",
            aten.lerp.Tensor,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), a), t((2, 3), b)), {}),
        )
        yield Case(
            f"addcmul[{tag(a, b, b)}]",
            "promotion",
            aten.addcmul.default,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), b), t((2, 3), b)), {}),
        )
        yield Case(
            f"addcdiv[{tag(a, a, b)}]",
            "promotion",
            aten.addcdiv.default,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), a), t((2, 3), b).abs() + 1), {}),
        )
        yield Case(
            f"add.Tensor[{tag(a, b)}]",
            "promotion",
            aten.add.Tensor,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), b)), {}),
        )
        yield Case(
            f"mul.Tensor[{tag(a, b)}-0dim]",
            "promotion",
            aten.mul.Tensor,
            lambda a=a, b=b: ((t((2, 3), a), t((), b)), {}),
        )
        yield Case(
            f"where.self[b8-{tag(a)}-0dim{tag(b)}]",
            "promotion",
            aten.where.self,
            lambda a=a, b=b: ((t((2, 3), BOOL), t((2, 3), a), t((), b)), {}),
        )
    yield Case("cat[f32-i64]", "promotion", aten.cat.default, lambda: (([t((2, 3), F32), t((1, 3), I64)],), {}))
    yield Case("cat[bf16-b8]", "promotion", aten.cat.default, lambda: (([t((2, 3), BF16), t((1, 3), BOOL)],), {}))
    yield Case(
        "where.self[u8cond]",
        "promotion",
        aten.where.self,
        lambda: ((t((2, 3), U8), t((2, 3), F32), t((2, 3), F32)), {}),
    )
    yield Case("add.Tensor[i64-0dim-f16]", "promotion", aten.add.Tensor, lambda: ((t((2, 3), I64), t((), F16)), {}))
    yield Case("add.Tensor[0dim-f32-bf16]", "promotion", aten.add.Tensor, lambda: ((t((), F32), t((2, 3), BF16)), {}))
    yield Case("maximum[bf16-f16]", "promotion", aten.maximum.default, lambda: ((t((2, 3), BF16), t((2, 3), F16)), {}))
    for a, b in itertools.product(FLOATS, FLOATS):
        for name, func in (
            ("gelu_backward", aten.gelu_backward.default),
            ("silu_backward", aten.silu_backward.default),
        ):
            yield Case(
                f"{name}[{tag(a, b)}]", "backward", func, lambda func=func, a=a, b=b: ((t((2, 3), a), t((2, 3), b)), {})
            )
        yield Case(
            f"threshold_backward[{tag(a, b)}]",
            "backward",
            aten.threshold_backward.default,
            lambda a=a, b=b: ((t((2, 3), a), t((2, 3), b), 0.0), {}),
        )


def _edges() -> Iterator[Case]:
    """Single cases for rules that turn on one detail (0-dim operands, index dtypes, devices)."""
    e = 4

    def tel_f32_biases() -> tuple[tuple[Any, ...], dict[str, Any]]:
        w = BF16
        return (
            t((2, 3, e), w),
            e,
            2,
            t((3 * e, e), w),
            t((3 * e,), F32),
            t((e, e), w),
            t((e,), F32),
            False,
            False,
            1e-5,
            t((e,), w),
            t((e,), w),
            t((e,), w),
            t((e,), w),
            t((8, e), w),
            t((8,), F32),
            t((e, 8), w),
            t((e,), F32),
        ), {}

    def mha_f32_bias() -> tuple[tuple[Any, ...], dict[str, Any]]:
        q = t((2, 3, e), BF16)
        return (q, q, q, e, 2, t((3 * e, e), BF16), t((3 * e,), F32), t((e, e), BF16), t((e,), BF16), None, False), {}

    qkv = (1, 1, 2, 4)
    yield Case(
        "_transformer_encoder_layer_fwd[bf16-biases-f32]",
        "fused",
        aten._transformer_encoder_layer_fwd.default,
        tel_f32_biases,
    )
    yield Case(
        "_native_multi_head_attention[bf16-qkv_bias-f32]",
        "fused",
        aten._native_multi_head_attention.default,
        mha_f32_bias,
    )

    def tel_f32_qkv_bias() -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = tel_f32_biases()
        fixed = list(args)
        for i in (6, 15, 17):  # only the qkv bias stays f32
            fixed[i] = fixed[i].to(BF16)
        return tuple(fixed), kwargs

    yield Case(
        "_transformer_encoder_layer_fwd[bf16-qkv_bias-f32]",
        "fused",
        aten._transformer_encoder_layer_fwd.default,
        tel_f32_qkv_bias,
    )
    yield Case(
        "_scaled_dot_product_flash_attention[bf16-on-cpu]",
        "sdpa",
        aten._scaled_dot_product_flash_attention.default,
        lambda: ((t(qkv, BF16), t(qkv, BF16), t(qkv, BF16)), {}),
    )
    yield Case(
        "_scaled_dot_product_efficient_attention[f32-on-cpu]",
        "sdpa",
        aten._scaled_dot_product_efficient_attention.default,
        lambda: ((t(qkv, F32), t(qkv, F32), t(qkv, F32), None, False), {}),
    )
    yield Case(
        "index_put_[bf16-0dim-f32]",
        "index",
        aten.index_put_.default,
        lambda: ((t((4, 3), BF16), [torch.tensor([0, 1])], t((), F32)), {}),
    )
    yield Case(
        "lerp.Tensor[bf16-bf16-0dimf32]",
        "promotion",
        aten.lerp.Tensor,
        lambda: ((t((4, 3), BF16), t((4, 3), BF16), t((), F32)), {}),
    )
    yield Case(
        "where.self[f32cond]", "promotion", aten.where.self, lambda: ((t((3,), F32), t((3,), F32), t((3,), F32)), {})
    )
    yield Case(
        "masked_fill.Tensor[bf16-1d-value]",
        "index",
        aten.masked_fill.Tensor,
        lambda: ((t((4, 3), BF16), t((4, 3), BOOL), t((1,), BF16)), {}),
    )
    yield Case(
        "index_copy[bf16-i32index]",
        "index",
        aten.index_copy.default,
        lambda: ((t((4, 3), BF16), 0, idx((2,), 4, I32), t((2, 3), BF16)), {}),
    )
    yield Case(
        "gather[bf16-f32index]", "index", aten.gather.default, lambda: ((t((4, 3), BF16), 0, t((2, 3), F32)), {})
    )
    yield Case(
        "scatter.src[bf16-f32index]",
        "index",
        aten.scatter.src,
        lambda: ((t((4, 3), BF16), 0, t((2, 3), F32), t((2, 3), BF16)), {}),
    )
    yield Case(
        "index_add[bf16-i32index]",
        "index",
        aten.index_add.default,
        lambda: ((t((4, 3), BF16), 0, idx((2,), 4, I32), t((2, 3), BF16)), {}),
    )
    yield Case("mean[i64]", "reduction", aten.mean.default, lambda: ((t((3,), I64),), {}))
    yield Case("sum[b8]", "reduction", aten.sum.default, lambda: ((t((3,), BOOL),), {}))
    yield Case(
        "sum.dim_IntList[bf16-dtype-f32]",
        "reduction",
        aten.sum.dim_IntList,
        lambda: ((t((2, 3), BF16), [1]), {"dtype": F32}),
    )
    yield Case("gelu[i64]", "unary", aten.gelu.default, lambda: ((t((3,), I64),), {}))
    yield Case("gelu[bf16]", "unary", aten.gelu.default, lambda: ((t((3,), BF16),), {}))
    yield Case("sqrt[i64]", "unary", aten.sqrt.default, lambda: ((t((3,), I64),), {}))
    yield Case("rsqrt[f16]", "unary", aten.rsqrt.default, lambda: ((t((3,), F16).abs() + 1,), {}))
    yield Case("_to_copy[bf16-to-f32]", "unary", aten._to_copy.default, lambda: ((t((3,), BF16),), {"dtype": F32}))
    yield Case("mm[b8-b8]", "matmul", aten.mm.default, lambda: ((t((2, 2), BOOL), t((2, 2), BOOL)), {}))
    yield Case("add.Tensor[i64-float-scalar]", "promotion", aten.add.Tensor, lambda: ((t((3,), I64), 2.5), {}))
    yield Case("mul.Tensor[bf16-float-scalar]", "promotion", aten.mul.Tensor, lambda: ((t((3,), BF16), 0.5), {}))
    yield Case("div.Tensor[i64-i64]", "promotion", aten.div.Tensor, lambda: ((t((3,), I64), t((3,), I64) + 1), {}))
    yield Case(
        "div.Tensor_mode[i64-i64-floor]",
        "promotion",
        aten.div.Tensor_mode,
        lambda: ((t((3,), I64), t((3,), I64) + 1), {"rounding_mode": "floor"}),
    )
    yield Case("eq.Tensor[bf16-f32]", "promotion", aten.eq.Tensor, lambda: ((t((3,), BF16), t((3,), F32)), {}))
    yield Case("clamp.default[i64-float]", "promotion", aten.clamp.default, lambda: ((t((3,), I64), 0.5), {}))
    yield Case("pow.Tensor_Scalar[i64-float]", "promotion", aten.pow.Tensor_Scalar, lambda: ((t((3,), I64), 0.5), {}))
    yield Case("full[int]", "factory", aten.full.default, lambda: (([2], 3), {}))
    yield Case("arange[float]", "factory", aten.arange.default, lambda: ((3.0,), {}))
    yield Case("max.other[bf16-f16]", "promotion", aten.max.other, lambda: ((t((3,), BF16), t((3,), F16)), {}))
    for g, qd, vd in ((F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, BF16), (BF16, BF16, F32), (F16, F16, F16)):

        def sdpa_back(
            g: torch.dtype = g, qd: torch.dtype = qd, vd: torch.dtype = vd
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            q = t((1, 2, 3, 4), qd)
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
            return (t((1, 2, 3, 4), g), q, q, t((1, 2, 3, 4), vd), out, lse, 0.0, False), {}

        yield Case(
            f"sdpa_flash_cpu_backward[{tag(g, qd, vd)}]",
            "backward",
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            sdpa_back,
        )
    for x, d in ((BF16, F32), (F16, None), (F32, BF16)):
        yield Case(
            f"_safe_softmax[{tag(x)}-dtype-{tag(d)}]",
            "softmax",
            aten._safe_softmax.default,
            lambda x=x, d=d: ((t((2, 3), x), -1), {} if d is None else {"dtype": d}),
        )
        yield Case(
            f"softmax.int[{tag(x)}-dtype-{tag(d)}]",
            "softmax",
            aten.softmax.int,
            lambda x=x, d=d: ((t((2, 3), x), -1, d), {}),
        )
    yield Case(
        "softmax_backward[f16-f16-f32]-h2f",
        "backward",
        aten._log_softmax_backward_data.default,
        lambda: ((t((2, 3), F32), t((2, 3), F32), -1, F16), {}),
    )


def _losses() -> Iterator[Case]:
    x_shape = (4, 5)
    for a, b in itertools.product(FLOATS, FLOATS):
        for name, func in (
            ("mse_loss", aten.mse_loss.default),
            ("l1_loss", aten.l1_loss.default),
            ("huber_loss", aten.huber_loss.default),
            ("kl_div", aten.kl_div.default),
        ):
            yield Case(
                f"{name}[{tag(a, b)}]", "loss", func, lambda func=func, a=a, b=b: ((t(x_shape, a), t(x_shape, b)), {})
            )
        yield Case(
            f"binary_cross_entropy_with_logits[{tag(a, b)}]",
            "loss",
            aten.binary_cross_entropy_with_logits.default,
            lambda a=a, b=b: ((t(x_shape, a), t(x_shape, b).float().sigmoid().to(b)), {}),
        )
        yield Case(
            f"binary_cross_entropy[{tag(a, b)}]",
            "loss",
            aten.binary_cross_entropy.default,
            lambda a=a, b=b: ((t(x_shape, a).float().sigmoid().to(a), t(x_shape, b).float().sigmoid().to(b)), {}),
        )
        yield Case(
            f"nll_loss_forward[{tag(a)}-weight-{tag(b)}]",
            "loss",
            aten.nll_loss_forward.default,
            lambda a=a, b=b: ((t(x_shape, a), idx((4,), 5), t((5,), b).abs(), 1, -100), {}),
        )
        yield Case(
            f"nll_loss_backward[{tag(b, a)}]",
            "backward",
            aten.nll_loss_backward.default,
            lambda a=a, b=b: ((t((), b), t(x_shape, a), idx((4,), 5), None, 1, -100, t((), b).abs() + 4), {}),
        )
        yield Case(
            f"mse_loss_backward[{tag(b, a, b)}]",
            "backward",
            aten.mse_loss_backward.default,
            lambda a=a, b=b: ((t((), b), t(x_shape, a), t(x_shape, b), 1), {}),
        )
        yield Case(
            f"huber_loss_backward[{tag(a, a, b)}]",
            "backward",
            aten.huber_loss_backward.default,
            lambda a=a, b=b: ((t((), a), t(x_shape, a), t(x_shape, b), 1, 1.0), {}),
        )
    for i in (I32, F32):
        yield Case(
            f"nll_loss_forward[f32-target-{tag(i)}]",
            "loss",
            aten.nll_loss_forward.default,
            lambda i=i: ((t(x_shape, F32), idx((4,), 5, i), None, 1, -100), {}),
        )


def _spd(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A well-conditioned symmetric positive definite matrix (every factorization succeeds)."""
    a = torch.randn((n, n), generator=_gen())
    return (a @ a.T + n * torch.eye(n)).to(dtype)


_DtypeBuilder = Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]


def _bind(make: _DtypeBuilder, d: torch.dtype) -> Builder:
    return lambda: make(d)


def _cdist(rows: int, d: torch.dtype, mode: int | None) -> Builder:
    return lambda: ((t((rows, 4), d), t((rows + 2 if rows < 25 else rows, 4), d), 2.0, mode), {})


def _complex_fft(func: torch._ops.OpOverload, cd: torch.dtype) -> Builder:
    def make() -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = torch.randn(8 if func is aten._fft_c2c.default else 5, dtype=torch.complex64, generator=_gen()).to(cd)
        return ((x, [0], 0, True) if func is aten._fft_c2c.default else (x, [0], 0, 8)), {}

    return make


def _no_kernel() -> Iterator[Case]:
    """Ops with no bf16/f16 kernel on CPU: each in f32 (accepted, result dtype) and bf16/f16."""
    ops: list[tuple[str, torch._ops.OpOverload, _DtypeBuilder]] = [
        ("linalg_qr", aten.linalg_qr.default, lambda d: ((_spd(4, d),), {})),
        ("geqrf", aten.geqrf.default, lambda d: ((_spd(4, d),), {})),
        (
            "linalg_householder_product",
            aten.linalg_householder_product.default,
            lambda d: ((_spd(4, d), t((2,), d)), {}),
        ),
        ("linalg_cholesky_ex", aten.linalg_cholesky_ex.default, lambda d: ((_spd(4, d),), {})),
        ("cholesky_solve", aten.cholesky_solve.default, lambda d: ((_spd(4, d), _spd(4, d)), {})),
        ("cholesky_inverse", aten.cholesky_inverse.default, lambda d: ((_spd(4, d),), {})),
        (
            "_cholesky_solve_helper",
            aten._cholesky_solve_helper.default,
            lambda d: ((_spd(4, d), _spd(4, d), False), {}),
        ),
        ("linalg_lu_factor_ex", aten.linalg_lu_factor_ex.default, lambda d: ((_spd(4, d),), {})),
        ("linalg_lu", aten.linalg_lu.default, lambda d: ((_spd(4, d),), {})),
        ("_linalg_det", aten._linalg_det.default, lambda d: ((_spd(4, d),), {})),
        ("_linalg_solve_ex", aten._linalg_solve_ex.default, lambda d: ((_spd(4, d), _spd(4, d)), {})),
        (
            "linalg_solve_triangular",
            aten.linalg_solve_triangular.default,
            lambda d: ((_spd(4, d), _spd(4, d)), {"upper": True}),
        ),
        ("_linalg_svd", aten._linalg_svd.default, lambda d: ((_spd(4, d),), {})),
        ("_linalg_eigh", aten._linalg_eigh.default, lambda d: ((_spd(4, d),), {})),
        ("linalg_eig", aten.linalg_eig.default, lambda d: ((_spd(4, d),), {})),
        ("linalg_ldl_factor_ex", aten.linalg_ldl_factor_ex.default, lambda d: ((_spd(4, d),), {})),
        ("linalg_inv_ex", aten.linalg_inv_ex.default, lambda d: ((_spd(4, d),), {})),
        ("_linalg_slogdet", aten._linalg_slogdet.default, lambda d: ((_spd(4, d),), {})),
        ("linalg_lstsq", aten.linalg_lstsq.default, lambda d: ((_spd(4, d), _spd(4, d)), {})),
        ("_cdist_forward", aten._cdist_forward.default, lambda d: ((t((3, 4), d), t((5, 4), d), 2.0, None), {})),
        (
            "_cdist_forward-p1-30rows",
            aten._cdist_forward.default,
            lambda d: ((t((30, 4), d), t((30, 4), d), 1.0, None), {}),
        ),
        ("_pdist_forward", aten._pdist_forward.default, lambda d: ((t((3, 4), d),), {})),
        (
            "_ctc_loss",
            aten._ctc_loss.Tensor,
            lambda d: (
                (t((5, 1, 4), F32).log_softmax(-1).to(d), torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([2])),
                {},
            ),
        ),
        ("special_ndtri", aten.special_ndtri.default, lambda d: ((t((4,), F32).sigmoid().to(d),), {})),
        ("special_zeta", aten.special_zeta.default, lambda d: ((t((4,), d).abs() + 2, t((4,), d).abs() + 1), {})),
        ("histogram", aten.histogram.bin_ct, lambda d: ((t((8,), d),), {})),
        ("binomial", aten.binomial.default, lambda d: ((torch.ones(4).to(d), t((4,), F32).sigmoid().to(d)), {})),
        ("_sample_dirichlet", aten._sample_dirichlet.default, lambda d: ((t((4,), d).abs() + 0.1,), {})),
        ("_fft_r2c", aten._fft_r2c.default, lambda d: ((t((8,), d), [0], 0, True), {})),
        ("special_erfcx", aten.special_erfcx.default, lambda d: ((t((4,), d),), {})),
        ("special_log_ndtr", aten.special_log_ndtr.default, lambda d: ((t((4,), d),), {})),
        ("histogram.bin_ct", aten.histogram.bin_ct, lambda d: ((t((8,), d),), {"bins": 4})),
        (
            "histogram.bins_tensor",
            aten.histogram.bins_tensor,
            lambda d: ((t((8,), d), torch.linspace(-2, 2, 5).to(d)), {}),
        ),
        ("_histogramdd_bin_edges", aten._histogramdd_bin_edges.default, lambda d: ((t((8, 2), d), [3, 3]), {})),
        ("_histogramdd_from_bin_cts", aten._histogramdd_from_bin_cts.default, lambda d: ((t((8, 2), d), [3, 3]), {})),
        ("histc", aten.histc.default, lambda d: ((t((8,), d),), {})),
        ("avg_pool3d", aten.avg_pool3d.default, lambda d: ((t((1, 1, 4, 4, 4), d), [2, 2, 2]), {})),
        (
            "avg_pool3d_backward",
            aten.avg_pool3d_backward.default,
            lambda d: (
                (t((1, 1, 2, 2, 2), d), t((1, 1, 4, 4, 4), d), [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None),
                {},
            ),
        ),
        (
            "_upsample_bilinear2d_aa",
            aten._upsample_bilinear2d_aa.default,
            lambda d: ((t((1, 1, 4, 4), d), [3, 3], False), {}),
        ),
        (
            "_upsample_bicubic2d_aa",
            aten._upsample_bicubic2d_aa.default,
            lambda d: ((t((1, 1, 4, 4), d), [3, 3], False), {}),
        ),
        (
            "_upsample_bilinear2d_aa_backward",
            aten._upsample_bilinear2d_aa_backward.default,
            lambda d: ((t((1, 1, 3, 3), d), [3, 3], [1, 1, 4, 4], False), {}),
        ),
        (
            "multilabel_margin_loss_forward",
            aten.multilabel_margin_loss_forward.default,
            lambda d: ((t((2, 4), d), torch.tensor([[1, 0, -1, 0], [2, -1, 0, 0]]), 1), {}),
        ),
        (
            "multilabel_margin_loss_backward",
            aten.multilabel_margin_loss_backward.default,
            lambda d: (
                (t((), d), t((2, 4), d), torch.tensor([[1, 0, -1, 0], [2, -1, 0, 0]]), 1, torch.zeros(2, 4).to(d)),
                {},
            ),
        ),
        ("multi_margin_loss", aten.multi_margin_loss.default, lambda d: ((t((2, 4), d), torch.tensor([1, 2])), {})),
        ("_standard_gamma", aten._standard_gamma.default, lambda d: ((t((4,), d).abs() + 1,), {})),
        (
            "_standard_gamma_grad",
            aten._standard_gamma_grad.default,
            lambda d: ((t((4,), d).abs() + 1, t((4,), d).abs() + 1), {}),
        ),
        (
            "rrelu_with_noise-train",
            aten.rrelu_with_noise.default,
            lambda d: ((t((4,), d), torch.zeros(4).to(d), 0.1, 0.3, True), {}),
        ),
        (
            "rrelu_with_noise-eval",
            aten.rrelu_with_noise.default,
            lambda d: ((t((4,), d), torch.zeros(4).to(d), 0.1, 0.3, False), {}),
        ),
        ("polar", aten.polar.default, lambda d: ((t((4,), d).abs(), t((4,), d)), {})),
        ("complex", aten.complex.default, lambda d: ((t((4,), d), t((4,), d)), {})),
        ("polar-f32-with", aten.polar.default, lambda d: ((t((4,), F32).abs(), t((4,), d)), {})),
    ]
    special = (
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
    ops += [
        (f"special_{n}", getattr(aten, f"special_{n}").default, lambda d: ((t((4,), d).abs() + 0.5,), {}))
        for n in special
    ]
    polynomials = (
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
    ops += [
        (
            f"special_{n}",
            getattr(aten, f"special_{n}").default,
            lambda d: ((t((4,), d), torch.full((4,), 3.0).to(d)), {}),
        )
        for n in polynomials
    ]
    for name, func, make in ops:
        for d in FLOATS:
            yield Case(f"{name}[{tag(d)}]", "nokernel", func, _bind(make, d))
    # the euclidean matmul path of cdist (p=2, > 25 rows) has every float kernel
    for d in (BF16, F16):
        yield Case(f"_cdist_forward-p2-30rows[{tag(d)}]", "nokernel", aten._cdist_forward.default, _cdist(30, d, None))
        yield Case(f"_cdist_forward-p2-mm[{tag(d)}]", "nokernel", aten._cdist_forward.default, _cdist(3, d, 1))
    # complex FFTs: complex32 (f16 values) has no MKL kernel; complex64 does
    for cd, label in ((torch.complex64, "c64"), (torch.complex32, "c32")):
        yield Case(f"_fft_c2c[{label}]", "nokernel", aten._fft_c2c.default, _complex_fft(aten._fft_c2c.default, cd))
        yield Case(f"_fft_c2r[{label}]", "nokernel", aten._fft_c2r.default, _complex_fft(aten._fft_c2r.default, cd))


def all_cases() -> list[Case]:
    from .contract_cases_moe import moe_cases

    cases = [
        *_matmul(),
        *_conv(),
        *_norms(),
        *_attention(),
        *_embedding_index(),
        *_bincount(),
        *_inplace(),
        *_promotion(),
        *_edges(),
        *_losses(),
        *_no_kernel(),
        *moe_cases(),
    ]
    ids = [c.id for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ValueError(f"duplicate case ids: {sorted(dup)}")
    return cases
