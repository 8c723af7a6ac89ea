"""apply(): stories 1 and 2 fixed on the real libraries, islands and their casts, autocast and
fast-path state, refusals that change nothing, and remove() restoring the model."""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from open_clip.transformer import LayerNormFp32
from torch import nn
from torch._subclasses import FakeTensorMode

import castwise
from castwise import ApplyError, Policy, PolicyError, RuleError
from castwise.applied import applied_to, cast_floating
from castwise.stories import build_encoder, build_openclip, build_t5

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
F16_MAX = torch.finfo(F16).max


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def assert_same_bits(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for key, old in before.items():
        new = after[key]
        assert new.dtype == old.dtype, key
        # compare bits, so -0.0 vs 0.0 and NaN payloads count too
        assert torch.equal(new.detach().reshape(-1).view(torch.uint8), old.reshape(-1).view(torch.uint8)), key


def instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.norm(torch.relu(self.fc1(x))))
        return out


# -- story 1: OpenCLIP built with precision="bf16", then .to(bf16) by the user ----------------


@pytest.fixture(scope="module")
def story1() -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    return build_openclip()  # type: ignore[no-any-return]


def test_story1_fails_as_the_user_saw_it(story1: tuple[Any, Any]) -> None:
    model, (image, _) = story1
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"mixed dtype|expected scalar type"):
        model.encode_image(image)


def test_story1_runs_forward_and_backward_after_apply_bf16_true(story1: tuple[Any, Any]) -> None:
    model, (image, text) = story1
    norms = [m for m in model.modules() if isinstance(m, LayerNormFp32)]
    assert norms and all(m.weight.dtype == BF16 for m in norms)  # what the user's .to(bf16) did
    before = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    with castwise.apply(model, Policy.parse("bf16-true")) as applied:
        assert all(m.weight.dtype == F32 and m.bias.dtype == F32 for m in norms)
        assert set(applied.islands) == {n for n, m in model.named_modules() if isinstance(m, LayerNormFp32)}
        assert model.visual.conv1.weight.dtype == BF16
        image_features, text_features, logit_scale = model(image, text)
        assert (image_features.dtype, text_features.dtype, logit_scale.dtype) == (BF16, BF16, BF16)
        (image_features.float().sum() + text_features.float().sum()).backward()
        assert model.visual.conv1.weight.grad is not None and model.visual.conv1.weight.grad.dtype == BF16
        assert norms[0].weight.grad is not None and norms[0].weight.grad.dtype == F32
    # removed: the model as the user had it, bit for bit (the backward's grads aside)
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(after[n].dtype == t.dtype and torch.equal(after[n].detach(), t) for n, t in before.items())
    assert all(m.weight.dtype == BF16 and m.weight.grad is None for m in norms)


# -- story 2: T5 in float16 with `wo` kept float32 ---------------------------------------------


