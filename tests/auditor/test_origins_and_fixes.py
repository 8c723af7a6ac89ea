"""The right origin and a verified fix where the fault is not where it shows.

- a gradient hook registered on an activation (in a forward hook) is blamed on the module whose
  code registered it, not the model's top level;
- a hook's fix is a code change (its ``return`` cast back), verified by a re-audit with the change
  simulated (``CodeFix.verified``), and the real run with that line changed passes;
- a tied Parameter names every module holding it (a cast through any of them changed it);
- a module left in float64 gets a float32 island at that module, not where the float64 arrives;
- a fault in one repeated block gets a rule for that block only; an ``nn.Sequential`` child's
  index is a selector of its own.

Each fixture is checked against the real CPU run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise.auditor.suggest import fixes
from castwise.policy import Policy
from castwise.report import Finding
from castwise.rules.audit._fixes import selector_for

BF16 = torch.bfloat16


def grad_to_f32(grad: torch.Tensor) -> torch.Tensor:
    return grad.float()


def grad_to_f32_fixed(grad: torch.Tensor) -> torch.Tensor:
    return grad.float().to(grad.dtype)  # the line castwise's code fix names


def hook_output_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    if output.requires_grad:
        output.register_hook(grad_to_f32)


def hook_output_grad_fixed(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    if output.requires_grad:
        output.register_hook(grad_to_f32_fixed)


def output_to_f32(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def output_to_f32_fixed(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.float().to(output.dtype)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4))
    return blocks.to(BF16)


def _x() -> torch.Tensor:
    return torch.randn(2, 8, dtype=BF16, generator=torch.Generator().manual_seed(0))


def _train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().sum().backward()


def test_an_activation_gradient_hook_is_blamed_on_the_module_that_registered_it() -> None:
    model = _mlp()
    model[1].register_forward_hook(hook_output_grad)
    report = castwise.audit(model, _x(), mode="train")
    (f,) = report.errors
    assert (f.code, f.module) == ("CW115", "1")  # was CW112 at the model's top level
    assert f.origin is not None and f.origin.module == "1" and f.origin.tensor == "tensor bf16[2, 8]"
    assert "grad_to_f32" in f.message and "hook 'grad_to_f32'" in f.message  # torch's own wording
    assert dict(f.details)["hook"] == "grad_to_f32"
    with pytest.raises(RuntimeError, match="has changed the type of value"):  # the real run agrees
        _train_step(model, _x())


def test_a_gradient_hook_code_fix_is_verified_and_the_changed_line_runs() -> None:
    model = _mlp()
    model[1].register_forward_hook(hook_output_grad)
    report = castwise.audit(model, _x(), mode="train")
    (f,) = report.errors
    fix = f.code_fix
    assert fix is not None and fix.verified
    assert fix.replace.strip() == "return grad.float().to(grad.dtype)"
    assert fix.original is not None and fix.original.strip() == "return grad.float()"
    assert fix.file.endswith("test_origins_and_fixes.py")
    data = json.loads(report.to_json())
    (entry,) = [e for e in data["findings"] if e["code"] == "CW115"]
    assert entry["code_fix"]["verified"] is True and entry["hook"] == "grad_to_f32"
    assert "(verified by a re-audit)" in " ".join(str(report).split())
    fixed = _mlp()  # the same model with the line changed as the code fix says: trains for real
    fixed[1].register_forward_hook(hook_output_grad_fixed)
    _train_step(fixed, _x())


def test_a_parameter_gradient_hook_code_fix_is_verified() -> None:
    model = _mlp()
    model[2].weight.register_hook(grad_to_f32)
    report = castwise.audit(model, _x(), mode="train")
    (f,) = report.errors
    assert (f.code, f.module) == ("CW115", "2") and f.code_fix is not None and f.code_fix.verified
    fixed = _mlp()
    fixed[2].weight.register_hook(grad_to_f32_fixed)
    _train_step(fixed, _x())


def test_a_forward_hook_code_fix_is_verified_and_the_changed_line_runs() -> None:
    model = _mlp()
    model[1].register_forward_hook(output_to_f32)
    report = castwise.audit(model, _x(), mode="both")
    (f,) = report.errors
    assert f.code == "CW115" and f.origin is not None and f.origin.module == "1"
    assert f.code_fix is not None and f.code_fix.verified
    assert f.code_fix.replace.strip() == "return output.float().to(output.dtype)"
    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        model(_x())
    fixed = _mlp()
    fixed[1].register_forward_hook(output_to_f32_fixed)
    _train_step(fixed, _x())


class _TopLevelTable(nn.Module):
    """A float32 table made at the top level (no module rule reaches it) plus a hooked layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.ones(8))  # default dtype float32 against bf16


