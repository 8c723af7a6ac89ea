"""Field study harness: audit torch.compile'd real models as a user would, and check the truth on CPU.

Run from the worktree root: PYTHONPATH=$PWD/src:$PWD/benchmarks/field python benchmarks/field/<model>.py
Each row: model, recipe, compile options, device, audit verdict, compiled ops checked per mode,
compiled error, `_orig_mod` in names, seconds; truth rows: the real CPU run eager and compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import castwise

torch.set_num_threads(1)
ROWS: list[dict[str, Any]] = []
OUT = "/tmp/field_rows.jsonl"


_SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def hf_causal_lm(which: str, gc: bool = False) -> nn.Module:
    """A small transformers causal LM from its config (no download), as a fine-tuning script builds
    it (sdpa attention); ``gc``: model.gradient_checkpointing_enable()."""
    import transformers

    configs: dict[str, Callable[[], Any]] = {
        "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **_SMALL),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **_SMALL),
    }
    if which not in configs:
        raise ValueError(f"unknown model {which!r}; valid: {', '.join(configs)}")
    torch.manual_seed(0)
    cfg = configs[which]()
    cfg._attn_implementation = "sdpa"
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(cfg)
    if gc:
        model.gradient_checkpointing_enable()  # type: ignore[operator]
    return model


class Autocast(nn.Module):
    """The model's own autocast around its forward (nanoGPT's train.py `ctx`, timm's amp_autocast)."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.inner(*args, **kwargs)


def _orig(report: castwise.Report) -> bool:
    text = report.to_json()
    return "_orig_mod" in text


def audit_row(
    model_name: str,
    recipe: str,
    build: Callable[[], nn.Module],
    inputs: Any,
    device: str,
    compile_kw: dict[str, Any],
    policy: str | None,
    mode: str = "both",
) -> dict[str, Any]:
    model = build()
    cm = torch.compile(model, **compile_kw)
    row: dict[str, Any] = {"model": model_name, "recipe": recipe, "compile": compile_kw, "device": device}
    t0 = time.perf_counter()
    try:
        rep = castwise.audit(cm, inputs, policy=policy, device=device, mode=mode)
    except Exception as exc:  # a crash out of castwise
        row.update(
            crash=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            tb=traceback.format_exc()[-3000:],
            seconds=round(time.perf_counter() - t0, 1),
        )
        _emit(row)
        return row
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["errors"] = [f"{f.code} {f.module} {f.op}: {f.message[:200]}" for f in rep.errors]
    row["warnings"] = sorted({f.code for f in rep.findings if f.level != "error"})
    row["runs"] = [(r.mode, r.kind, r.status) for r in rep.runs]
    comp = rep.summary.get("compiled", {})
    row["compiled"] = {
        m: {
            k: v
            for k, v in s.items()
            if k in ("graphs", "backward_graphs", "ops_checked", "error", "backward_untraced")
        }
        | {"breaks": len(s.get("graph_breaks", []))}
        for m, s in comp.items()
    }
    row["orig_mod"] = _orig(rep)
    row["checked_nothing"] = [m for m, s in comp.items() if not s.get("ops_checked") or s.get("error")]
    _emit(row)
    return row


def truth_row(
    model_name: str,
    recipe: str,
    build: Callable[[], nn.Module],
    inputs: Any,
    policy: str | None,
    compiled: bool,
    compile_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The real run on this CPU: the policy applied as castwise.apply does, forward + backward."""
    model = build()
    row: dict[str, Any] = {
        "model": model_name,
        "recipe": recipe,
        "truth": "compiled" if compiled else "eager",
        "compile": compile_kw or {},
        "device": "cpu(real)",
    }
    t0 = time.perf_counter()
    try:
        applied = castwise.apply(model, policy) if policy else None
        run = torch.compile(model, **(compile_kw or {})) if compiled else model
        args, kwargs = (
            (inputs, {}) if isinstance(inputs, tuple) else ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
        )
        model.train()
        out = run(*args, **kwargs)
        loss = _loss(out)
        if loss is not None:
            loss.float().backward()
        model.eval()
        with torch.no_grad():
            run(*args, **kwargs)
        row["ok"] = True
        del applied
    except Exception as exc:
        row["ok"] = False
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    _emit(row)
    return row


def _loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    if isinstance(out, (tuple, list)):
        ts = [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return sum(t.float().mean() for t in ts) if ts else None  # type: ignore[return-value]
    if isinstance(out, dict) or hasattr(out, "values"):
        vals = list(out.values()) if isinstance(out, dict) else [getattr(out, k) for k in out]
        return _loss(tuple(v for v in vals if isinstance(v, torch.Tensor)))
    if hasattr(out, "sample"):
        return out.sample.float().mean()
    return None


def _emit(row: dict[str, Any]) -> None:
    ROWS.append(row)
    with open(OUT, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
    short = {k: v for k, v in row.items() if k != "tb"}
    print(json.dumps(short, default=str), flush=True)
    if "tb" in row:
        print(row["tb"], file=sys.stderr, flush=True)


RECIPES: list[tuple[str, str | None, bool]] = [
    # (recipe name, policy, the model's own autocast wrapper)
    ("none", None, False),
    ("bf16-mixed", "bf16-mixed", False),
    ("16-mixed", "16-mixed", False),
    ("bf16-true", "bf16-true", False),
    ("own-autocast-bf16", None, True),
]


def study(
    model_name: str,
    base: Callable[[], nn.Module],
    inputs: Any,
    *,
    fullgraph: bool = True,
    recipes: list[str] | None = None,
    devices: tuple[str, ...] = ("cuda", "cpu"),
    truth: bool = True,
    truth_compiled: tuple[str, ...] = (),
    build_gc: Callable[[], nn.Module] | None = None,
    dynamic_once: bool = False,
) -> None:
    recipes_all = list(RECIPES)
    if build_gc is not None:
        recipes_all.append(("bf16-mixed+grad-ckpt", "bf16-mixed", False))
    for rname, policy, own in recipes_all:
        build = build_gc if rname.endswith("grad-ckpt") and build_gc is not None else base
        if recipes is not None and rname not in recipes:
            continue
        for device in devices:
            b = (lambda d=device, build=build: Autocast(build(), d)) if own else build
            audit_row(model_name, rname, b, inputs, device, {}, policy)
            if fullgraph and rname in ("none", "bf16-mixed"):
                audit_row(model_name, rname, b, inputs, device, {"fullgraph": True}, policy)
            if dynamic_once and rname == "bf16-mixed":
                audit_row(model_name, rname, b, inputs, device, {"dynamic": True}, policy)
        if truth:
            bt = (lambda build=build: Autocast(build(), "cpu")) if own else build
            truth_row(model_name, rname, bt, inputs, policy, compiled=False)
            if rname in truth_compiled or rname in os.environ.get("FIELD_TRUTH_COMPILED", "").split(","):
                truth_row(model_name, rname, bt, inputs, policy, compiled=True)


with contextlib.suppress(Exception):
    torch._dynamo.config.cache_size_limit = 64
