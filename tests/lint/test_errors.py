"""Files castwise cannot read: a ConfigError with file and line, never another exception."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from castwise.errors import ConfigError
from castwise.lint import lint_config
from castwise.lint._source import MAX_BYTES
from castwise.report import Report


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("default_config.yaml", "mixed_precision: bf16\ndistributed_type: [DEEPSPEED\nuse_cpu: false\n", 3),
        ("ds_config.json", '{\n  "fp16": {"enabled": true,}\n}\n', 2),
        ("config.toml", '"--mixed_precision" = "bf16"\n"--gradient_precision" = \n', 2),
        ("config.env", 'export MIXED_PRECISION="bf16\nexport X=1\n', 1),
    ],
)
def test_broken_syntax_names_file_and_line(tmp_path: Path, name: str, text: str, line: int) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        lint_config(path)
    assert info.value.path == str(path)
    assert info.value.line == line
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_binary_garbage(tmp_path: Path) -> None:
    path = write(tmp_path, "default_config.yaml", b"compute_environment: x\n\x89PNG\r\n\x1a\n\x00\x00\xff")
    with pytest.raises(ConfigError, match="binary") as info:
        lint_config(path)
    assert info.value.line == 4  # the line of the first NUL byte


def test_not_utf8(tmp_path: Path) -> None:
    path = write(tmp_path, "config.env", b"export A=1\nexport B=\xff\xfe\n")
    with pytest.raises(ConfigError, match="UTF-8") as info:
        lint_config(path)
    assert info.value.line == 2


def test_huge_file_refused_from_its_size(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    with path.open("wb") as fh:  # sparse: 50 MB without writing 50 MB
        fh.truncate(50 * 1024 * 1024)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="MiB"):
        lint_config(path)
    assert time.perf_counter() - start < 5  # refused before reading (generous bound: shared CI)
    assert MAX_BYTES < 50 * 1024 * 1024


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        lint_config(tmp_path / "nope.yaml")


def test_missing_referenced_file_names_the_setting(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "default_config.yaml",
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: missing/ds.json\n"
        "mixed_precision: bf16\n",
    )
    with pytest.raises(ConfigError, match=r"deepspeed_config\.deepspeed_config_file") as info:
        lint_config(path)
    assert (info.value.path, info.value.line) == (str(path), 3)


def test_missing_deepspeed_file_of_training_args(tmp_path: Path) -> None:
    path = write(tmp_path, "args.json", '{"output_dir": "o",\n "bf16": true,\n "deepspeed": "ds_nope.json"}')
    with pytest.raises(ConfigError, match=r"ds_nope\.json") as info:
        lint_config(path)
    assert info.value.line == 3


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("notes.txt", "just some words\n"),
        ("settings.yaml", "colour: blue\nsize: 3\n"),
        ("data.json", '{"a": 1}'),
        ("pyproject.toml", '[project]\nname = "x"\n'),
    ],
)
def test_unknown_format_lists_the_formats(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(ConfigError, match="castwise reads: Accelerate config") as info:
        lint_config(write(tmp_path, name, text))
    assert "DeepSpeed" in str(info.value) and "SimpleTuner" in str(info.value)


# open_clip's own launch script: its precision is on the command line, not in a config castwise reads
OPEN_CLIP_LAUNCH = """\
#!/bin/bash
export CUDA_VISIBLE_DEVICES=0,1,2,3
export OMP_NUM_THREADS=8
cd open_clip/src
torchrun --nproc_per_node 4 -m open_clip_train.main \\
    --train-data '/data/cc12m/cc12m-train-{0000..2175}.tar' \\
    --batch-size 320 \\
    --precision amp_bf16 \\
    --model ViT-B-32
