"""The policy package: fields declared once (grammar, str and validation follow from the table),
the torch-free parts load without torch, one preset table that lint-config reads too, and the
exact PolicyError / RuleError messages of values built in Python."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from castwise import ModuleRule, Policy, PolicyError, RuleError
from castwise.lint import build_model, read_config
from castwise.policy import fields, grammar, presets
from castwise.policy.float8 import Float8Recipe

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPES_TEXT = "bf16, f16, f32, f64 (or bfloat16, float16, float32, float64)"


def test_torch_free_parts_import_without_torch() -> None:
    """lint-config reads the presets: the package and its table-only modules load without torch
    (reading a clause's dtype builds torch's dtype objects; importing does not)."""
    code = (
        "import sys\n"
        "import castwise.policy, castwise.policy.presets, castwise.policy.fields, castwise.policy.grammar\n"
        "import castwise.policy.selectors, castwise.lint\n"
        "from castwise.policy import ModuleRule, presets\n"
        "assert presets.lightning('16').compute == 'float16'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_policy_declares_the_fields_of_the_table_in_its_order() -> None:
    assert [f.name for f in dataclasses.fields(Policy)] == [f.attr for f in fields.FIELDS] + ["rules"]
    assert tuple(sorted(fields.CLAUSE_KEYS)) == fields.CLAUSE_KEYS
    assert set(fields.CLAUSE_KEYS) == {f.clause for f in fields.FIELDS} | {"keep[SELECTOR]", "out[SELECTOR]"}


def _candidates(field: fields.Field) -> list[Any]:
    if field.kind in ("dtype", "dtype?"):
        return [*DTYPES, *([None] if field.kind == "dtype?" else [])]
    if field.kind == "bool":
        return [True, False]
    if field.kind == "choice":
        return list(field.choices)
    if field.kind == "float8":
        return [None, Float8Recipe("tensorwise"), Float8Recipe("rowwise"), Float8Recipe("delayed", "e4m3")]
    return [None, "dynamic", 128.0, 0.5]


@pytest.mark.parametrize("field", fields.FIELDS, ids=lambda f: f.attr)
@pytest.mark.parametrize("base", ["bf16-true", "16-mixed", "32-true", "O2"])
def test_every_field_value_prints_as_its_clause_and_parses_back(field: fields.Field, base: str) -> None:
    start = Policy.parse(base)
    tried = 0
    for value in _candidates(field):
        try:
            policy = start.replace(**{field.attr: value})
        except PolicyError:
            continue  # a combination the policy refuses (f16 params with loss scaling, ...)
        tried += 1
        text = str(policy)
        assert Policy.parse(text) == policy, text
        head, *clauses = grammar.split(text)
        assert head in presets.PRESETS or head.startswith("params="), text
        # every clause str prints is one the field table declares (or a module rule)
        assert all(c.split("=", 1)[0] in fields.CLAUSE_KEYS or c.startswith(("keep[", "out[")) for c in clauses)
    assert tried >= 1


def test_a_changed_field_prints_as_its_clause_against_its_preset() -> None:
    for field in fields.FIELDS[2:]:
        start = Policy.parse("bf16-true,master_weights=on")  # so that loss scaling is allowed
        preset = Policy.parse("bf16-true")
        value = next(v for v in _candidates(field) if v != getattr(preset, field.attr) and _valid(start, field, v))
        text = str(start.replace(**{field.attr: value}))
        assert text.split(",")[0] == "bf16-true" and f"{field.clause}={field.show(value)}" in text.split(","), text


def _valid(start: Policy, field: fields.Field, value: Any) -> bool:
    try:
        start.replace(**{field.attr: value})
    except PolicyError:
        return False
    return True


def test_clause_values_parse_through_the_field_table() -> None:
    assert fields.by_clause("buffers") is not None and fields.by_clause("buffers").parse("params") is None
    assert fields.by_clause("norms").parse("follow") is None  # type: ignore[union-attr]
    assert fields.by_clause("loss_scale").parse("128") == 128.0  # type: ignore[union-attr]
    assert fields.by_clause("fastpath").parse("Yes") is True  # type: ignore[union-attr]
    assert fields.by_clause("nonsense") is None


# -- one preset table, read by Policy and by lint-config --------------------------------------


def test_every_preset_is_its_clause_string() -> None:
    table = Policy.presets()
    assert sorted(table) == sorted(presets.PRESETS)
    for name, preset in presets.PRESETS.items():
        assert Policy.parse(preset.text) == table[name], name
        assert (table[name].param_dtype, table[name].compute_dtype) == (
            getattr(torch, preset.params),
            getattr(torch, preset.compute),
        )


def _lint_model(tmp_path: Path, name: str, text: str) -> dict[str, str | None]:
    path = tmp_path / name
    path.write_text(text)
    model = build_model(read_config(path))
    return {
        k: (t.value if (t := getattr(model, k)) is not None else None) for k in ("weights", "compute", "loss_scaling")
    }


def _policy_model(policy: Policy) -> dict[str, str | None]:
    loss = policy.loss_scale if isinstance(policy.loss_scale, str) else "none"
    # lint's compute is the dtype the matmuls take: a float8 recipe's forward format
    compute = policy.float8.forward_dtype if policy.float8 is not None else str(policy.compute_dtype)[6:]
    return {
        "weights": str(policy.param_dtype).removeprefix("torch."),
        "compute": compute,
        "loss_scaling": loss,
    }


@pytest.mark.parametrize("precision", sorted(presets.ECOSYSTEMS["lightning"]))
def test_lint_and_policy_agree_on_every_lightning_precision(tmp_path: Path, precision: str) -> None:
    linted = _lint_model(tmp_path, "trainer.yaml", f"trainer:\n  accelerator: gpu\n  precision: '{precision}'\n")
    assert linted == _policy_model(Policy.parse(f"lightning:{precision}"))


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16", "fp8"])
def test_lint_and_policy_agree_on_accelerate_mixed_precision(tmp_path: Path, mixed_precision: str) -> None:
    text = f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: {mixed_precision}\n"
    linted = _lint_model(tmp_path, "default_config.yaml", text)
    policy = Policy.parse(f"accelerate:{mixed_precision}")
    assert linted == _policy_model(policy) and policy.is_mixed


def test_lightning_shorthands_parse_as_lightning_reads_them() -> None:
    assert Policy.parse("lightning:16") == Policy.parse("16-mixed")
    assert Policy.parse("lightning:bf16") == Policy.parse("bf16-mixed")
    assert Policy.parse("lightning:32") == Policy.parse("32-true")


# -- messages of values built in Python -------------------------------------------------------

PYTHON_ERRORS: list[tuple[Any, type[Exception], str]] = [
    (lambda: Policy(param_dtype=torch.int8), PolicyError, f"param_dtype=torch.int8 is not valid; valid: {DTYPES_TEXT}"),
    (lambda: Policy(output_dtype="f32"), PolicyError, f"output_dtype='f32' is not valid; valid: {DTYPES_TEXT}"),
    (lambda: Policy(norms="f32"), PolicyError, f"norms='f32' is not valid; valid: None or {DTYPES_TEXT}"),
    (
        lambda: Policy(buffer_dtype=torch.float8_e4m3fn),
        PolicyError,
        f"buffer_dtype=torch.float8_e4m3fn is not valid; valid: None or {DTYPES_TEXT}",
    ),
    (lambda: Policy(cast_back="round"), PolicyError, "cast_back='round' is not valid; valid: plain, saturate"),
    (
        lambda: Policy(loss_scale=True),
        PolicyError,
        "loss_scale=True is not valid; valid: 'dynamic', None or a float > 0",
    ),
    (lambda: Policy(loss_scale=0), PolicyError, "loss_scale=0.0 is not valid; valid: 'dynamic', None or a float > 0"),
    (lambda: Policy(rules=[]), PolicyError, "rules must be a tuple of castwise.ModuleRule"),
    (lambda: ModuleRule("*.wo", torch.int8), RuleError, f"rule dtype torch.int8 is not valid; valid: {DTYPES_TEXT}"),
    (lambda: ModuleRule("*.wo", torch.float32, "pin"), RuleError, "rule kind 'pin' is not valid; valid: keep, out"),
    (
        lambda: ModuleRule(3, torch.float32),
        RuleError,
        "rule selector 3 is not valid; valid: a glob like '*.wo', 're:REGEX', 'class:Name', a module class, "
        "or a predicate (name, module) -> bool",
    ),
    (
        lambda: ModuleRule(" ", torch.float32),
        RuleError,
        "empty rule selector; valid: a glob like '*.wo', 're:REGEX' or 'class:Name'",
    ),
]


@pytest.mark.parametrize(("build", "kind", "message"), PYTHON_ERRORS, ids=[m[2][:40] for m in PYTHON_ERRORS])
def test_values_built_in_python_raise_the_exact_message(build: Any, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind) as info:
        build()
    assert str(info.value) == message


def test_an_integer_loss_scale_is_stored_as_a_float() -> None:
    policy = Policy.parse("16-mixed").replace(loss_scale=128)
    assert policy.loss_scale == 128.0 and isinstance(policy.loss_scale, float)
    assert str(policy) == "16-mixed,loss_scale=128.0"


# -- the package's one dtype-name table -------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_scalar_type_names_are_torchs() -> None:
    from castwise import _dtypes

    for name, scalar in _dtypes.SCALAR_TYPE.items():
        # the legacy tensor type string carries c10's ScalarType name: torch.BFloat16Tensor
        assert torch.empty(0, dtype=getattr(torch, name)).type() == f"torch.{scalar}Tensor"
        assert _dtypes.from_scalar_type(scalar) == name and _dtypes.from_scalar_type(name) == name
    assert _dtypes.from_scalar_type("Quarter") is None


def test_lossless_casts_follow_the_bits_table() -> None:
    from castwise import _dtypes

    for src in _dtypes.POLICY_DTYPES:
        for dst in _dtypes.POLICY_DTYPES:
            x = torch.randn(1000, dtype=torch.float64).to(getattr(torch, src))
            exact = torch.equal(x.to(getattr(torch, dst)).to(x.dtype), x) and _dtypes.BITS[dst] != _dtypes.BITS[src]
            assert _dtypes.widens(src, dst) == exact, (src, dst)


@pytest.mark.parametrize("package", ["castwise.policy", "castwise.applied", "castwise.lint"])
def test_no_submodule_is_shadowed_by_a_name_its_package_exports(package: str) -> None:
    """`import castwise.applied.inspection as m` must give the module, never a function the
    package re-exports under the same name (why no module is named apply, audit or resolve)."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        assert getattr(pkg, info.name) is module, f"{package}.{info.name} is shadowed"
