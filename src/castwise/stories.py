"""The five stories as small, self-contained models (for `castwise demo` and the tests).

Each story is a real failure reported in a widely used project; the models here rebuild it
locally from configs (nothing is downloaded). A story returns ``(model, inputs)`` like a
``castwise audit`` target, and knows how the user ran it (policy, device, mode), what a
correct diagnosis names, and how to run it for real on this machine's CPU.

Stories 1 and 2 need ``open_clip_torch`` and ``transformers`` (``pip install castwise[demo]``);
the others need only torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from castwise._dtypes import is_low
from castwise.run import tensors_of

Inputs = Any  # a tensor, a tuple of positional args or a dict of keyword args


@dataclass(frozen=True)
class Story:
    number: int
    slug: str
    title: str
    summary: str
    build: Callable[[], tuple[nn.Module, Inputs]]
    policy: str | None  # how the user runs it
    device: str  # the device the user deploys on
    mode: str  # "train" | "eval"
    module: str  # where the failure shows
    origin: str | None = None  # where the dtype came from, when elsewhere
    compute: torch.dtype | None = None  # the low-precision dtype a fix must keep
    requires: tuple[str, ...] = ()  # import names of optional libraries
    extra: dict[str, Any] = field(default_factory=dict)

    def missing(self) -> list[str]:
        """Optional libraries this story needs that are not installed or fail to import."""
        return [name for name in self.requires if unavailable(name) is not None]

    def unavailable(self) -> list[str]:
        """Why each optional library this story needs cannot be used (``unavailable``)."""
        return [why for why in map(unavailable, self.requires) if why is not None]

    def run_real(self, model: nn.Module | None = None, inputs: Inputs = None) -> Any:
        """Run the story on real CPU tensors the way the user did (raises the user's error)."""
        if model is None:
            model, inputs = self.build()
        return run_as_user(model, inputs, self.policy, self.mode)


def unavailable(name: str) -> str | None:
    """Why the optional library ``name`` cannot be used, or None when it imports. Installed is
    not enough: open_clip with a torchvision built for another torch raises on import."""
    try:
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install 'castwise[demo]')"
        importlib.import_module(name)
    except Exception as exc:  # whatever its import raises: ImportError, RuntimeError, AttributeError...
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{name} is installed but fails to import ({type(exc).__name__}: {first}); repair that install"
    return None


def call(model: nn.Module, inputs: Inputs) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def first_tensor(out: Any) -> torch.Tensor | None:
    return next(iter(tensors_of(out)), None)


def run_as_user(model: nn.Module, inputs: Inputs, policy: str | None, mode: str) -> Any:
    """Eval: model.eval() under no_grad; train: forward and backward of a float32 sum.
    A ``*-mixed`` policy runs under CPU autocast, as Lightning does."""
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(policy or "")
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else _null()
    if mode == "eval":
        model.eval()
        with torch.no_grad(), ctx:
            return call(model, inputs)
    model.train()
    with ctx:
        out = call(model, inputs)
    t = first_tensor(out)
    if t is not None:
        t.float().sum().backward()  # type: ignore[no-untyped-call]  # float32 reduction: the loss is not where the dtype goes wrong
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- story 1: OpenCLIP, fp32 LayerNorm cast to bf16 -------------------------------------------


def build_openclip() -> tuple[nn.Module, Inputs]:
    import open_clip

    torch.manual_seed(0)
    # precision="bf16" builds LayerNormFp32 islands; the user then casts everything to bf16
    model = open_clip.create_model("ViT-B-32", pretrained=None, precision="bf16", device="cpu")
    model = model.to(torch.bfloat16)
    image = torch.randn(1, 3, 224, 224, dtype=torch.bfloat16)
    text = torch.randint(0, 49408, (1, 77))
    return model, (image, text)


# -- story 2: T5 in float16, wo kept float32 leaks into the residual stream --------------------


