"""The tracer: module attribution (forward and backward), provenance, autocast, fake CUDA."""

from __future__ import annotations

import torch
from torch import nn

from castwise import _autocast
from castwise.stories import STORIES
from castwise.trace import fake as fake_mod
from castwise.trace.backward import python_backward
from castwise.trace.tracer import Tracer, run, traced


class Up(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.up = Up()
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.up(self.a(x)).to(self.b.weight.dtype))


def _trace(
    model: nn.Module, x: torch.Tensor, mode: str = "train", device: str = "cpu", autocast: torch.dtype | None = None
) -> tuple[Tracer, object]:
    fmode = fake_mod.new_mode()
    copy = fake_mod.fake_model(model, fmode, device)
    fx = fake_mod.fake_input(x, fmode, device, {})
    tracer = Tracer(copy, device, fake=True, inputs=[("x", fx)])
    with fmode:
        if autocast is not None:
            with _autocast.autocast(device, autocast):
                trace = run(tracer, copy, (fx,), {}, mode, engine_backward=device == "cpu")
        else:
            trace = run(tracer, copy, (fx,), {}, mode, engine_backward=device == "cpu")
    return tracer, trace


def test_forward_ops_are_attributed_to_the_innermost_module() -> None:
    _, trace = _trace(Net(), torch.randn(2, 8), mode="eval")
    ops = [(module, op) for module, op, phase, _i, _o in trace.ops]  # type: ignore[attr-defined]
    assert ("a", "aten.addmm") in ops
    assert ("up", "aten._to_copy") in ops or ("up", "aten.mul") in ops
    assert ("b", "aten.addmm") in ops
    assert all(phase == "forward" for _m, _op, phase, _i, _o in trace.ops)  # type: ignore[attr-defined]


def test_backward_ops_are_attributed_through_node_metadata() -> None:
    _, trace = _trace(Net(), torch.randn(2, 8), mode="train")
    backward = [(module, op) for module, op, phase, _i, _o in trace.ops if phase == "backward"]  # type: ignore[attr-defined]
    assert backward, "train mode runs backward"
    modules = {m for m, _ in backward}
    # the weight gradients of both Linears are computed in backward and land on their modules
    assert {"a", "b"} <= modules
    assert ("b", "aten.mm") in backward


def _live(
    model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None
) -> tuple[Tracer, dict[str, torch.Tensor]]:
    """Run under the tracer and keep intermediate tensors alive (forward hooks of our own)."""
    fmode = fake_mod.new_mode()
    copy = fake_mod.fake_model(model, fmode, "cpu")
    fx = fake_mod.fake_input(x, fmode, "cpu", {})
    tracer = Tracer(copy, "cpu", fake=True, inputs=[("x", fx)])
    kept: dict[str, torch.Tensor] = {"x": fx}
    for name, module in copy.named_children():
        module.register_forward_hook(lambda m, a, o, name=name: kept.__setitem__(name, o))
    with fmode, traced(tracer), torch.no_grad():
        if autocast is not None:
            with _autocast.autocast("cpu", autocast):
                kept["out"] = copy(fx)
        else:
            kept["out"] = copy(fx)
    kept.update({n: p for n, p in copy.named_parameters()})
    return tracer, kept


def test_provenance_names_parameters_inputs_and_dtype_changing_ops() -> None:
    model = Net().to(torch.bfloat16)
    tracer, kept = _live(model, torch.randn(2, 8, dtype=torch.bfloat16))
    p = tracer.prov_of(kept["x"])
    assert p is not None and (p.kind, p.tensor) == ("input", "model input `x`")
    w = tracer.prov_of(kept["a.weight"])
    assert w is not None and (w.kind, w.module, w.tensor) == ("param", "a", "param a.weight")
    # `up` made float32 from bf16: its cast is the origin of its float32 output (a dtype-preserving
    # mul after it passes the origin on)
    up = tracer.prov_of(kept["up"])
    assert up is not None and (up.kind, up.module, up.op, up.dtype) == ("cast", "up", "aten._to_copy", torch.float32)
    # the bf16 output of `b` keeps the origin of the bf16 it was computed from (b's own parameters)
    out = tracer.prov_of(kept["out"])
    assert out is not None and out.dtype == torch.bfloat16 and out.module == "b"


