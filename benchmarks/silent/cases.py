"""The silent cases: planted silent precision loss modelled on real threads, and look-alike
controls that are fine. Each has its builder (seeded, the model as its user writes it, f32),
the policy the audit is given, the recipe as it really runs (benchmarks/silent/truth.py), its
counterpart (a planted case's fix, a control's bug twin) and, when planted, the expected
finding: the op (aten name, any of a few spellings), the module (user's name) and where the
16-bit came from (a module or a named tensor: a buffer, an input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from benchmarks.silent import builders as b
from benchmarks.silent.truth import Built, Recipe

F32 = torch.float32
CE_OPS = ("_log_softmax", "log_softmax", "cross_entropy_loss", "nll_loss_forward", "nll_loss2d_forward")
LOGPROB_OPS = ("_log_softmax", "log_softmax", "div")
TABLE_OPS = ("bmm", "matmul", "mm", "mul", "outer", "einsum")


@dataclass(frozen=True)
class Expect:
    ops: tuple[str, ...]  # aten names, without namespace and overload
    module: str  # the module whose op loses precision (or a module inside it)
    origin: tuple[str, ...]  # any of: a module (or inside it), a tensor's name (buffer, input)
    # the targets whose autocast would run the op in f32: on the others the right answer is silence
    devices: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # lm | vit | dit | moe | kernel
    kind: str  # planted | control
    thread: str  # the thread it is modelled on
    build: Callable[[], Built]
    policy: str | None  # what the audit is given
    metric: str
    recipe: Recipe  # as the recipe runs it
    other: Recipe  # planted: the fix; control: the bug it looks like
    expect: Expect | None = None


# Lightning's bf16-true / FSDP2's param cast as they run: module.to(bf16), norms included
# (castwise's bf16-true alone keeps norms as f32 islands, which these recipes do not)
TRUE_POLICY = "bf16-true,norms=none"
TRUE = Recipe("true")
MIXED = Recipe("mixed")
UPCAST = Recipe("true", attrs=(("upcast", True),))


def _ce(name: str, lm: str, thread: str) -> Case:
    return Case(
        name,
        "lm",
        "planted",
        thread,
        lambda: b.lm_loss(lm),
        TRUE_POLICY,
        "nll",
        TRUE,
        UPCAST,
        Expect(CE_OPS, "loss_fn", ("lm.lm_head",)),
    )


def _rl(name: str, lm: str, thread: str) -> Case:
    return Case(
        name,
        "lm",
        "planted",
        thread,
        lambda: b.rl_policy(lm),
        TRUE_POLICY,
        "nll",
        TRUE,
        UPCAST,
        # CPU autocast's f32 list has no log_softmax (torch 2.10-2.15, recorded in castwise/_releases)
        Expect(LOGPROB_OPS, "logprobs", ("lm.lm_head",), devices=("cuda",)),
    )


def _positions(name: str, lm: str, thread: str) -> Case:
    # a collator's float position_ids, cast to bf16 by the engine's input cast: 30000 and 30001
    # are one bf16 value (a 128-wide grid there), so the rotary phases are of other positions
    return Case(
        name,
        "lm",
        "planted",
        thread,
        lambda: b.lm_at_positions(lm, float_positions=True),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep_inputs=("position_ids",)),
        Expect(TABLE_OPS, "lm.model.rotary_emb", ("position_ids",)),
    )


def _rope_control(name: str, lm: str, thread: str) -> Case:
    # the rotary inv_freq buffer cast to bf16 by a module cast, the phase still computed in f32
    # from it: a frequency off by 2^-9 relative, the same for queries and keys, so the relative
    # phases attention reads move by distance * 2^-9 only (measured: as small as the bf16 run's)
    return Case(
        name,
        "lm",
        "control",
        thread,
        lambda: b.lm_at_positions(lm),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", inputs_float=("position_ids",)),
    )


def _router(name: str, family: str, thread: str, trunk: str, type_as: bool = False) -> Case:
    return Case(
        name,
        family,
        "planted",
        thread,
        lambda: b.moe(trunk, type_as=type_as),
        TRUE_POLICY,
        "experts",
        TRUE,
        UPCAST,
        Expect(("topk",), "moe.router", ("moe.router", "trunk")),
    )


def _loop_control(name: str, thread: str, norm: dict[str, Any], bug: tuple[str, Any]) -> Case:
    """A chunked RMSNorm loop that is fine, against the bf16 loop over every channel (its bug)."""
    built = {"chunk": 1, **norm}
    return Case(
        name,
        "kernel",
        "control",
        thread,
        lambda: b.norm_lm(**built),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", attrs=(bug,)),
    )


PLANTED: list[Case] = [
    # cross-entropy on bf16 logits, parameters cast without autocast
    _ce("llama_ce_bf16_true", "llama", "Modalities/modalities#464 (CLM loss on bf16 logits under FSDP2)"),
    _ce("qwen2_ce_bf16_true", "qwen2", "deepspeedai/DeepSpeedExamples#754 (loss in fp32 when using bf16)"),
    _ce("gpt2_ce_fsdp2", "gpt2", "Modalities/modalities#464 (FSDP2 MixedPrecisionPolicy casts params, no autocast)"),
    _ce("mistral_ce_bf16_true", "mistral", "deepspeedai/DeepSpeedExamples#754 (DeepSpeed bf16 loss)"),
    _ce("qwen3_ce_bf16_true", "qwen3", "apple/ml-cross-entropy#55 (FSDP2 bf16 logits into the loss)"),
    # RL logprobs: temperature division and log_softmax in bf16
    _rl("llama_rl_logprob_temperature", "llama", "radixark/miles#1554 (temperature division in bf16)"),
    _rl("qwen2_rl_logprob", "qwen2", "radixark/miles#1554 (compute_log_probs on bf16 logits)"),
    _rl("gpt2_rl_logprob", "gpt2", "radixark/miles#1554 (train vs rollout logprob gap)"),
    Case(
        "vit_ce_bf16_true",
        "vit",
        "planted",
        "pytorch/xla#7992 (CE must run in f32; here bf16-true runs it in bf16)",
        b.vit_classifier,
        TRUE_POLICY,
        "nll",
        TRUE,
        UPCAST,
        Expect(CE_OPS, "loss_fn", ("net.head",)),
    ),
    # f32 tables narrowed, used with large arguments
    _positions("llama_float_position_ids_cast", "llama", "nkalyanv99/UNI-D2#6 (bf16 positions above 256)"),
    _positions("qwen2_float_position_ids_cast", "qwen2", "huggingface/candle#3520 (position 15962 rounds to 15968)"),
    Case(
        "neox_rope_positions_type_as",
        "kernel",
        "planted",
        "NVIDIA/Megatron-LM#535, EleutherAI/gpt-neox#1016 (seq.type_as(inv_freq) rounds positions)",
        lambda: b.rope_lm(f32_phase=False),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep=("attn.rotary.inv_freq",)),
        Expect(TABLE_OPS, "attn.rotary", ("attn.rotary",)),
    ),
    Case(
        "dit_timestep_input_cast",
        "dit",
        "planted",
        "modelscope/DiffSynth-Studio#562 (timestep 999.40 -> 1000 in bf16)",
        lambda: b.dit(long_timestep=False),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep_inputs=("timestep",)),
        Expect(("mul",), "net.transformer_blocks.0.norm1.emb.time_proj", ("timestep",)),
    ),
    Case(
        "sd3_timestep_input_cast",
        "dit",
        "planted",
        "huggingface/diffusers#9405 (flux/sd3 timestep 750 -> 752 in bf16)",
        b.sd3,
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep_inputs=("timestep",)),
        Expect(("mul",), "net.time_text_embed.time_proj", ("timestep",)),
    ),
    Case(
        "dit_timestep_to_dtype",
        "dit",
        "planted",
        "modelscope/DiffSynth-Studio#1025 (sinusoidal embedding of a bf16 timestep)",
        b.tiny_dit,
        TRUE_POLICY + ",inputs=none",  # the model casts its inputs itself (the timestep too early)
        "out",
        Recipe("true", keep_inputs=("x", "t")),
        Recipe("true", keep_inputs=("x", "t"), attrs=(("low", F32),)),
        Expect(("mul",), "t_embedder", ("t_embedder",)),
    ),
    Case(
        "positions_from_bf16_mask_cumsum",
        "lm",
        "planted",
        "nkalyanv99/UNI-D2#6 (bf16 positions above 256), huggingface/transformers#25431 (cumsum dtype)",
        lambda: b.masked_lm(long_mask=False),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep_inputs=("attention_mask",)),
        Expect(("cumsum",), "positions", ("attention_mask",)),
    ),
    Case(
        "qwen2_positions_from_bf16_mask_cumsum",
        "lm",
        "planted",
        "nkalyanv99/UNI-D2#6, huggingface/transformers#25431 (a half cumsum)",
        lambda: b.masked_lm(long_mask=False, kind="qwen2"),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", keep_inputs=("attention_mask",)),
        Expect(("cumsum",), "positions", ("attention_mask",)),
    ),
    # MoE routing decisions on 16-bit values
    _router("moe_router_softmax_bf16", "moe", "ViperEkura/AstrAI#57 (bf16 softmax before topk)", "embed"),
    _router(
        "moe_router_probs_type_as", "moe", "ViperEkura/AstrAI#57 (f32 softmax cast back before topk)", "embed", True
    ),
    _router("vit_moe_router_bf16", "vit", "ViperEkura/AstrAI#57 (near-tie expert flips), V-MoE routing", "vit"),
    _router("dit_moe_router_bf16", "dit", "ViperEkura/AstrAI#57, DiT-MoE routing", "dit", True),
    Case(
        "moe_expert_bias_buffer_bf16",
        "moe",
        "planted",
        "PrimeIntellect-ai/prime-rl#2953 (expert_bias kept f32), DeepSeek-V3 e_score_correction_bias",
        b.bias_moe,
        TRUE_POLICY,
        "experts",
        TRUE,
        Recipe("true", keep=("moe.router.e_score_correction_bias",)),
        Expect(("topk", "add"), "moe.router", ("moe.router",)),
    ),
    # long reductions accumulated in 16-bit by hand-written kernels
    Case(
        "rmsnorm_chunked_sum_bf16",
        "kernel",
        "planted",
        "meta-llama/llama#1048 (RMSNorm must run in f32), pytorch/pytorch#189581",
        lambda: b.norm_lm(chunk=1),
        TRUE_POLICY,
        "out",
        TRUE,
        UPCAST,
        Expect(("add",), "norm", ("norm", "embed")),
    ),
    Case(
        "vit_final_rmsnorm_loop_bf16",
        "vit",
        "planted",
        "dingo-actual/om#11 (bf16 norms unstable), meta-llama/llama#1048 (norm in 16-bit)",
        b.vit_loop_norm,
        TRUE_POLICY,
        "out",
        TRUE,
        UPCAST,
        Expect(("add",), "net.norm", ("net.norm", "net.blocks.0")),
    ),
    Case(
        "moe_load_counts_index_add_bf16",
        "moe",
        "planted",
        "PrimeIntellect-ai/prime-rl#2953 (per-step expert usage counts for balancing)",
        b.aux_moe,
        TRUE_POLICY,
        "loss",
        TRUE,
        UPCAST,
        Expect(("index_add", "index_add_"), "balance", ("trunk", "balance")),
    ),
    Case(
        "linear_attention_chunk_state_bf16",
        "kernel",
        "planted",
        "huggingface/transformers#25431 (cumsum of states in half), vllm-project/vllm-gaudi#1009 (mamba cumsum)",
        b.scan_lm,
        TRUE_POLICY,
        "out",
        TRUE,
        UPCAST,
        Expect(("add",), "mixer", ("mixer", "embed")),
    ),
]

CONTROLS: list[Case] = [
    _rope_control("llama_rope_inv_freq_cast", "llama", "huggingface/transformers#29285 (RoPE tables in bf16)"),
    _rope_control("qwen2_rope_inv_freq_cast", "qwen2", "huggingface/candle#3520 (qwen2 rotary tables)"),
    Case(
        "rope_inv_freq_to_bf16_f32_phase",
        "kernel",
        "control",
        "sgl-project/sglang-jax#1472 (inv_freq rounded, phase in f32: a relative phase error only)",
        b.cast_rope_lm,
        "bf16-mixed",
        "out",
        MIXED,
        Recipe("mixed", attrs=(("phase_low", True),)),
    ),
    Case(
        "llama_ce_autocast",
        "lm",
        "control",
        "Modalities/modalities#464 (autocast's f32 list covers log_softmax / cross_entropy)",
        lambda: b.lm_loss("llama"),
        "bf16-mixed",
        "nll",
        MIXED,
        TRUE,
    ),
    Case(
        "llama_hf_loss_bf16_true",
        "lm",
        "control",
        "transformers ForCausalLMLoss upcasts the logits (huggingface/transformers#29285 logits.float())",
        lambda: b.lm_loss("llama", hf_loss=True),
        TRUE_POLICY,
        "loss",
        TRUE,
        Recipe("true", attrs=(("hf_loss", False),)),
    ),
    Case(
        "gpt2_logits_float_ce",
        "lm",
        "control",
        "Modalities/modalities#464, torchtitan loss: logits.float() before CE",
        lambda: b.lm_loss("gpt2", upcast=True),
        TRUE_POLICY,
        "nll",
        TRUE,
        Recipe("true", attrs=(("upcast", False),)),
    ),
    Case(
        "rope_f32_type_as",
        "kernel",
        "control",
        "KellerJordan/modded-nanogpt#39 (tables in f32, cast back at use)",
        lambda: b.rope_lm(f32_phase=True),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", attrs=(("f32_phase", False),)),
    ),
    Case(
        "moe_f32_router",
        "moe",
        "control",
        "ViperEkura/AstrAI#57 (router probabilities kept f32 through topk)",
        lambda: b.moe("embed", f32=True),
        TRUE_POLICY,
        "experts",
        TRUE,
        Recipe("true", attrs=(("f32", False),)),
    ),
    Case(
        "vit_ce_autocast",
        "vit",
        "control",
        "pytorch/xla#7992 (autocast runs cross-entropy in f32)",
        b.vit_classifier,
        "bf16-mixed",
        "nll",
        MIXED,
        TRUE,
    ),
    Case(
        "rmsnorm_one_sum_bf16",
        "kernel",
        "control",
        "NVIDIA/apex#1652 (a bf16 sum/mean: ATen accumulates in f32)",
        lambda: b.norm_lm(chunk=512),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", attrs=(("chunk", 1),)),
    ),
    # accumulation look-alikes (CW143): the accumulator float32, a loop too short to matter, a
    # compensated loop; each against the bf16 loop over all 512 channels it looks like
    _loop_control(
        "rmsnorm_chunked_sum_f32_acc",
        "meta-llama/llama#1048 (the norm's accumulator kept float32 in a bf16 model)",
        {"acc_f32": True},
        ("acc_f32", False),
    ),
    _loop_control(
        "rmsnorm_short_chunk_loop_bf16",
        "pytorch/pytorch#189581 (a few chunk sums added in bf16: each chunk summed by ATen in f32)",
        {"chunk": 64},
        ("chunk", 1),
    ),
    _loop_control(
        "rmsnorm_kahan_loop_bf16",
        "Kahan-compensated bf16 summation (pure-bf16 training's compensated adds)",
        {"kahan": True},
        ("kahan", False),
    ),
    Case(
        "dit_integer_timestep",
        "dit",
        "control",
        "utensils/mold#786 (an integer timestep is never cast to bf16)",
        lambda: b.dit(long_timestep=True),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", inputs_float=("timestep",)),
    ),
    Case(
        "positions_from_integer_mask",
        "lm",
        "control",
        "transformers generation: position_ids = attention_mask.long().cumsum(-1) - 1",
        lambda: b.masked_lm(long_mask=True),
        TRUE_POLICY,
        "out",
        TRUE,
        Recipe("true", inputs_float=("attention_mask",)),
    ),
]

CASES: dict[str, Case] = {c.name: c for c in PLANTED + CONTROLS}
