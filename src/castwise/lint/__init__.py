"""`castwise lint-config`: contradictory precision settings, found from the files alone.

``lint_config(path)`` reads one training configuration (or several used together), turns
them into castwise's precision model (`PrecisionModel`: weights, compute, gradient,
optimizer-state and reduce dtypes, loss scaling, device, each traced back to the settings it
comes from) and checks it with the CW2xx rules. Torch is never imported.

Formats: SimpleTuner config.env / config.json / config.toml, Accelerate default_config.yaml
(and the DeepSpeed file it points to), DeepSpeed JSON, Lightning / LightningCLI YAML, Hugging
Face TrainingArguments JSON (or YAML), torchtitan job TOML. The format is detected from the content, and from the
file name where the content does not say.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from castwise.errors import ConfigError
from castwise.lint import accelerate, deepspeed, hf, lightning, megatron, megatron_bridge, simpletuner, torchtitan
from castwise.lint._source import (
    Document,
    looks_like_shell,
    parse_json,
    parse_shell,
    parse_toml,
    parse_yaml,
    read_text,
)
from castwise.lint.model import FORMATS, LEDGER_EXTRA, ConfigFile, PrecisionModel, Setting, Traced
from castwise.report import Report

__all__ = [
    "FORMATS",
    "ConfigFile",
    "PrecisionModel",
    "Setting",
    "Traced",
    "build_model",
    "lint_config",
    "read_config",
    "render",
]

PathLike = str | os.PathLike[str]


_NAME_IT = " (name it e.g. config.env, default_config.yaml, ds_config.json)"


def _unknown(shown: str, what: str, why: str = "", name_it: str = _NAME_IT) -> ConfigError:
    return ConfigError(
        f"cannot tell which training configuration this {what} is{why}; castwise reads: "
        + "; ".join(FORMATS[k] for k in sorted(FORMATS))
        + f". Check the file is one of these{name_it}",
        path=shown,
        line=1,
    )


def _name_hint(name: str) -> str | None:
    n = name.lower()
    if "deepspeed" in n or n.startswith(("ds_config", "ds-config", "zero")):
        return "deepspeed"
    if "accelerate" in n or n in ("default_config.yaml", "default_config.yml"):
        return "accelerate"
    if "lightning" in n or "trainer" in n:
        return "lightning"
    if "training_args" in n or "trainingarguments" in n:
        return "hf-training-args"
    return None


class _Loader:
    """Reads files once each (a DeepSpeed file named by two configs is one file)."""

    def __init__(self) -> None:
        self.seen: dict[Path, ConfigFile] = {}

    def load(self, path: Path, shown: str, expect: str | None = None, via: Setting | None = None) -> ConfigFile:
        key = path.resolve() if path.exists() else path.absolute()
        if key in self.seen:
            return self.seen[key]
        if via is not None and not path.exists():
            raise ConfigError(
                f"{via.name} points to {via.text!r}, which does not exist "
                f"(looked for {shown}); fix the path in the setting",
                path=via.file,
                line=via.line,
            )
        text = read_text(path, shown)
        cf = self._read(path, shown, text, expect, via)
        self.seen[key] = cf
        return cf

    def _link(self, path: Path, shown: str, via: Setting) -> ConfigFile:
        return self.load(path, shown, expect="deepspeed", via=via)

    def _read(self, path: Path, shown: str, text: str, expect: str | None, via: Setting | None) -> ConfigFile:
        name = path.name.lower()
        suffix = path.suffix.lower()
        base = path.parent
        if (
            suffix in (".env", ".sh")
            or name == "config.env"
            or (suffix not in (".json", ".yaml", ".yml", ".toml") and looks_like_shell(text))
        ):
            if name != "config.env" and megatron.is_megatron(text):
                return megatron.read(text, shown)
            if name != "config.env" and not simpletuner.is_simpletuner_env(parse_shell(text, shown)):
                # e.g. a `torchrun train.py --precision amp_bf16` launch script: read as SimpleTuner
                # it would get SimpleTuner's defaults, a precision model of a run that is not this one
                raise _unknown(
                    shown,
                    "shell file",
                    " (it sets none of SimpleTuner's config.env variables, such as MIXED_PRECISION; "
                    "castwise does not read the command lines of launch scripts)",
                    name_it=", and give castwise the configuration files the script uses",
                )
            return simpletuner.read_env(text, shown)
        if suffix == ".toml":
            doc = parse_toml(text, shown)
            if torchtitan.is_torchtitan(doc.data) and not simpletuner.is_simpletuner_mapping(doc.data):
                return torchtitan.read(doc, text, shown)
            known = simpletuner.is_simpletuner_mapping(doc.data) or "mixed_precision" in doc.data
            if expect is None and not known:
                raise _unknown(shown, "TOML file")
            return simpletuner.read_mapping(doc, shown)
        if suffix == ".json" or (suffix not in (".yaml", ".yml") and text.lstrip().startswith("{")):
            doc = parse_json(text, shown)
            return self._mapping(doc, shown, base, expect or self._json_format(doc, name))
        if suffix in (".yaml", ".yml"):
            doc = parse_yaml(text, shown)
            return self._mapping(doc, shown, base, expect or self._yaml_format(doc, name))
        raise _unknown(shown, "file")

    def _json_format(self, doc: Document, name: str) -> str | None:
        data = doc.data
        if any(k.startswith("--") for k in data):
            return "simpletuner"
        if deepspeed.is_deepspeed_mapping(data):
            return "deepspeed"
        if simpletuner.is_simpletuner_mapping(data):
            return "simpletuner"
        if hf.is_hf_mapping(data):
            return "hf-training-args"
        hint = _name_hint(name)
        if hint is None and ("mixed_precision" in data or "gradient_precision" in data):
            return "simpletuner"
        return hint

    def _yaml_format(self, doc: Document, name: str) -> str | None:
        data = doc.data
        if megatron_bridge.is_megatron_bridge(data):
            return "megatron-bridge"
        if accelerate.is_accelerate_mapping(data):
            return "accelerate"
        if lightning.is_lightning_mapping(data):
            return "lightning"
        if hf.is_hf_mapping(data):
            return "hf-training-args"
        hint = _name_hint(name)
        if hint is None and "mixed_precision" in data and ("use_cpu" in data or "num_processes" in data):
            return "accelerate"
        return hint

    def _mapping(self, doc: Document, shown: str, base: Path, fmt: str | None) -> ConfigFile:
        if fmt == "simpletuner":
            return simpletuner.read_mapping(doc, shown)
        if fmt == "deepspeed":
            return deepspeed.read(doc, shown)
        if fmt == "accelerate":
            return accelerate.read(doc, shown, base, self._link)
        if fmt == "lightning":
            return lightning.read(doc, shown, base, self._link)
        if fmt == "hf-training-args":
            return hf.read(doc, shown, base, self._link)
        if fmt == "megatron-bridge":
            return megatron_bridge.read(doc, shown)
        raise _unknown(shown, "file")


def read_config(paths: PathLike | Sequence[PathLike]) -> list[ConfigFile]:
    """Every file of the run, read: the given ones, then the files they point to."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ConfigError("no configuration file given; pass one or more paths")
    loader = _Loader()
    out: list[ConfigFile] = []

    def add(cf: ConfigFile) -> None:
        if any(c is cf for c in out):
            return
        out.append(cf)
        for link in cf.links:
            add(link)

    for item in items:
        p = Path(item)
        add(loader.load(p, str(item)))
    return out


