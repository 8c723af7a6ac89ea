"""Rules the audit reports (CW1xx, CW9xx): findings about a model's dtype flow."""

from __future__ import annotations

from castwise.rules import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW101", name="fp32-module-cast-to-low-precision",
        category="KEEP_FP32_MODULE_DOWNCAST", severity="error",
        summary="A module that computes in float32 has low-precision weights.",
        detects=(
            "An op inside a module receives a float32 activation (the module casts its input up "
            "on purpose, like OpenCLIP's LayerNormFp32) together with bf16/fp16 parameters of "
            "that same module, and the real kernel refuses the mix."
        ),
        why=(
            "Some layers are written to run in float32 whatever the model's precision. A blanket "
            "`model.to(torch.bfloat16)` casts their weights too, so the float32 input they make "
            "meets low-precision weights: 'expected scalar type Float but found BFloat16'."
        ),
        example=(
            "model = open_clip.create_model('ViT-B-32', precision='bf16')\n"
            "model = model.to(torch.bfloat16)  # LayerNormFp32 weights become bf16\n"
            "model(image, text)  # visual.ln_pre: layer_norm(f32 input, bf16 weight) fails"
        ),
        fix=(
            "Keep the module's parameters in float32: `castwise.apply(model, "
            "Policy.parse('bf16-true'))` keeps norm layers as float32 islands, or avoid the "
            "blanket `.to(dtype)` and use the library's own precision option."
        ),
    ),
    Rule(
        code="CW102", name="fp32-leak-into-strict-op",
        category="KEEP_FP32_MODULE_LEAK", severity="error",
        summary="float32 from a module kept in float32 reaches an op that refuses it.",
        detects=(
            "A low-precision op receives a float32 tensor whose float32 dtype comes from a "
            "module kept in float32 (transformers' _keep_in_fp32_modules, a user's fp32 layer), "
            "possibly several layers earlier through the residual stream."
        ),
        why=(
            "Modules kept in float32 to avoid overflow return float32. Added to a half-precision "
            "residual stream the whole stream becomes float32, and the first strict consumer "
            "(a fused norm, a Linear outside autocast) fails far from the cause."
        ),
        example=(
            "model = T5EncoderModel.from_pretrained(path, dtype=torch.float16)  # wo kept fp32\n"
            "# encoder.block.0...wo returns f32; encoder.block.1's fused norm refuses it"
        ),
        fix=(
            "Cast the kept-float32 module's output back to the compute dtype (saturating to "
            "float16's range): `castwise.apply(model, Policy.parse('16-true'))` does this for "
            "_keep_in_fp32_modules; or run in bfloat16, which needs no fp32 islands."
        ),
    ),
    Rule(
        code="CW103", name="fast-path-ignores-autocast",
        category="FASTPATH_BYPASSES_AUTOCAST", severity="error",
        summary="A fused fast path runs outside autocast and refuses the mixed dtypes.",
        detects=(
            "TransformerEncoderLayer / MultiheadAttention take their fused C++ fast path "
            "(eval mode, no_grad) which does not apply autocast on CPU, so autocast's "
            "low-precision activations meet float32 weights."
        ),
        why=(
            "Training runs the Python path under autocast and works; the first validation step "
            "takes the fast path and crashes, after a whole epoch."
        ),
        example=(
            "layer = nn.TransformerEncoderLayer(32, 4, batch_first=True)\n"
            "model.eval()\n"
            "with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    model(x, src_key_padding_mask=mask)  # encoder.layers.0 fails"
        ),
        fix=(
            "Turn the fast path off while the model runs under autocast: a policy with "
            "`fastpath=off` (e.g. `bf16-mixed,fastpath=off`) does it inside `castwise.apply`; "
            "by hand, `torch.backends.mha.set_fastpath_enabled(False)`."
        ),
    ),
    Rule(
        code="CW104", name="fp32-into-low-precision-kernel",
        category="AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL", severity="error",
        summary="An op that only takes fp16/bf16 (or equal q/k/v dtypes) gets float32.",
        detects=(
            "A kernel that is not autocast-aware (fused attention, flash/xFormers kernels, "
            "custom ops) receives float32 made by autocast (layer_norm, softmax run in float32 "
            "on CUDA) or by fp32 parameters, next to low-precision tensors."
        ),
        why=(
            "Autocast's float32 ops return float32. On CUDA, layer_norm of q and k returns "
            "float32 while v stays bf16; the kernel refuses. CPU autocast keeps layer_norm in "
            "bf16, so the bug is invisible on a laptop."
        ),
        example=(
            "q, k = self.q_norm(q), self.k_norm(k)  # float32 under CUDA autocast\n"
            "memory_efficient_attention(q, k, v)   # v is bf16: refused"
        ),
        fix=(
            "Cast the float32 tensors to the kernel's dtype right before it: a policy rule "
            "`out[*.q_norm]=bf16` casts a module's output, or `q = q.to(v.dtype)` in code."
        ),
    ),
    Rule(
        code="CW105", name="input-dtype-mismatch",
        category="MODEL_INPUT_DTYPE_MISMATCH", severity="error",
        summary="Model inputs and weights are in different dtypes, with no autocast.",
        detects=(
            "An op receives a model input (or a tensor derived from it) in one floating dtype "
            "and parameters in another, outside autocast."
        ),
        why=(
            "Casting a model with .half()/.bfloat16() does not cast its inputs: 'Input type "
            "(float) and bias type (c10::BFloat16) should be the same'."
        ),
        example="model = model.bfloat16()\nmodel(torch.randn(2, 8))  # float32 input",
        fix=(
            "Cast the inputs with the model: a policy with `inputs=bf16` (the `*-true` presets "
            "do it), or run a float32 model under autocast (`bf16-mixed`)."
        ),
    ),
    Rule(
        code="CW106", name="unconverted-tensor",
        category="UNCONVERTED_TENSOR_OR_BUFFER", severity="error",
        summary="A tensor made in forward (or kept outside the module tree) has the wrong dtype.",
        detects=(
            "An op receives a tensor created inside forward with the default dtype (arange, "
            "zeros, a timestep table) or a plain tensor attribute, in a different dtype than "
            "the activations it meets."
        ),
        why="Module.to(dtype) only reaches parameters and registered buffers.",
        example=(
            "freqs = torch.arange(half) / half  # float32, made in forward\n"
            "self.linear(x * freqs)  # x and weights are bf16"
        ),
        fix="Create the tensor with `dtype=x.dtype`, or register it as a buffer.",
    ),
    Rule(
        code="CW107", name="strict-same-dtype-op",
        category="STRICT_SAME_DTYPE_OP", severity="error",
        summary="An op that needs identical dtypes (index_put, scatter, masked_scatter...) got two.",
        detects=(
            "index_put / advanced-index assignment, masked_scatter, scatter, in-place updates "
            "and similar ops that autocast does not promote receive different floating dtypes."
        ),
        why=(
            "These ops are outside autocast's lists; mixing encoder features into float32 "
            "embeddings or writing into a preallocated buffer fails: 'Index put requires the "
            "source and destination dtypes match'."
        ),
        example="embeds[mask] = image_features  # f32 embeds, bf16 features",
        fix="Cast the source to the destination's dtype at the write: `src.to(dst.dtype)`.",
    ),
    Rule(
        code="CW108", name="attention-mask-dtype",
        category="MASK_DTYPE_MISMATCH", severity="error",
        summary="An attention mask or bias is in a different floating dtype than the query.",
        detects="scaled_dot_product_attention (or an attention kernel) gets a floating mask "
                "whose dtype differs from the query's.",
        why="Masks built with the default dtype stay float32 when the model runs in half.",
        example="mask = torch.zeros(t, t)  # f32\nF.scaled_dot_product_attention(q, k, v, mask)  # q bf16",
        fix="Build the mask with `dtype=q.dtype`, or use a boolean mask.",
    ),
    Rule(
        code="CW109", name="norm-dtype-mismatch",
        category="NORM_PARAM_OR_STATS_DTYPE", severity="error",
        summary="A norm layer's weights or running statistics differ from its input's dtype.",
        detects="batch_norm / group_norm / layer_norm receive an input in one dtype and "
                "weights or running statistics in another that the kernel refuses.",
        why="Half converters often keep norm layers in float32, which some kernels refuse.",
        example="bn = nn.BatchNorm2d(8)  # f32\nbn(x.half())  # eval mode, CPU",
        fix="Make the norm an fp32 island (input cast up, output cast back): the `*-true` "
            "presets keep norms in float32 with casts at their boundaries.",
    ),
    Rule(
        code="CW110", name="dtype-contract-violation",
        category="MODEL_INPUT_DTYPE_MISMATCH", severity="error",
        summary="An op receives dtypes its real kernel refuses.",
        detects="Any op whose inputs break the real kernel's dtype contract on the target "
                "device, when no more specific rule explains where the dtype came from.",
        why="Fake and meta kernels do not check dtypes as real kernels do; castwise checks "
            "every op against a table of what real kernels accept.",
        example="torch.mm(a_f32, b_bf16)",
        fix="Cast one side to the other's dtype where they first meet; the report's origin "
            "names where the odd dtype came from.",
    ),
    Rule(
        code="CW111", name="dtype-unsupported-on-device",
        category="DTYPE_UNSUPPORTED_ON_DEVICE", severity="error",
        summary="The target device has no kernel for this op in this dtype.",
        detects="An op is called in a dtype the target device's kernel does not implement.",
        why="A dtype that works on one device may have no kernel on another.",
        example="torch.view_as_complex(x.bfloat16())",
        fix="Run that op in a supported dtype (an fp32 island around it).",
    ),
    Rule(
        code="CW112", name="gradient-dtype-mismatch",
        category="OPTIMIZER_OR_GRAD_DTYPE", severity="error",
        summary="In backward, a gradient's dtype differs from what its tensor needs.",
        detects="A backward op receives a gradient in a different dtype from its forward "
                "tensor, or a gradient hook changes the dtype.",
        why="Backward fails after forward succeeded, often only at the first training step.",
        example="x.register_hook(lambda g: g.float())  # on a bf16 tensor",
        fix="Keep gradients in their tensor's dtype; cast the loss, not the gradients.",
    ),
    Rule(
        code="CW113", name="module-weights-cast-by-hand",
        category="MODEL_INPUT_DTYPE_MISMATCH", severity="error",
        summary="One module's weights were cast to another dtype than the rest of the model.",
        detects=(
            "Outside autocast, an op of a module meets that module's own parameters in one dtype "
            "and activations in the model's dominant dtype (the dtype of most of its parameters), "
            "and the real kernel refuses the mix."
        ),
        why=(
            "A single `.to(torch.bfloat16)` / `.half()` on one submodule leaves it out of step "
            "with the float32 model around it: 'mat1 and mat2 must have the same dtype'. The "
            "module upstream did nothing wrong."
        ),
        example=(
            "self.a = nn.Linear(4, 4)\n"
            "self.b = nn.Linear(4, 4).to(torch.bfloat16)  # cast by hand\n"
            "self.b(self.a(x))  # b's bf16 weights meet a's f32 output"
        ),
        fix=(
            "Cast that module back with the rest of the model (`model.b.float()`; the `32-true` "
            "policy casts every module), or cast its input to its dtype if it is meant to run "
            "in low precision."
        ),
    ),
    Rule(
        code="CW120", name="silent-fp32-upcast",
        category="KEEP_FP32_MODULE_LEAK", severity="warning",
        summary="Activations silently became float32 in a low-precision region.",
        detects="In a model meant to compute in bf16/fp16, a module's output is float32 where "
                "its input was low precision, and the float32 spreads to later modules.",
        why="Nothing fails, but the model runs (part of) its activations in float32: more "
            "memory and slower, while the user believes it runs in half precision.",
        example="T5 in float16 without a strict norm: the residual stream is f32 from block 0.",
        fix="Cast the float32 output back at the module that makes it (an fp32 island with "
            "cast-back: the `*-true` presets do it).",
    ),
    Rule(
        code="CW121", name="train-eval-divergence",
        category="FASTPATH_BYPASSES_AUTOCAST", severity="warning",
        summary="The model passes in one mode and fails in the other.",
        detects="The audit runs train (forward+backward) and eval (no_grad); one is clean and "
                "the other has errors.",
        why="Training may run for hours before the first validation step crashes.",
        example="nn.TransformerEncoder under bf16-mixed: train passes, eval fails.",
        fix="See the error finding of the failing mode; the suggested policy fixes both.",
    ),
    Rule(
        code="CW122", name="tensor-not-in-policy-dtype",
        category="UNCONVERTED_TENSOR_OR_BUFFER", severity="warning",
        summary="A parameter or buffer stays in another dtype than the policy gives it.",
        detects="After the policy is applied, a floating parameter or buffer is still not in "
                "the policy's dtype for it (param_dtype, buffers=, a module rule, an fp32 "
                "island): mixed policies cast no tensor outside islands, so a tensor cast by "
                "hand (a bf16 cache in a float32 model under bf16-mixed) stays as it is. "
                "Tensors the policy casts are not reported: applying the policy fixes them.",
        why="Autocast casts the operands of the ops it manages only; ops outside its lists "
            "(index_put, cat, in-place writes, custom kernels) meet the odd dtype as it is.",
        example="buffer `cache` made with dtype=torch.bfloat16, audited under bf16-mixed.",
        fix="Store the tensor in the policy's dtype where it is made, or say what you mean in "
            "the policy (`buffers=bf16`, `keep[<module>]=bf16`).",
    ),
    Rule(
        code="CW130", name="model-raised",
        category=None, severity="error",
        summary="The model raised an error that is not about dtypes.",
        detects="The model's forward or backward raised an exception castwise does not "
                "recognise as a dtype problem (shapes, missing arguments...).",
        why="It is reported as what it is, not hidden or mislabelled.",
        example="model(torch.randn(2, 7))  # expects 8 features",
        fix="Fix the error the message names; then re-run the audit.",
    ),
    Rule(
        code="CW901", name="op-not-checked",
        category="UNCAST_CUSTOM_OP_OR_EXTENSION", severity="info",
        summary="An op ran that castwise could not check against a real kernel's contract.",
        detects="An op without an entry in castwise's dtype-contract table, or without a fake "
                "implementation, ran during the audit.",
        why="The audit says what it did not check instead of passing silently.",
        example="a custom extension op with no fake kernel",
        fix="Audit with `--real` on a small configuration to check it on real tensors.",
    ),
    Rule(
        code="CW902", name="fake-run-incomplete",
        category=None, severity="warning",
        summary="The fake-tensor run stopped at an op fake tensors cannot run; later ops were not checked.",
        detects="An op raised inside the fake-tensor machinery (no fake kernel, a data-dependent "
                "shape or value such as `.item()` or `nonzero`), so the rest of the model did not run.",
        why="Silence would read as 'no problem found'; the audit says where it stopped instead.",
        example="if mask.any(): ...  # needs a value fake tensors do not have",
        fix="Audit with `--real` (fake=False) on a small configuration of the model.",
    ),
    Rule(
        code="CW123", name="policy-rule-matches-nothing",
        category=None, severity="warning",
        summary="A keep[...] or out[...] rule of the policy matches no module of the model.",
        detects="A user's module rule whose selector selects no module: a glob whose `*` stands "
                "for one dotted segment where the module sits deeper (`keep[*.mlp]=f32` on a "
                "Llama, whose MLPs are `model.layers.0.mlp`), a misspelt name, a class the model "
                "does not use. The finding names the selector that would match.",
        why="The policy silently runs without the rule: the audit then checks another policy "
            "than the one written, and a clean report says nothing about the island or cast "
            "the user asked for. `castwise.apply` warns for the same reason.",
        example="castwise.audit(llama, inputs, policy='bf16-true,keep[*.mlp]=f32')\n"
                "# model.layers.0.mlp is two segments below '*': the rule selects nothing",
        fix="Use the suggested selector: `**` spans any number of segments (`keep[**.mlp]=f32`), "
            "or name the path with one `*` per segment (`keep[model.layers.*.mlp]=f32`).",
    ),
)
