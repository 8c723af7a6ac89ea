"""The evidence read from a report: kernel names, words, and the clues added for issue #12."""

from __future__ import annotations

import pytest

from castwise.diagnosis._features import kernel_kind, words
from castwise.diagnosis.explain import explain, read_evidence


@pytest.mark.parametrize(
    ("op", "kind"),
    [
        ("addmm_impl_cpu_", "aten"),
        ("LayerNormKernelImpl", "aten"),
        ("triu_tril_cuda_template", "aten"),
        ("nll_loss_forward_out_cpu", "aten"),
        ("ROIAlign_forward", "extension"),
        ("ms_deform_attn_forward_cuda", "extension"),
        ("upfirdn2d", "extension"),
        ("softmax", None),
    ],
)
def test_kernel_kind_tells_pytorch_kernels_from_extensions(op: str, kind: str | None) -> None:
    assert kernel_kind(op) == kind


def test_a_missing_half_kernel_is_the_devices_limit_in_pytorch_and_the_extensions_in_an_extension() -> None:
    aten = explain("RuntimeError: \"addmm_impl_cpu_\" not implemented for 'Half'")
    ext = explain("RuntimeError: \"ROIAlign_forward\" not implemented for 'Half'")
    assert aten.category == "DTYPE_UNSUPPORTED_ON_DEVICE"
    assert ext.category == "UNCAST_CUSTOM_OP_OR_EXTENSION"
    assert any("extension" in e for e in ext.evidence)


def test_words_leave_out_glue_and_traceback_boilerplate() -> None:
    text = 'Traceback (most recent call last):\n  File "train.py", line 3\nthe LoRA adapter and the PEFT model'
    assert words(text) == ["train", "lora", "adapter", "peft", "model"]


def test_words_are_features_but_the_listing_puts_the_structured_evidence_first() -> None:
    report = (
        'File "finetune_lora.py", line 40, in <module>\n    out = model(input_ids)\n'
        'File "/env/site-packages/torch/nn/modules/linear.py", line 114, in forward\n'
        "    return F.linear(input, self.weight, self.bias)\n"
        "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16"
    )
    names = {f.name for f in read_evidence(report).features}
    assert {"word:finetune_lora", "word:linear"} <= names
    listing = explain(report).evidence
    assert listing and not listing[0].startswith("the word")


def test_a_retyped_gradscaler_message_is_still_read() -> None:
    assert explain("ValueError: Attemting to unscale fp16 Gradients").category == "GRADSCALER_LOW_PRECISION_PARAMS"


def test_adams_eps_in_half_precision_is_underflow() -> None:
    report = "Training in half precision with Adam: after the first step the weights are NaN. eps is 1e-8."
    assert explain(report).category == "LOSS_SCALE_OR_UNDERFLOW"


def test_an_old_gpu_named_in_an_xformers_refusal_is_a_device_limit() -> None:
    report = (
        "NotImplementedError: No operator found for `memory_efficient_attention_forward` with inputs:\n"
        "     query       : shape=(1, 577, 16, 64) (torch.bfloat16)\n"
        "`cutlassF` is not supported because:\n    bf16 is only supported on A100+ GPUs"
    )
    assert explain(report).category == "DTYPE_UNSUPPORTED_ON_DEVICE"


def test_a_gtx16_card_keeps_its_device_weight_in_a_silent_report_and_a_t4_does_not() -> None:
    report = "fp16 training: the loss turns NaN after a few steps on my GTX 1660 Super and on a T4"
    feats = {f.name: f for f in read_evidence(report).features}
    assert "shape:no error message" in feats
    assert feats["silent&clue:GTX 16xx"].prior.get("DTYPE_UNSUPPORTED_ON_DEVICE", 0) > 0
    assert "DTYPE_UNSUPPORTED_ON_DEVICE" not in feats["silent&clue:GPU without bf16"].prior


def test_a_loss_computed_in_low_precision_can_be_silent() -> None:
    report = (
        "Training in bf16: we computed the cross-entropy loss in bf16 and accuracy dropped; "
        "computing the loss in fp32 improved accuracy"
    )
    assert explain(report).category == "UNSAFE_OR_LOWPREC_LOSS"