class _Builder:
    """Collects the model's values; a weak value (a launcher's default) never replaces one
    that a file states."""

    def __init__(self) -> None:
        self.values: dict[str, Traced] = {}
        self.weak: set[str] = set()
        self.mechanism = "autograd"

    def put(self, name: str, traced: Traced, mechanism: str = "autograd", weak: bool = False) -> None:
        if weak and name in self.values:
            return
        self.values[name] = traced
        if weak:
            self.weak.add(name)
        else:
            self.weak.discard(name)
        if name == "gradients":
            self.mechanism = mechanism

    def model(self) -> PrecisionModel:
        v = self.values
        return PrecisionModel(
            weights=v.get("weights"),
            compute=v.get("compute"),
            gradients=v.get("gradients"),
            loss_scaling=v.get("loss_scaling"),
            optimizer_state=v.get("optimizer_state"),
            reduce=v.get("reduce"),
            device=v.get("device"),
            gradient_mechanism=self.mechanism,
            master=v.get("master"),
            state_scheme=v.get("state_scheme"),
            rounding=v.get("rounding"),
            checkpoint_load=v.get("checkpoint_load"),
            accumulate_steps=v.get("accumulate_steps"),
        )


_LAUNCH_ORDER = (
    "simpletuner",
    "accelerate",
    "hf-training-args",
    "lightning",
    "torchtitan",
    "megatron",
    "megatron-bridge",
    "deepspeed",
)