def block_dtypes(model: Any, inputs: dict[str, torch.Tensor]) -> list[tuple[torch.dtype, torch.dtype]]:
    """(input, output) hidden-state dtype of every encoder block: the residual stream."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    hooks = [
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out[0].dtype)))
        for block in model.encoder.block
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_story2_fails_as_the_user_saw_it() -> None:
    model: Any
    model, inputs = build_t5()
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == F32  # transformers kept it
    message = "expected scalar type torch.float16 but found torch.float32"  # StrictRMSNorm, as apex's kernel
    with torch.no_grad(), pytest.raises(RuntimeError, match=re.escape(message)):
        model(**inputs)


def test_story2_residual_stream_stays_f16_between_blocks_under_16_true() -> None:
    model: Any
    model, inputs = build_t5()
    applied = castwise.apply(model, "16-true")
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    assert applied.islands[wo] == F32 and applied.decisions[wo].island_reason == "_keep_in_fp32_modules 'wo'"
    assert block_dtypes(model, inputs) == [(F16, F16)] * len(model.encoder.block)
    with torch.no_grad():
        assert model(**inputs).last_hidden_state.dtype == F16
    applied.remove()


def _wo_output(cast_back: str) -> torch.Tensor:
    model: Any
    model, _ = build_t5()
    castwise.apply(model, f"16-true,cast_back={cast_back}")
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo
    with torch.no_grad():
        wo.weight.fill_(1.0)  # 64 inputs of +-2000: +-128000 in float32, past float16's 65504
        x = torch.full((1, 2, wo.in_features), 2000.0, dtype=F16)
        x[0, 1] = -2000.0
        out: torch.Tensor = wo(x)
        return out


def test_saturating_cast_back_clamps_to_f16_range_instead_of_inf() -> None:
    out = _wo_output("saturate")
    assert out.dtype == F16
    assert out[0, 0].eq(F16_MAX).all() and out[0, 1].eq(-F16_MAX).all()


def test_plain_cast_back_overflows_to_inf() -> None:
    out = _wo_output("plain")
    assert out.dtype == F16 and torch.isinf(out).all()


# -- islands, inputs, outputs ---------------------------------------------------------------


def test_true_policy_casts_inputs_and_runs_norms_as_f32_islands() -> None:
    model = MLP()
    seen: dict[str, torch.dtype] = {}
    model.norm.register_forward_pre_hook(lambda m, args: seen.update(norm_in=args[0].dtype))
    model.fc2.register_forward_pre_hook(lambda m, args: seen.update(fc2_in=args[0].dtype))
    with castwise.apply(model, "bf16-true"):
        assert (model.fc1.weight.dtype, model.norm.weight.dtype) == (BF16, F32)
        out = model(torch.randn(2, 8))  # float32 input: cast to bf16 by the policy
    # the island casts inside its forward: a pre-hook still sees the bf16 that arrives,
    # and the next layer gets bf16 back
    assert seen == {"norm_in": BF16, "fc2_in": BF16} and out.dtype == BF16


def test_nested_island_casts_back_to_the_enclosing_island_dtype() -> None:
    model: Any = nn.Sequential(
        OrderedDict(outer=nn.Sequential(OrderedDict(inner=nn.Linear(4, 4), after=nn.Linear(4, 4))))
    )
    seen: list[torch.dtype] = []
    model.outer.after.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with castwise.apply(model, "16-true,keep[outer]=f32,keep[outer.inner]=bf16") as applied:
        assert applied.islands == {"outer": F32, "outer.inner": BF16}
        assert model(torch.randn(1, 4)).dtype == F16
    assert seen == [F32]  # inner's bf16 output went back to the f32 around it, not to f16


def test_out_rule_casts_a_module_output() -> None:
    model = MLP()
    seen: list[torch.dtype] = []
    model.fc2.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with castwise.apply(model, "bf16-true,out[norm]=f32,keep[fc2]=f32"):
        model(torch.randn(2, 8))
    assert seen == [F32]


def test_input_mappings_of_the_caller_are_not_mutated() -> None:
    class TakesMapping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch: OrderedDict[str, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = self.fc(batch["x"])
            return out

    model = TakesMapping()
    batch = OrderedDict(x=torch.randn(1, 4))
    with castwise.apply(model, "bf16-true"):
        assert model(batch).dtype == BF16
    assert batch["x"].dtype == F32
    out = cast_floating(batch, BF16)
    assert type(out) is OrderedDict and out["x"].dtype == BF16 and batch["x"].dtype == F32


# -- autocast and fast-path state -----------------------------------------------------------


def test_mixed_policy_enters_autocast_inside_and_leaves_it_after() -> None:
    model = MLP()
    seen: dict[str, torch.dtype] = {}
    model.fc1.register_forward_hook(lambda m, args, out: seen.update(fc1=out.dtype))
    with castwise.apply(model, "bf16-mixed"):
        assert model.fc1.weight.dtype == F32  # mixed: weights stay float32
        out = model(torch.randn(2, 8))
        assert not torch.is_autocast_enabled("cpu")
    assert seen["fc1"] == BF16 and out.dtype == F32


def test_islands_turn_autocast_off_inside_under_mixed_policies() -> None:
    model = MLP()
    seen: dict[str, torch.dtype] = {}
    model.fc2.register_forward_hook(lambda m, args, out: seen.update(fc2=out.dtype))
    with castwise.apply(model, "bf16-mixed,keep[fc2]=f32"):
        model(torch.randn(2, 8))
    assert seen["fc2"] == BF16  # ran in f32 with autocast off, then cast back to the compute dtype


class Probe(nn.Module):
    """Records the global state while its forward runs; raises when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.state: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        self.state.append((torch.backends.mha.get_fastpath_enabled(), torch.is_autocast_enabled("cpu")))
        if fail:
            raise ValueError("boom")
        out: torch.Tensor = self.fc(x)
        return out


