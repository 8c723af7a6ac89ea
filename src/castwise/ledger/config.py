"""The ledger of a run from its configuration files alone (torch-free).

The lint readers (castwise.lint) turn the files into the precision model, whose values each
engine's reader derives from the engine's own source (cited there). This module lays that
model out as ledger rows, and splits a row where the engine treats parameters differently:
low-bit optimizers keep small tensors unquantized, DeepSpeed's ``torch_autocast`` reduces
Linear/Conv parameters in the autocast dtype.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from castwise.ledger.values import UNKNOWN, Entry, Ledger, Row
from castwise.lint import build_model, read_config
from castwise.lint import hf as hf_reader
from castwise.lint.model import ConfigFile, PrecisionModel, Traced, said

__all__ = ["ledger_from_config"]

PathLike = str | os.PathLike[str]
ALL = "all trained parameters"
_LOAD_NOTE = (
    "load_state_dict copies into the existing parameters, keeping their dtype (torch Module._load_from_state_dict)"
)
_SAVE_NOTE = "state_dict() saves the parameters as stored"


def _entry(t: Traced | None) -> Entry:
    if t is None:
        return Entry()
    return Entry(t.value, said(t.settings) if t.settings else "default", t.note)


def _row(model: PrecisionModel, params: tuple[str, ...]) -> Row:
    storage = _entry(model.weights)
    load = _entry(model.checkpoint_load) if model.checkpoint_load is not None else None
    if load is None and storage.known:
        load = Entry(storage.value, storage.source, _LOAD_NOTE)
    master = _entry(model.master)
    return Row(
        params=params,
        storage=storage,
        compute=_entry(model.compute),
        gradient=_entry(model.gradients),
        reduction=_entry(model.reduce),
        master=master,
        state=_entry(model.optimizer_state),
        scheme=_entry(model.state_scheme),
        rounding=_entry(model.rounding),
        checkpoint_save=Entry(storage.value, storage.source, _SAVE_NOTE) if storage.known else Entry(),
        checkpoint_load=load or Entry(),
    )


def _optim(files: Sequence[ConfigFile]) -> str | None:
    for cf in files:
        s = cf.get("optim") if cf.format == "hf-training-args" else None
        if s is not None:
            return str(s.value).strip().lower()
    return None


def _split_low_bit(row: Row, files: Sequence[ConfigFile]) -> tuple[Row, ...]:
    optim = _optim(files)
    small = hf_reader.small_tensor_state(optim) if optim is not None else None
    if small is None:
        return (row,)
    state = row.storage if small == "param" else Entry("float32", row.state.source, row.state.note)
    scheme = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(state.value, UNKNOWN)
    big = Row(**{**row.__dict__, "params": ("tensors of >= 4096 elements",)})
    rest = Row(
        **{
            **row.__dict__,
            "params": ("tensors of < 4096 elements",),
            "state": Entry(state.value, row.state.source, "too small to quantize: " + row.state.note),
            "scheme": Entry(scheme, row.state.source, "too small to quantize"),
        }
    )
    return (big, rest)


def _split_autocast(row: Row, files: Sequence[ConfigFile]) -> tuple[Row, ...]:
    for cf in files:
        on = cf.get("torch_autocast.enabled") if cf.format == "deepspeed" else None
        if on is not None and row.reduction.known and row.reduction.value != "float32":
            linear = Row(**{**row.__dict__, "params": ("Linear, Conv1d/2d/3d parameters",)})
            note = "parameters without comm_dtype all-reduce in their own dtype (torch_autocast.get_comm_dtype)"
            other = Row(
                **{**row.__dict__, "params": ("other parameters",), "reduction": Entry("float32", said((on,)), note)}
            )
            return (linear, other)
    return (row,)


def ledger_from_config(paths: PathLike | Sequence[PathLike]) -> Ledger:
    """The ledger the files decide; raises ConfigError for a file castwise cannot read."""
    files = read_config(paths)
    model = build_model(files)
    rows: tuple[Row, ...] = (_row(model, (ALL,)),)
    rows = tuple(r2 for r in rows for r2 in _split_autocast(r, files))
    rows = tuple(r2 for r in rows for r2 in _split_low_bit(r, files))
    notes = []
    steps = model.accumulate_steps
    if steps is not None:
        notes.append(f"gradients accumulate over {steps.value} micro-batches ({said(steps.settings)})")
    names = ", ".join(dict.fromkeys(cf.path for cf in files))
    return Ledger(rows, names, tuple(notes))