def test_a_code_fix_whose_re_audit_still_fails_is_not_verified() -> None:
    model = _TopLevelTable().to(BF16)
    model.a.weight.register_hook(grad_to_f32)
    report = castwise.audit(model, _x(), mode="train")
    hooked = [f for f in report.errors if f.code == "CW115"]
    assert len(report.errors) > len(hooked)  # the table's own error stays after the hook's fix
    for f in hooked:
        assert f.code_fix is None or not f.code_fix.verified


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8))  # most weights: the model's dtype
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # weight tying

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_a_tied_weight_finding_names_every_module_holding_it() -> None:
    torch.manual_seed(0)
    model = _Tied().to(BF16)
    model.embed.float()  # the user changed the embedding; the head holds the same Parameter
    ids = torch.randint(0, 16, (2, 5))
    report = castwise.audit(model, ids, mode="eval")
    first = report.sorted_findings()[0]
    assert first.level == "error" and first.origin is not None
    named = {first.origin.module, *dict(first.details).get("culprit_modules", ())}
    assert {"embed", "head"} <= named
    with pytest.raises(RuntimeError), torch.no_grad():  # the real run fails too
        model(ids)


class _Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.embed(ids)))


def test_a_float64_module_under_autocast_gets_an_island_at_that_module_verified_for_real() -> None:
    torch.manual_seed(0)
    model = _Doubled()
    model.embed.double()
    ids = torch.randint(0, 16, (2, 5))
    report = castwise.audit(model, ids, policy="bf16-mixed")
    assert report.errors and not any(f.code == "CW114" for f in report.findings)  # autocast was not off
    assert str(report.suggested_policy) == "bf16-mixed,keep[embed]=f32"
    with pytest.raises(RuntimeError):  # the real run under the user's policy fails
        applied = castwise.apply(model, "bf16-mixed")
        try:
            _train_step(model, ids)
        finally:
            applied.remove()
    applied = castwise.apply(model, report.suggested_policy)
    try:
        _train_step(model, ids)
    finally:
        applied.remove()


def _finding(module: str, *also: str) -> Finding:
    details = (("also_at", list(also)),) if also else ()
    return Finding(code="CW109", message="m", module=module, details=details)


def test_a_fault_in_one_block_gets_a_rule_for_that_block_only() -> None:
    assert selector_for("layers.3.norm", _finding("layers.3.norm")) == "layers.3.norm"
    assert selector_for("layers.3.norm", _finding("layers.3.norm", "layers.4.norm")) == "layers.*.norm"
    assert selector_for("2", _finding("2", "5")) == "2"  # an nn.Sequential child: never "*"
    policy = fixes(Policy.parse("bf16-true"), [_finding("layers.3.norm")], BF16)
    assert str(policy) == "bf16-true,keep[layers.3.norm]=f32"


def test_an_island_in_an_nn_sequential_child_is_suggested_and_runs_for_real() -> None:
    class Upcast(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.float())

    torch.manual_seed(0)
    model = nn.Sequential(Upcast(8, 8), nn.ReLU(), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(BF16)
    model[0].float()  # a float32 island without a cast back
    report = castwise.audit(model, _x())
    assert report.errors and report.errors[0].origin is not None and report.errors[0].origin.module == "0"
    assert str(report.suggested_policy) == "bf16-true,keep[0]=f32"
    applied = castwise.apply(model, report.suggested_policy)
    try:
        _train_step(model, _x())
    finally:
        applied.remove()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16)
        self.k_proj = nn.Linear(16, 16)
        self.v_proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).view(2, 5, 2, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = (q * 0.5).contiguous() + 0.0  # ops after the projections: q/k/v are not the last tensors made
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(2, 5, 16))


class _UpcastK(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())  # kept f32, output not cast back


def test_sdpa_refusing_q_k_v_blames_the_projection_off_the_models_dtype() -> None:
    torch.manual_seed(0)
    model = _Attention().to(BF16)
    model.k_proj.__class__ = _UpcastK
    model.k_proj.float()
    x = torch.randn(2, 5, 16, dtype=BF16)
    report = castwise.audit(model, x, mode="eval")
    first = report.errors[0]
    assert first.origin is not None and first.origin.module == "k_proj"
    assert "receives ," not in first.message
    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        model(x)
    applied = castwise.apply(model, report.suggested_policy)
    try:
        _train_step_3d(model, x)
    finally:
        applied.remove()


def _train_step_3d(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().sum().backward()


class _NoAutocastConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):  # an un-decorated custom op does this
            return super().forward(x)


