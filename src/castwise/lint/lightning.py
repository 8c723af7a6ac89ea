"""Lightning Trainer settings in YAML: a LightningCLI config (``trainer:`` section) or a bare
mapping of Trainer arguments.

Semantics (Lightning-AI/pytorch-lightning, lightning/pytorch/trainer/connectors/
accelerator_connector.py and lightning/fabric/plugins/precision/):
- ``precision``: ``32-true``, ``64-true``, ``16-mixed``, ``bf16-mixed``, ``16-true``,
  ``bf16-true``, ``transformer-engine``...; the aliases 16, 32, 64, "bf16" convert to
  ``16-mixed``, ``32-true``, ``64-true``, ``bf16-mixed``. ``*-mixed``: float32 weights and
  autocast (MixedPrecision; 16-mixed adds a GradScaler). ``*-true``: HalfPrecision converts the
  module to the dtype; it has no GradScaler. ``transformer-engine`` (``-float16``):
  TransformerEnginePrecision converts the module to bf16 (f16) and runs float8 GEMMs under
  te.fp8_autocast (castwise's presets of the same names).
- ``plugins`` holding a Precision plugin while ``precision`` is also given raises
  "Received both `precision=...` and `plugins=...`. Choose one."
- ``accelerator: cpu`` with ``16-mixed``: Lightning warns that fp16 AMP is not supported on CPU
  and runs ``bf16-mixed`` instead.
- DeepSpeed strategies use DeepSpeedPrecision: the engine converts the module to the dtype and
  keeps float32 master weights. ``DeepSpeedStrategy(config=...)`` (a JSON path or a dict) is
  completed by fabric/strategies/deepspeed.py _format_precision_config: an ``fp16`` block is
  added for 16-mixed/16-true only when the config has none, a ``bf16`` block for bf16-* only
  when it has none; blocks already in the file are kept as written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from castwise.lint import deepspeed
from castwise.lint._source import Document, Path_
from castwise.lint.model import ConfigFile, Setting, Traced
from castwise.policy import presets

# Lightning's precision shorthands, shared with castwise.Policy's "lightning:" prefix
ALIASES: dict[str, str] = presets.LIGHTNING_ALIASES


def is_lightning_mapping(data: dict[str, Any]) -> bool:
    if isinstance(data.get("trainer"), dict):
        return True
    # a bare mapping of Trainer arguments
    return any(k in data for k in ("precision", "accelerator", "strategy", "plugins"))


def normalize(value: Any) -> str:
    text = str(value).strip().lower()
    return ALIASES.get(text, text)


def _plugin_entries(node: Any) -> list[tuple[Any, Path_]]:
    if isinstance(node, list):
        return [(item, (i,)) for i, item in enumerate(node)]
    return [(node, ())] if node is not None else []


def is_precision_plugin(class_path: str) -> bool:
    last = class_path.rsplit(".", 1)[-1]
    return last.endswith("Precision") or last.endswith("PrecisionPlugin")


def read(
    doc: Document,
    shown: str,
    base: Path | None = None,
    load_link: Callable[[Path, str, Setting], ConfigFile] | None = None,
) -> ConfigFile:
    prefix: Path_ = ("trainer",) if isinstance(doc.data.get("trainer"), dict) else ()
    trainer: dict[str, Any] = doc.data["trainer"] if prefix else doc.data
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}

    def name(*path: str | int) -> str:
        return ".".join(str(p) for p in (*prefix, *path) if not isinstance(p, int))

    for key in ("precision", "accelerator", "devices"):
        value = trainer.get(key)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            settings[key] = Setting(name(key), value, shown, doc.line((*prefix, key)))
        elif key == "precision" and value is not None:  # devices may be a list; precision never
            rejected[key] = Setting(name(key), value, shown, doc.line((*prefix, key)))
    strategy = trainer.get("strategy")
    if isinstance(strategy, str):
        settings["strategy"] = Setting(name("strategy"), strategy, shown, doc.line((*prefix, "strategy")))
    links: tuple[ConfigFile, ...] = ()
    if isinstance(strategy, dict) and isinstance(strategy.get("class_path"), str):
        settings["strategy"] = Setting(
            name("strategy"), strategy["class_path"], shown, doc.line((*prefix, "strategy", "class_path"))
        )
        init = strategy.get("init_args")
        ds_config = init.get("config") if isinstance(init, dict) else None
        at: Path_ = (*prefix, "strategy", "init_args", "config")
        if "deepspeed" in strategy["class_path"].lower() and isinstance(ds_config, dict):
            links = (deepspeed.read(doc, shown, at, linked_from=name("strategy", "init_args", "config")),)
        elif (
            "deepspeed" in strategy["class_path"].lower()
            and isinstance(ds_config, str)
            and ds_config.strip()
            and load_link is not None
            and base is not None
        ):
            via = Setting(name("strategy", "init_args", "config"), ds_config, shown, doc.line(at))
            target = Path(ds_config.strip()).expanduser()
            # Lightning opens the path from the working directory; castwise looks beside the YAML first
            candidate = target if target.is_absolute() else base / target
            if not candidate.exists() and not target.is_absolute() and target.exists():
                candidate = target
            links = (load_link(candidate, str(candidate), via),)
    for item, sub in _plugin_entries(trainer.get("plugins")):
        class_path = item.get("class_path") if isinstance(item, dict) else item
        if isinstance(class_path, str) and is_precision_plugin(class_path):
            settings["precision_plugin"] = Setting(
                name("plugins"), class_path, shown, doc.line((*prefix, "plugins", *sub))
            )
            init = item.get("init_args") if isinstance(item, dict) else None
            recipe = init.get("recipe") if isinstance(init, dict) else None
            if class_path.endswith("TransformerEnginePrecision") and isinstance(recipe, dict):
                # DelayedScaling(**recipe): lint_fp8_recipes checks its keys (castwise.lint.fp8_recipes)
                for k, v in recipe.items():
                    at_key: Path_ = (*prefix, "plugins", *sub, "init_args", "recipe", str(k))
                    settings[f"te_recipe.{k}"] = Setting(
                        name("plugins", "init_args", "recipe", str(k)), v, shown, doc.line(at_key)
                    )
            if isinstance(init, dict) and isinstance(init.get("precision"), (str, int)):
                settings["plugin_precision"] = Setting(
                    name("plugins", "init_args", "precision"),
                    init["precision"],
                    shown,
                    doc.line((*prefix, "plugins", *sub, "init_args", "precision")),
                )
            break
    return ConfigFile(shown, "lightning", settings, links, rejected=rejected)


def effective_precision(cf: ConfigFile) -> tuple[str | None, tuple[Setting, ...]]:
    """The precision the Trainer runs and the settings that say so (None: not set)."""
    p = cf.get("precision")
    if p is not None:
        value = normalize(p.value)
        acc = cf.get("accelerator")
        if value == "16-mixed" and acc is not None and str(acc.value).lower() == "cpu":
            return "bf16-mixed", (p, acc)  # Lightning swaps fp16 AMP for bf16 AMP on CPU
        return value, (p,)
    plugin = cf.get("precision_plugin")
    if plugin is not None:
        last = str(plugin.value).rsplit(".", 1)[-1]
        pp = cf.get("plugin_precision")
        if pp is not None:
            return normalize(pp.value), (plugin, pp)
        if last.startswith("Half"):
            return "16-true", (plugin,)  # HalfPrecision's default
        if last.startswith("Double"):
            return "64-true", (plugin,)
    return None, ()


def contribute(cf: ConfigFile, put: Any) -> None:
    precision, src = effective_precision(cf)
    strategy = cf.get("strategy")
    on_deepspeed = strategy is not None and "deepspeed" in str(strategy.value).lower()
    # what each precision does to weights, compute and loss scaling: castwise's own presets
    preset = presets.lightning(precision) if precision is not None else None
    if preset is not None and precision is not None:
        weights, compute, scaling = preset.params, preset.gemm, preset.loss_scaling
        note = (
            "MixedPrecision: autocast over float32 weights"
            if precision.endswith("-mixed")
            else "the module is converted to this dtype"
        )
        if on_deepspeed and strategy is not None and precision in ("16-mixed", "bf16-mixed"):
            weights = compute
            src = (*src, strategy)
            note = "DeepSpeedPrecision: the engine converts the module; fp32 master weights in the optimizer"
            put("optimizer_state", Traced("float32", src, note))
        else:
            put("optimizer_state", Traced(weights, src, "optimizer state follows the parameters' dtype"))
        put("weights", Traced(weights, src, note))
        put("compute", Traced(compute, src, note))
        put("gradients", Traced(weights, src, "gradients follow the weights"))
        put("loss_scaling", Traced(scaling, src, "16-mixed uses a GradScaler; other precisions none"))
    acc = cf.get("accelerator")
    if acc is not None:
        dev = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps", "tpu": "xla"}.get(str(acc.value).lower())
        if dev is not None:
            put("device", Traced(dev, (acc,), "accelerator"))
