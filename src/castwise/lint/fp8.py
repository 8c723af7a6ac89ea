"""CW212: FP8 training asked for where there is no FP8 (torch-free).

Which settings ask for FP8 comes from castwise's precision vocabulary (a preset with a float8
recipe: Accelerate's ``fp8``, Lightning's ``transformer-engine*``); which devices have it, from
the compute capability of the GPU the configuration names: float8 matmuls (``torch._scaled_mm``,
TransformerEngine's FP8 GEMMs) need sm_89 or newer.
"""

from __future__ import annotations

from collections.abc import Sequence

from castwise.lint import lightning
from castwise.lint.model import ConfigFile, PrecisionModel, Setting, finding, said
from castwise.policy import presets
from castwise.report import Finding

# compute capability of the GPUs lint-config can name (SageMaker instance families, castwise.lint
# .accelerate.SAGEMAKER_GPUS), from NVIDIA's CUDA GPU table
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "K80": (3, 7),
    "M60": (5, 2),
    "P4": (6, 1),
    "P40": (6, 1),
    "P100": (6, 0),
    "V100": (7, 0),
    "T4": (7, 5),
    "A100": (8, 0),
    "A10": (8, 6),
    "A10G": (8, 6),
    "L4": (8, 9),
    "L40S": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
    "B200": (10, 0),
}
FP8_CAPABILITY = (8, 9)
_NOT_CUDA = {"cpu": "CPU", "xla": "TPU / XLA", "mps": "Apple MPS"}


def fp8_settings(files: Sequence[ConfigFile]) -> list[tuple[Setting, ...]]:
    """The settings (per file) whose precision carries a float8 recipe."""
    out: list[tuple[Setting, ...]] = []
    for cf in files:
        if cf.format in ("accelerate", "simpletuner"):
            s = cf.get("mixed_precision")
            preset = presets.accelerate(str(s.value)) if s is not None else None
            if s is not None and preset is not None and preset.float8 is not None:
                out.append((s,))
        elif cf.format == "lightning":
            precision, src = lightning.effective_precision(cf)
            preset = presets.lightning(precision) if precision is not None else None
            if preset is not None and preset.float8 is not None:
                out.append(src)
    return out


def _without_fp8(value: str) -> str | None:
    """Why the model's device has no FP8 (None: it has, or castwise cannot tell)."""
    if value in _NOT_CUDA:
        return f"runs on {_NOT_CUDA[value]}, which has no FP8 matmuls"
    if value.startswith("cuda:"):
        gpu = value[5:]
        sm = GPU_CAPABILITY.get(gpu)
        if sm is not None and sm < FP8_CAPABILITY:
            return f"runs on {gpu} GPUs (compute capability {sm[0]}.{sm[1]}; FP8 needs 8.9 or newer)"
    return None


def cw212(files: Sequence[ConfigFile], model: PrecisionModel) -> list[Finding]:
    dev = model.device
    why = _without_fp8(dev.value) if dev is not None and dev.settings else None
    if dev is None or why is None:
        return []
    out = []
    for src in fp8_settings(files):
        out.append(
            finding(
                "CW212",
                (*src, *dev.settings),
                f"{said(src)} asks for FP8 training, but {said(dev.settings)} {why}: float8 GEMMs fail there "
                "(torch._scaled_mm and TransformerEngine refuse them) or the run falls back to another "
                "precision than the file says.",
                f"Change {src[0].name} to bf16 (bf16-mixed), or change {dev.settings[0].name} to an FP8 "
                "GPU (L4, L40S, H100, H200, B200: SageMaker ml.g6 / ml.g6e / ml.p5).",
            )
        )
    return out