def test_a_layer_that_turns_autocast_off_itself_is_the_region_and_gets_the_island() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), _NoAutocastConv(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(1, 3, 12, 12)
    report = castwise.audit(model, x, policy="bf16-mixed")
    first = report.errors[0]
    assert first.code == "CW114" and first.origin is not None and first.origin.module == "2"
    assert str(report.suggested_policy) == "bf16-mixed,keep[2]=f32"
    for policy in ("bf16-mixed", report.suggested_policy):
        applied = castwise.apply(model, policy)
        try:
            if policy == "bf16-mixed":
                with pytest.raises(RuntimeError, match="should be the same"):
                    _train_step(model, x)
            else:
                _train_step(model, x)
        finally:
            applied.remove()


class _Promoting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.side = nn.Sequential(nn.Linear(8, 8))
        self.out = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x) + self.side(x.half()))  # bf16 + f16 -> f32


def test_a_type_promotion_names_the_operand_off_the_models_dtype() -> None:
    torch.manual_seed(0)
    model = _Promoting().to(BF16)
    model.side.half()  # the module the user changed
    report = castwise.audit(model, _x(), mode="eval")
    first = report.errors[0]
    assert first.origin is not None and first.origin.op == "aten.add"  # where the f32 was made
    assert "side.0" in dict(first.details)["culprit_modules"]  # and why: the f16 operand's module
    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        model(_x())


class _UpcastBlock(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())  # upcasts its inputs, never casts back


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 32)
        self.block = _UpcastBlock(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


@pytest.mark.parametrize("island", [True, False], ids=["f32-island-no-castback", "upcast-inputs-only"])
def test_a_block_that_upcasts_its_inputs_gets_the_island_at_the_block(island: bool) -> None:
    torch.manual_seed(0)
    model = _Net().to(BF16)
    if island:
        model.block.float()
    report = castwise.audit(model, _x())
    assert report.errors
    # the island is the block that upcasts, not its last layer (island) nor an output cast of the
    # block that comes after its first layer already refused the float32 (inputs only)
    assert str(report.suggested_policy) == "bf16-true,keep[block]=f32"
    with pytest.raises(RuntimeError, match="same dtype"):
        _train_step(model, _x())
    applied = castwise.apply(model, report.suggested_policy)
    try:
        _train_step(model, _x())
    finally:
        applied.remove()


class _UpcastConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())  # the conv's own check raises before any op dispatches


def test_a_layer_that_upcasts_its_own_input_is_the_origin_where_its_check_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_UpcastConv(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.Conv2d(16, 4, 3)).to(BF16)
    x = torch.randn(1, 3, 12, 12, dtype=BF16)
    report = castwise.audit(model, x)
    first = report.errors[0]
    assert first.module == "0" and first.origin is not None and first.origin.module == "0"
    # CW101: the cast in its forward met its own weights (was CW105: "model input ... meets weights")
    assert first.code == "CW101" and "aten._to_copy" in first.message
    assert str(report.suggested_policy) == "bf16-true,keep[0]=f32"
    with pytest.raises(RuntimeError, match="should be the same"):
        _train_step(model, x)
    applied = castwise.apply(model, report.suggested_policy)
    try:
        _train_step(model, x)
    finally:
        applied.remove()


class _Rotated(nn.Module):
    """An adapter whose forward multiplies its weight by a matrix it makes (a user's LoRA-style
    rotation): ``torch.eye`` takes torch's default dtype, float32, beside bf16 weights."""

    def __init__(self, made: bool) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.made = made
        self.rot = torch.eye(16)  # a plain attribute: .to() does not convert it either

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rot = torch.eye(16) if self.made else self.rot
        return self.head(nn.functional.linear(x, self.base.weight @ rot, self.base.bias))


def test_a_tensor_made_with_the_default_dtype_gets_a_default_dtype_policy_verified_for_real() -> None:
    torch.manual_seed(0)
    model = _Rotated(made=True).to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):  # the real run as the user has it
        model(x)
    report = castwise.audit(model, x)
    assert [f.code for f in report.errors] == ["CW106"]
    assert str(report.suggested_policy) == "bf16-true,default_dtype=bf16"
    applied = castwise.apply(model, report.suggested_policy)
    try:
        out = model(x)
        out.float().sum().backward()
        assert out.dtype == torch.bfloat16  # low precision kept
    finally:
        applied.remove()


def test_a_tensor_attribute_gets_no_default_dtype_policy() -> None:
    # the control: torch's default dtype does not reach a tensor made before the run
    model = _Rotated(made=False).to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    report = castwise.audit(model, x)
    assert [f.code for f in report.errors] == ["CW106"]
    assert "default_dtype" not in str(report.suggested_policy)
