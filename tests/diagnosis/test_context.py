"""castwise.diagnose(): dtype errors raised for real get notes (module, origin, cause, fix); other
exceptions pass untouched; the original exception object and traceback are kept."""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise import stories
from castwise.diagnosis.context import diagnose

warnings.filterwarnings("ignore", message=".*nested tensors.*")
logging.getLogger().setLevel(logging.ERROR)  # open_clip warns that no pretrained weights load


def _story(number: int) -> stories.Story:
    return next(s for s in stories.STORIES if s.number == number)


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


def _run_story_under_diagnose(number: int) -> tuple[BaseException, nn.Module, dict[str, torch.dtype]]:
    story = _story(number)
    assert not story.missing(), f"story {number} needs {story.missing()} (pip install castwise[demo])"
    model, inputs = story.build()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as info, castwise.diagnose():
        story.run_real(model, inputs)
    return info.value, model, dtypes


@pytest.mark.parametrize(
    ("number", "module", "category"),
    [
        (1, "visual.ln_pre", "KEEP_FP32_MODULE_DOWNCAST"),
        (2, "encoder.block.1.layer.0.layer_norm", "KEEP_FP32_MODULE_LEAK"),
        (3, "encoder.layers.0", "FASTPATH_BYPASSES_AUTOCAST"),
    ],
)
def test_story_failures_carry_module_cause_and_fix(number: int, module: str, category: str) -> None:
    exc, model, dtypes = _run_story_under_diagnose(number)
    notes = _notes(exc)
    assert any(f"raised in module `{module}`" in n for n in notes), notes
    assert any(n.startswith("castwise: cause: " + category) for n in notes), notes
    assert any(n.startswith("castwise: fix: ") for n in notes), notes
    # the notes print with the traceback, as PEP 678 says
    printed = "".join(traceback.format_exception(exc))
    assert f"`{module}`" in printed
    # the replay never changed the user's model
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes


def test_story2_names_the_origin() -> None:
    exc, _, _ = _run_story_under_diagnose(2)
    origin = [n for n in _notes(exc) if "the offending dtype came from" in n]
    assert origin and "`encoder.block.0.layer.1.DenseReluDense.wo`" in origin[0], _notes(exc)


def test_story3_origin_is_found_under_the_mixed_policy() -> None:
    """Autocast is gone by __exit__: the replay retries under the low dtype's mixed policy."""
    exc, _, _ = _run_story_under_diagnose(3)
    origin = [n for n in _notes(exc) if "the offending dtype came from" in n]
    assert origin and "bf16-mixed" in origin[0], _notes(exc)


# -- the exception is the user's --------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _fail_with_dtype() -> None:
    model = Tiny().to(torch.bfloat16)
    model(torch.randn(3, 4))  # float32 input into a bfloat16 model


def test_same_exception_object_type_and_traceback() -> None:
    caught: list[BaseException] = []

    def inner() -> None:
        try:
            _fail_with_dtype()
        except RuntimeError as exc:
            caught.append(exc)
            raise

    with pytest.raises(RuntimeError) as info, diagnose():
        inner()
    assert info.value is caught[0]
    assert type(info.value) is RuntimeError
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-3:] != [] and "_fail_with_dtype" in frames and "inner" in frames
    notes = _notes(info.value)
    assert "castwise: raised in module `body.0` (Linear) of Tiny" in notes
    assert any("MODEL_INPUT_DTYPE_MISMATCH" in n for n in notes), notes
    # an annotated error pasted into `castwise explain` keeps its module
    explained = castwise.explain("".join(traceback.format_exception(info.value)))
    assert explained.locus is not None and explained.locus.module == "body.0"


def test_non_dtype_exceptions_pass_untouched() -> None:
    model = Tiny()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info, diagnose():
        model(torch.randn(3, 5))
    assert not hasattr(info.value, "__notes__")
    with pytest.raises(KeyError) as key, diagnose():
        {}["missing"]
    assert not hasattr(key.value, "__notes__")


