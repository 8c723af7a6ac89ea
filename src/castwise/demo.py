"""``castwise demo``: the five dtype stories on built-in models, each failing for real, diagnosed,
fixed by the suggested policy, and passing under it; then a numerics story (a T5-style model
that overflows float16, and the float32 island that buys it back)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from castwise._wrap import wrap

WIDTH = 100


class _Out:
    def __init__(self, stream: TextIO, width: int = WIDTH) -> None:
        self.stream = stream
        self.width = width
        self.color = stream.isatty() and os.environ.get("NO_COLOR") is None

    def _c(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def line(self, text: str = "", indent: int = 0) -> None:
        if not text:
            print(file=self.stream)
            return
        for chunk in wrap(text, self.width - indent) or [""]:
            print(" " * indent + chunk, file=self.stream)
        self.stream.flush()

    def field(self, label: str, text: str) -> None:
        wrapped = wrap(" ".join(str(text).split()), self.width - 14) or [""]
        print(f"  {self._c('2', f'{label:<11}')} {wrapped[0]}", file=self.stream)
        for chunk in wrapped[1:]:
            print(" " * 14 + chunk, file=self.stream)
        self.stream.flush()

    def head(self, text: str) -> None:
        print(file=self.stream)
        print(self._c("1", text), file=self.stream)
        self.stream.flush()

    def ok(self, text: str) -> None:
        self.field(self._c("32", "pass"), text)

    def bad(self, label: str, text: str) -> None:
        self.field(self._c("31", label), text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _timed(out: _Out, what: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    print(f"  ... {what}", end="", file=out.stream, flush=True)
    try:
        return fn()
    finally:
        print(f" ({time.perf_counter() - start:.1f}s)", file=out.stream, flush=True)


def _model_story(out: _Out, story: Any) -> bool | None:
    import torch

    from castwise.applied import apply
    from castwise.auditor import audit

    out.head(f"Story {story.number}. {story.title}")
    out.field("setup", story.summary)
    how = f"policy={story.policy or 'none (the model as it is)'}, device={story.device}, mode={story.mode}"
    out.field("runs as", how)
    reasons = story.unavailable()
    if reasons:
        out.field("skipped", "; ".join(reasons))
        return None  # not run: neither diagnosed nor failed

    model, inputs = _timed(out, "building the model", story.build)
    try:
        story.run_real(model, inputs)
    except Exception as exc:  # the user's real error is what this story is about
        out.bad("real run", _first_line(exc))
    else:
        if story.device == "cuda":
            out.field(
                "real run",
                "passes on this CPU (CPU autocast keeps layer_norm in bf16); it fails on "
                "CUDA, which castwise simulates below",
            )
        else:
            out.bad("real run", "passed, but this story should fail: torch's behaviour has changed")
    # the same model throughout: the failed run and the audit leave it as it was
    report = _timed(
        out,
        f"auditing on fake tensors for {story.device}",
        lambda: audit(model, inputs, policy=story.policy, device=story.device, mode="both"),
    )
    errors = report.errors
    if not errors:
        out.bad("audit", "found no error")
        return False
    f = next((e for e in errors if e.module == story.module), errors[0])
    out.field("found", f"{f.code} {f.rule.name} [{', '.join(f.modes)}]")
    out.field("at", f"`{f.module}`" + (f" in {f.op}" if f.op else ""))
    if f.origin is not None:
        out.field("origin", str(f.origin))
    out.field("why", f.message)
    divergence = [x for x in report.findings if x.code == "CW121"]
    if divergence:
        out.field("note", divergence[0].message)
    policy = report.suggested_policy
    if policy is None:
        out.bad("fix", "no policy found that passes a re-audit")
        return False
    out.field("fix", f"castwise.apply(model, Policy.parse({str(policy)!r}))")
    out.field("policy", policy.describe())
    if story.device != "cpu":
        again = _timed(
            out,
            f"re-auditing for {story.device} under the policy",
            lambda: audit(model, inputs, policy=policy, device=story.device, mode="both"),
        )
        if again.errors:
            out.bad("after fix", f"the {story.device} re-audit still finds {len(again.errors)} error(s)")
            return False
    apply(model, policy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = story.run_real(model, inputs)
    except Exception as exc:
        out.bad("after fix", _first_line(exc))
        return False
    from castwise.stories import first_tensor

    t = first_tensor(result)
    dtype = f", output {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else ""
    also = f", and so does the {story.device} re-audit" if story.device != "cpu" else ""
    out.ok(f"the real run on this CPU passes under the policy{dtype}{also}")
    located_origin = story.origin is None or (f.origin is not None and story.origin in str(f.origin))
    return f.module == story.module and located_origin


def _config_story(out: _Out) -> bool:
    from castwise.lint import lint_config
    from castwise.stories import SIMPLETUNER_ENV

    out.head("Story 5. SimpleTuner: bf16 weights with fp32 gradient precision")
    out.field("setup", "config.env: MIXED_PRECISION=bf16, --base_model_precision=bf16, --gradient_precision=fp32")
    out.field("real run", "loads the model, runs a step, then backward fails: 'Expected BFloat16, got Float'")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.env")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(SIMPLETUNER_ENV)
        report = lint_config(path)
    errors = report.errors
    here = folder + os.sep  # the file is the story's, not the temporary folder's: print config.env:3
    if not errors:
        out.bad("lint", "found no error")
        return False
    f = errors[0]
    out.field("found", f"{f.code} {f.rule.name}, from the file alone, before anything loads")
    out.field("settings", ", ".join(f.settings))
    out.field("why", f.message.replace(here, ""))
    out.field("fix", (f.fix or f.rule.fix).replace(here, ""))
    return True


def _numerics_story(out: _Out) -> bool | None:
    """Story 6: values, not dtypes. T5 under 16-true overflows; forecast and locate_nonfinite
    name `wo` (numerics I, imported lazily: skipped where not installed); tune finds the
    float32 islands; the run is finite under them."""
    import importlib
    import math

    out.head("Story 6. T5 in float16: `wo` overflows; which layers must stay float32?")
    out.field(
        "setup",
        "T5 encoder, float32 weights, block 2's `wo` with weights past float16's 65504; trained "
        "under 16-true,keep_in_fp32=off (transformers' hard-coded float32 `wo` turned off)",
    )
    from castwise.stories import build_t5_overflow, unavailable

    reason = unavailable("transformers")
    if reason is not None:
        out.field("skipped", reason)
        return None
    from castwise.numerics._compare_core import loss_only
    from castwise.numerics._compare_target import parse_target
    from castwise.numerics.tune import tune

    policy = "16-true,keep_in_fp32=off"
    model, inputs = _timed(out, "building the model", build_t5_overflow)
    loss, _ = loss_only(model, inputs, parse_target(policy), "train", None)
    if math.isfinite(loss):
        out.field("real run", f"finite (loss {loss:.4g}): torch's behaviour has changed")
    else:
        out.bad("real run", f"loss {loss} under {policy}: float16 makes `wo`'s weights inf")
    steps: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
        ("forecast", "castwise.numerics.forecast", lambda m: m.forecast(model, inputs, target="f16")),
        ("locate", "castwise.numerics.locate", lambda m: m.locate_nonfinite(model, inputs, policy=policy)),
    )
    for what, module, call in steps:
        try:
            found = call(importlib.import_module(module))
        except ImportError:
            out.field(what, f"skipped ({module} is not installed)")
            continue
        first = next(iter(found.findings), None)
        where = "" if first is None else f"`{first.module}`" if first.module else "the model's top level"
        out.field(what, "no finding" if first is None else f"{first.code} at {where}")
    tuned = _timed(out, "tuning float32 islands (real runs)", lambda: tune(model, inputs, policy=policy, budget=1e-2))
    out.field("islands", ", ".join(tuned.islands) or "none")
    out.field(
        "policy", f"{tuned.policy}  ({100 * tuned.low_precision_share:.1f}% of FLOPs in f16, {tuned.runs} real runs)"
    )
    fixed, _ = loss_only(model, inputs, parse_target(tuned.policy), "train", None)
    if not (tuned.met and math.isfinite(fixed)):
        out.bad("after fix", f"loss {fixed}, error {tuned.error:.2e}")
        return False
    out.ok(f"finite under the tuned policy: loss differs from float32 by {tuned.error:.1e} (budget 1e-2)")
    return any(name.endswith(".wo") for name in tuned.islands)


class _quiet_libraries:
    """Silence the stories' libraries (open_clip's 'no pretrained weights' warning, transformers'
    progress bars) for the demo only; restored after."""

    def __enter__(self) -> None:
        import logging

        self.disabled = logging.root.manager.disable
        logging.disable(logging.WARNING)
        self.hf = None
        try:
            from transformers.utils import logging as hf_logging

            self.hf = hf_logging
            self.bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        except Exception:  # absent or broken: its stories are skipped, saying why
            self.hf = None

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.disable(self.disabled)
        if self.hf is not None and self.bars:
            self.hf.enable_progress_bar()


def run_demo(stream: TextIO | None = None, width: int = WIDTH) -> int:
    """Run the six stories; 0 when each is diagnosed as expected (and fixed where fixable)."""
    out = _Out(stream or sys.stdout, width)
    out.line("castwise demo: five real mixed-precision failures from public issue trackers, rebuilt on")
    out.line("small local models, each run for real, audited on fake tensors, and fixed by a policy;")
    out.line("then a model that overflows float16, and the float32 island that fixes it.")
    start = time.perf_counter()
    results: list[bool | None] = []
    try:
        from castwise.stories import STORIES
    except ImportError as exc:  # torch itself is missing
        out.line(f"castwise demo needs torch: {exc}")
        return 2
    with _quiet_libraries():
        for story in STORIES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(_model_story(out, story))
    results.append(_config_story(out))
    with _quiet_libraries(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results.append(_numerics_story(out))
    ran = [r for r in results if r is not None]
    skipped = len(results) - len(ran)
    note = f" ({skipped} skipped: a library it needs is missing, see above)" if skipped else ""
    seconds = time.perf_counter() - start
    out.head(f"{sum(ran)}/{len(ran)} stories diagnosed and fixed{note} in {seconds:.0f}s.")
    return 0 if all(ran) else 1