def test_upcast_outside_autocast_is_recorded() -> None:
    model = Net().to(torch.bfloat16)
    _, trace = _trace(model, torch.randn(2, 8, dtype=torch.bfloat16), mode="eval")
    ups = trace.upcasts  # type: ignore[attr-defined]
    assert [u.module for u in ups] == ["up"]
    assert ups[0].in_dtype == torch.bfloat16


def test_cpu_autocast_is_seen_and_named_by_the_op_it_casts_for() -> None:
    _, trace = _trace(Net(), torch.randn(2, 8), mode="eval", autocast=torch.bfloat16)
    outs = [(m, op, o) for m, op, _p, _i, o in trace.rows() if op == "aten.addmm"]  # type: ignore[attr-defined]
    assert outs and all(o[0].startswith("bf16") for _m, _op, o in outs)
    tracer, kept = _live(Net(), torch.randn(2, 8), autocast=torch.bfloat16)
    a = tracer.prov_of(kept["a"])
    assert a is not None and (a.kind, a.module, a.op, a.dtype) == ("autocast", "a", "aten.addmm", torch.bfloat16)


def test_fake_cuda_uses_cuda_autocast_rules_and_runs_backward() -> None:
    block = STORIES[3].build()[0].blocks[0]
    x = torch.randn(2, 16, 64)
    _, trace = _trace(block, x, mode="train", device="cuda", autocast=torch.bfloat16)
    ops = trace.rows()  # type: ignore[attr-defined]
    norms = [o for m, op, _p, _i, o in ops if op == "aten.native_layer_norm" and m == "attn.q_norm"]
    # CUDA autocast runs layer_norm in float32 (CPU autocast would keep bf16)
    assert norms and norms[0][0].startswith("f32")
    assert trace.error is not None  # type: ignore[attr-defined]
    assert "fused_attention" in str(trace.error)  # type: ignore[attr-defined]


def test_python_backward_matches_the_engine_on_real_tensors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    x = torch.randn(5, 4)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    tracer = Tracer(model, "cpu", fake=False)
    loss = model(x).sum()
    python_backward(tracer.at, [loss], [None])
    for p, want in zip(model.parameters(), expected, strict=True):
        assert p.grad is not None and torch.allclose(p.grad, want)


def test_global_hooks_leave_the_encoder_fast_path_on_and_its_error_real() -> None:
    story = STORIES[2]
    model, (x, mask) = story.build()
    model.eval()
    tracer = Tracer(model, "cpu", fake=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trace = run(tracer, model, (x, mask), {}, "eval", engine_backward=True)
    ops = [op for _m, op, *_ in trace.ops]
    assert "aten._nested_tensor_from_mask" in ops  # the fast path was taken under the tracer
    assert trace.error is not None and "BFloat16" in str(trace.error)
    assert trace.failure is not None and trace.failure.op == "aten._transformer_encoder_layer_fwd"
    assert trace.failure.module == "encoder.layers.0"


def test_a_per_module_hook_would_have_hidden_the_fast_path() -> None:
    # the control for the test above: why the tracer uses global hooks only
    model, (x, mask) = STORIES[2].build()
    model.eval()
    model.encoder.layers[0].register_forward_hook(lambda m, a, o: None)
    tracer = Tracer(model, "cpu", fake=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trace = run(tracer, model, (x, mask), {}, "eval", engine_backward=True)
    # layer 0 leaves its fast path: the story's real failure is replaced by a different one
    assert "aten._transformer_encoder_layer_fwd" not in [op for _m, op, *_ in trace.ops]
    assert trace.failure is None or trace.failure.op != "aten._transformer_encoder_layer_fwd"


def test_fake_copy_shares_no_weights_keeps_ties_and_targets_the_device() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as in language models
    model.register_buffer("scale", torch.ones(4))
    fmode = fake_mod.new_mode()
    copy = fake_mod.fake_model(model, fmode, "cuda")
    params = list(copy.parameters())
    assert len(params) == 1 and copy[1].weight is copy[0].weight  # the tie survives
    assert all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in (*params, *copy.buffers()))
    assert isinstance(params[0], nn.Parameter) and params[0].requires_grad
    assert copy[0] is not model[0] and next(model.parameters()).device.type == "cpu"