def test_decorator_forms_return_values_and_raise() -> None:
    @castwise.diagnose()
    def ok(x: int) -> int:
        return x + 1

    @castwise.diagnose
    def bad() -> None:
        _fail_with_dtype()

    assert ok(1) == 2
    assert ok.__name__ == "ok"
    with pytest.raises(RuntimeError) as info:
        bad()
    assert any("`body.0`" in n for n in _notes(info.value))
    # a decorated function can fail many times; each failure is annotated once
    with pytest.raises(RuntimeError) as again:
        bad()
    assert len([n for n in _notes(again.value) if "raised in module" in n]) == 1


def test_nested_diagnose_annotates_once() -> None:
    with pytest.raises(RuntimeError) as info, diagnose(), diagnose():
        _fail_with_dtype()
    assert len([n for n in _notes(info.value) if n.startswith("castwise: cause:")]) == 1


def test_dtype_error_outside_any_module_gets_cause_and_fix() -> None:
    emb = torch.zeros(6, 4)
    with pytest.raises(RuntimeError) as info, diagnose():
        emb[torch.tensor([1, 2])] = torch.ones(2, 4, dtype=torch.bfloat16)
    notes = _notes(info.value)
    assert not any("raised in module" in n for n in notes)
    assert any("STRICT_SAME_DTYPE_OP" in n for n in notes) and any("fix:" in n for n in notes)


def test_backward_error_gets_cause_without_module() -> None:
    """Backward runs in autograd's engine: no module frame is on the stack, the cause still is."""
    w = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError) as info, diagnose():
        y = w * 2
        y.register_hook(lambda g: g.float())  # a hook that changes the gradient's dtype
        y.sum().backward()
    notes = _notes(info.value)
    assert not any("raised in module" in n for n in notes)
    assert any(n.startswith("castwise: cause: OPTIMIZER_OR_GRAD_DTYPE") for n in notes), notes


class NeedsRealValues(nn.Module):
    """Fails with a dtype error, but its forward reads a value (`.item()`), which fake tensors
    cannot give: the replay cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = int(x.abs().sum().item() > -1) + int(x.nonzero().shape[0] > -1)
        for _ in range(steps):
            x = self.lin(x)
        return x


def test_replay_failure_keeps_the_notes_it_can() -> None:
    with pytest.raises(RuntimeError) as info, diagnose():
        NeedsRealValues()(torch.randn(2, 4))
    notes = _notes(info.value)
    assert "castwise: raised in module `lin` (Linear) of NeedsRealValues" in notes
    assert any(n.startswith("castwise: cause:") for n in notes)


def test_model_called_through_forward_directly() -> None:
    """No module-call frame: the root forward frame's parameters are the inputs."""
    model = Tiny().to(torch.float16)
    with pytest.raises(RuntimeError) as info, diagnose():
        model.forward(torch.randn(2, 4))
    notes = _notes(info.value)
    assert "castwise: raised in module `body.0` (Linear) of Tiny" in notes
    assert any("came from" in n for n in notes), notes


def test_no_hooks_or_modes_while_running() -> None:
    """Nothing is installed while nothing fails: the work happens only in __exit__."""
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    before = (sys.gettrace(), sys.getprofile())
    with diagnose():
        assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
        assert _get_current_dispatch_mode() is None
        assert not torch._C._is_torch_function_mode_enabled()
        assert (sys.gettrace(), sys.getprofile()) == before
        out = Tiny()(torch.randn(2, 4))
    assert out.shape == (2, 2)


def test_diagnose_rejects_arguments() -> None:
    with pytest.raises(TypeError, match="no arguments"):
        diagnose(3)  # type: ignore[call-overload]


def test_keyboard_interrupt_is_not_touched() -> None:
    exc: Any = None
    try:
        with diagnose():
            raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        exc = e
    assert exc is not None and not hasattr(exc, "__notes__")
