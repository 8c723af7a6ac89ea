"""The CW2xx checks: contradictions in the precision model and between settings.

Each check names the settings involved exactly as written (``Finding.settings``), where each
is (``Finding.locations``, "file:line"), what contradicts what (``message``) and which setting
to change (``fix``). Rule pages live in castwise/rules/lint.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from castwise._dtypes import is_low, short
from castwise.lint import accelerate, fp8, fp8_recipes, fsdp, hf, ledger_checks, lightning
from castwise.lint.model import ConfigFile, PrecisionModel, finding, is_auto, is_false, is_true, said
from castwise.lint.values import check_values
from castwise.policy import presets
from castwise.report import Finding

# GPUs below compute capability 8.0: no bf16 arithmetic (torch.cuda.is_bf16_supported is False
# for them without emulation; transformers: "You need Ampere+ GPU with cuda>=11.0")
NO_BF16_GPUS: frozenset[str] = frozenset({"K80", "M60", "P100", "P4", "P40", "V100", "T4"})


def _cw201(model: PrecisionModel) -> list[Finding]:
    # SimpleTuner trainer._handle_backward_step: `param.grad.data = param.grad.data.to(torch.float32)`
    # for bf16 parameters (weight_dtype bf16 when mixed_precision == "bf16"). A DeepSpeed
    # grad_accum_dtype buffer ("accumulate") is a supported layout, not this contradiction.
    w, g = model.weights, model.gradients
    if w is None or g is None or not is_low(w.value) or g.value != "float32" or model.gradient_mechanism != "cast":
        return []
    grad_setting = g.settings[-1]
    said_w = said(w.settings) if w.settings else f"The default ({w.note})"
    keep = w.settings[0].name if w.settings else "the mixed precision setting"
    return [
        finding(
            "CW201",
            (*w.settings, *g.settings),
            f"{said_w} store the trained weights in {short(w.value)}, but {said(g.settings)} "
            f"converts every gradient to f32 after backward: param.grad (f32) no longer matches its "
            f"{short(w.value)} parameter, and backward fails ('Expected BFloat16, got Float') once the "
            "model has loaded.",
            f"Change {grad_setting.name}: remove it or set it to `unmodified` so gradients follow the "
            f"{short(w.value)} weights. If you want f32 gradients, keep f32 master weights instead "
            f"(change {keep}).",
        )
    ]


def _cw202(files: Sequence[ConfigFile]) -> list[Finding]:
    # DeepSpeedConfig: assert not (fp16 enabled and bf16 enabled); TrainingArguments.__post_init__:
    # "At most one of fp16 and bf16 can be True" (and the same for *_full_eval)
    out = []
    for cf in files:
        pairs: list[tuple[str, str]] = []
        if cf.format == "deepspeed":
            pairs = [("fp16.enabled", "bf16.enabled")]
        elif cf.format == "hf-training-args":
            pairs = [("fp16", "bf16"), ("fp16_full_eval", "bf16_full_eval")]
        for a, b in pairs:
            sa, sb = cf.get(a), cf.get(b)
            if sa is None or sb is None or not is_true(sa.value) or not is_true(sb.value):
                continue
            refusal = (
                "DeepSpeed refuses it: 'bfloat16 and fp16 modes cannot be simultaneously enabled'"
                if cf.format == "deepspeed"
                else "TrainingArguments raises 'At most one of fp16 and bf16 can be True, but not both'"
            )
            out.append(
                finding(
                    "CW202",
                    (sa, sb),
                    f"{said((sa, sb))}: a run has one half-precision dtype, and {refusal}.",
                    f"Set {sb.name} to false to train in fp16 (GPUs before Ampere), or {sa.name} to false "
                    "to train in bf16 (Ampere or newer, no loss scaling needed)"
                    + (', or write "auto" in both and let the launcher decide.' if cf.format == "deepspeed" else "."),
                )
            )
    return out


def _cw203(files: Sequence[ConfigFile]) -> list[Finding]:
    # accelerate DeepSpeedPlugin.set_mixed_precision: raises when the file enables the other
    # dtype; fills only "auto" (fill_match(..., must_match=False)), so explicit values win
    out = []
    ds_files = [cf for cf in files if cf.format == "deepspeed"]
    for acc in (cf for cf in files if cf.format == "accelerate"):
        mp, s = accelerate.mixed_precision(acc)
        if mp is None or s is None:
            continue
        dist = acc.get("distributed_type")
        linked = [cf for cf in acc.links if cf.format == "deepspeed"]
        targets = linked or (ds_files if dist is not None and str(dist.value).upper() == "DEEPSPEED" else [])
        for ds in targets:
            fp16, bf16 = ds.get("fp16.enabled"), ds.get("bf16.enabled")
            if mp in ("fp16", "bf16", "fp8"):
                mine = "fp16" if mp == "fp16" else "bf16"
                other_s = bf16 if mine == "fp16" else fp16
                mine_s = fp16 if mine == "fp16" else bf16
                if other_s is not None and is_true(other_s.value):
                    out.append(
                        finding(
                            "CW203",
                            (s, other_s),
                            f"{said((s,))} asks for {mine}, but the DeepSpeed file enables the other "
                            f'dtype: {said((other_s,))}. Accelerate raises "`--mixed_precision` arg '
                            f"cannot be set to `{mp}` when `{other_s.name.split('.')[0]}` is set in the "
                            'DeepSpeed config file".',
                            f'Write "auto" for {other_s.name} and {mine}.enabled in {other_s.file} so '
                            f"{s.name} decides, or change {s.name} to the dtype the DeepSpeed file enables.",
                        )
                    )
                elif mine_s is not None and is_false(mine_s.value):
                    out.append(
                        finding(
                            "CW203",
                            (s, mine_s),
                            f"{said((s,))} asks for {mine}, but {said((mine_s,))} disables it; "
                            'Accelerate only fills "auto" values, so DeepSpeed trains in fp32 while '
                            f"the launcher reports {mp}.",
                            f'Set {mine_s.name} to "auto" (or true) in {mine_s.file}, or set {s.name} to no.',
                            severity="warning",
                        )
                    )
            elif mp == "no":
                for on in (x for x in (fp16, bf16) if x is not None and is_true(x.value)):
                    out.append(
                        finding(
                            "CW203",
                            (s, on),
                            f"{said((s,))} asks for no mixed precision, but {said((on,))} makes DeepSpeed "
                            f"convert the model to {on.name.split('.')[0]}: the file wins, and code that "
                            "trusts accelerator.mixed_precision (input casting, autocast) does the wrong thing.",
                            f'Set {on.name} to "auto" so {s.name} decides, or set {s.name} to {on.name.split(".")[0]}.',
                            severity="warning",
                        )
                    )
    return out


def _cw204(model: PrecisionModel) -> list[Finding]:
    # torch.amp.GradScaler.unscale_ raises "Attempting to unscale FP16 gradients." for fp16 grads;
    # DeepSpeed's fp16 engine keeps fp32 master weights and its own scaler, so it is exempt
    w, c, ls, opt = model.weights, model.compute, model.loss_scaling, model.optimizer_state
    if w is None or c is None or ls is None:
        return []
    if w.value != "float16" or c.value != "float16" or ls.value != "dynamic":
        return []
    if opt is not None and opt.value == "float32":
        return []  # float32 master weights (DeepSpeed, ZeRO): the engine's scaler handles fp16 weights
    amp = ls.settings or c.settings
    return (
        [
            finding(
                "CW204",
                (*amp, *w.settings),
                f"{said(amp)} turns on fp16 AMP with a GradScaler, but {said(w.settings)} loads the "
                "weights in float16: GradScaler.unscale_ refuses float16 gradients ('Attempting to "
                "unscale FP16 gradients').",
                f"Change {w.settings[0].name} to float32 (mixed precision keeps f32 master weights), or "
                f"switch {amp[0].name} off and train in bf16.",
            )
        ]
        if w.settings
        else []
    )


def _cw205(files: Sequence[ConfigFile]) -> list[Finding]:
    # lightning _AcceleratorConnector: a Precision plugin and precision != None raise ValueError
    out = []
    for cf in files:
        if cf.format != "lightning":
            continue
        p, plugin = cf.get("precision"), cf.get("precision_plugin")
        if p is None or plugin is None:
            continue
        out.append(
            finding(
                "CW205",
                (p, plugin),
                f"{said((p,))} and a precision plugin {said((plugin,))}: the Trainer refuses both "
                f'("Received both `precision={p.text}` and `plugins=...`. Choose one.").',
                f"Remove {p.name} and set the plugin's init_args.precision, or remove the plugin from "
                f"{plugin.name} and keep {p.name}.",
            )
        )
    return out


def _cw206(model: PrecisionModel) -> list[Finding]:
    # Lightning HalfPrecision (16-true) has no GradScaler; DeepSpeed fp16.loss_scale > 0 is static
    w, c, ls = model.weights, model.compute, model.loss_scaling
    if w is None or c is None or w.value != "float16" or c.value != "float16":
        return []
    if ls is not None and ls.value not in ("none", "static:1"):
        return []
    settings = tuple(dict.fromkeys((*w.settings, *(ls.settings if ls is not None else ()))))
    if not settings:
        return []
    what = "a static loss scale of 1" if ls is not None and ls.value == "static:1" else "no loss scaling"
    return [
        finding(
            "CW206",
            settings,
            f"{said(settings)}: weights and compute in float16 with {what}; gradients below ~6e-8 "
            "flush to zero in float16 and large ones overflow, so training stalls or turns NaN.",
            f"Change {settings[0].name}: use fp16 mixed precision with dynamic loss scaling "
            "(Lightning 16-mixed, TrainingArguments fp16 over f32 weights, DeepSpeed fp16.loss_scale 0), "
            "or bf16 where the hardware supports it.",
            severity="warning",
        )
    ]


def _cw207(files: Sequence[ConfigFile], model: PrecisionModel) -> list[Finding]:
    # bf16 / TF32 need compute capability >= 8.0 (transformers: "You need Ampere+ GPU",
    # "--tf32 requires Ampere or a newer GPU arch"); Accelerator: "fp16 mixed precision requires
    # a GPU"; Lightning: 16-mixed on CPU is replaced by bf16-mixed
    out = []
    dev = model.device
    if dev is not None and dev.settings and dev.value.startswith("cuda:") and dev.value[5:] in NO_BF16_GPUS:
        gpu = dev.value[5:]
        users = [t for t in (model.compute, model.weights) if t is not None and t.value == "bfloat16"]
        src = tuple(dict.fromkeys(s for t in users for s in t.settings))
        if src:
            out.append(
                finding(
                    "CW207",
                    (*src, *dev.settings),
                    f"{said(src)} asks for bf16, but {said(dev.settings)} runs on {gpu} GPUs (compute "
                    "capability below 8.0): no bf16 tensor cores, so bf16 kernels are refused or emulated "
                    "far slower.",
                    f"Change {src[0].name} to fp16 (with loss scaling) or no, or change "
                    f"{dev.settings[0].name} to an Ampere-or-newer instance (A10G, A100, L4, H100).",
                )
            )
        # transformers TrainingArguments: "--tf32 requires Ampere or a newer GPU arch"
        for cf in files:
            tf32 = cf.get("tf32") if cf.format == "hf-training-args" else None
            if tf32 is not None and is_true(tf32.value):
                out.append(
                    finding(
                        "CW207",
                        (tf32, *dev.settings),
                        f"{said((tf32,))} asks for TF32 matmuls, but {said(dev.settings)} runs on {gpu} GPUs: "
                        "TF32 needs Ampere or newer, and TrainingArguments refuses it at start.",
                        f"Remove {tf32.name} (or set it to false), or change {dev.settings[0].name} to an "
                        "Ampere-or-newer instance.",
                    )
                )
    c = model.compute
    on_cpu = dev is not None and dev.settings and dev.value == "cpu"
    if dev is not None and on_cpu and c is not None and c.value == "float16" and c.settings:
        out.append(
            finding(
                "CW207",
                (*c.settings, *dev.settings),
                f"{said(c.settings)} asks for fp16 mixed precision, but {said(dev.settings)} runs on "
                "CPU: Accelerate refuses it ('fp16 mixed precision requires a GPU') or, in newer "
                "versions, runs without a GradScaler.",
                f"Change {c.settings[0].name} to bf16 (CPU autocast supports it) or to no.",
                severity="warning",
            )
        )
    for cf in files:
        if cf.format != "lightning":
            continue
        p, acc = cf.get("precision"), cf.get("accelerator")
        if (
            p is not None
            and acc is not None
            and lightning.normalize(p.value) == "16-mixed"
            and str(acc.value).lower() == "cpu"
        ):
            out.append(
                finding(
                    "CW207",
                    (p, acc),
                    f"{said((p, acc))}: fp16 AMP is not supported on CPU; Lightning warns and runs "
                    "bf16-mixed instead, so the run is not the one the file describes.",
                    f"Set {p.name} to bf16-mixed (what will run) or 32-true.",
                    severity="warning",
                )
            )
    return out


def _cw208(files: Sequence[ConfigFile]) -> list[Finding]:
    # transformers HfTrainerDeepSpeedConfig.trainer_config_process: fill_match("fp16.enabled",
    # args.fp16 or args.fp16_full_eval) and the same for bf16; mismatches raise at Trainer start
    out = []
    for args in (cf for cf in files if cf.format == "hf-training-args"):
        wanted = hf.flags(args)
        for ds in (cf for cf in args.links if cf.format == "deepspeed"):
            for key in ("fp16.enabled", "bf16.enabled"):
                s = ds.get(key)
                if s is None or is_auto(s.value):
                    continue
                hf_on, hf_src = wanted[key]
                if is_true(s.value) == hf_on:
                    continue
                dt = key.split(".")[0]
                hf_text = said(hf_src) if hf_src else f"{dt} not set (false)"
                if not hf_src:
                    # name what the arguments do ask for, so both sides of the mismatch show
                    other = "bf16.enabled" if dt == "fp16" else "fp16.enabled"
                    on, other_src = wanted[other]
                    if on:
                        hf_src = other_src
                        hf_text = f"{said(other_src)} and {dt} not set (false)"
                out.append(
                    finding(
                        "CW208",
                        (*hf_src, s),
                        f"{hf_text} in the TrainingArguments, but {said((s,))} in the DeepSpeed config: "
                        "the Trainer refuses the mismatch at start ('Please correct the following "
                        f"DeepSpeed config values that mismatch TrainingArguments values: - ds {key}').",
                        f'Set {s.name} to "auto" in {s.file} (the Trainer fills it from {dt}), or make '
                        f"{dt} in {args.path} agree with it.",
                    )
                )
    return out


def _cw209(files: Sequence[ConfigFile]) -> list[Finding]:
    # lightning fabric/strategies/deepspeed.py _format_precision_config: adds an fp16 block for
    # 16-* / a bf16 block for bf16-* only when the config has none; DeepSpeed then refuses both
    out = []
    for lt in (cf for cf in files if cf.format == "lightning"):
        p = lt.get("precision")
        if p is None:
            continue
        precision = lightning.normalize(p.value)
        for ds in (cf for cf in lt.links if cf.format == "deepspeed"):
            blocks = {dt: ds.get(f"{dt}.block") for dt in ("fp16", "bf16")}
            on = {dt: s for dt in ("fp16", "bf16") if (s := ds.get(f"{dt}.enabled")) is not None and is_true(s.value)}
            off = {dt: s for dt in ("fp16", "bf16") if (s := ds.get(f"{dt}.enabled")) is not None and is_false(s.value)}
            # the DeepSpeed block Lightning adds: the one named after the precision's compute dtype
            preset = presets.lightning(precision)
            want = {"float16": "fp16", "bfloat16": "bf16"}.get(preset.compute) if preset is not None else None
            if want is not None:
                other = "bf16" if want == "fp16" else "fp16"
                if other in on and blocks[want] is None:
                    out.append(
                        finding(
                            "CW209",
                            (p, on[other]),
                            f"{said((p,))} makes Lightning add a {want} block to the DeepSpeed config, which "
                            f"already has {said((on[other],))}: both end up enabled and DeepSpeed refuses "
                            "them ('bfloat16 and fp16 modes cannot be simultaneously enabled').",
                            f"Remove the {other} block from {on[other].file} (trainer.precision then decides), "
                            f"or set {p.name} to {'16-mixed' if other == 'fp16' else 'bf16-mixed'}, the "
                            "precision the file enables.",
                        )
                    )
                elif want in off:
                    out.append(
                        finding(
                            "CW209",
                            (p, off[want]),
                            f"{said((p,))} asks for {want}, but {said((off[want],))} is kept as written: "
                            f"DeepSpeed trains without {want} while the Trainer reports {precision}.",
                            f"Remove the {want} block from {off[want].file} or set {off[want].name} to true.",
                            severity="warning",
                        )
                    )
            elif precision in ("32-true", "64-true") and on:
                s = next(iter(on.values()))
                out.append(
                    finding(
                        "CW209",
                        (p, s),
                        f"{said((p,))} asks for full precision, but {said((s,))} makes DeepSpeed convert "
                        "the model to half precision: the file wins.",
                        f"Set {s.name} to false, or set {p.name} to the matching -mixed precision.",
                        severity="warning",
                    )
                )
    return out


def run_checks(files: Sequence[ConfigFile], model: PrecisionModel) -> list[Finding]:
    findings = [
        *_cw201(model),
        *_cw202(files),
        *_cw203(files),
        *_cw204(model),
        *_cw205(files),
        *_cw206(model),
        *_cw207(files, model),
        *_cw208(files),
        *_cw209(files),
        *fp8.cw212(files, model),
        *fp8_recipes.run_checks(files),
        *check_values(files),
        *fsdp.run_checks(files),
        *ledger_checks.run_checks(files, model),
    ]
    return findings


__all__ = ["NO_BF16_GPUS", "run_checks"]
