"""castwise.explain: wordings normalised, frames read, causes ranked, and no torch on the CLI path.

The error texts here are written for these tests in the shapes users paste them (CPython,
pytest and IPython tracebacks, logs with progress bars around them); the real-kernel tests
raise the errors with torch on this machine and explain the exception objects."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from castwise import rules
from castwise.categories import CATEGORIES
from castwise.diagnosis._frames import library_of, parse_frames
from castwise.diagnosis._patterns import dtype_name, read_signals
from castwise.diagnosis.explain import Explanation, explain, read_evidence

PY = sys.executable


# -- wordings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "family", "dtypes"),
    [
        (
            "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16",
            "matmul-dtype",
            ("float32", "bfloat16"),
        ),
        (
            "RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::Half != float",
            "matmul-dtype",
            ("float16", "float32"),
        ),
        (
            "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: struct c10::Half != struct c10::BFloat16",  # noqa: E501
            "matmul-dtype",
            ("float16", "bfloat16"),
        ),
        (
            "RuntimeError: Expected object of scalar type Half but got scalar type Float for argument #3 'mat2' "
            "in call to _th_addmm",
            "scalar-type-arg",
            ("float16", "float32"),
        ),
        (
            "RuntimeError: self and mat2 must have the same dtype, but got Half and Float",
            "matmul-dtype",
            ("float16", "float32"),
        ),
        (
            "RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same",  # noqa: E501
            "conv-dtype",
            ("float16", "float32"),
        ),
        (
            "RuntimeError: Input type (torch.cuda.FloatTensor) and weight type (CUDABFloat16Type) should be the same",
            "conv-dtype",
            ("float32", "bfloat16"),
        ),
        (
            "RuntimeError: Input type (c10::BFloat16) and bias type (float) should be the same",
            "conv-dtype",
            ("bfloat16", "float32"),
        ),
        (
            "RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float",
            "norm-mixed-dtype",
            ("float32",),
        ),
        ("RuntimeError: expected scalar type c10::BFloat16 but found float", "scalar-type", ("bfloat16", "float32")),
        ("RuntimeError: expected scalar type Half but found Float", "scalar-type", ("float16", "float32")),
        (
            "RuntimeError: Index put requires the source and destination dtypes match, got BFloat16 for the destination "  # noqa: E501
            "and Float for the source.",
            "index-put-dtype",
            ("bfloat16", "float32"),
        ),
        (
            "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            "attn_mask.dtype: float and  query.dtype: c10::Half instead.",
            "attn-mask-dtype",
            ("float32", "float16"),
        ),
        ("ValueError: Attempting to unscale FP16 gradients.", "unscale-low-precision-grads", ("float16",)),
        ("RuntimeError: \"LayerNormKernelImpl\" not implemented for 'Half'", "no-kernel-for-dtype", ("float16",)),
    ],
)
def test_wordings_normalise_to_one_signal(message: str, family: str, dtypes: tuple[str, ...]) -> None:
    signals = read_signals(f"some log line\n{message}\nmore noise 42%|####  |")
    assert [s.family for s in signals] == [family]
    assert signals[0].dtypes == dtypes


@pytest.mark.parametrize(
    ("token", "name"),
    [
        ("c10::BFloat16", "bfloat16"),
        ("struct c10::Half", "float16"),
        ("torch.cuda.HalfTensor", "float16"),
        ("CUDABFloat16Type", "bfloat16"),
        ("'Float'", "float32"),
        ("torch.float32", "float32"),
        ("CPUBFloat16Type", "bfloat16"),
        ("torch.FloatTensor", "float32"),
        ("double", "float64"),
        ("Banana", None),
    ],
)
def test_dtype_spellings(token: str, name: str | None) -> None:
    assert dtype_name(token) == name


_CASES = [
    # (realistic kernel calls that fail on this CPU, expected family)
    (lambda: F.linear(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.bfloat16)), "matmul-dtype"),
    (lambda: torch.randn(2, 4) @ torch.randn(4, 3, dtype=torch.float16), "matmul-dtype"),
    (lambda: torch.bmm(torch.randn(1, 2, 4), torch.randn(1, 4, 3, dtype=torch.bfloat16)), "scalar-type"),
    (
        lambda: F.conv2d(
            torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)
        ),
        "conv-dtype",
    ),
    (
        lambda: F.layer_norm(
            torch.randn(2, 4), (4,), torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
        ),
        "norm-mixed-dtype",
    ),
    (
        lambda: F.scaled_dot_product_attention(
            *(torch.randn(1, 2, 3, 4) for _ in range(2)), torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
        ),
        "qkv-dtype",
    ),
    (
        lambda: torch.zeros(4, 3).index_put_((torch.tensor([0]),), torch.ones(1, 3, dtype=torch.bfloat16)),
        "index-put-dtype",
    ),
    (
        lambda: torch.zeros(4).masked_scatter(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.float16)),
        "masked-scatter-dtype",
    ),
    (lambda: torch.zeros(4).lerp_(torch.ones(4, dtype=torch.bfloat16), 0.5), "inplace-arg-dtype"),
    (lambda: torch.view_as_complex(torch.randn(2, 2, dtype=torch.bfloat16)), "complex-dtype"),
    (lambda: torch.zeros(4, dtype=torch.float16).masked_fill(torch.ones(4, dtype=torch.bool), -1e9), "fp16-overflow"),
    (lambda: torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4, dtype=torch.bfloat16)), "rnn-dtype"),
]


@pytest.mark.parametrize(("call", "family"), _CASES)
def test_real_kernel_errors_are_read(call: object, family: str) -> None:
    """The messages this torch really raises are recognised, from the exception object."""
    with pytest.raises(Exception) as info:
        call()  # type: ignore[operator]
    e = explain(info.value)
    assert e.is_dtype_error
    assert e.signal is not None and e.signal.startswith(family), e.signal
    assert e.category is not None
    # the exception's own traceback is read: the locus is this test file or the nn module it called
    assert any(f.file.endswith("test_explain.py") for f in e.frames)
    assert e.locus is not None and e.locus.file is not None
    assert e.locus.file.endswith("test_explain.py") or "torch/nn/modules/" in e.locus.file


def test_exception_with_chained_cause_is_explained() -> None:
    try:
        try:
            torch.zeros(3).index_put_((torch.tensor([1]),), torch.ones(1, dtype=torch.float16))
        except RuntimeError as inner:
            raise ValueError("writing features into the embedding table failed") from inner
    except ValueError as outer:
        e = explain(outer)
    assert e.category == "STRICT_SAME_DTYPE_OP"
    assert "float16" in e.dtypes


# -- frames and locus ---------------------------------------------------------------------------

CPYTHON_LORA = """\
Traceback (most recent call last):
  File "/home/me/proj/finetune.py", line 88, in <module>
    out = model.generate(**batch, max_new_tokens=32)
  File "/opt/env/lib/python3.11/site-packages/peft/peft_model.py", line 1875, in generate
    outputs = self.base_model.generate(*args, **kwargs)
  File "/opt/env/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in _call_impl
    return forward_call(*args, **kwargs)
  File "/opt/env/lib/python3.11/site-packages/peft/tuners/lora/layer.py", line 727, in forward
    result = result + lora_B(lora_A(dropout(x))) * scaling
  File "/opt/env/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125, in forward
    return F.linear(input, self.weight, self.bias)
