"""Real models from configs (no weights downloaded) and planted precision-sensitive modules,
for benchmarks/bench_numerics_compare.py and bench_numerics_tune.py."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Builder = Callable[[int], tuple[nn.Module, Any]]


# -- plants: a module wrapping a Linear/Conv whose own ops are precision-sensitive ----------


class Plant(nn.Module):
    kind = "plant"

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:  # models that read their Linear's weight (T5 reads wo.weight.dtype)
        weight: torch.Tensor = self.inner.weight
        return weight

    def op(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.op(self.inner(*args, **kwargs))


class Cancel(Plant):
    """Catastrophic cancellation: (h + s) - s, s = 64 max|h|."""

    kind = "cancellation"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        s = 64 * h.detach().abs().amax()
        return (h + s) - s


class OnePassNorm(Plant):
    """A normalisation with a one-pass variance E[g^2] - E[g]^2 of offset activations."""

    kind = "one-pass-variance-norm"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        g = h + 16 * h.detach().abs().amax()
        dims = tuple(range(1, h.dim()))  # all but the batch: a 1x1 conv output has a last dim of 1
        mu = g.mean(dims, keepdim=True)
        var = (g * g).mean(dims, keepdim=True) - mu * mu
        return (g - mu) * torch.rsqrt(var.abs() + 1e-6) * h.detach().std()


class TinyEpsNorm(Plant):
    """An RMS normalisation of small activations with epsilon 1e-12 (zero in float16)."""

    kind = "tiny-eps-norm"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        g = h * 1e-4
        dims = tuple(range(1, h.dim()))
        return g / torch.sqrt(g.pow(2).mean(dims, keepdim=True) + 1e-12) * h.detach().std()


class LargeProjection(Plant):
    """A large-magnitude intermediate: h scaled past float16's range, then back."""

    kind = "large-magnitude-projection"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        k = 4 * 65504.0 / float(h.detach().abs().amax().clamp_min(1e-12))
        return (h * k) * (1.0 / k)


def _tiny_eps_rms(h: torch.Tensor) -> torch.Tensor:
    g = h * 1e-4
    return g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-12) * h.detach().std()


def plant_inline(model: nn.Module, name: str) -> None:
    """``inline-rmsnorm-tiny-eps``: the module ``name`` (one with children: an attention, an MLP,
    a block) normalises its output inline, in its own forward, with an RMSNorm of epsilon 1e-12
    (zero in float16) on small activations: the fault is the module's own ops, not a child's."""
    module = model.get_submodule(name)
    cls = type(module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = cls.forward(self, *args, **kwargs)
        return _tiny_eps_rms(out) if isinstance(out, torch.Tensor) else (_tiny_eps_rms(out[0]), *out[1:])

    module.__class__ = type(f"InlineNorm{cls.__name__}", (cls,), {"forward": forward})


def inline_parents(model: nn.Module, inputs: Any) -> list[str]:
    """Modules with children (not containers) whose output is a floating tensor or a tuple led by one."""
    from castwise.run import Inputs

    outs: dict[str, Any] = {}
    names = [
        n
        for n, m in model.named_modules()
        if n and any(True for _ in m.children()) and not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict))
    ]
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o)) for n in names]
    try:
        with torch.no_grad():
            Inputs.of(inputs).call(model)
    finally:
        for h in hooks:
            h.remove()

    def led(o: Any) -> bool:
        first = o[0] if isinstance(o, tuple) and o else o
        return isinstance(first, torch.Tensor) and first.is_floating_point()

    return [n for n in names if led(outs.get(n))]


PLANTS: dict[str, tuple[type[Plant], ...]] = {
    "bf16-mixed": (Cancel, OnePassNorm),
    "16-true": (Cancel, OnePassNorm, TinyEpsNorm, LargeProjection),
}


def plantable(model: nn.Module) -> list[str]:
    """Linear / Conv / transformers Conv1D modules called as modules (not MHA's out_proj)."""
    out = []
    for name, module in model.named_modules():
        if not name or "out_proj" in name:
            continue
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) or type(module).__name__ == "Conv1D":
            out.append(name)
    return out


def plant(model: nn.Module, name: str, cls: type[Plant]) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, cls(getattr(parent, child)))


def choose(model: nn.Module, policy: str, rng: random.Random) -> tuple[str, type[Plant]]:
    """A module outside the policy's own float32 islands (T5's `wo` is one under 16-true: a plant
    there computes in float32 and is not sensitive) and a plant."""
    from castwise.policy import Policy, resolve

    kept = [n for n, d in resolve(Policy.parse(policy), model).items() if d.island == torch.float32]
    names = [n for n in plantable(model) if not any(n == k or n.startswith(k + ".") for k in kept)]
    return rng.choice(names), rng.choice(PLANTS[policy])


# -- models ----------------------------------------------------------------------------------


BIG = {"on": False}  # larger inputs, for timing: compute, not Python, dominates


def _ids(seed: int, vocab: int = 100) -> torch.Tensor:
    batch, length = (8, 64) if BIG["on"] else (2, 16)
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _image(seed: int, size: int = 32) -> torch.Tensor:
    batch, size = (8, 2 * size) if BIG["on"] else (2, size)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def bert(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return BertModel(cfg, add_pooling_layer=False), {"input_ids": _ids(seed)}


def gpt2(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        vocab_size=100, n_embd=64, n_layer=layers, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2Model(cfg), {"input_ids": _ids(seed)}


def llama(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaModel(cfg), {"input_ids": _ids(seed)}


def t5(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_heads=4)
    return T5EncoderModel(cfg), {"input_ids": _ids(seed)}


def vit(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=64 if BIG["on"] else 32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return ViTModel(cfg, add_pooling_layer=False), {"pixel_values": _image(seed)}


def timm_convnext(seed: int, layers: int = 0) -> tuple[nn.Module, Any]:
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=10), (_image(seed),)


def timm_vit(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    import timm

    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=10,
        img_size=64 if BIG["on"] else 32,
        patch_size=8,
        depth=layers,
    )
    return model, (_image(seed),)


def tv_resnet(seed: int, layers: int = 0) -> tuple[nn.Module, Any]:
    import torchvision

    # 64x64: layer4's batch norms see 2x2 positions (at 32x32, one: a batch of 2 values is noise)
    return torchvision.models.resnet18(num_classes=10), (_image(seed, 64),)


def tv_mobilenet(seed: int, layers: int = 0) -> tuple[nn.Module, Any]:
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=10), (_image(seed, 64),)


def nn_encoder(seed: int, layers: int = 2) -> tuple[nn.Module, Any]:
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(64, 8)
    )
    batch, length = (8, 64) if BIG["on"] else (2, 16)
    return model, (torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(seed)),)


MODELS: dict[str, Builder] = {
    "bert": bert,
    "gpt2": gpt2,
    "llama": llama,
    "t5": t5,
    "vit": vit,
    "timm-convnext": timm_convnext,
    "timm-vit": timm_vit,
    "tv-resnet18": tv_resnet,
    "tv-mobilenet": tv_mobilenet,
    "nn-encoder": nn_encoder,
}


def build(name: str, seed: int, big: bool = False, **kwargs: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    BIG["on"] = big
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name](seed, **kwargs)
