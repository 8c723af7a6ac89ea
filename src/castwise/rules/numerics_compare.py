"""Rules of ``castwise numerics --compare`` and ``--tune`` (CW320-CW339): values, not dtypes."""

from __future__ import annotations

from castwise.rules._rule import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW320",
        name="module-adds-error-past-rounding",
        category=None,
        severity="warning",
        summary="A module adds more error under the policy than rounding to its format explains.",
        detects=(
            "castwise compare runs the model under the policy and under the reference (float32 by "
            "default) on the same weights, inputs and random state, then runs each module alone "
            "under the policy on the reference's inputs (its callees replaying the reference's "
            "outputs). The error that module adds by its own ops is past its tolerance: 4 times "
            "the unit roundoff of the narrowest format it computed in (bf16 2^-8, f16 2^-11, "
            "float8 e4m3 2^-4), the most that rounding inputs, weights and output explains."
        ),
        why=(
            "Everything in low precision differs from float32 by rounding; comparing every tensor "
            "drowns the user in those differences. A module whose own error is far past rounding "
            "(catastrophic cancellation, a one-pass variance, an epsilon that float16 cannot hold, "
            "large magnitudes next to small ones) is why the loss moves, and it is where a float32 "
            "island helps; modules downstream only inherit its error."
        ),
        example=(
            "report = castwise.compare(model, batch, policy='bf16-mixed')\n"
            "# warning CW320 at `blocks.3.norm`: adds relative error 2.1e-01 on its own, 3361x what\n"
            "# rounding to bf16 explains (6.25e-02); ranked 1 of 57 by added error"
        ),
        fix=(
            "Keep the module in float32: add `keep[NAME]=f32` to the policy (an island: weights "
            "f32, inputs cast in, output cast back, saturating to float16's range). Each finding "
            "names its island, verified by re-running the policy with it alone (the error >= 4x "
            "lower); modules past tolerance with one cause get one island (their class, or their "
            "parent) where the first module's alone is not enough. Or let "
            "`castwise.tune(model, batch, policy=..., budget=...)` choose the smallest islands by "
            "FLOPs; or make the op stable (two-pass variance, a larger epsilon, subtract before "
            "casting)."
        ),
    ),
    Rule(
        code="CW321",
        name="module-makes-nonfinite-under-policy",
        category=None,
        severity="error",
        summary="A module makes inf/nan under the policy from the reference's finite inputs.",
        detects=(
            "Run alone under the policy on the reference run's (finite) inputs, the module's own "
            "ops return inf or nan where the reference's output is finite: float16's range "
            "(65504) overflows, a square underflows to zero and is divided by, or a float8 "
            "format saturates. The non-finite values start in this module; modules after it "
            "inherit them."
        ),
        why=(
            "One inf in the forward pass turns the loss and every gradient into nan; with loss "
            "scaling the step is skipped forever, without it the weights are destroyed."
        ),
        example=(
            "T5 under 16-true,keep_in_fp32=off: `encoder.block.0.layer.1.DenseReluDense.wo` returns\n"
            "values past 65504 (pretrained T5's wo weights are large); float16 makes them inf"
        ),
        fix=(
            "Keep the module in float32 with `keep[NAME]=f32` (transformers hard-codes this for "
            "T5's `wo` in `_keep_in_fp32_modules`); the island's output is cast back saturating "
            "to float16's finite range. Or train in bfloat16, whose range is float32's."
        ),
    ),
    Rule(
        code="CW322",
        name="compiled-diverges-from-eager",
        category=None,
        severity="warning",
        summary="A module's torch.compile'd (Inductor) numerics leave its eager numerics past rounding.",
        detects=(
            "compare(torch.compile(model), inputs, policy=..., reference='eager') runs the policy "
            "eagerly with every module call recorded, then compiles modules alone with Inductor and "
            "runs each on the eager run's inputs for that call: from the model itself down, "
            "descending only where the compiled code diverges past 4 times the unit roundoff of the "
            "module's format. The deepest diverging module, first in call order, is named, with "
            "whether torch._inductor.config.emulate_precision_casts=True closes the gap."
        ),
        why=(
            "Eager rounds every op's result to bf16/f16; Inductor fuses a chain of ops into one "
            "kernel that keeps float32 in registers and rounds once, splits reductions differently, "
            "or avoids an f16 overflow eager makes. The loss then differs between the compiled and "
            "the eager model, and backend ablation or the accuracy minifier never name the user's "
            "module."
        ),
        example=(
            "castwise.compare(torch.compile(model), x, policy='bf16-true', reference='eager')\n"
            "# warning CW322 at `blocks.1.gate`: compiled by Inductor differs from its eager run on the\n"
            "# same inputs: relative error 3.5e-01, past the bf16 tolerance (1.56e-02); ...\n"
            "# with emulate_precision_casts=True the gap closes (0.00e+00)"
        ),
        fix=(
            "Decide which numerics you want: where emulate_precision_casts closes the gap, set it "
            "(torch._inductor.config.emulate_precision_casts = True) to make the compiled model "
            "round as eager does; or make both agree by computing the module in float32 "
            "(`keep[NAME]=f32`), or by reordering the ops so no small term is added to a large one "
            "in 16 bits."
        ),
    ),
    Rule(
        code="CW330",
        name="tune-budget-not-met",
        category=None,
        severity="error",
        summary="No set of float32 islands among the candidates brings the error within the budget.",
        detects=(
            "castwise tune kept every candidate module (all modules that add error under the "
            "policy, by sensitivity) in float32 and a verified run still differs from the "
            "reference by more than the budget."
        ),
        why=(
            "The error does not come from modules an island can isolate: the stream between "
            "modules (residual additions, ops in the model's own forward) or the policy's storage "
            "dtypes carry it, or the budget is below what the low-precision format can give."
        ),
        example=(
            "castwise.tune(model, batch, policy='bf16-true', budget=1e-6)\n"
            "# error CW330: with 12 islands (38% of FLOPs) the loss still differs by 2.4e-03"
        ),
        fix=(
            "Raise the budget, use a mixed policy (float32 weights, `bf16-mixed`), or a wider "
            "format (bf16 instead of float8, f16 with loss scaling instead of pure f16)."
        ),
    ),
    Rule(
        code="CW331",
        name="tuned-float32-islands",
        category=None,
        severity="info",
        summary="The float32 islands tune found: the policy, its verified error and its low-precision share.",
        detects=(
            "castwise tune ranked the modules by sensitivity (the error each adds alone, weighted "
            "by the loss gradient, as ModelOpt's AutoQuantize scores layers) and bisected the "
            "shortest prefix of that ranking whose real run meets the budget."
        ),
        why=(
            "Few modules are sensitive; keeping only those in float32 keeps almost all FLOPs in "
            "low precision, where guessing keeps too much (whole blocks) or too little."
        ),
        example=(
            "castwise numerics build.py:t5 --policy 16-true,keep_in_fp32=off --tune 1e-2\n"
            "# info CW331: policy 16-true,keep_in_fp32=off,keep[encoder.block.0.layer.1.DenseReluDense.wo]=f32"
        ),
        fix=(
            "Use the policy: `castwise.apply(model, Policy.parse(tuned.policy))`, or pass its "
            "string to your trainer's castwise integration."
        ),
    ),
)
