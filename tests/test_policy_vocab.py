"""One precision vocabulary: every string other tools write parses to what that tool does, and
``str()`` prints a string that parses back to it (castwise.policy.presets, .vocab, .float8)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import castwise
from castwise import Policy, PolicyError
from castwise.errors import ApplyError
from castwise.policy.float8 import Float8Recipe

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# every precision string issue 23 lists, as users write them
ISSUE_STRINGS: list[str | int] = [
    "fp8",
    "accelerate:fp8",
    "transformer-engine",
    "transformer-engine-float16",
    "lightning:transformer-engine",
    "16",
    16,
    "mixed_precision_param=bfloat16,mixed_precision_reduce=float32",
    "--bf16",
    "--fp16",
    "--bf16 --fp8-format hybrid",
    "mxfp8",
    "nanogpt:bfloat16",
    "timm:bfloat16",
    "hf:bfloat16",
]
BARE_DTYPE_NAMES = ["bfloat16", "float16", "torch.bfloat16", "half", "torch.float16", "f16"]


@pytest.mark.parametrize("text", ISSUE_STRINGS, ids=str)
def test_every_string_parses_and_round_trips(text: str | int) -> None:
    policy = Policy.parse(text)
    printed = str(policy)
    assert Policy.parse(printed) == policy
    assert str(Policy.parse(printed)) == printed  # stable


def test_fp8_is_bf16_autocast_plus_tensorwise_float8_gemms() -> None:
    # Accelerate: mixed_precision="fp8" enables native_amp in bf16 and (AO backend, its first
    # choice) torchao's Float8Linear with the default tensorwise config
    fp8 = Policy.parse("fp8")
    assert fp8 == Policy.parse("accelerate:fp8") == Policy.parse("bf16-mixed,fp8=tensorwise")
    assert fp8.replace(float8=None) == Policy.parse("bf16-mixed")
    assert fp8.float8 == Float8Recipe("tensorwise", "e4m3") and fp8.float8.forward_dtype == "float8_e4m3fn"
    mx = Policy.parse("mxfp8")
    assert mx.replace(float8=None) == Policy.parse("bf16-mixed") and mx.float8 is not None
    assert (mx.float8.scaling, mx.float8.block) == ("mxfp8", 32)
    assert str(fp8) == "fp8" and str(mx) == "mxfp8"


@pytest.mark.parametrize(("text", "dtype"), [("transformer-engine", BF16), ("transformer-engine-float16", F16)])
def test_lightning_transformer_engine_is_its_true_precision_plus_delayed_hybrid(text: str, dtype: torch.dtype) -> None:
    # TransformerEnginePrecision(weights_dtype=...): module.to(weights_dtype), inputs cast, torch's
    # default dtype set while a step runs, te.fp8_autocast(DelayedScaling()) whose format is HYBRID
    p = Policy.parse(text)
    assert p == Policy.parse(f"lightning:{text}")
    assert (p.param_dtype, p.compute_dtype, p.input_dtype, p.default_dtype) == (dtype, dtype, dtype, dtype)
    assert p.norms is None and p.keep_in_fp32 is False and p.loss_scale is None
    assert p.float8 == Float8Recipe("delayed", "hybrid")
    assert (p.float8.forward_dtype, p.float8.gradient_dtype) == ("float8_e4m3fn", "float8_e5m2")
    base = "lightning:bf16-true" if dtype == BF16 else "lightning:16-true"
    assert p.replace(float8=None) == Policy.parse(base)


def test_bare_16_and_the_integer_16_are_lightnings_16_mixed() -> None:
    assert Policy.parse("16") == Policy.parse(16) == Policy.parse("16-mixed")
    assert Policy.parse(32) == Policy.parse("32-true") and Policy.parse(64) == Policy.parse("64-true")


def test_torchtitan_keys_are_fsdp2s_mixed_precision_policy() -> None:
    # torchtitan: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) over f32 sharded weights,
    # inputs cast (cast_forward_inputs defaults to True), outputs left as computed
    p = Policy.parse("mixed_precision_param=bfloat16,mixed_precision_reduce=float32")
    assert p == Policy.parse("bf16-mixed,output=bf16") and str(p) == "bf16-mixed,output=bf16"
    model = nn.Sequential(nn.Linear(4, 4))
    (root,) = castwise.fsdp2.plan(model, p).units
    assert root.mp_policy_kwargs() == {
        "param_dtype": BF16,
        "reduce_dtype": F32,
        "output_dtype": None,
        "cast_forward_inputs": True,
    }
    assert root.stored == F32
    assert Policy.parse("mixed_precision_param=float32") == Policy.parse("32-true")
    assert Policy.parse("mixed_precision_reduce=bfloat16").reduce_dtype == BF16  # param's default: bfloat16


def test_megatron_flags() -> None:
    # Float16Module: model (norms too) and first-stage inputs in the half dtype, last stage returns
    # float32; float32 main params in the optimizer; --bf16 reduces in f32, --fp16 in f16 with a
    # DynamicGradScaler
    bf16 = Policy.parse("--bf16")
    assert (bf16.param_dtype, bf16.compute_dtype, bf16.output_dtype, bf16.input_dtype) == (BF16, BF16, F32, BF16)
    assert bf16.master_weights and bf16.norms is None and bf16.reduce_dtype == F32 and bf16.loss_scale is None
    fp16 = Policy.parse("--fp16")
    assert (fp16.param_dtype, fp16.loss_scale, fp16.reduce_dtype, fp16.master_weights) == (F16, "dynamic", F16, True)
    hybrid = Policy.parse("--bf16 --fp8-format hybrid")
    assert hybrid.replace(float8=None) == bf16 and hybrid.float8 == Float8Recipe("delayed", "hybrid")
    assert str(hybrid) == "--bf16,fp8=delayed"
    mx = Policy.parse("--bf16 --fp8-format e4m3 --fp8-recipe mxfp8")
    assert mx.float8 == Float8Recipe("mxfp8", "e4m3")
    with pytest.raises(PolicyError, match="valid: e4m3, hybrid"):
        Policy.parse("--bf16 --fp8-format e5m3")
    # without --fp8-format Megatron runs no float8 (args.fp8 is None): bf16, the recipe inert
    assert Policy.parse("--bf16 --fp8-recipe mxfp8") == bf16
    with pytest.raises(PolicyError, match=r"Megatron flag '--fp32-residual' .* valid: --bf16, --fp16"):
        Policy.parse("--bf16 --fp32-residual")


@pytest.mark.parametrize(
    ("text", "means"),
    [
        ("nanogpt:bfloat16", "bf16-mixed"),  # ctx = torch.amp.autocast(device_type, dtype=ptdtype)
        ("nanogpt:float16", "16-mixed"),  # ... with GradScaler(enabled=(dtype == 'float16'))
        ("timm:bfloat16", "bf16-mixed"),  # --amp --amp-dtype bfloat16
        ("timm:torch.float16", "16-mixed"),  # NativeScaler for float16
        # torch_dtype=: every weight, norms included, in bf16; buffers outside the state dict (the
        # rotary inv_freq) as the model built them; inputs and outputs as the model makes them
        ("hf:bfloat16", "pure_bf16,keep_nonpersistent=on,inputs=none,output=f32"),
        ("hf:torch.float16", "pure_fp16,keep_nonpersistent=on,inputs=none,output=f32"),
    ],
)
def test_a_prefix_says_which_reading_a_dtype_name_has(text: str, means: str) -> None:
    assert Policy.parse(text) == Policy.parse(means)


@pytest.mark.parametrize("text", BARE_DTYPE_NAMES)
def test_a_bare_dtype_name_is_refused_with_both_readings(text: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.parse(text)
    message = str(info.value)
    mixed, true = ("'bf16-mixed'", "'bf16-true'") if "bf" in text else ("'16-mixed'", "'16-true'")
    assert f"precision {text!r} is a bare dtype name" in message
    assert mixed in message and true in message
    assert "nanoGPT's dtype=" in message and "timm's --amp-dtype" in message and "torch_dtype=" in message
    assert "nanogpt:" in message and "hf:" in message


def test_fp8_clause_values() -> None:
    assert str(Policy.parse("bf16-mixed,fp8=rowwise")) == "bf16-mixed,fp8=rowwise"
    assert str(Policy.parse("32-true,fp8=delayed:e4m3")) == "32-true,fp8=delayed:e4m3"
    assert Policy.parse("fp8,fp8=none") == Policy.parse("bf16-mixed")
    with pytest.raises(PolicyError, match=r"fp8='colwise' is not valid; valid: none, or SCALING\[:FORMAT\]"):
        Policy.parse("bf16-mixed,fp8=colwise")
    with pytest.raises(PolicyError, match="fp8 format 'e3m4' is not valid; valid: e4m3, e5m2, hybrid"):
        Policy.parse("bf16-mixed,fp8=tensorwise:e3m4")
    assert "float8 GEMMs in Linears (tensorwise scaling, e4m3)" in Policy.parse("fp8").describe()


def test_apply_refuses_recipes_torchao_does_not_train_and_says_what_to_use() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for text in ("transformer-engine", "--bf16 --fp8-format hybrid --fp8-recipe blockwise"):
        with pytest.raises(ApplyError) as info:
            castwise.apply(model, text)
        message = str(info.value)
        assert "apply cannot run fp8=" in message and "valid: fp8=tensorwise, fp8=rowwise, fp8=mxfp8" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model[0]) is nn.Linear and "forward" not in vars(model[0])
    castwise.apply(model, "bf16-mixed").remove()  # nothing left applied


def test_the_vocabulary_is_torch_free() -> None:
    code = (
        "import sys\n"
        "from castwise.policy import presets, vocab, float8\n"
        "assert presets.accelerate('fp8').float8.scaling == 'tensorwise'\n"
        "assert presets.lightning('transformer-engine').gemm == 'float8_e4m3fn'\n"
        "assert vocab.translate(['--bf16 --fp8-format hybrid']) == ['--bf16', 'fp8=delayed:hybrid']\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
