"""Policy: every preset string users know parses, means what its ecosystem means, round-trips,
and bad strings or self-contradicting policies fail with a message that says what to do."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import castwise
from castwise import ModuleRule, Policy, PolicyError, RuleError

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = (F64, F32, F16, BF16)

# -- every preset string in DESIGN.md, and what it must mean ---------------------------------

FP32_NAMES = ("32-true", "no", "fp32", "O0", "lightning:32-true", "accelerate:no", "openclip:fp32", "apex:O0")
MIXED16_NAMES = ("16-mixed", "fp16", "amp", "O1", "lightning:16-mixed", "accelerate:fp16", "openclip:amp", "apex:O1")
MIXEDBF16_NAMES = ("bf16-mixed", "bf16", "amp_bf16", "lightning:bf16-mixed", "accelerate:bf16", "openclip:amp_bf16")
TRUE16_NAMES = ("16-true", "openclip:fp16")
TRUEBF16_NAMES = ("bf16-true", "openclip:bf16")
PURE16_NAMES = ("pure_fp16", "openclip:pure_fp16", "lightning:16-true")
PUREBF16_NAMES = ("pure_bf16", "openclip:pure_bf16", "lightning:bf16-true")
ALL_NAMES = (
    *FP32_NAMES,
    "64-true",
    *MIXED16_NAMES,
    *MIXEDBF16_NAMES,
    *TRUE16_NAMES,
    *TRUEBF16_NAMES,
    *PURE16_NAMES,
    *PUREBF16_NAMES,
    "O2",
    "apex:O2",
    "O3",
    "apex:O3",
    "params=float32,compute=bfloat16,output=float32",
    "params=f32,compute=bf16,output=f32",
    "params=fp32,compute=float16,output=fp32",
    "params=bf16",
    "params=float16,compute=f16",
)


def _fields(p: Policy) -> tuple[object, ...]:
    return (p.param_dtype, p.compute_dtype, p.output_dtype, p.input_dtype, p.loss_scale, p.master_weights, p.norms)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_preset_string_parses_and_round_trips(name: str) -> None:
    policy = Policy.parse(name)
    text = str(policy)
    assert Policy.parse(text) == policy
    assert "openclip:" not in text and str(Policy.parse(text)) == text  # printing is canonical


@pytest.mark.parametrize("name", FP32_NAMES)
def test_fp32_presets_change_nothing(name: str) -> None:
    p = Policy.parse(name)
    assert _fields(p) == (F32, F32, F32, None, None, False, None)
    assert not p.is_mixed and p.autocast_dtype is None and p.rules == ()


def test_64_true_converts_weights_and_inputs_to_float64() -> None:
    assert _fields(Policy.parse("64-true")) == (F64, F64, F64, F64, None, False, None)


@pytest.mark.parametrize("name", MIXED16_NAMES)
def test_16_mixed_is_f32_weights_f16_autocast_with_dynamic_loss_scaling(name: str) -> None:
    p = Policy.parse(name)
    assert _fields(p) == (F32, F16, F32, None, "dynamic", False, None)
    assert p.is_mixed and p.autocast_dtype == F16


@pytest.mark.parametrize("name", MIXEDBF16_NAMES)
def test_bf16_mixed_is_f32_weights_bf16_autocast_without_loss_scaling(name: str) -> None:
    p = Policy.parse(name)
    assert _fields(p) == (F32, BF16, F32, None, None, False, None)
    assert p.is_mixed and p.autocast_dtype == BF16


@pytest.mark.parametrize(("names", "low"), [(TRUE16_NAMES, F16), (TRUEBF16_NAMES, BF16)])
def test_true_presets_store_low_precision_with_norm_islands_and_cast_inputs(
    names: tuple[str, ...], low: torch.dtype
) -> None:
    for name in names:
        p = Policy.parse(name)
        assert _fields(p) == (low, low, low, low, None, False, F32), name
        assert not p.is_mixed and p.keep_in_fp32 and p.cast_back == "saturate"


@pytest.mark.parametrize(("names", "low"), [(PURE16_NAMES, F16), (PUREBF16_NAMES, BF16)])
def test_pure_presets_cast_everything_norms_included(names: tuple[str, ...], low: torch.dtype) -> None:
    for name in names:
        assert _fields(Policy.parse(name)) == (low, low, low, low, None, False, None), name


def test_lightning_prefix_means_lightnings_true_precision() -> None:
    # Lightning's HalfPrecision converts the whole module, norms and _keep_in_fp32_modules
    # included, and the inputs, and sets torch's default dtype while a step runs; its module.to(dtype)
    # casts complex buffers too
    assert Policy.parse("lightning:bf16-true") == Policy.parse(
        "pure_bf16,keep_in_fp32=off,default_dtype=bf16,cast_complex=on"
    )
    assert Policy.parse("lightning:16-true") == Policy.parse(
        "pure_fp16,keep_in_fp32=off,default_dtype=f16,cast_complex=on"
    )
    assert Policy.parse("lightning:half") == Policy.parse("lightning:16-true")
    assert (
        Policy.parse("lightning:64-true")
        == Policy.parse("lightning:double")
        == Policy.parse("64-true,default_dtype=f64")
    )
    assert Policy.parse("bf16-true").norms == F32  # castwise's own bf16-true keeps norm islands
    assert Policy.parse("bf16-true").default_dtype is None and Policy.parse("pure_bf16").default_dtype is None
    # a clause after the prefixed string overrides what it implies; printing says it as Lightning does
    assert Policy.parse("lightning:bf16-true,default_dtype=none").default_dtype is None
    assert str(Policy.parse("lightning:bf16-true")) == "lightning:bf16-true"
    assert str(Policy.parse("lightning:bf16-true,keep[*.wo]=f32")) == "lightning:bf16-true,keep[*.wo]=f32"


def test_apex_o2_keeps_batchnorm_f32_with_master_weights_and_dynamic_scaling() -> None:
    p = Policy.parse("O2")
    assert _fields(p) == (F16, F16, F32, F16, "dynamic", True, None)
    assert [str(r) for r in p.rules] == ["keep[class:torch.nn.modules.batchnorm._BatchNorm]=f32"]
    assert p.rules[0].matches("bn", nn.BatchNorm2d(3)) and p.rules[0].matches("bn", nn.SyncBatchNorm(3))
    assert not p.rules[0].matches("ln", nn.LayerNorm(3))


def test_apex_o3_is_pure_fp16_with_f32_outputs() -> None:
    # Apex patches forward for O2 and O3 alike: inputs to float16, outputs to float32
    assert _fields(Policy.parse("O3")) == (F16, F16, F32, F16, None, False, None)


def test_fp16_and_bf16_alone_are_accelerate_autocast_and_prefixes_pick_the_ecosystem() -> None:
    assert Policy.parse("bf16") == Policy.parse("bf16-mixed") == Policy.parse("accelerate:bf16")
    assert Policy.parse("openclip:bf16") == Policy.parse("bf16-true")
    assert Policy.parse("fp16") == Policy.parse("16-mixed")
    assert Policy.parse("openclip:fp16") == Policy.parse("16-true")


def test_spelling_and_whitespace_are_forgiving() -> None:
    assert Policy.parse(" BF16-True ") == Policy.parse("bf16-true")
    assert Policy.parse("o2") == Policy.parse("O2")
    assert Policy.parse("Params = float32 , compute = torch.bfloat16") == Policy.parse("bf16-mixed")


def test_jmp_style_defaults_derive_from_params_and_compute() -> None:
    assert Policy.parse("params=float32,compute=bfloat16,output=float32") == Policy.parse("bf16-mixed")
    assert Policy.parse("params=f32,compute=bf16") == Policy.parse("bf16-mixed")  # mixed: output f32
    assert Policy.parse("params=bf16") == Policy.parse("bf16-true")  # compute defaults to params
    assert Policy.parse("params=f16,compute=f16,output=f32").output_dtype == F32
    # loss scaling is not implied by jmp-style f16 mixed: it is asked for
    assert Policy.parse("params=f32,compute=f16").loss_scale is None


def test_clauses_override_a_preset() -> None:
    p = Policy.parse("bf16-true,norms=none,inputs=none,fastpath=off,cast_back=plain,keep_in_fp32=off")
    assert (p.norms, p.input_dtype, p.fastpath, p.cast_back, p.keep_in_fp32) == (None, None, False, "plain", False)
    assert Policy.parse("bf16-true,norms=none") == Policy.parse("pure_bf16")
    assert Policy.parse("16-mixed,loss_scale=128").loss_scale == 128.0
    assert Policy.parse("bf16-mixed,buffers=bf16").effective_buffer_dtype == BF16
    # overriding params/compute of a preset re-derives the dtype defaults, keeps the rest
    p = Policy.parse("bf16-true,params=f32,compute=bf16,fastpath=off")
    assert (p.param_dtype, p.output_dtype, p.input_dtype, p.norms, p.fastpath) == (F32, F32, None, None, False)


def test_policy_is_a_frozen_hashable_value() -> None:
    p = Policy.parse("bf16-true,keep[*.wo]=f32")
    with pytest.raises(AttributeError):
        p.param_dtype = F32  # type: ignore[misc]
    assert hash(p) == hash(Policy.parse(str(p))) and len({p, Policy.parse(str(p))}) == 1
    assert p.replace(fastpath=False).fastpath is False and p.fastpath is True
    assert Policy(loss_scale=None) == Policy.parse("32-true")


def test_presets_match_lightning_precision_plugins() -> None:
    from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    for name in ("16-mixed", "bf16-mixed"):
        plugin = MixedPrecision(name, "cpu")  # type: ignore[arg-type]
        p = Policy.parse(name)
        assert (plugin.scaler is not None) == (p.loss_scale == "dynamic"), name
        with plugin.forward_context():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == p.compute_dtype
    for name in ("16-true", "bf16-true"):
        half = HalfPrecision(name)  # type: ignore[arg-type]
        p = Policy.parse(name)
        assert half.convert_module(nn.Linear(2, 2)).weight.dtype == p.param_dtype
        assert half.convert_input(torch.ones(1)).dtype == p.input_dtype
    assert DoublePrecision().convert_input(torch.ones(1)).dtype == Policy.parse("64-true").input_dtype


class _Probe(nn.Module):
    """Records what a step sees: torch's default dtype and autocast; ``_keep_in_fp32_modules``
    as transformers models declare it (Lightning's module.to(dtype) does not read it)."""

    _keep_in_fp32_modules: ClassVar[list[str]] = ["wo"]

    def __init__(self) -> None:
        super().__init__()
        self.wo = nn.Linear(2, 2)
        self.norm = nn.LayerNorm(2)
        self.register_buffer("scale", torch.ones(2))
        self.seen: tuple[object, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.seen = (x.dtype, torch.get_default_dtype(), autocast, torch.zeros(1).dtype)
        return x


@pytest.mark.parametrize("precision", ["32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_lightning_prefixed_policies_run_a_step_as_the_trainers_plugin_does(precision: str) -> None:
    """What the Trainer's precision plugin does to the module, the batch and the step (its
    forward_context: default dtype, autocast), castwise.apply does under lightning:PRECISION."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    plugins = {"32-true": Precision, "64-true": DoublePrecision, "16-true": HalfPrecision, "bf16-true": HalfPrecision}
    plugin = MixedPrecision(precision, "cpu") if "mixed" in precision else plugins[precision]()  # type: ignore[arg-type]
    if isinstance(plugin, HalfPrecision):
        plugin = HalfPrecision(precision)  # type: ignore[arg-type]
    lightning_model, castwise_model = _Probe(), _Probe()
    lightning_model = plugin.convert_module(lightning_model)
    x = plugin.convert_input(torch.ones(2))
    with plugin.forward_context():
        lightning_model(x)
    outside = torch.get_default_dtype()
    with castwise.apply(castwise_model, f"lightning:{precision}"):
        castwise_model(torch.ones(2))
        dtypes = {n: t.dtype for n, t in [*castwise_model.named_parameters(), *castwise_model.named_buffers()]}
    assert torch.get_default_dtype() == outside == torch.float32  # restored after the forward
    assert castwise_model.seen == lightning_model.seen, precision
    expected = {n: t.dtype for n, t in [*lightning_model.named_parameters(), *lightning_model.named_buffers()]}
    assert dtypes == expected, precision


@pytest.mark.parametrize(
    "precision", ["fp32", "amp", "amp_bf16", "amp_bfloat16", "fp16", "bf16", "pure_fp16", "pure_bf16"]
)
def test_presets_match_openclip_training_code(precision: str) -> None:
    from open_clip import get_input_dtype
    from open_clip_train.precision import get_autocast

    p = Policy.parse(f"openclip:{precision}")
    assert p.input_dtype == get_input_dtype(precision)
    with get_autocast(precision, device_type="cpu")():
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    assert p.autocast_dtype == autocast
    assert (p.loss_scale == "dynamic") == (precision == "amp")  # open_clip_train: GradScaler for "amp" only
    assert (p.norms == F32) == (precision in ("fp16", "bf16"))  # LayerNormFp32 only for fp16/bf16


# -- bad strings: the message names the wrong part and lists valid choices, sorted ------------

PRESETS_SORTED = (
    "--bf16, --fp16, 16, 16-mixed, 16-true, 32, 32-true, 64, 64-true, O0, O1, O2, O3, amp, amp_bf16, amp_bfloat16, "
    "bf16, bf16-mixed, bf16-true, deepspeed-bf16, deepspeed-f16, e4m3, e4m3fn, e5m2, f8e4m3fn, f8e5m2, float8, "
    "float8_e4m3fn, float8_e5m2, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2, fsdp2-bf16, fsdp2-f16, hf-bf16, hf-f16, "
    "mxfp8, no, pure_bf16, pure_fp16, transformer-engine, transformer-engine-float16"
)
CLAUSES_SORTED = (
    "buffers, cast_back, cast_complex, compute, converted, default_dtype, fastpath, fp8, inputs, keep[SELECTOR], "
    "keep_buffers, keep_in_fp32, keep_nonpersistent, loss_scale, master_weights, norms, out[SELECTOR], output, "
    "params, reduce"
)
DTYPES_TEXT = "valid: bf16, f16, f32, f64 (or bfloat16, float16, float32, float64)"

BAD = [
    (
        "bf17-mixed",
        PolicyError,
        f"unknown precision 'bf17-mixed' (did you mean 'bf16-mixed'?); valid presets: {PRESETS_SORTED}; "
        "or clauses like 'params=f32,compute=bf16,output=f32'",
    ),
    ("", PolicyError, f"empty policy string; valid presets: {PRESETS_SORTED}"),
    ("params=f32,compute=bf17", PolicyError, f"compute: 'bf17' is not a dtype castwise manages; {DTYPES_TEXT}"),
    ("bf16-true,norms=f8", PolicyError, f"norms: 'f8' is not a dtype castwise manages; {DTYPES_TEXT}"),
    ("bf16-true,keep[*.wo]=int8", PolicyError, f"keep[*.wo]: 'int8' is not a dtype castwise manages; {DTYPES_TEXT}"),
    ("bf16-true,bogus=1", PolicyError, f"unknown clause 'bogus'; valid clauses: {CLAUSES_SORTED}"),
    (
        "bf16-true,fast_path=off",
        PolicyError,
        f"unknown clause 'fast_path' (did you mean 'fastpath'?); valid clauses: {CLAUSES_SORTED}",
    ),
    (
        "warp-speed",
        PolicyError,
        f"unknown precision 'warp-speed'; valid presets: {PRESETS_SORTED}; "
        "or clauses like 'params=f32,compute=bf16,output=f32'",
    ),
    (
        "bf16-true,16-true",
        PolicyError,
        f"clause '16-true' has no '=' (a preset may only come first); valid clauses: {CLAUSES_SORTED}",
    ),
    ("bf16-true,fastpath=maybe", PolicyError, "fastpath='maybe' is not valid; valid: off, on"),
    ("16-true,master_weights=2", PolicyError, "master_weights='2' is not valid; valid: off, on"),
    ("bf16-true,cast_back=round", PolicyError, "cast_back='round' is not valid; valid: plain, saturate"),
    ("16-mixed,loss_scale=lots", PolicyError, "loss_scale='lots' is not valid; valid: dynamic, none, or a number > 0"),
    (
        "foo:bf16",
        PolicyError,
        "unknown precision prefix 'foo'; valid prefixes: accelerate, apex, deepspeed, fsdp2, hf, lightning, "
        "megatron, nanogpt, openclip, timm",
    ),
    (
        "openclip:amp_fp8",
        PolicyError,
        "unknown openclip precision 'amp_fp8'; valid: amp, amp_bf16, amp_bfloat16, bf16, fp16, fp32, pure_bf16, "
        "pure_fp16",
    ),
    ("apex:O4", PolicyError, "unknown apex precision 'O4'; valid: O0, O1, O2, O3"),
    (
        "bf16-true,,fastpath=off",
        PolicyError,
        "empty clause in 'bf16-true,,fastpath=off' (two commas in a row, or a trailing comma)",
    ),
    ("bf16-true,", PolicyError, "empty clause in 'bf16-true,' (two commas in a row, or a trailing comma)"),
    ("bf16-true,fastpath=off,fastpath=on", PolicyError, "clause 'fastpath' given twice"),
    (
        "bf16-true,keep[fn:mymod.pick]=f32",
        RuleError,
        "'fn:mymod.pick': predicate rules cannot be parsed from text; pass a callable "
        "ModuleRule(lambda name, module: ..., dtype) in Python",
    ),
    (
        "bf16-true,keep[re:(]=f32",
        RuleError,
        "rule selector 're:(': bad regular expression (missing ), unterminated subpattern at position 0)",
    ),
    ("bf16-true,keep[class:]=f32", RuleError, "rule selector 'class:' names no class; e.g. 'class:LayerNorm'"),
]


@pytest.mark.parametrize(("text", "kind", "message"), BAD, ids=[b[0] or "empty" for b in BAD])
def test_bad_strings_raise_policy_error_with_the_exact_message(text: str, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind) as info:
        Policy.parse(text)
    assert str(info.value) == message
    assert isinstance(info.value, PolicyError) and isinstance(info.value, ValueError)


def test_listed_choices_are_sorted() -> None:
    for listing in (PRESETS_SORTED, CLAUSES_SORTED, "bf16, f16, f32, f64"):
        items = listing.split(", ")
        assert items == sorted(items)
    assert sorted(Policy.presets()) == PRESETS_SORTED.split(", ")


def test_parse_refuses_what_is_not_a_string() -> None:
    with pytest.raises(PolicyError, match=r"a policy is a string or a castwise\.Policy, not float"):
        Policy.parse(16.0)  # type: ignore[arg-type]
    p = Policy.parse("bf16-true")
    assert Policy.parse(p) is p


# -- contradictions fail at construction, with the reason ------------------------------------

CONTRADICTIONS = [
    (
        "params=bf16,compute=f32",
        "params=bf16 with compute=f32: mixed precision keeps float32 weights and computes "
        "in bf16 or f16 under autocast; valid pairs: params equal to compute, or params=f32 with compute=bf16|f16",
    ),
    ("params=f16,compute=bf16", "params=f16 with compute=bf16: mixed precision"),
    ("params=f64,compute=f32", "params=f64 with compute=f32: mixed precision"),
    (
        "params=f16,loss_scale=dynamic",
        "loss_scale=dynamic with params=f16: gradients would be stored in f16 and loss scaling cannot unscale them "
        "(GradScaler raises 'Attempting to unscale FP16 gradients'); use float32 params (a *-mixed policy), "
        "or master_weights=on",
    ),
    ("16-true,loss_scale=1024", "loss_scale=1024.0 with params=f16: gradients would be stored in f16"),
    (
        "bf16-mixed,master_weights=on",
        "master_weights=on with params=f32: master weights are float32 copies of bf16/f16 parameters; with float32 "
        "params there is nothing to copy; drop master_weights",
    ),
    ("16-mixed,params=f16", "loss_scale=dynamic with params=f16"),
    ("16-mixed,loss_scale=-1", "loss_scale=-1.0 is not valid; valid: 'dynamic', None or a float > 0"),
    ("16-mixed,loss_scale=inf", "loss_scale=inf is not valid"),
]


@pytest.mark.parametrize(("text", "reason"), CONTRADICTIONS)
def test_contradictions_raise_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.parse(text)
    assert str(info.value).startswith(reason)


def test_contradictions_raise_when_built_in_python_too() -> None:
    with pytest.raises(PolicyError, match="params=bf16 with compute=f32"):
        Policy(param_dtype=BF16, compute_dtype=F32)
    with pytest.raises(PolicyError, match="loss_scale=dynamic with params=bf16"):
        Policy(param_dtype=BF16, compute_dtype=BF16, output_dtype=BF16, loss_scale="dynamic")
    with pytest.raises(PolicyError, match=r"param_dtype=torch.int8 is not valid; valid: bf16, f16, f32, f64"):
        Policy(param_dtype=torch.int8)
    with pytest.raises(PolicyError, match=r"rules must be a tuple of castwise\.ModuleRule"):
        Policy(rules=["keep[*.wo]=f32"])  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="cast_back='round' is not valid; valid: plain, saturate"):
        Policy(cast_back="round")  # type: ignore[arg-type]
    # loss scaling with f16 storage is fine once master weights hold the float32 copy (Apex O2)
    assert Policy(param_dtype=F16, compute_dtype=F16, loss_scale="dynamic", master_weights=True).master_weights


def test_describe_says_what_the_policy_does() -> None:
    assert Policy.parse("bf16-true").describe() == (
        "bf16 weights and compute; outputs bf16; norms as f32 islands; inputs cast to bf16"
    )
    assert Policy.parse("16-mixed,fastpath=off").describe() == (
        "f32 weights, autocast to f16; outputs f32; dynamic loss scaling; fused fast paths off"
    )


# -- the round-trip property -----------------------------------------------------------------

_SEGMENT = st.text(alphabet="abcxyz019_*?", min_size=1, max_size=5)
_GLOB = st.lists(st.one_of(_SEGMENT, st.just("**")), min_size=1, max_size=4).map(".".join)
# regex pieces include the characters that make clause splitting hard: ',', '=', '[', ']'
_REGEX_PIECE = st.sampled_from(
    ["a", "wo", r"\.", ".*", "[a-c]", "[,=]", "(?:q|k)", r"\d+", "x{1,3}", "(?=y)", "=", ",", "_proj", "|"]
)
_REGEX = st.lists(_REGEX_PIECE, min_size=1, max_size=6).map(lambda parts: "re:" + "".join(parts))
_CLASS = st.sampled_from(
    [
        "class:LayerNorm",
        "class:torch.nn.LayerNorm",
        "class:T5LayerNorm",
        "class:Linear",
        "class:torch.nn.modules.batchnorm._BatchNorm",
        "class:open_clip.transformer.LayerNormFp32",
    ]
)
_SELECTOR = st.one_of(_GLOB, _REGEX, _CLASS, st.sampled_from([nn.LayerNorm, nn.Linear, nn.GroupNorm]))
_RULE = st.builds(ModuleRule, _SELECTOR, st.sampled_from(DTYPES), st.sampled_from(["keep", "out"]))
_OPTIONAL_DTYPE = st.one_of(st.none(), st.sampled_from(DTYPES))


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    params, compute = draw(st.sampled_from([(F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (F32, F16), (F32, BF16)]))
    low_params = params in (F16, BF16)
    master = low_params and draw(st.booleans())
    scale_choices: list[object] = [None]
    if not low_params or master:
        scale_choices += ["dynamic", draw(st.floats(min_value=1e-3, max_value=2.0**24, allow_nan=False))]
    return Policy(
        param_dtype=params,
        compute_dtype=compute,
        output_dtype=draw(st.sampled_from(DTYPES)),
        buffer_dtype=draw(_OPTIONAL_DTYPE),
        input_dtype=draw(_OPTIONAL_DTYPE),
        loss_scale=draw(st.sampled_from(scale_choices)),  # type: ignore[arg-type]
        master_weights=master,
        norms=draw(_OPTIONAL_DTYPE),
        keep_in_fp32=draw(st.booleans()),
        cast_back=draw(st.sampled_from(["saturate", "plain"])),
        fastpath=draw(st.booleans()),
        rules=tuple(draw(st.lists(_RULE, max_size=4))),
        reduce_dtype=draw(st.sampled_from(DTYPES)),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_str_parses_back_to_an_equal_policy(policy: Policy) -> None:
    text = str(policy)
    again = Policy.parse(text)
    assert again == policy, text
    assert str(again) == text


def test_round_trip_of_awkward_selectors() -> None:
    rules = (ModuleRule("re:(?:a|b)=x,[,]]", F32), ModuleRule("**.wo", F16, "out"), ModuleRule("re:[a]=b", BF16))
    p = Policy.parse("bf16-true").with_rules(*rules)
    assert Policy.parse(str(p)) == p
    assert str(p) == "bf16-true,keep[re:(?:a|b)=x,[,]]]=f32,out[**.wo]=f16,keep[re:[a]=b]=bf16"


def test_predicate_rules_print_but_do_not_parse() -> None:
    def pick(name: str, module: nn.Module) -> bool:
        return name.endswith("wo")

    p = Policy.parse("16-true").with_rules(ModuleRule(pick, F32))
    assert str(p).endswith(f"keep[fn:{__name__}.test_predicate_rules_print_but_do_not_parse.<locals>.pick]=f32")
    with pytest.raises(RuleError, match="predicate rules cannot be parsed from text"):
        Policy.parse(str(p))