def test_fastpath_off_is_set_during_forward_and_restored_after_also_on_error() -> None:
    model = Probe()
    assert torch.backends.mha.get_fastpath_enabled()
    with castwise.apply(model, "bf16-mixed,fastpath=off"):
        model(torch.randn(1, 4))
        assert torch.backends.mha.get_fastpath_enabled() and not torch.is_autocast_enabled("cpu")
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(1, 4), fail=True)
        assert torch.backends.mha.get_fastpath_enabled() and not torch.is_autocast_enabled("cpu")
    assert model.state == [(False, True), (False, True)]
    with castwise.apply(model, "bf16-mixed"):
        model(torch.randn(1, 4))
    assert model.state[-1] == (True, True)  # fastpath=on leaves torch's default alone


class TableInForward(nn.Module):
    """Builds a table in forward without a dtype, as Lightning's demo Transformer does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        table = torch.zeros(4)
        self.seen.append(table.dtype)
        if fail:
            raise ValueError("boom")
        out: torch.Tensor = self.proj(x + table)
        return out


def test_default_dtype_is_set_during_forward_and_restored_after_also_on_error() -> None:
    model = TableInForward()
    with castwise.apply(model, "lightning:bf16-true") as applied:
        assert applied.policy.default_dtype == BF16
        assert model(torch.randn(1, 4)).dtype == BF16  # the table is bf16, as under Lightning
        assert torch.get_default_dtype() == F32
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(1, 4), fail=True)
        assert torch.get_default_dtype() == F32
    with castwise.apply(model, "pure_bf16"), pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(1, 4))  # no default_dtype: the table stays f32
    assert model.seen == [BF16, BF16, F32] and torch.get_default_dtype() == F32


def test_story3_fast_path_still_fails_under_apply_and_fastpath_off_fixes_it() -> None:
    model, (x, mask) = build_encoder()
    model.eval()
    with castwise.apply(model, "bf16-mixed"), torch.no_grad(), pytest.raises(RuntimeError):
        model(x, mask)  # apply does not change which code path the model takes
    with castwise.apply(model, "bf16-mixed,fastpath=off"), torch.no_grad():
        assert model(x, mask).dtype == F32


def test_islands_inside_a_fast_path_module_turn_the_fast_path_off() -> None:
    model, (x, mask) = build_encoder()
    model.eval()
    with castwise.apply(model, "bf16-true") as applied, torch.no_grad():
        assert applied.fastpath_off and "encoder.layers.0.norm1" in applied.islands
        assert model(x, mask).dtype == BF16


# -- parameters, state dict, remove -------------------------------------------------------------


def test_parameters_keep_identity_and_an_optimizer_built_before_still_trains_them() -> None:
    torch.manual_seed(0)
    model = MLP()
    params_before = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = list(model.state_dict())
    applied = castwise.apply(model, "bf16-true")
    assert list(model.parameters()) == params_before and all(
        a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)
    )
    assert list(model.state_dict()) == keys
    model(torch.randn(4, 8)).float().sum().backward()
    opt.step()
    trained = model.fc1.weight.detach().clone()
    assert trained.dtype == BF16
    applied.remove()
    # remove() keeps what training wrote (cast back), it does not roll the weights back
    assert model.fc1.weight.dtype == F32 and torch.equal(model.fc1.weight.detach(), trained.float())


def test_remove_restores_bits_dtypes_and_forwards_and_is_idempotent() -> None:
    model = MLP()
    before = snapshot(model)
    applied = castwise.apply(model, "16-true")
    assert instance_forwards(model) == ["", "norm"]
    model(torch.randn(2, 8))
    applied.remove()
    applied.remove()
    assert_same_bits(model, before)
    assert instance_forwards(model) == [] and applied_to(model) is None


def test_remove_restores_a_forward_someone_else_patched_before() -> None:
    model = MLP()
    original_forward = model.forward

    def patched(x: torch.Tensor) -> torch.Tensor:  # e.g. accelerate's convert_outputs_to_fp32
        return original_forward(x) * 2

    model.forward = patched  # type: ignore[method-assign]
    with castwise.apply(model, "bf16-true"):
        assert model.forward is not patched
        model(torch.randn(1, 8))
    assert model.forward is patched


def test_remove_keeps_running_stats_updated_under_the_policy() -> None:
    model: Any = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = snapshot(model)
    with castwise.apply(model, "pure_bf16"):
        assert model[1].running_mean.dtype == BF16
        model.train()
        model(torch.randn(2, 3, 8, 8))
    assert model[1].running_mean.dtype == F32 and not torch.equal(model[1].running_mean, before["1.running_mean"])
    assert torch.equal(model[0].weight.detach(), before["0.weight"])  # untouched tensors: original bits


def test_applied_model_can_be_garbage_collected() -> None:
    model = MLP()
    castwise.apply(model, "bf16-true")  # handle dropped on purpose
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


# -- refusals: clear errors, nothing changed ---------------------------------------------------


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert_same_bits(model, before)
    assert instance_forwards(model) == [] and applied_to(model) is None


def test_apply_refuses_int8_weights_before_changing_anything() -> None:
    model = MLP()
    model.fc2.weight = nn.Parameter(torch.zeros(4, 16, dtype=torch.int8), requires_grad=False)
    before = snapshot(model)
    with pytest.raises(ApplyError) as info:
        castwise.apply(model, "bf16-true")
    assert str(info.value) == (
        "parameter 'fc2.weight' is i8: a quantised weight castwise cannot cast without "
        "destroying it; valid parameter dtypes: bf16, f16, f32, f64"
    )
    assert_untouched(model, before)


def test_apply_refuses_a_tensor_subclass_parameter() -> None:
    class Packed(torch.Tensor):
        pass

    model = MLP()
    model.fc2.weight = nn.Parameter(torch.randn(4, 16).as_subclass(Packed))
    before = snapshot(model)
    with pytest.raises(ApplyError, match=r"parameter 'fc2\.weight' is a Packed holding Packed: quantised or sharded"):
        castwise.apply(model, "bf16-true")
    assert_untouched(model, before)


def test_apply_refuses_a_torch_ao_quantised_model() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(MLP(), {nn.Linear}, dtype=torch.qint8)  # type: ignore[no-untyped-call]
    keys = list(model.state_dict())
    with pytest.raises(ApplyError, match=r"module 'fc1' is a quantised .*Linear \(packed int8 weights\)"):
        castwise.apply(model, "bf16-true")
    assert model.norm.weight.dtype == F32 and instance_forwards(model) == []
    assert list(model.state_dict()) == keys


def test_double_apply_and_nested_apply_are_refused() -> None:
    model = MLP()
    applied = castwise.apply(model, "bf16-true")
    with pytest.raises(ApplyError, match=r"MLP is already under castwise policy bf16-true; call \.remove\(\)"):
        castwise.apply(model, "16-true")
    with pytest.raises(ApplyError, match="Linear is inside a MLP that is already under castwise policy bf16-true"):
        castwise.apply(model.fc1, "16-true")
    outer = nn.Sequential(model)
    with pytest.raises(ApplyError, match="its submodule '0' is already under castwise policy bf16-true"):
        castwise.apply(outer, "16-true")
    applied.remove()
    castwise.apply(model, "16-true").remove()  # after remove() a new policy is fine


def test_bad_policy_or_conflicting_rules_change_nothing() -> None:
    model = MLP()
    before = snapshot(model)
    with pytest.raises(PolicyError):
        castwise.apply(model, "bf16-ture")
    with pytest.raises(RuleError):
        castwise.apply(model, "bf16-true,keep[fc1]=f32,keep[class:Linear]=f16")
    assert_untouched(model, before)


# -- fake tensors ---------------------------------------------------------------------------


@pytest.fixture
def fake_mode() -> Iterator[FakeTensorMode]:
    with FakeTensorMode() as mode:
        yield mode


def test_apply_works_on_a_model_of_fake_tensors(fake_mode: FakeTensorMode) -> None:
    model = nn.Sequential(nn.Linear(4096, 4096), nn.LayerNorm(4096), nn.Linear(4096, 8))  # no real memory
    with castwise.apply(model, "bf16-true") as applied:
        assert (model[0].weight.dtype, model[1].weight.dtype) == (BF16, F32)
        assert type(model[0].weight).__name__ == "FakeTensor" and applied.islands == {"1": F32}
        out = model(torch.randn(2, 4096))
        assert out.dtype == BF16 and type(out).__name__ == "FakeTensor"
    assert model[0].weight.dtype == F32 and instance_forwards(model) == []


def test_a_deepcopy_of_an_applied_model_runs_its_own_weights() -> None:
    model = MLP()
    with castwise.apply(model, "bf16-true,out[fc2]=f32"):
        ema = copy.deepcopy(model)  # EMA and checkpoint copies are taken while training under the policy
        with torch.no_grad():
            for p in ema.parameters():
                p.zero_()
            x = torch.randn(2, 8)
            assert ema(x).eq(0).all() and not model(x).eq(0).all()
            assert ema(x).dtype == BF16  # the copy keeps the policy: f32 input cast in, bf16 out


def test_forward_signature_stays_visible_through_the_wrappers() -> None:
    import inspect

    model, _ = build_t5()
    names = list(inspect.signature(model.forward).parameters)
    with castwise.apply(model, "16-true"):
        assert list(inspect.signature(model.forward).parameters) == names


def test_apply_works_on_a_meta_model_under_true_and_mixed_policies() -> None:
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.LayerNorm(4, device="meta"))
    with castwise.apply(model, "bf16-mixed,keep[1]=f32"):  # autocast has no meta backend: skipped
        assert model(torch.randn(2, 4, device="meta")).dtype == F32
    with castwise.apply(model, "bf16-true"):
        assert model(torch.randn(2, 4, device="meta")).dtype == BF16 and model[0].weight.dtype == BF16
    assert model[0].weight.dtype == F32 and model[0].weight.device.type == "meta"


def test_mixed_policy_leaves_tensors_as_they_are_like_lightning_and_accelerate() -> None:
    # Lightning's and Accelerate's mixed precision only autocast; a hand-cast layer stays as it is
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    model.register_buffer("cache", torch.zeros(4, dtype=torch.bfloat16))
    with castwise.apply(model, "bf16-mixed"):
        assert model[0].weight.dtype == torch.float32
        assert model[1].weight.dtype == torch.bfloat16
        assert model.cache.dtype == torch.bfloat16
        assert model(torch.randn(2, 4)).dtype == torch.float32  # autocast reconciles the Linears
    with castwise.apply(model, "bf16-mixed,buffers=f32"):  # an explicit buffers= clause does cast buffers
        assert model.cache.dtype == torch.float32
        assert model[1].weight.dtype == torch.bfloat16
    assert model.cache.dtype == torch.bfloat16


def test_a_rule_that_matches_no_module_warns() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"keep\[\*\.nonexistent\]=f32 matches no module"):
        castwise.apply(model, "bf16-true,keep[*.nonexistent]=f32").remove()


def test_mixed_policy_without_islands_leaves_a_quantised_model_alone() -> None:
    model = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8)
    with castwise.apply(model, "bf16-mixed"):
        model(torch.randn(2, 4))
    with pytest.raises(ApplyError, match="quantised"):
        castwise.apply(model, "bf16-true")
