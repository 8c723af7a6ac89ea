"""Rules the numerics report (CW301-CW319): values, not dtypes (locate_nonfinite, forecast, watch)."""

from __future__ import annotations

from castwise.rules._rule import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW301",
        name="nonfinite-from-precision",
        category="FP16_RANGE_OVERFLOW",
        severity="error",
        summary="An op made NaN/Inf that a wider dtype computes finite: precision caused it.",
        detects=(
            "locate_nonfinite (or watch's replay of a non-finite step) ran the model on real tensors "
            "and found the first op, forward or backward, whose output holds a NaN/Inf none of its "
            "inputs held. The same op on the same inputs in float32 (or the whole step in float32) "
            "stays finite: the 16-bit dtype overflowed (past 65504 for float16), underflowed to zero "
            "or cancelled. The finding names the module, the op, the line, the inputs' ranges and "
            "the dtype's limits. A warning when a later op clamped or masked it away."
        ),
        why=(
            "A loss that turns NaN at step 40,000 is usually one activation past float16's range "
            "(T5's feed-forward `wo`, attention scores, a variance) that then spreads everywhere: "
            "anomaly mode blames a later backward op, per-module hooks blame the consumer."
        ),
        example=(
            "model = T5Block(...).half()  # pretrained-scale wo weights\n"
            "castwise.locate_nonfinite(model, (x,))\n"
            "# CW301 at `layer.1.DenseReluDense.wo` in aten.mm: absmax 8.1e4 > f16 max 65504"
        ),
        fix=(
            "Keep the module in float32 with a saturating cast back (`keep[<module>]=f32` in the "
            "castwise policy), use loss scaling for gradients (GradScaler), or run in bfloat16."
        ),
    ),
    Rule(
        code="CW302",
        name="nonfinite-real-bug",
        category=None,
        severity="error",
        summary="An op made NaN/Inf that float32 makes too: a bug in the computation, not the precision.",
        detects=(
            "The first op that made a NaN/Inf from inputs without it (found as for CW301) still "
            "makes it in a wider dtype on the same inputs: log(0), 0/0, inf - inf in a mask, "
            "softmax over a row that is all -inf, exp of a large argument, the gradient of sqrt at 0."
        ),
        why=(
            "No precision setting fixes it: keeping layers in float32 or loss scaling only moves "
            "or hides the failure. The code has to change at the line the finding names."
        ),
        example=(
            "loss = -(target * torch.log(probs)).sum()  # probs has exact zeros\n"
            "castwise.locate_nonfinite(model, batch)\n"
            "# CW302 at `criterion` in aten.log: -inf in f32 too -> use log_softmax / clamp_min(eps)"
        ),
        fix=(
            "Change the computation at the reported line: clamp the argument of log/sqrt/rsqrt, "
            "add an epsilon to denominators, mask with `torch.finfo(dtype).min` instead of -inf, "
            "use log_softmax / logsumexp. The finding's fix names the case."
        ),
    ),
    Rule(
        code="CW303",
        name="nonfinite-weights-or-inputs",
        category=None,
        severity="error",
        summary="NaN/Inf is already in the parameters, buffers or inputs before any op runs.",
        detects=(
            "Before the run, a parameter, a buffer or a model input holds NaN/Inf: no op of the "
            "model made it. Typical after an optimizer step on non-finite gradients, a corrupt "
            "checkpoint, or a data pipeline that divides by zero."
        ),
        why=(
            "Every later value inherits it; hunting for the producing layer is useless because the "
            "damage happened before this step (usually in the previous optimizer step)."
        ),
        example=(
            "optimizer.step()  # on a NaN gradient, without GradScaler\n"
            "castwise.locate_nonfinite(model, batch)\n"
            "# CW303: NaN/Inf before any op ran: parameter encoder.0.weight"
        ),
        fix=(
            "Find the step that first went non-finite (castwise.watch stops there, before the "
            "optimizer step), restore the last good checkpoint, and check the data for NaN/Inf."
        ),
    ),
    Rule(
        code="CW304",
        name="nonfinite-outside-traced-ops",
        category=None,
        severity="warning",
        summary="Outputs or gradients are non-finite, but no traced op made NaN/Inf from finite inputs.",
        detects=(
            "The run ends with NaN/Inf in the outputs or the gradients, yet every op the tracer saw "
            "had a non-finite input whenever its output was non-finite, and the weights and inputs "
            "were finite: the value came from code the dispatch tracer does not see (a tensor "
            "hook, a custom kernel that writes in place)."
        ),
        why="The producer is outside the model's ops; the usual hunt has to look at hooks and extensions.",
        example=("p.register_hook(lambda g: g / 0)\ncastwise.locate_nonfinite(model, x)  # CW304"),
        fix="Check gradient hooks, custom autograd Functions' backward and extensions that write into tensors.",
    ),
    Rule(
        code="CW305",
        name="nonfinite-step-not-reproduced",
        category=None,
        severity="warning",
        summary="A training step went non-finite, but its replay (same batch, RNG and weights) stayed finite.",
        detects=(
            "castwise.watch saw a non-finite loss or gradient norm and replayed the step under "
            "locate_nonfinite, with the same batch, random state and weights, before the optimizer "
            "step; the replay made no NaN/Inf."
        ),
        why=(
            "The step is not deterministic (non-deterministic kernels, data-dependent code outside "
            "the model, a loss computed outside the watched call), or the NaN came from state the "
            "replay does not restore."
        ),
        example=("with castwise.watch(model) as w:\n    ...  # CW305: the replay of step 41230 stayed finite"),
        fix=(
            "Pass the step's own loss computation to watch (`replay=`), turn on deterministic "
            "algorithms, and run locate_nonfinite on the saved batch."
        ),
    ),
    Rule(
        code="CW310",
        name="forecast-overflow",
        category="FP16_RANGE_OVERFLOW",
        severity="warning",
        summary="A module's values would overflow the target dtype (forecast from a wider run).",
        detects=(
            "forecast ran the model once in its current precision, streaming every op's absmax: an "
            "op inside this module makes values past the target's largest finite value (65504 for "
            "float16) from inputs within it, so the target would make Inf there. The margin is "
            "given in powers of two."
        ),
        why=(
            "Switching a model trained in bfloat16 or float32 to float16 (or float8 without "
            "scaling) overflows exactly there; the Inf turns into NaN a few ops later."
        ),
        example=(
            "castwise.forecast(t5_block, (x,), target='f16')\n"
            "# CW310 `layer.1.DenseReluDense.wo` absmax 8.1e4 = 2^0.3 past f16's 65504"
        ),
        fix=(
            "Keep the module in float32 with a saturating cast back (`keep[<module>]=f32`), or stay "
            "in bfloat16 for it; for gradients, loss scaling lowers the scale on overflow."
        ),
    ),
    Rule(
        code="CW311",
        name="forecast-flush-to-zero",
        category=None,
        severity="warning",
        summary="A share of a module's non-zero activations would flush to zero in the target dtype.",
        detects=(
            "The power-of-two histogram of the module's outputs (forecast's streamed reduction) puts "
            "more than the threshold share of its non-zero values below half the target's smallest "
            "subnormal: the target rounds them to zero."
        ),
        why=(
            "Underflow is silent: small activations become exact zeros, a later division or rsqrt "
            "turns them into Inf, or the layer silently stops learning."
        ),
        example=(
            "castwise.forecast(model, x, target='f16')\n"
            "# CW311 `norm` 12% of its non-zero activations would flush to zero in f16"
        ),
        fix="Keep the module in float32 (`keep[<module>]=f32`), or use bfloat16, whose range is float32's.",
    ),
    Rule(
        code="CW312",
        name="forecast-gradient-underflow",
        category=None,
        severity="warning",
        summary="A share of a module's gradients would flush to zero in the target dtype without loss scaling.",
        detects=(
            "In the backward half of forecast's run, more than the threshold share of the non-zero "
            "gradients made in the module lie below half the target's smallest subnormal."
        ),
        why=(
            "float16 gradients of small magnitude underflow to zero without loss scaling: those "
            "weights stop training, with no error and no NaN."
        ),
        example=(
            "castwise.forecast(model, x, target='f16')\n"
            "# CW312 `head`: 40% of gradients flush to zero in f16; a loss scale of 2^16 keeps them"
        ),
        fix=(
            "Use loss scaling (`torch.amp.GradScaler`, the trainer's fp16 option): the finding gives "
            "the scale that lifts the flushed gradients into range; or train in bfloat16."
        ),
    ),
    Rule(
        code="CW313",
        name="float8-leave-out",
        category=None,
        severity="warning",
        summary="A Linear layer to leave out of float8 training.",
        detects=(
            "For a float8 target, forecast judges each Linear by the target's recipe ('fp8': "
            "tensorwise, 'bf16-mixed,fp8=rowwise', 'mxfp8'): an operand (input, weight, "
            "grad_output) whose rows or columns lose most of their magnitude to zero after that "
            "recipe's scaling in more than 5% of them, a GEMM (forward, grad_input, grad_weight "
            "over the tokens) that torch._scaled_mm's shape rules refuse (multiples of 16; 32 "
            "for MX blocks), or a bias under mxfp8 (torchao's MX linear drops it)."
        ),
        why=(
            "Layers with outliers (a large absmax next to many small values) lose most of their "
            "values in float8's narrow range; converting them costs accuracy for no speed."
        ),
        example=(
            "castwise.forecast(model, x, target='float8_e4m3fn')\n"
            "# CW313 `lm_head`: 31% of the input flushes; module_filter_fn excludes it"
        ),
        fix=(
            "Convert the other layers only: the report's summary gives a castwise policy that keeps "
            "these layers in bfloat16 and a torchao `module_filter_fn` that skips them."
        ),
    ),
)