"""


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("train_openclip.sh", OPEN_CLIP_LAUNCH),
        ("launch.env", OPEN_CLIP_LAUNCH.replace("#!/bin/bash\n", "")),
        ("run", OPEN_CLIP_LAUNCH.replace("#!/bin/bash\n", "")),  # no suffix: shell by its first line
    ],
)
def test_launch_script_of_another_project_is_refused_not_read_as_simpletuner(
    tmp_path: Path, name: str, text: str
) -> None:
    with pytest.raises(ConfigError, match=r"sets none of SimpleTuner's config\.env variables") as info:
        lint_config(write(tmp_path, name, text))
    message = str(info.value)
    assert "castwise reads: Accelerate config" in message and "DeepSpeed" in message and "Lightning" in message
    assert "name it e.g. config.env" not in message  # renaming would bring the wrong reading back


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("default_config.yaml", "- a\n- b\n"),
        ("ds_config.json", "[1, 2]"),
        ("trainer.yaml", ""),
    ],
)
def test_document_that_is_not_a_mapping(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        lint_config(write(tmp_path, name, text))


def test_deep_nesting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        lint_config(write(tmp_path, "ds_config.json", "[" * 100_000 + "]" * 100_000))
    with pytest.raises(ConfigError):
        lint_config(write(tmp_path, "default_config.yaml", "a: " + "[" * 50_000 + "]" * 50_000))


NAMES = [
    "config.env",
    "config.json",
    "config.toml",
    "default_config.yaml",
    "ds_config.json",
    "trainer.yaml",
    "training_args.json",
    "run.sh",
    "other.yml",
]
PREFIXES = [
    "",
    "export MIXED_PRECISION=",
    "{",
    '{"fp16": ',
    "trainer:\n  precision: ",
    "mixed_precision: ",
    '"--mixed_precision" = ',
    "compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  deepspeed_config_file: ",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(NAMES),
    prefix=st.sampled_from(PREFIXES),
    body=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200),
)
def test_random_text_gives_report_or_config_error(tmp_path: Path, name: str, prefix: str, body: str) -> None:
    path = tmp_path / name
    path.write_text(prefix + body, encoding="utf-8")
    try:
        result = lint_config(path)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(result, Report)
        result.to_json()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(NAMES), body=st.text(alphabet="{}[]\":,\n -=$'#\\tfalseuo0123{}bf16p.", max_size=120))
def test_random_syntax_soup_gives_report_or_config_error(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    try:
        result = lint_config(path)
    except ConfigError:
        return
    assert isinstance(result, Report)


def test_yaml_alias_bomb_is_quick(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    text = "mixed_precision: bf16\ndistributed_type: 'NO'\n" + "\n".join(lines) + "\n"
    path = write(tmp_path, "default_config.yaml", text)
    start = time.perf_counter()
    report = lint_config(path)
    assert time.perf_counter() - start < 5
    assert report.ok


# any JSON-like value, placed under the keys the readers look at: wrong types must be ignored
# (or refused with ConfigError), never crash a reader
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 70000)
    | st.floats(allow_nan=False)
    | st.sampled_from(
        [
            "auto",
            "bf16",
            "fp16",
            "fp32",
            "no",
            "16-mixed",
            "bf16-true",
            "16",
            "cpu",
            "true",
            "ml.p3.2xlarge",
            "DEEPSPEED",
            "MULTI_CPU",
            "float16",
            "nope.json",
            "HalfPrecision",
            "lightning.pytorch.strategies.DeepSpeedStrategy",
            "",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "enabled",
                    "class_path",
                    "init_args",
                    "precision",
                    "loss_scale",
                    "config",
                    "fp16",
                    "bf16",
                    "deepspeed_config_file",
                    "x",
                ]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
KEYS = [
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "communication_data_type",
    "data_types",
    "mixed_precision",
    "distributed_type",
    "use_cpu",
    "ec2_instance_type",
    "deepspeed_config",
    "fsdp_config",
    "trainer",
    "precision",
    "plugins",
    "strategy",
    "accelerator",
    "output_dir",
    "deepspeed",
    "torch_dtype",
    "model_init_kwargs",
    "use_cpu",
    "fp16_full_eval",
    "bf16_full_eval",
    "--mixed_precision",
    "gradient_precision",
    "base_model_precision",
    "compute_environment",
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(
        ["ds_config.json", "training_args.json", "config.json", "default_config.yaml", "trainer.yaml", "x.yaml"]
    ),
    data=st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=6),
)
def test_random_values_under_known_keys(tmp_path: Path, name: str, data: dict[str, object]) -> None:
    import json

    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")  # JSON is valid YAML too
    try:
        result = lint_config(path)
    except ConfigError:
        return
    assert isinstance(result, Report)
    result.to_json()


def test_endless_device_is_refused_not_read_forever() -> None:
    # a device reports size 0; reading stops at the limit
    with pytest.raises(ConfigError, match="MiB"):
        lint_config("/dev/zero")
