"""Real cases of non-finite values, small enough for unit tests (each a model and its inputs)."""

from __future__ import annotations

import torch
from torch import nn


def t5_encoder(scale: float = 30000.0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A transformers T5 encoder in float16 whose first block's `wo` has weights scaled as in
    pretrained T5 checkpoints (large `wo`, the reason transformers keeps it in float32)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        feed_forward_proj="relu",
    )
    model = T5EncoderModel(config)
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(scale)
    ids = torch.randint(0, 64, (2, 12))
    return model, {"input_ids": ids}


class Attention(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, fill: float = float("-inf")) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # no 1/sqrt(d): the scores grow with the scale
        if mask is not None:
            scores = scores.masked_fill(mask, fill)
        return scores.softmax(-1) @ self.v(x)


class AttnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.attn = Attention()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.attn(self.embed(x), mask))


def attention_scores_overflow() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = AttnModel()
    with torch.no_grad():
        model.attn.q.weight.mul_(300.0)
        model.attn.k.weight.mul_(300.0)
    return model.half(), (torch.randn(2, 6, 8).half(),)


def softmax_all_masked_row() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mask = torch.zeros(2, 6, 6, dtype=torch.bool)
    mask[1, 2, :] = True  # a query that may attend to nothing
    return AttnModel(), (torch.randn(2, 6, 8), mask)


class Classifier(nn.Module):
    """Loss computed from probabilities by hand: log(0) where a probability is exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.loss = NLLFromProbs()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.relu(self.body(x)).softmax(-1) * (self.body(x) > -1e9), y)


class NLLFromProbs(nn.Module):
    def forward(self, probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        picked = probs.gather(1, y[:, None]).squeeze(1)
        return -torch.log(picked * (y != 0)).mean()  # class 0 is "ignored" by zeroing: log(0)


def log_of_zero_in_loss() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Classifier(), (torch.randn(4, 8), torch.tensor([1, 0, 2, 3]))


class ExpHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.rate = Rate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rate(self.lin(x))


class Rate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x).sum(-1)  # a Poisson rate without a clamp


def exp_overflow(scale: float) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """scale 1.2 in float16: exp(~20) passes 65504 but not float32's range (precision); scale
    10 in float32: exp(~200) passes float32's range too (a bug)."""
    torch.manual_seed(0)
    model = ExpHead()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.fill_(17.0 * scale)
    x = torch.randn(2, 8)
    return (model.half(), (x.half(),)) if scale < 5 else (model, (x,))


class HandNorm(nn.Module):
    """A LayerNorm written by hand, computing its variance in the input's dtype, without eps."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(-1, keepdim=True)
        var = centered.pow(2).mean(-1, keepdim=True)  # underflows to 0 in float16 for small x
        return self.weight * centered / var.sqrt()


class NormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = HandNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def layernorm_variance_fp16() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = NormModel()
    with torch.no_grad():
        model.proj.weight.mul_(1e-4)
        model.proj.bias.zero_()
    return model.half(), (torch.randn(3, 16).half(),)


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


class GradAmplifier(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleGrad.apply(self.lin(x), self.factor)  # type: ignore[no-any-return]


class SqrtAtZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(torch.relu(x) - torch.relu(x))  # forward finite, gradient 1/(2*sqrt(0))


def backward_overflow_fp16() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GradAmplifier(1e6), nn.Linear(8, 1))
    return model.half(), (torch.randn(2, 8).half(),)


def backward_sqrt_at_zero() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), SqrtAtZero(), nn.Linear(8, 1)), (torch.randn(2, 8),)


def small_gradients() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A model whose loss is tiny: its gradients sit below float16's smallest subnormal."""
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x))) * 1e-7

    return Tiny(), (torch.randn(4, 16),)


def norm_backward_overflow() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A gradient passing 65504 inside torch's LayerNorm (which computes in float32 inside), in its
    own backward (the forward wrapped, as a hook would)."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(8)
    inner = norm.forward
    norm.forward = lambda x: ScaleGrad.apply(inner(x), 1e6)  # type: ignore[method-assign, assignment]
    return nn.Sequential(nn.Linear(8, 8), norm, nn.Linear(8, 1)), (torch.randn(4, 8),)
