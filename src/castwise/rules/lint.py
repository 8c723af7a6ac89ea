"""Rules lint-config reports (CW2xx): contradictions between training precision settings."""

from __future__ import annotations

from castwise.rules._rule import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW201",
        name="low-precision-weights-fp32-gradients",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="error",
        summary="Weights stored in bf16/fp16 with gradient precision set to fp32.",
        detects="A configuration stores the trained weights in bfloat16 (or float16) and asks "
        'for float32 gradients, e.g. SimpleTuner\'s MIXED_PRECISION="bf16" (which makes '
        "SimpleTuner keep the weights in bf16) together with --gradient_precision=fp32 "
        "(which converts every param.grad to float32 after backward).",
        why="Autograd creates gradients in the parameter's dtype; converting them to float32 "
        "behind the parameter's back leaves param.grad and param in different dtypes. The "
        "next backward accumulates a bf16 gradient into the fp32 one, gradient clipping and "
        "fused optimizers see mixed dtypes, and the run dies in backward ('Expected "
        "BFloat16, got Float') after the multi-GB model has loaded and the first step ran.",
        example='export MIXED_PRECISION="bf16"\n'
        'export TRAINER_EXTRA_ARGS="--base_model_precision=bf16"\n'
        'export TRAINER_EXTRA_ARGS="${TRAINER_EXTRA_ARGS} --gradient_precision=fp32"',
        fix="Drop --gradient_precision=fp32 (or set it to `unmodified`) so gradients follow the "
        "bf16 weights, or keep float32 master weights (true mixed precision, e.g. "
        'MIXED_PRECISION="no" with autocast) if you want float32 gradients.',
    ),
    Rule(
        code="CW202",
        name="fp16-and-bf16-both-enabled",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="fp16 and bf16 are both enabled in one configuration.",
        detects="A DeepSpeed config with fp16.enabled and bf16.enabled both true, or "
        "TrainingArguments with fp16 and bf16 (or fp16_full_eval and bf16_full_eval) "
        "both true.",
        why="A run has one half-precision dtype. DeepSpeed refuses the config ('bfloat16 and "
        "fp16 modes cannot be simultaneously enabled'), TrainingArguments raises ('At most "
        "one of fp16 and bf16 can be True, but not both') - after the job was scheduled.",
        example='{"fp16": {"enabled": true}, "bf16": {"enabled": true}}',
        fix="Keep one: bf16 on Ampere or newer GPUs (no loss scaling needed), fp16 on older "
        'GPUs (with dynamic loss scaling). Set the other to false, or to "auto" in a '
        "DeepSpeed file so the launcher fills it.",
    ),
    Rule(
        code="CW203",
        name="accelerate-deepspeed-precision-mismatch",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="Accelerate's mixed_precision disagrees with the DeepSpeed config it points to.",
        detects="An Accelerate config whose mixed_precision names one dtype while its "
        "deepspeed_config_file enables the other (error), or enables none / a dtype "
        "mixed_precision does not ask for (warning: the DeepSpeed file wins).",
        why="Accelerate fills the DeepSpeed fp16/bf16 blocks from mixed_precision only where "
        'they say "auto". mixed_precision fp16 with bf16.enabled true in the file raises '
        "('`--mixed_precision` arg cannot be set to `fp16` when `bf16` is set in the "
        "DeepSpeed config file'); an explicit enabled=false is kept, so the run trains in a "
        "precision nobody asked for.",
        example="# default_config.yaml\ndistributed_type: DEEPSPEED\nmixed_precision: fp16\n"
        "deepspeed_config:\n  deepspeed_config_file: ds_config.json\n"
        '# ds_config.json\n{"bf16": {"enabled": true}}',
        fix='Write "auto" for fp16.enabled and bf16.enabled in the DeepSpeed file so '
        "mixed_precision decides, or make mixed_precision name the dtype the file enables.",
    ),
    Rule(
        code="CW204",
        name="loss-scaling-with-half-weights",
        category="GRADSCALER_LOW_PRECISION_PARAMS",
        severity="error",
        summary="fp16 loss scaling (GradScaler) over weights stored in float16.",
        detects="fp16 mixed precision, which adds a torch GradScaler, while the model's weights "
        "are loaded in float16 (torch_dtype / dtype / model_init_kwargs.torch_dtype "
        "float16).",
        why="GradScaler.unscale_ refuses float16 gradients: 'ValueError: Attempting to unscale "
        "FP16 gradients.' Mixed precision expects float32 master weights; half weights "
        "leave the optimizer no precision to absorb small updates.",
        example='{"fp16": true, "torch_dtype": "float16"}',
        fix="Load the weights in float32 (torch_dtype float32 or auto with a float32 "
        "checkpoint) and keep fp16: true, or train a LoRA/adapter whose trainable weights "
        "are float32, or switch to bf16 (no GradScaler).",
    ),
    Rule(
        code="CW205",
        name="lightning-precision-with-precision-plugin",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="Lightning Trainer given both a precision string and a precision plugin.",
        detects="trainer.precision together with a Precision plugin (MixedPrecision, "
        "HalfPrecision, BitsandbytesPrecision, ...) in trainer.plugins.",
        why="The Trainer refuses the combination: 'Received both `precision=...` and "
        "`plugins=...`. Choose one.' The precision plugin already carries the precision.",
        example="trainer:\n  precision: bf16-mixed\n  plugins:\n"
        "    - class_path: lightning.pytorch.plugins.precision.MixedPrecision\n"
        "      init_args: {precision: 16-mixed, device: cuda}",
        fix="Remove trainer.precision and keep the plugin (set its init_args.precision), or "
        "remove the plugin and keep trainer.precision.",
    ),
    Rule(
        code="CW206",
        name="fp16-without-loss-scaling",
        category="FP16_RANGE_OVERFLOW",
        severity="warning",
        summary="Training in float16 with no loss scaling.",
        detects="Weights and compute in float16 with no GradScaler: Lightning precision "
        "16-true, a model loaded in float16 without fp16 AMP, or a DeepSpeed static "
        "fp16.loss_scale of 1.",
        why="float16 has 5 exponent bits: gradients below about 6e-8 flush to zero and "
        "large activations overflow to inf. Without loss scaling, small gradients vanish "
        "silently and the loss stalls or turns NaN.",
        example="trainer:\n  precision: 16-true",
        fix="Use fp16 mixed precision with dynamic loss scaling (Lightning 16-mixed, "
        "DeepSpeed fp16.loss_scale 0), or bf16 (bf16-true / bf16-mixed) on hardware that "
        "supports it.",
    ),
    Rule(
        code="CW207",
        name="precision-unsupported-on-device",
        category="DTYPE_UNSUPPORTED_ON_DEVICE",
        severity="error",
        summary="A half-precision dtype the configured device does not support.",
        detects="bf16 requested for a GPU the configuration names that has no bf16 support "
        "(V100, T4, P100, K80, M60: compute capability below 8.0, e.g. a SageMaker "
        "ml.p3 / ml.g4dn instance), or TF32 (TrainingArguments tf32) on such a GPU - an "
        "error; fp16 mixed precision on a CPU-only run (use_cpu, MULTI_CPU, accelerator: "
        "cpu) - a warning.",
        why="bf16 arithmetic needs Ampere (sm_80) or newer: older GPUs refuse bf16 kernels or "
        "emulate them far slower, and fused kernels have no bf16 build for them. fp16 AMP "
        "on CPU is refused by older Accelerate ('fp16 mixed precision requires a GPU'), "
        "silently dropped by newer ones (no GradScaler on CPU), and replaced by bf16-mixed "
        "in Lightning.",
        example="compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: ml.p3.2xlarge\nmixed_precision: bf16",
        fix="On pre-Ampere GPUs use fp16 with loss scaling (or fp32); on CPU use bf16 (CPU "
        "autocast supports it) or no mixed precision.",
    ),
    Rule(
        code="CW208",
        name="trainer-deepspeed-precision-mismatch",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="TrainingArguments' fp16/bf16 disagree with the DeepSpeed config they pass.",
        detects='TrainingArguments whose fp16/bf16 (or *_full_eval) differ from a non-"auto" '
        "fp16.enabled / bf16.enabled in the DeepSpeed config named by `deepspeed`.",
        why="transformers compares every non-auto DeepSpeed value with the arguments and "
        "raises at Trainer start: 'Please correct the following DeepSpeed config values "
        "that mismatch TrainingArguments values: - ds fp16.enabled=True vs hf "
        "fp16|fp16_full_eval=False'.",
        example='# training_args.json\n{"bf16": true, "deepspeed": "ds_config.json"}\n'
        '# ds_config.json\n{"fp16": {"enabled": true}}',
        fix='Write "auto" for fp16.enabled and bf16.enabled in the DeepSpeed file (the '
        "documented way: the Trainer fills them), or make them match fp16/bf16.",
    ),
    Rule(
        code="CW209",
        name="lightning-deepspeed-precision-mismatch",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="Lightning's precision disagrees with the DeepSpeed config of its DeepSpeedStrategy.",
        detects="trainer.precision naming one half dtype while the DeepSpeedStrategy config "
        "(init_args.config, a path or a dict) enables the other (error: both end up "
        "enabled), or writes the requested dtype's block disabled, or enables a half "
        "dtype under 32-true (warnings: the file wins).",
        why="Lightning completes the DeepSpeed config only where a block is missing: with "
        "precision bf16-mixed and a config holding fp16.enabled true, it adds a bf16 block "
        "and DeepSpeed refuses both ('bfloat16 and fp16 modes cannot be simultaneously "
        "enabled'); a block written with enabled false is kept, so the run is not in the "
        "precision the Trainer reports.",
        example="trainer:\n  precision: bf16-mixed\n  strategy:\n"
        "    class_path: lightning.pytorch.strategies.DeepSpeedStrategy\n"
        "    init_args: {config: ds_config.json}\n"
        '# ds_config.json\n{"fp16": {"enabled": true}}',
        fix="Remove the fp16/bf16 blocks from the DeepSpeed config and let trainer.precision "
        "decide, or make trainer.precision name the dtype the file enables.",
    ),
    Rule(
        code="CW220",
        name="precision-setting-wrong-value",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="A precision setting holds a value of the wrong type, or one the tool does not accept.",
        detects="A precision setting castwise reads whose value is not one its tool takes: "
        'DeepSpeed fp16.enabled / bf16.enabled that are not true, false or "auto" '
        '("yes please"), a DeepSpeed fp16/bf16 block that is not a mapping, '
        "TrainingArguments flags (fp16, bf16, tf32, ...) that are not booleans "
        "(bf16: [1, 2]), a Lightning trainer.precision that is no precision string "
        "(a list, a typo), Accelerate / SimpleTuner mixed_precision outside no, fp16, "
        "bf16, fp8. The finding names the setting, its value and the valid values.",
        why="Such values never do what they seem to. The tool refuses them when the job starts "
        "(DeepSpeed's config model, Lightning's precision connector), or reads them as "
        "something else: TrainingArguments does not convert JSON values, so any non-empty "
        'string or list for bf16 counts as true, "false" included. castwise would '
        "otherwise skip the value silently and check a run that is not the one configured.",
        example='# ds_config.json\n{"fp16": {"enabled": "yes please"}, "zero_optimization": {"stage": 2}}',
        fix="Write one of the valid values the finding lists, as the type the tool expects "
        "(true/false as JSON or YAML booleans, precision names as strings).",
    ),
    Rule(
        code="CW230",
        name="update-below-storage-precision",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="bf16/f16 weights updated in place with no f32 master copy, stochastic rounding or Kahan sum.",
        detects="A configuration whose trained weights are stored in bfloat16 (or float16) and updated "
        "by an optimizer that keeps no higher-precision master copy and rounds to nearest: HF "
        "torch_dtype bfloat16 with a plain optimizer, DeepSpeed bf16_master_weights_and_grads, "
        "torchtitan training.dtype bfloat16. With the learning rate known, the finding says from "
        "which |w| on an Adam step (|update| ~ lr) is lost.",
        why="bf16 keeps 8 significant bits: an update smaller than 2^-8 of the weight rounds back "
        "to the same value. Adam's steps are about lr in size, so every weight larger than lr*256 "
        "stops changing; with lr=1e-5 that is nearly every weight: the loss stalls and nothing errors.",
        example='{"output_dir": "out", "torch_dtype": "bfloat16", "learning_rate": 1e-5}',
        fix="Keep f32 master weights (load in float32 and train with bf16 autocast; DeepSpeed's "
        "default fp32 master), or an optimizer with bf16 stochastic rounding (torchao "
        "bf16_stochastic_round=True) or Kahan summation.",
    ),
    Rule(
        code="CW231",
        name="low-precision-gradient-accumulation",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="Gradients accumulated in bf16/f16 over several micro-batches.",
        detects="gradient_accumulation_steps > 1 while the gradients the micro-batches add into are "
        "bfloat16 or float16 (DeepSpeed bf16 without data_types.grad_accum_dtype fp32, Megatron "
        "--fp16 / --grad-reduce-in-bf16 without --accumulate-allreduce-grads-in-fp32, pure-bf16 HF runs), "
        "and the expected relative error of the sum, 2^-bits * sqrt(N) / (6 ln 2) (round-to-nearest's "
        "error per addition summed over N additions; measured on an MLP: bf16 0.3% at 32, 1.1% at 128), "
        "reaches 2^-7: bf16 from ~70 micro-batches, f16 from ~4400.",
        why="Each addition rounds the running sum to 8 significant bits: once the sum is much larger "
        "than one micro-batch's gradient, small components of the later micro-batches vanish, and the "
        "step follows the first micro-batches more than the rest.",
        example='{"bf16": {"enabled": true}, "gradient_accumulation_steps": 128, "zero_optimization": {"stage": 2}}',
        fix="Accumulate in float32: DeepSpeed data_types.grad_accum_dtype fp32, Megatron "
        "--accumulate-allreduce-grads-in-fp32, torch param.grad_dtype = torch.float32.",
    ),
    Rule(
        code="CW232",
        name="reduce-narrower-than-gradient",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="warning",
        summary="Gradients kept in f32 but all-reduced in bf16/f16.",
        detects="A reduce dtype narrower than the gradients' dtype: DeepSpeed communication_data_type "
        "(or its model-dtype default) below data_types.grad_accum_dtype, torchtitan "
        "mixed_precision_reduce below the gradients' dtype, FSDP reduce_dtype below grad_dtype; under castwise "
        "run, the reduce dtype FSDP2's fully_shard really uses for each parameter (its MixedPrecisionPolicy as "
        "initialized) below the dtype the gradient is computed and kept in.",
        why="The all-reduce rounds every rank's gradient and their sum to the narrower dtype: the "
        "precision the gradients were kept in is thrown away at the one step that sums the most values.",
        example='{"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}}',
        fix="Reduce in the gradients' dtype (communication_data_type fp32, mixed_precision_reduce "
        "float32, reduce_dtype=torch.float32), or keep the gradients in the reduce dtype on purpose.",
    ),
    Rule(
        code="CW150",
        name="update-rounds-away-in-storage",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="Optimizer steps leave bf16/f16 weights behind where the same steps in f32 move them.",
        detects="castwise ledger TARGET and the audit's optimizer= run one step of the user's optimizer on a "
        "copy of the model, castwise run reads a script's first four steps, each against the same steps in "
        "float32 (same class, settings, gradients and prior state); a bf16/f16 parameter whose stored "
        "weights miss more than half of the f32 movement (|w16 - w32| / |w32 - w0|) is reported, with "
        "the share missed. On synthetic gradients, only for optimizers whose step does not scale with "
        "the gradient (Adam-like).",
        why="Without an f32 master copy, stochastic rounding or Kahan summation an update below half "
        "the spacing of the stored dtype rounds back to the old value: the weights stop training.",
        example="castwise ledger model.py:build --optimizer torch.optim.AdamW --lr 1e-5",
        fix="Keep f32 master weights (f32 parameters under autocast), or an optimizer with bf16 "
        "stochastic rounding or Kahan summation.",
    ),
    Rule(
        code="CW151",
        name="resume-changes-state-precision",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="Loading the optimizer's state_dict gives its state another dtype than training made.",
        detects="castwise ledger TARGET saves the optimizer's state after one step and loads it into a "
        "fresh optimizer, as a resume does; a state tensor whose dtype differs after loading is reported.",
        why="torch's Optimizer.load_state_dict casts floating state to its parameter's dtype: f32 moments "
        "kept for bf16 parameters come back bf16 after a resume, and the run continues less precisely.",
        example="castwise ledger model.py:build --optimizer mylib.MixedAdamW",
        fix="Keep the saved dtype when loading (override load_state_dict or re-cast the state after it).",
    ),
    Rule(
        code="CW153",
        name="optimizer-step-makes-nonfinite",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="error",
        summary="An optimizer step made NaN/Inf in 16-bit weights that the same step in f32 keeps finite.",
        detects="The audit's optimizer step (optimizer=) and castwise run's reading of a script's first "
        "optimizer.step() compare the stored step with the same step in f32 (same class, settings, "
        "gradients and prior state, on a sample of each bf16/f16 parameter): weights the 16-bit step "
        "made NaN or Inf, finite before and in f32, are reported with their param groups.",
        why="An optimizer that keeps its state in the parameter's dtype computes it there: in f16 Adam's "
        "squared gradients and its eps (1e-8) flush to zero, the update divides by zero and the weights "
        "are NaN after the first step, with nothing raised.",
        example="model = model.half()\nopt = torch.optim.Adam(model.parameters(), lr=1e-4)",
        fix="Keep f32 master weights and optimizer state (f32 parameters under autocast), or an optimizer "
        "that keeps f32 state for 16-bit weights.",
    ),
    Rule(
        code="CW152",
        name="gradients-accumulated-in-16-bit-at-runtime",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="A script's bf16/f16 .grad, summed over micro-batches, lost precision against an f32 sum.",
        detects="castwise run watches a script's first and second optimizer.step(): in between, a tensor hook "
        "on each bf16/f16 parameter (it returns None: nothing changes) sums a sample of every micro-batch's "
        "gradient in f32, and the .grad torch summed in 16 bits is measured against it. Reported when the "
        "16-bit sum's error is at least 4x that of storing the f32 sum once in 16 bits and at least 2^-7 "
        "(measured: bf16 over ~128 micro-batches of an MLP), naming the parameter groups.",
        why="Each backward adds into the stored gradient and rounds the sum to 8 (bf16) or 11 (f16) "
        "significant bits: once the sum is much larger than one micro-batch's gradient, the later "
        "micro-batches' small components vanish and the step follows the first micro-batches.",
        example="for x in micro_batches:  # 128 of them\n    model(x).sum().backward()  # bf16 model\noptimizer.step()",
        fix="Accumulate in float32: param.grad_dtype = torch.float32 (torch >= 2.9), f32 parameters under "
        "autocast, or fewer micro-batches per step.",
    ),
    Rule(
        code="CW155",
        name="checkpoint-resume-changes-precision",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="warning",
        summary="Resuming from a checkpoint file gives its weights or optimizer state another precision.",
        detects="castwise ledger CHECKPOINT --against TARGET|CONFIG reads the file's dtypes (safetensors header; "
        "torch.load weights_only=True onto the meta device: no values, no code run) and compares storage, "
        "optimizer state (dtype, scheme) and master copy with the run it resumes into, per parameter where "
        "the run names them; each field that differs is named.",
        why="load_state_dict copies into the existing parameters and keeps their dtype, and torch's "
        "Optimizer.load_state_dict casts floating state to the parameter's dtype: a run trained with f32 "
        "moments and resumed into bf16 parameters continues with bf16 moments, with nothing raised.",
        example="castwise ledger ckpt/last.ckpt --against train.py:build --optimizer torch.optim.AdamW",
        fix="Resume into the precision the checkpoint was trained in, or convert on purpose and check the "
        "loss right after the resume.",
    ),
    Rule(
        code="CW154",
        name="optimizer-step-mixes-dtypes",
        category="OPTIMIZER_OR_GRAD_DTYPE",
        severity="error",
        summary="The optimizer step raises on a gradient whose dtype differs from its parameter's and state's.",
        detects="The audit's optimizer step (optimizer=), castwise ledger TARGET and castwise run (before a "
        "script's first optimizer.step()) run the user's optimizer class and each param group's settings on a "
        "sample of its parameters in their dtypes, with gradients of the run's gradient dtypes "
        "(param.grad_dtype); a group whose step raises is reported with the dtypes it mixed, where the "
        "gradient's dtype came from, the state the step made, and each fix run on the same sample "
        "(f32 master weights, gradients in the parameter's dtype, foreach=False, fused=True): works or fails.",
        why="torch's Adam, AdamW, NAdam, RAdam and Adamax make their state in the parameter's dtype "
        "(torch/optim/adam.py _init_group) and mix it with the gradient in one op (exp_avg.lerp_(grad)), "
        "which refuses two dtypes: bf16 weights with param.grad_dtype = torch.float32 crash at the first "
        "step, after the model has loaded and the first backward ran. SGD, Adagrad and RMSprop add the "
        "gradient and run.",
        example="model = model.bfloat16()\nfor p in model.parameters():\n    p.grad_dtype = torch.float32\n"
        "opt = torch.optim.AdamW(model.parameters())",
        fix="The finding lists what worked on the sample: for torch's Adam family, f32 master weights (f32 "
        "parameters under bf16 autocast: the gradients are f32 too) or gradients in the parameter's dtype "
        "(grad_dtype unset); foreach=False and fused=True raise the same.",
    ),
)
