"""``castwise.apply`` and ``torch.compile`` in either order (also ``fullgraph=True``): the policy's
selectors name the user's modules, Dynamo traces the forwards apply installs, and the compiled
model computes what the applied eager model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise
from castwise.applied import applied_to
from castwise.errors import AuditError

POLICY = "bf16-true,keep[head]=f32"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(x))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_apply_before_or_after_compile_runs_the_policy() -> None:
    x = torch.randn(4, 8)
    reference = _net()
    castwise.apply(reference, POLICY)
    want = reference(x)
    for order in ("before", "after"):
        for fullgraph in (False, True):
            model = _net()
            if order == "before":
                castwise.apply(model, POLICY)
                compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
            else:
                compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
                castwise.apply(compiled, POLICY)
            out = compiled(x)
            out.float().sum().backward()
            where = f"apply {order} compile, fullgraph={fullgraph}"
            assert model.body.weight.dtype == torch.bfloat16, where
            assert model.head.weight.dtype == torch.float32, where  # `head`, not `_orig_mod.head`
            assert model.body.weight.grad is not None and model.body.weight.grad.dtype == torch.bfloat16, where
            assert out.dtype == want.dtype, where
            torch.testing.assert_close(out, want, msg=where)


def test_remove_after_compile_gives_the_model_back() -> None:
    model = _net()
    x = torch.randn(4, 8)
    want = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    applied = castwise.apply(compiled, POLICY)
    assert applied_to(compiled) is applied and applied_to(model) is applied
    assert compiled(x).dtype == torch.bfloat16
    with pytest.raises(AuditError, match=r"under castwise\.apply"):
        castwise.audit(compiled, x)
    applied.remove()
    assert applied_to(compiled) is None
    out = compiled(x)  # recompiled for the forwards as they were
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(out, want)


def _gpt2() -> nn.Module:
    """HF GPT-2 from a toy config: its loss logs a warning (``loss_function``), a graph break
    inside the forward that apply's autocast block surrounds."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_mixed_policy_compiles_across_a_graph_break_in_the_forward() -> None:
    """After a graph break inside apply's autocast block, the block runs eagerly and Dynamo
    compiles each function it calls: a restore made by a call became a graph that only sets the
    autocast state, which AOTAutograd refuses (BackendCompilerFailed), whenever the policy's dtype
    is not the device's default (16-mixed on CPU; bf16-mixed on CUDA)."""
    ids = torch.randint(0, 64, (2, 8))
    model = _gpt2()
    castwise.apply(model, "16-mixed")
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.float32
    assert model.lm_head.weight.grad is not None
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and not torch.is_autocast_enabled("cpu")


def test_a_graph_break_in_one_applied_model_leaves_the_next_compile_whole() -> None:
    """apply's forward is one code object for every model it wraps. Where Dynamo could not resume
    after a graph break inside its autocast block, it skipped that code for good: every later
    compile of any applied model ran the policy's forward eagerly, and fullgraph=True silently
    gave two graphs. torch.autocast is a block Dynamo resumes in."""
    ids = torch.randint(0, 64, (2, 8))
    gpt2 = _gpt2()
    castwise.apply(gpt2, "bf16-mixed")
    torch.compile(gpt2, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    model = _net()
    castwise.apply(model, "bf16-mixed")
    out = torch.compile(model, backend=counting, fullgraph=True)(torch.randn(4, 8))
    assert len(graphs) == 1  # the policy's forward and the model's, one graph
    assert out.dtype == torch.float32 and model.body.weight.dtype == torch.float32


def test_an_applied_mixed_policy_exports() -> None:
    """torch.export traces apply's forward as Dynamo does: the policy's autocast is a region of the
    exported program (before, the state set directly made export refuse the program's dtypes)."""
    model = _net()
    castwise.apply(model, "bf16-mixed")
    x = torch.randn(4, 8)
    exported = torch.export.export(model, (x,))
    ops = [getattr(n.target, "__name__", str(n.target)) for n in exported.graph.nodes if n.op == "call_function"]
    assert "wrap_with_autocast" in ops, ops  # the policy's region
    out = exported.module()(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x))