def build_model(files: Sequence[ConfigFile]) -> PrecisionModel:
    """Combine the files of one run into the precision model.

    Launchers (SimpleTuner, Accelerate, TrainingArguments, Lightning) first, DeepSpeed last:
    when a DeepSpeed config takes part, its engine decides the weights, master weights and
    loss scaling, and its "auto" values take the launcher's settings.
    """
    b = _Builder()
    put = b.put
    auto: dict[str, tuple[bool, tuple[Setting, ...]]] = {}
    for fmt in _LAUNCH_ORDER:
        for cf in files:
            if cf.format != fmt:
                continue
            if fmt == "simpletuner":
                simpletuner.contribute(cf, put)
            elif fmt == "accelerate":
                accelerate.contribute(cf, put)
                mp, s = accelerate.mixed_precision(cf)
                if mp is not None and s is not None:
                    auto.setdefault("fp16.enabled", (mp == "fp16", (s,)))
                    auto.setdefault("bf16.enabled", (mp in ("bf16", "fp8"), (s,)))
            elif fmt == "hf-training-args":
                hf.contribute(cf, put)
                for k, v in hf.flags(cf).items():
                    auto.setdefault(k, v)
            elif fmt == "lightning":
                lightning.contribute(cf, put)
            elif fmt == "torchtitan":
                torchtitan.contribute(cf, put)
            elif fmt == "megatron":
                megatron.contribute(cf, put)
            elif fmt == "megatron-bridge":
                megatron.contribute(megatron_bridge.megatron_view(cf), put)
            else:
                deepspeed.contribute(cf, put, auto)
    _ddp_reduce(files, b)
    return b.model()


_DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU")


def _ddp_reduce(files: Sequence[ConfigFile], b: _Builder) -> None:
    """DDP's reduce dtype: torch/nn/parallel/distributed.py buckets gradients by ``param.grad``'s
    dtype (the Reducer all-reduces each bucket as it is), so DDP reduces in the gradients' dtype."""
    grads = b.values.get("gradients")
    if "reduce" in b.values or grads is None:
        return
    for cf in files:
        s = cf.get("distributed_type") if cf.format == "accelerate" else cf.get("strategy")
        if cf.format not in ("accelerate", "lightning") or s is None or not isinstance(s.value, str):
            continue
        word = s.value.strip()
        if word.upper() in _DDP_TYPES or (cf.format == "lightning" and word.lower().startswith("ddp")):
            note = "DDP all-reduces gradient buckets in param.grad's dtype (torch.nn.parallel Reducer)"
            b.put("reduce", Traced(grads.value, (s, *grads.settings), note))
            return


def lint_config(path: PathLike | Sequence[PathLike]) -> Report:
    """Check the precision settings of a training configuration (one file, or a list of files
    used by one run) for contradictions. Raises ConfigError for a file castwise cannot read."""
    from castwise.lint.checks import run_checks

    files = read_config(path)
    model = build_model(files)
    findings = run_checks(files, model)
    names = ", ".join(dict.fromkeys(cf.path for cf in files))
    return Report(
        findings=findings,
        title=f"castwise lint-config {names}",
        summary={
            "files": [{"path": cf.path, "format": cf.format} for cf in files],
            "precision": model.to_dict(),
        },
    )


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _short_location(location: str, report: Report) -> str:
    """``file:line`` with the file's name alone when no two files read share it (the report's
    header and findings give the full paths): the table stays narrow."""
    paths = [str(f["path"]) for f in report.summary.get("files", [])]
    names = [Path(p).name for p in paths]
    for path in paths:
        if location.startswith(f"{path}:") and names.count(Path(path).name) == 1:
            return Path(path).name + location[len(path) :]
    return location


def _pack(units: list[str], head: str, width: int) -> list[str]:
    """``head`` then the units, comma-separated, as many to a line as fit; a unit (a setting with
    its location) is never split, continuation lines align under the first unit."""
    lines = [head + units[0]]
    for unit in units[1:]:
        if len(lines[-1]) + 2 + len(unit) <= width:
            lines[-1] += f", {unit}"
        else:
            lines[-1] += ","
            lines.append(" " * len(head) + unit)
    return lines


def render(report: Report, width: int = 100) -> str:
    """The report as `castwise lint-config` prints it: findings, then the precision model, at
    ``width`` columns (each setting's source wraps under the "from" column)."""
    from castwise.report import render_report

    text = render_report(report, width)
    precision: Any = report.summary.get("precision")
    if not isinstance(precision, dict):
        return text
    # the format each file was read as: a file read as the wrong one would show a wrong model
    read_as = [f"{Path(f['path']).name} as {FORMATS.get(f['format'], f['format'])}" for f in report.summary["files"]]
    rows = ["", *_pack(read_as, "read: ", width), "precision model (what the run will do):"]
    extra = [k for k in LEDGER_EXTRA if precision.get(k) is not None]
    for name in ("weights", "compute", "gradients", "loss_scaling", "optimizer_state", "reduce", "device", *extra):
        t = precision.get(name)
        if t is None:
            rows.append(f"  {name:<16} (not set by these files)")
            continue
        from castwise._dtypes import short

        units = [
            f"{s['name']}={_text(s['value'])} ({_short_location(s['location'], report)})" for s in t["settings"]
        ] or ["default"]
        rows += _pack(units, f"  {name:<16} {short(t['value']):<10} from ", width)
    return text + "\n" + "\n".join(rows)
