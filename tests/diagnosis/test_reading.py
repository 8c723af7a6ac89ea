"""Reports as users paste them: colours, rank prefixes, wrapped and cut messages, chained
exceptions, notebook and rich tracebacks, progress bars, other languages."""

from __future__ import annotations

from castwise.diagnosis._patterns import read_signals
from castwise.diagnosis._reading import normalise, raising_block, split_chain
from castwise.diagnosis.explain import explain

LORA_FRAMES = """Traceback (most recent call last):
  File "/home/u/train.py", line 88, in <module>
    out = model(**batch)
  File "/env/lib/python3.11/site-packages/peft/tuners/lora/layer.py", line 509, in forward
    result = result + lora_B(lora_A(dropout(x))) * scaling
"""


def test_ansi_colour_codes_are_dropped() -> None:
    text = LORA_FRAMES + "\x1b[31;1mRuntimeError\x1b[0m: \x1b[1mexpected scalar type Float but found BFloat16\x1b[0m\n"
    e = explain(text)
    assert e.error == "RuntimeError: expected scalar type Float but found BFloat16"
    assert e.locus is not None and e.locus.library == "peft" and e.locus.line == 509
    assert e.category == "ADAPTER_DTYPE_MISMATCH"


def test_rank_prefixes_are_dropped_from_frames_and_error() -> None:
    text = "".join(
        f"[rank0]: {line}\n"
        for line in (LORA_FRAMES + "RuntimeError: expected scalar type Float but found BFloat16").splitlines()
    )
    e = explain(text)
    assert e.error is not None and not e.error.startswith("[rank")
    assert e.locus is not None and e.locus.library == "peft"
    assert "0: [rank1]: x" not in normalise("0: [rank1]: x") and normalise("0: [rank1]: x") == "x"


def test_conv_message_wrapped_over_two_lines_is_read() -> None:
    text = (
        "RuntimeError: Input type (torch.cuda.HalfTensor) and weight type\n"
        "(torch.cuda.FloatTensor) should be the same or input should be a MKLDNN tensor and weight is a dense "
        "tensor\n"
    )
    sigs = read_signals(normalise(text))
    assert [s.family for s in sigs] == ["conv-dtype"]
    assert sigs[0].dtypes == ("float16", "float32")
    assert explain(text).is_dtype_error


def test_truncated_message_still_names_a_dtype() -> None:
    e = explain("Scalar Type Error when enable FP16 (`RuntimeError: Expected object of scalar type Half...`)")
    assert e.signal is not None and e.signal.startswith("scalar-type")
    assert e.dtypes == ("float16",)
    assert e.category is not None


def test_chained_exception_locus_is_the_raising_frame() -> None:
    def forward() -> None:
        raise RuntimeError("mat1 and mat2 must have the same dtype, but got Float and Half")

    def step() -> None:
        try:
            forward()
        except RuntimeError as exc:
            raise ValueError("training step failed") from exc

    try:
        step()
    except ValueError as wrapper:
        e = explain(wrapper)
    assert e.locus is not None and e.locus.function == "forward"
    assert e.error is not None and "mat1 and mat2" in e.error
    assert e.dtypes == ("float32", "float16")


def test_chain_markers_split_the_blocks_in_printed_order() -> None:
    text = (
        'Traceback (most recent call last):\n  File "a.py", line 3, in f\nRuntimeError: Index put requires the '
        "source and destination dtypes match, got Float for the destination and Half for the source.\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File \"b.py\", line 9, in g\nKeyError: 'x'\n"
    )
    assert len(split_chain(text).blocks) == 2
    assert "a.py" in raising_block(text, lambda b: bool(read_signals(b)))
    e = explain(text)
    assert e.locus is not None and e.locus.file == "a.py"
    assert e.category == "STRICT_SAME_DTYPE_OP"


def test_jupyter_traceback() -> None:
    text = """---------------------------------------------------------------------------
RuntimeError                              Traceback (most recent call last)
Cell In[7], line 3
      1 model = get_peft_model(model, config)
----> 3 out = model.generate(**inputs)

File ~/venv/lib/python3.11/site-packages/peft/tuners/lora/layer.py:509, in Linear.forward(self, x, *args, **kwargs)
    507 x = x.to(lora_A.weight.dtype)
--> 509 result = result + lora_B(lora_A(dropout(x))) * scaling

RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16
"""
    e = explain(text)
    assert e.locus is not None and e.locus.library == "peft" and e.locus.line == 509
    assert e.category == "ADAPTER_DTYPE_MISMATCH"


def test_rich_box_traceback() -> None:
    text = """╭─────────────────────────────── Traceback (most recent call last) ────────────────────────────────╮
│ /env/lib/python3.10/site-packages/peft/peft_model.py:575 in forward                              │
│                                                                                                  │
│ ❱ 575 │   │   return self.get_base_model()(*args, **kwargs)                                     │
│ /env/lib/python3.10/site-packages/peft/tuners/lora.py:902 in forward                             │
╰──────────────────────────────────────────────────────────────────────────────────────────────────╯
RuntimeError: expected scalar type Half but found Float
"""
    e = explain(text)
    assert e.locus is not None and e.locus.library == "peft"
    assert e.error == "RuntimeError: expected scalar type Half but found Float"


def test_progress_bars_and_redraws_are_skipped() -> None:
    text = (
        "Steps:   0%|          | 0/800 [00:00<?, ?it/s]\rSteps:   0%|          | 0/800 [00:01<?, ?it/s]"
        "Traceback (most recent call last):\n"
        '  File "/env/site-packages/torch/amp/grad_scaler.py", line 259, in _unscale_grads_\n'
        '    raise ValueError("Attempting to unscale FP16 gradients.")\n'
        "ValueError: Attempting to unscale FP16 gradients.\n"
        "  0%|          | 0/6931 [00:01<?, ?it/s]\n"
    )
    clean = normalise(text)
    assert "it/s" not in clean
    e = explain(text)
    assert e.category == "GRADSCALER_LOW_PRECISION_PARAMS"
    assert e.error == "ValueError: Attempting to unscale FP16 gradients."


def test_new_wordings() -> None:
    cases = [
        ("RuntimeError: Expected counts to have type Half but got Float", "norm-stats-dtype"),
        (
            "AssertionError: Input and cos/sin must have the same dtype, got torch.float32 and torch.bfloat16",
            "rotary-dtype",
        ),
        (
            "ValueError: torch.bfloat16 is not supported for quantization method awq. Supported dtypes: "
            "[torch.float16]",
            "quant-dtype-unsupported",
        ),
        (
            "ValueError: `FlatParameter` requires uniform dtype but got torch.float16 and torch.float32",
            "flat-param-dtype",
        ),
        (
            "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
            "loss-scale-collapse",
        ),
        ("loss.backward() --> expected FloatTensor but found DoubleTensor", "scalar-type"),
    ]
    for text, family in cases:
        assert [s.family for s in read_signals(text)] == [family], text


def test_report_in_chinese_is_read() -> None:
    text = (
        "微调时报错AssertionError: Input and cos/sin must have the same dtype, got torch.float32 and torch.bfloat16\n"
        "发现用flash-attn的时候，用bf16加载模型，会进入`apply_rotary_emb`函数，会强制把q转为float类型"
    )
    e = explain(text)
    assert e.signal is not None and e.signal.startswith("rotary-dtype")
    assert e.category == "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL"
    quant = explain("QLoRA 量化后推理报错 expected scalar type Float but found BFloat16, bnb_4bit_compute_dtype")
    assert quant.category == "QUANT_COMPUTE_DTYPE_MISMATCH"