class StrictRMSNorm(nn.Module):
    """An RMSNorm with a fused kernel's dtype contract (apex FusedRMSNorm, which transformers
    uses for T5LayerNorm when apex is installed): input dtype must equal weight dtype."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            raise RuntimeError(f"expected scalar type {self.weight.dtype} but found {x.dtype}")
        out: torch.Tensor = nn.functional.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return out


def build_t5() -> tuple[nn.Module, Inputs]:
    from transformers import T5Config, T5EncoderModel
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4)
    with tempfile.TemporaryDirectory() as folder:
        # save + from_pretrained(dtype=float16) is the path that keeps `wo` in float32
        T5EncoderModel(config).save_pretrained(folder)
        model = T5EncoderModel.from_pretrained(folder, dtype=torch.float16)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, T5LayerNorm):
                setattr(parent, name, StrictRMSNorm(child.weight, child.variance_epsilon))
    return model, {"input_ids": torch.randint(0, 128, (2, 7))}


def build_t5_overflow() -> tuple[nn.Module, Inputs]:
    """A float32 T5 encoder whose block 2 `wo` has weight columns past float16's range (65504),
    with the matching `wi` rows scaled down, so float32 computes an ordinary function. Under
    16-true (`keep_in_fp32=off`) those weights become inf and `wo` makes nan; a float32 `wo`
    island fixes it. (Pretrained T5's float16 overflow, why transformers keeps `wo` in float32,
    is in large activations, planted here in the weights: an output past 65504 itself cannot
    be fixed by any island whose output returns to float16.)"""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=6, num_heads=4, dropout_rate=0.0)
    model = T5EncoderModel(config)
    ff = model.get_submodule("encoder.block.2.layer.1.DenseReluDense")
    with torch.no_grad():
        cols = torch.tensor([3, 17])
        ff.get_parameter("wi.weight")[cols] *= 1e-6
        ff.get_parameter("wo.weight")[:, cols] *= 1e6
    return model, {"input_ids": torch.randint(0, 128, (4, 16))}


# -- story 3: nn.TransformerEncoder, bf16-mixed, eval takes the fast path -----------------------


class PoseAutoEncoder(nn.Module):
    def __init__(self, dims: int = 24, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(dims, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(hidden, dims)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.proj(x), src_key_padding_mask=padding_mask))
        return out


def build_encoder() -> tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    model = PoseAutoEncoder()
    x = torch.randn(4, 10, 24)
    padding_mask = torch.zeros(4, 10, dtype=torch.bool)
    padding_mask[1, 7:] = True
    return model, (x, padding_mask)


# -- story 4: q/k LayerNorm hands float32 to a bf16-only kernel under CUDA autocast -----------


def _check_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not is_low(q.dtype) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            "fused_attention: query/key/value should all be float16 or bfloat16 and share a dtype, "
            f"got query.dtype={q.dtype} key.dtype={k.dtype} value.dtype={v.dtype}"
        )


@torch.library.custom_op("castwise_stories::fused_attention", mutates_args=())
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for xFormers' memory_efficient_attention (no CPU build): same dtype contract,
    enforced by both the real and the fake implementation."""
    _check_fused(q, k, v)
    return nn.functional.scaled_dot_product_attention(q, k, v)


@fused_attention.register_fake
def _fused_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    _check_fused(q, k, v)
    return torch.empty_like(q)


def _fused_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = nn.functional.scaled_dot_product_attention(*leaves)
        return tuple(torch.autograd.grad(out, leaves, grad))


def _fused_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


fused_attention.register_autograd(_fused_backward, setup_context=_fused_setup)


class QKNormAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(dim // heads)
        self.k_norm = nn.LayerNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        y = fused_attention(q, k, v)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class DiTBlock(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = QKNormAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.attn(self.norm(x))
        return out


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_dit() -> tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    return TinyDiT(), (torch.randn(2, 16, 64),)


# -- story 5: SimpleTuner config, bf16 weights with fp32 gradient precision --------------------

SIMPLETUNER_ENV = """\
export MODEL_TYPE="full"
export MODEL_NAME="black-forest-labs/FLUX.1-dev"
export MIXED_PRECISION="bf16"
export TRAINING_DYNAMO_BACKEND="no"
export LEARNING_RATE=1e-5
export TRAIN_BATCH_SIZE=1
export TRAINER_EXTRA_ARGS="--base_model_precision=bf16"
export TRAINER_EXTRA_ARGS="${TRAINER_EXTRA_ARGS} --max_grad_norm=1.0 --gradient_precision=fp32"
"""


STORIES: tuple[Story, ...] = (
    Story(
        1,
        "openclip-layernorm-bf16",
        "OpenCLIP: the fp32 LayerNorm that was cast to bf16",
        "open_clip built with precision='bf16', then model.to(torch.bfloat16) by the user",
        build_openclip,
        None,
        "cpu",
        "eval",
        "visual.ln_pre",
        None,
        torch.bfloat16,
        ("open_clip",),
    ),
    Story(
        2,
        "t5-fp16-keep-fp32-wo",
        "CogVideoX/T5: float32 `wo` leaks into the float16 stream",
        "T5 encoder loaded in float16 keeps `wo` in float32; a fused norm refuses the float32",
        build_t5,
        None,
        "cpu",
        "eval",
        "encoder.block.1.layer.0.layer_norm",
        "encoder.block.0.layer.1.DenseReluDense.wo",
        torch.float16,
        ("transformers",),
    ),
    Story(
        3,
        "encoder-eval-fastpath",
        "Lightning bf16-mixed: training works, validation crashes",
        "nn.TransformerEncoder under bf16 autocast: eval takes the fused fast path",
        build_encoder,
        "bf16-mixed",
        "cpu",
        "eval",
        "encoder.layers.0",
        None,
        torch.bfloat16,
    ),
    Story(
        4,
        "qk-norm-fp32-into-bf16-kernel",
        "xFormers: a q/k LayerNorm hands float32 to a bf16 kernel",
        "layer_norm runs in float32 under CUDA autocast; the fused kernel takes only bf16/f16",
        build_dit,
        "bf16-mixed",
        "cuda",
        "train",
        "blocks.0.attn",
        "blocks.0.attn.q_norm",
        torch.bfloat16,
    ),
)