RuntimeError: expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float
"""

PYTEST_SCALER = """\
tests/test_train.py:41: in test_one_step
    trainer.train()
.venv/lib/python3.12/site-packages/accelerate/accelerator.py:2410: in clip_grad_norm_
    self.unscale_gradients()
.venv/lib/python3.12/site-packages/torch/amp/grad_scaler.py:338: in unscale_
    optimizer_state["found_inf_per_device"] = self._unscale_grads_(
E   ValueError: Attempting to unscale FP16 gradients.
"""

IPYTHON_NORM = """\
---------------------------------------------------------------------------
RuntimeError                              Traceback (most recent call last)
Cell In[7], line 3
      1 x = torch.randn(8, 3, 32, 32).half()
----> 3 y = net(x)

File ~/miniconda3/lib/python3.10/site-packages/torch/nn/modules/batchnorm.py:171, in _BatchNorm.forward(self, input)
    169 bn_training = self.training
--> 171 return F.batch_norm(
    172     input,

RuntimeError: expected scalar type Half but found Float
"""


def test_cpython_frames_and_locus() -> None:
    frames = parse_frames(CPYTHON_LORA)
    assert [f.library for f in frames] == [None, "peft", "torch", "peft", "torch"]
    assert frames[3].function == "forward" and frames[3].line == 727
    assert frames[3].code == "result = result + lora_B(lora_A(dropout(x))) * scaling"
    e = explain(CPYTHON_LORA)
    # torch's Linear only calls the op: the frame at fault is the LoRA layer that called it
    assert e.locus is not None and e.locus.library == "peft" and e.locus.function == "forward"
    assert e.locus.line == 727 and e.locus.code == "result = result + lora_B(lora_A(dropout(x))) * scaling"
    assert e.category == "ADAPTER_DTYPE_MISMATCH"
    assert any("peft" in why for why in e.evidence)


def test_pytest_frames() -> None:
    frames = parse_frames(PYTEST_SCALER)
    assert [(f.library, f.function) for f in frames] == [
        (None, "test_one_step"),
        ("accelerate", "clip_grad_norm_"),
        ("torch", "unscale_"),
    ]
    e = explain(PYTEST_SCALER)
    assert e.category == "GRADSCALER_LOW_PRECISION_PARAMS" and e.level == "high"
    assert e.rule is None or rules.REGISTRY[e.rule].category == e.category


def test_ipython_frames() -> None:
    frames = parse_frames(IPYTHON_NORM)
    assert frames[-1].file.endswith("torch/nn/modules/batchnorm.py") and frames[-1].line == 171
    assert frames[-1].function == "_BatchNorm.forward"
    assert frames[-1].code == "return F.batch_norm("
    assert explain(IPYTHON_NORM).category == "NORM_PARAM_OR_STATS_DTYPE"


RICH = """\
│ /opt/env/lib/python3.10/site-packages/torch/nn/modules/module.py:1501 in _call_impl            │
│                                                                                                │
│ ❱ 1501 │   │   │   return forward_call(*args, **kwargs)                                        │
│ /opt/env/lib/python3.10/site-packages/peft/tuners/lora/layer.py:498 in forward                 │
╰────────────────────────────────────────────────────────────────────────────────────────────────╯
RuntimeError: expected scalar type Float but found Half
"""


def test_rich_frames() -> None:
    frames = parse_frames(RICH)
    assert [(f.library, f.function, f.line) for f in frames] == [
        ("torch", "_call_impl", 1501),
        ("peft", "forward", 498),
    ]
    assert explain(RICH).category == "ADAPTER_DTYPE_MISMATCH"


NOTEBOOK_LINKS = """\
[/usr/local/lib/python3.11/dist-packages/accelerate/accelerator.py](https://localhost:8080/#) in backward(self, loss)
   2241         else:
-> 2242             loss.backward(**kwargs)

File [~/envs/llm/lib/python3.11/site-packages/transformers/models/mistral/modeling_mistral.py:410](vscode://x), in \
MistralAttention.forward(self, hidden_states)
    408 query_states = self.q_proj(hidden_states)
--> 410 attn_output = torch.matmul(attn_weights, value_states)

RuntimeError: expected scalar type BFloat16 but found Float
"""


def test_notebook_link_frames() -> None:
    """Colab and VS Code print frames as links; they are still frames."""
    frames = parse_frames(NOTEBOOK_LINKS)
    assert [(f.library, f.function, f.line) for f in frames] == [
        ("accelerate", "backward", None),
        ("transformers", "MistralAttention.forward", 410),
    ]
    assert frames[0].code == "loss.backward(**kwargs)"
    assert frames[1].code == "attn_output = torch.matmul(attn_weights, value_states)"


def test_library_from_paths() -> None:
    assert library_of("/x/site-packages/xformers/ops/fmha/common.py") == ("xformers", "xformers/ops/fmha/common.py")
    assert library_of(r"C:\py\Lib\site-packages\apex\normalization\fused_layer_norm.py")[0] == "apex"
    assert library_of("/home/u/src/unsloth/unsloth/kernels/fast_lora.py")[0] == "unsloth"
    assert library_of("/home/u/train.py") == (None, "/home/u/train.py")


# -- categories ---------------------------------------------------------------------------------

FASTPATH = """\
Epoch 0: 100%|##########| 120/120 [00:14<00:00, loss=0.31]
Validation DataLoader 0:   0%|          | 0/30 [00:00<?, ?it/s]
Traceback (most recent call last):
  File "/srv/app/train.py", line 61, in validation_step
    recon = self.model(poses, padding_mask)
  File "/srv/env/lib/python3.10/site-packages/torch/nn/modules/transformer.py", line 517, in forward
    output = mod(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask_for_layers)
  File "/srv/env/lib/python3.10/site-packages/torch/nn/modules/transformer.py", line 907, in forward
    return torch._transformer_encoder_layer_fwd(
RuntimeError: expected scalar type Float but found BFloat16
"""

XFORMERS = """\
  File "/w/models/dit.py", line 140, in forward
    out = xops.memory_efficient_attention(q, k, v)
  File "/w/env/site-packages/xformers/ops/fmha/__init__.py", line 276, in memory_efficient_attention
    return _memory_efficient_attention(
  File "/w/env/site-packages/xformers/ops/fmha/common.py", line 190, in validate_inputs
    raise ValueError(
ValueError: Query/Key/Value should either all have the same dtype, or (in the quantized case) Key/Value \
should have dtype torch.int32
  query.dtype: torch.float32
  key.dtype  : torch.float32
  value.dtype: torch.bfloat16
"""

T5_APEX = """\
  File "/app/pipe.py", line 301, in encode_prompt
    embeds = self.text_encoder(ids)[0]
  File "/env/site-packages/transformers/models/t5/modeling_t5.py", line 601, in forward
    normed_hidden_states = self.layer_norm(hidden_states)
  File "/env/site-packages/apex/normalization/fused_layer_norm.py", line 420, in forward
    return fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps)
RuntimeError: expected scalar type Float but found Half
"""

INDUCTOR = """\
  File "/env/site-packages/torch/_dynamo/eval_frame.py", line 655, in _fn
    return fn(*args, **kwargs)
  File "/env/site-packages/torch/_inductor/compile_fx.py", line 1201, in compile_fx
    return aot_autograd(
torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:
RuntimeError: expected scalar type BFloat16 but found Float
"""

BNB = """\
  File "/env/site-packages/bitsandbytes/nn/modules.py", line 480, in forward
    out = bnb.matmul_4bit(x, self.weight.t(), bias=bias, quant_state=self.weight.quant_state)
  File "/env/site-packages/bitsandbytes/autograd/_functions.py", line 570, in matmul_4bit
    return MatMul4Bit.apply(A, B, out, bias, quant_state)
RuntimeError: expected scalar type Half but found BFloat16
"""

DEEPSPEED = """\
[rank1]:   File "/env/site-packages/deepspeed/runtime/engine.py", line 1899, in forward
[rank1]:     loss = self.module(*inputs, **kwargs)
[rank1]:   File "/env/site-packages/torch/nn/modules/conv.py", line 456, in _conv_forward
[rank1]:     return F.conv2d(input, weight, bias, self.stride,
[rank1]: RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (CUDABFloat16Type) should be the same
"""


@pytest.mark.parametrize(
    ("text", "category"),
    [
        (FASTPATH, "FASTPATH_BYPASSES_AUTOCAST"),
        (XFORMERS, "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL"),
        (T5_APEX, "KEEP_FP32_MODULE_LEAK"),
        (INDUCTOR, "TORCH_COMPILE_DTYPE"),
        (BNB, "QUANT_COMPUTE_DTYPE_MISMATCH"),
        (DEEPSPEED, "DISTRIBUTED_PRECISION_CONFIG"),
        (
            "RuntimeError: torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.",
            "UNSAFE_OR_LOWPREC_LOSS",
        ),
        ("RuntimeError: value cannot be converted to type at::Half without overflow", "FP16_RANGE_OVERFLOW"),
        (
            "RuntimeError: Current CUDA Device does not support bfloat16. Please switch dtype to float16.",
            "DTYPE_UNSUPPORTED_ON_DEVICE",
        ),
        (
            "  File \"/p/optim/shampoo.py\", line 90, in step\n    state['exp_avg'].lerp_(grad, 1 - beta)\n"
            "RuntimeError: expected dtype float for `end` but got dtype c10::BFloat16",
            "OPTIMIZER_OR_GRAD_DTYPE",
        ),
        (
            "x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)\nRuntimeError: Expected attn_mask dtype to be "
            "bool or to match query dtype, but got attn_mask.dtype: float and  query.dtype: c10::BFloat16 instead.",
            "MASK_DTYPE_MISMATCH",
        ),
        (
            "model = model.half()\nlogits = model(torch.randn(4, 3, 224, 224).cuda())\nRuntimeError: Input type "
            "(torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) should be the same",
            "MODEL_INPUT_DTYPE_MISMATCH",
        ),
    ],
)
def test_categories(text: str, category: str) -> None:
    e = explain(text)
    assert e.category == category, (e.category, [c.category for c in e.candidates])
    assert e.candidates[0].category == category
    assert e.is_dtype_error
    assert e.fixes and e.cause and e.title == CATEGORIES[category].title


def test_distributed_log_prefix_is_stripped_for_frames() -> None:
    frames = parse_frames(DEEPSPEED)
    assert [f.library for f in frames] == ["deepspeed", "torch"]


def test_long_log_is_read_around_the_error() -> None:
    noise = "".join(f"step {i} | loss {1 / (i + 1):.4f} | lr 3e-4 | 11.2 it/s\n" for i in range(20_000))
    e = explain(noise + T5_APEX + noise[:5000])
    assert e.category == "KEEP_FP32_MODULE_LEAK"
    assert e.locus is not None and e.locus.library == "apex"


def test_paraphrased_message_is_still_read() -> None:
    e = explain("with torch.cuda.amp my DeformConv op fails: expect scalar type Float but Half")
    assert e.dtypes == ("float32", "float16")
    assert e.category == "UNCAST_CUSTOM_OP_OR_EXTENSION"


def test_low_evidence_ranks_several_candidates() -> None:
    e = explain("RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16")
    assert e.category is not None
    assert e.level in ("low", "medium")
    assert len(e.candidates) >= 3
    scores = [c.score for c in e.candidates]
    assert scores == sorted(scores, reverse=True) and sum(scores) <= 1.0 + 1e-9
    assert "not enough evidence" in str(e)


def test_more_evidence_raises_confidence() -> None:
    bare = explain("RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16")
    assert explain(CPYTHON_LORA).confidence > bare.confidence


def test_device_mismatch_is_not_a_dtype_error() -> None:
    e = explain(
        "RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (torch.HalfTensor) should be the same"
    )
    assert e.category is None and not e.is_dtype_error
    assert "device" in e.title


def test_integer_operand_is_no_precision_cause() -> None:
    e = explain("RuntimeError: expected scalar type Long but found Float")
    assert e.category is None and not e.is_dtype_error
    quant = explain("RuntimeError: self and mat2 must have the same dtype, but got Half and Char")
    assert quant.category == "QUANT_COMPUTE_DTYPE_MISMATCH"


def test_no_evidence_says_so() -> None:
    e = explain(
        "Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\nKeyError: 'missing_column'"
    )
    assert e.category is None and e.candidates == () and not e.is_dtype_error
    assert e.to_dict()["candidates"] == []
    assert "no evidence" in str(e)


def test_non_dtype_exception_is_not_a_dtype_error() -> None:
    try:
        F.linear(torch.randn(2, 5), torch.randn(3, 4))
    except RuntimeError as exc:
        assert not explain(exc).is_dtype_error


def test_bad_input_type() -> None:
    with pytest.raises(TypeError, match="exception or a string"):
        explain(42)  # type: ignore[arg-type]


# -- output -------------------------------------------------------------------------------------


def test_to_dict_shape() -> None:
    d = explain(T5_APEX).to_dict()
    json.dumps(d)  # JSON-serialisable
    assert d["category"] == "KEEP_FP32_MODULE_LEAK"
    assert all(set(c) == {"category", "score", "title"} for c in d["candidates"])
    assert d["candidates"][0]["category"] == d["category"]
    assert d["locus"]["library"] == "apex" and d["locus"]["line"] == 420
    assert d["rule"] in rules.REGISTRY and rules.REGISTRY[d["rule"]].category == d["category"]
    assert d["dtypes"] == ["float32", "float16"]


def test_str_fits_100_columns() -> None:
    for text in (CPYTHON_LORA, XFORMERS, T5_APEX, FASTPATH, "x" * 300 + " expected scalar type Half but found Float"):
        out = str(explain(text))
        assert out.startswith("castwise explain:")
        assert max(len(line) for line in out.splitlines()) <= 100


def test_explanation_is_frozen() -> None:
    e = explain(XFORMERS)
    assert isinstance(e, Explanation)
    with pytest.raises(AttributeError):
        e.category = "x"  # type: ignore[misc]


# -- CLI ----------------------------------------------------------------------------------------


def test_cli_json_and_human(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    log.write_text("step 10 loss 2.31\n" + FASTPATH, encoding="utf-8")
    out = subprocess.run(
        [PY, "-m", "castwise", "explain", str(log), "--json", "-"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["category"] == "FASTPATH_BYPASSES_AUTOCAST" and d["rule"] == "CW103"
    human = subprocess.run(
        [PY, "-m", "castwise", "explain", "-"], input=FASTPATH, capture_output=True, text=True, timeout=60, check=False
    )
    assert human.returncode == 0
    assert "FASTPATH_BYPASSES_AUTOCAST" in human.stdout and "transformer.py:907" in human.stdout


def test_cli_explain_does_not_import_torch(tmp_path: Path) -> None:
    log = tmp_path / "err.txt"
    log.write_text(CPYTHON_LORA, encoding="utf-8")
    out = subprocess.run(
        [PY, "-X", "importtime", "-m", "castwise", "explain", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert "castwise.diagnosis.explain" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_explain_module_is_torch_free() -> None:
    code = (
        "import sys, castwise; from castwise.diagnosis.explain import explain; "
        "import castwise.diagnosis.context; "
        "explain('RuntimeError: expected scalar type Half but found Float'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- phrasing families that were missed or misread ------------------------------------------


def _top(text: str, n: int = 1) -> list[str]:
    return [c.category for c in explain(text).candidates[:n]]


@pytest.mark.parametrize(
    "message",
    [
        # cudnn/RNN.cpp and RNN.cpp word the RNN checks this way, for weights and for the hidden state
        "RuntimeError: Input and parameter tensors are not the same dtype, found input tensor with Float and "
        "parameter tensor with Half",
        "RuntimeError: Input and hidden tensors are not the same dtype, found input tensor with Half and hidden "
        "tensor with Float",
    ],
)
def test_rnn_input_against_weights_or_hidden_state(message: str) -> None:
    e = explain(message)
    assert e.signal is not None and e.signal.startswith("rnn-dtype in rnn"), e.signal
    assert e.category == "MODEL_INPUT_DTYPE_MISMATCH"
    assert set(e.dtypes) == {"float32", "float16"}


def test_rnn_hidden_state_names_its_side() -> None:
    [sig] = read_signals(
        "Input and hidden tensors are not the same dtype, found input tensor with BFloat16 and hidden tensor with Float"
    )
    assert sig.roles == ("input", "hidden") and (sig.first, sig.second) == ("bfloat16", "float32")


@pytest.mark.parametrize(
    "message",
    [
        "RuntimeError: expected both vectors to have same dtype, but found Float and BFloat16",
        "RuntimeError: dot : expected both vectors to have same dtype, but found Half and Float",
        "RuntimeError: vdot : expected both vectors to have same dtype, but found BFloat16 and Half",
    ],
)
def test_dot_with_or_without_the_op_prefix_is_a_strict_op(message: str) -> None:
    e = explain(message)
    assert e.signal is not None and e.signal.startswith("dot-dtype")
    assert e.category == "STRICT_SAME_DTYPE_OP"


def test_bare_lerp_message_is_an_optimizer_update() -> None:
    # lerp_ is how optimizer moments and EMA weights are updated; no traceback needed
    e = explain("RuntimeError: expected dtype float for `end` but got dtype c10::BFloat16")
    assert e.category == "OPTIMIZER_OR_GRAD_DTYPE"
    assert "STRICT_SAME_DTYPE_OP" in _top("expected dtype float for `end` but got dtype c10::BFloat16", 3)


def test_cudnn_argument_check_tells_forward_input_from_backward_gradient() -> None:
    forward = (
        "RuntimeError: Expected tensor for argument #1 'input' to have the same type as tensor for argument "
        "#2 'weight'; but type torch.cuda.HalfTensor does not equal torch.cuda.FloatTensor (while checking "
        "arguments for cudnn_convolution)"
    )
    e = explain(forward)
    assert e.category == "MODEL_INPUT_DTYPE_MISMATCH"
    assert e.signal is not None and e.signal.startswith("conv-dtype in convolution (input f16, weight f32)")
    backward = forward.replace("'input'", "'grad_output'").replace(
        "cudnn_convolution)", "cudnn_convolution_backward_input)"
    )
    b = explain(backward)
    assert b.signal is not None and b.signal.startswith("grad-output-type in backward")
    assert b.category == "OPTIMIZER_OR_GRAD_DTYPE"
    # the same check in a norm wrapper points at the norm's parameters
    norm = forward.replace("cudnn_convolution)", "cudnn_batch_norm)")
    assert explain(norm).category == "NORM_PARAM_OR_STATS_DTYPE"
    # one dtype on two devices is not a dtype error
    devices = forward.replace("torch.cuda.HalfTensor", "torch.FloatTensor")
    assert not explain(devices).is_dtype_error


@pytest.mark.parametrize(
    "message",
    [
        "RuntimeError: self and mat2 must have the same dtype",
        "RuntimeError: self and mat2 must have the same dtype, but got BFloat16 and Float",
        "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float",
    ],
)
def test_adapter_cause_needs_adapter_evidence(message: str) -> None:
    bare = explain(message)
    assert bare.category != "ADAPTER_DTYPE_MISMATCH"
    if "self and mat2" in message:  # bias against weight: the layer got a half-converted model or input
        assert bare.category == "MODEL_INPUT_DTYPE_MISMATCH"
    with_lora = (
        '  File "/env/site-packages/peft/tuners/lora/layer.py", line 500, in forward\n'
        "    result = result + lora_B(lora_A(dropout(x))) * scaling\n" + message
    )
    assert explain(with_lora).category == "ADAPTER_DTYPE_MISMATCH"
    assert explain("I added LoRA adapters with peft, then:\n" + message).category == "ADAPTER_DTYPE_MISMATCH"


MIXED_CPU = "RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float"

OPEN_CLIP_LN = (
    """\
  File "/env/site-packages/open_clip/transformer.py", line 38, in forward
    x = F.layer_norm(x.to(torch.float32), self.normalized_shape, self.weight, self.bias, self.eps)
  File "/env/site-packages/torch/nn/functional.py", line 2910, in layer_norm
    return torch.layer_norm(
"""
    + MIXED_CPU
)

GROUP_NORM = (
    """\
  File "/w/unet.py", line 88, in forward
    h = self.norm1(h)
  File "/env/site-packages/torch/nn/modules/normalization.py", line 313, in forward
    return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
  File "/env/site-packages/torch/nn/functional.py", line 2965, in group_norm
    return torch.group_norm(
"""
    + MIXED_CPU
)


def test_cpu_norm_mixed_dtype_ranks_both_norm_causes_and_frames_decide() -> None:
    top2 = _top(MIXED_CPU, 2)
    assert set(top2) == {"NORM_PARAM_OR_STATS_DTYPE", "KEEP_FP32_MODULE_DOWNCAST"}
    # the bare message cannot tell them apart: never a high-confidence answer (the calibrated
    # confidence, not the raw score gap, is what the fitted model commits to)
    assert explain(MIXED_CPU).level != "high"
    assert _top(OPEN_CLIP_LN) == ["KEEP_FP32_MODULE_DOWNCAST"]
    assert _top(GROUP_NORM) == ["NORM_PARAM_OR_STATS_DTYPE"]


FLASH = "RuntimeError: FlashAttention only support fp16 and bf16 data type"


def test_flash_attention_float32_reads_autocast_evidence() -> None:
    # a bare refusal: float32 reached a half-only kernel (the whole model ran in float32, say)
    assert _top(FLASH, 2) == ["DTYPE_UNSUPPORTED_ON_DEVICE", "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL"]
    # under autocast the float32 came from autocast's float32 ops: the fp32-island cause
    under_amp = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    out = model(x)\n" + FLASH
    assert _top(under_amp) == ["AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL"]


def test_lerp_in_model_code_stays_a_strict_op() -> None:
    # with a traceback, the frames say whose lerp it was: here a model's own interpolation
    text = (
        '  File "/w/pipeline.py", line 77, in blend\n'
        "    latents = torch.lerp(latents, noise_latents, alpha)\n"
        "RuntimeError: expected dtype float for `end` but got dtype c10::BFloat16"
    )
    assert _top(text) == ["STRICT_SAME_DTYPE_OP"]
    adam = (
        '  File "/env/site-packages/torch/optim/adam.py", line 410, in _single_tensor_adam\n'
        "    exp_avg.lerp_(grad, 1 - beta1)\n"
        "RuntimeError: expected dtype float for `end` but got dtype c10::BFloat16"
    )
    assert _top(adam) == ["OPTIMIZER_OR_GRAD_DTYPE"]


def _stft_bf16() -> object:
    return torch.stft(
        torch.randn(64, dtype=torch.bfloat16), 16, window=torch.ones(16, dtype=torch.bfloat16), return_complex=True
    )


# more of PyTorch's own wording families, raised for real by this torch on CPU
_MORE_REAL = [
    (
        # a bare mv from a test: inputs vs an unconverted tensor is the fitted model's call, the
        # wording is what this test pins
        lambda: torch.mv(torch.randn(3, 4), torch.randn(4, dtype=torch.bfloat16)),
        "matmul-dtype",
        None,
    ),
    (
        lambda: torch.zeros(4).put_(torch.tensor([0]), torch.ones(1, dtype=torch.bfloat16)),
        "scatter-dtype",
        "STRICT_SAME_DTYPE_OP",
    ),
    (
        lambda: torch.zeros(4, 3).index_copy_(0, torch.tensor([0]), torch.ones(1, 3, dtype=torch.float16)),
        "scatter-dtype",
        "STRICT_SAME_DTYPE_OP",
    ),
    (
        lambda: torch.zeros(4, 3).index_add_(0, torch.tensor([0]), torch.ones(1, 3, dtype=torch.bfloat16)),
        "scatter-dtype",
        "STRICT_SAME_DTYPE_OP",
    ),
    (_stft_bf16, "no-kernel-for-dtype", "DTYPE_UNSUPPORTED_ON_DEVICE"),
    (lambda: torch.fft.rfft(torch.randn(8, dtype=torch.float16)), "no-kernel-for-dtype", "DTYPE_UNSUPPORTED_ON_DEVICE"),
    (
        lambda: torch.linalg.inv(torch.eye(3, dtype=torch.bfloat16)),
        "no-kernel-for-dtype",
        "DTYPE_UNSUPPORTED_ON_DEVICE",
    ),
    (lambda: torch.linalg.qr(torch.eye(3, dtype=torch.bfloat16)), "no-kernel-for-dtype", "DTYPE_UNSUPPORTED_ON_DEVICE"),
    (
        lambda: torch.quantile(torch.rand(8, dtype=torch.bfloat16), 0.5),
        "no-kernel-for-dtype",
        "DTYPE_UNSUPPORTED_ON_DEVICE",
    ),
    (
        lambda: torch.polar(torch.rand(3, dtype=torch.bfloat16), torch.rand(3, dtype=torch.bfloat16)),
        "complex-dtype",
        "DTYPE_UNSUPPORTED_ON_DEVICE",
    ),
    (
        lambda: torch.zeros(3, dtype=torch.int64).lerp_(torch.ones(3, dtype=torch.bfloat16), 0.5),
        "inplace-arg-dtype",
        None,
    ),
]


@pytest.mark.parametrize(("call", "family", "category"), _MORE_REAL)
def test_more_real_wordings_are_read(call: object, family: str, category: str | None) -> None:
    with pytest.raises(Exception) as info:
        call()  # type: ignore[operator]
    e = explain(info.value)
    assert e.signal is not None and e.signal.startswith(family), (e.signal, str(info.value)[:120])
    if category is not None:
        assert e.category == category, [c.category for c in e.candidates[:3]]


def test_two_word_cpp_dtype_names() -> None:
    assert dtype_name("long int") == "int64"
    assert dtype_name("unsigned char") == "uint8"
    [sig] = read_signals("expected dtype long int for `end` but got dtype c10::BFloat16")
    assert (sig.first, sig.second) == ("int64", "bfloat16")


def test_onednn_primitive_failure_reads_as_a_device_limit() -> None:
    # an LSTM given a bf16 hidden state with float32 input on CPU fails inside oneDNN; the message
    # names no dtype, so it is not called a dtype clash, but the likely causes are still ranked
    with pytest.raises(RuntimeError) as info:
        torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4), (torch.zeros(1, 1, 4, dtype=torch.bfloat16),) * 2)
    e = explain(info.value)
    assert e.signal is not None and e.signal.startswith("onednn-primitive")
    # the fitted model ranks the two readings (a CPU kernel limit, inputs in another dtype than the
    # module) by the reports it was fitted on; which comes first is the data's call, not the test's
    top3 = [c.category for c in e.candidates[:3]]
    assert {"DTYPE_UNSUPPORTED_ON_DEVICE", "MODEL_INPUT_DTYPE_MISMATCH"} <= set(top3)


# -- an eager op's error met while dynamo traced ---------------------------------------------


def test_an_eager_dtype_error_raised_under_torch_compile_is_not_blamed_on_compile() -> None:
    # the compiled graph runs the op eager runs: a Linear fed bf16 activations with f32 weights
    # raises through dynamo's frames what eager raises. Codebases that always compile (nanochat,
    # torchtitan) paste it so: the cause is the op's, not torch.compile's
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as eager:
        lin(x)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(lin, backend="eager")(x)
    torch._dynamo.reset()
    assert "torch/_dynamo" in "".join(traceback.format_tb(compiled.value.__traceback__))
    e_eager, e_compiled = explain(eager.value), explain(compiled.value)
    assert e_compiled.category != "TORCH_COMPILE_DTYPE"
    assert e_compiled.category == e_eager.category


def test_dynamos_fake_tensor_replay_of_an_eager_error_is_the_ops_error() -> None:
    # while tracing, dynamo runs the op on fake tensors and wraps its refusal; eager raises the same
    text = (
        "torch._dynamo.exc.TorchRuntimeError: Dynamo failed to run FX node with fake tensors: call_function "
        "<built-in function linear>(*(FakeTensor(..., size=(2, 8, 64), dtype=torch.bfloat16), "
        "Parameter(FakeTensor(..., size=(64, 64), requires_grad=True))), **{}): got "
        "RuntimeError('expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float')"
    )
    assert explain(text).category != "TORCH_COMPILE_DTYPE"
    assert explain(text + "\nIt works in eager mode, only fails with torch.compile.").category == "TORCH_COMPILE_DTYPE"


def test_a_cpu_scalar_operand_in_dynamos_replay_still_points_at_compile() -> None:
    # a 0-d tensor is a CPU scalar eager lets through; fake-tensor propagation checks its dtype:
    # there compile really differs from eager (nanochat's lerp_ with an f32 0-d weight)
    text = (
        "Under torch.compile, the fused AdamW step fails:\n"
        "torch._dynamo.exc.TorchRuntimeError: Failed running call_method lerp_(*(FakeTensor(..., "
        "device='cuda:0', size=(4096, 256), dtype=torch.bfloat16), FakeTensor(..., device='cuda:0', "
        "size=(4096, 256), dtype=torch.bfloat16), FakeTensor(..., size=())), **{}):\n"
        "expected dtype torch.bfloat16 for `weight`, but got dtype torch.float32"
    )
    names = {f.name for f in read_evidence(text).features}
    assert "text:torch.compile" in names
    plain = text.replace("FakeTensor(..., size=())", "FakeTensor(..., device='cuda:0', size=(4096, 256))")
    assert "text:torch.compile" not in {f.name for f in read_evidence(plain).features}
