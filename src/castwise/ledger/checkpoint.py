"""The ledger of a checkpoint on disk (imports torch only for torch.save files).

A file is read for its dtypes, never run: a safetensors file by its JSON header alone (the 8-byte
length, then ``{name: {"dtype", "shape", ...}}``: no tensor is read); a ``torch.save`` file with
``torch.load(weights_only=True, map_location="meta")``: torch's restricted unpickler builds no
object but tensors and plain containers, and every tensor lands on the meta device (dtypes and
shapes, no values). The file is a model ``state_dict``, an optimizer ``state_dict``
(``{"state", "param_groups"}``, HF Trainer's ``optimizer.pt``), or a dict holding both (``model`` /
``state_dict`` / ``module`` and ``optimizer`` / ``optimizer_states``, as Lightning and plain
training loops save them). An optimizer's parameters are numbered; where the model's tensors are
in the file too, each number is paired with the next model tensor of its state's shape, in order
(torch numbers parameters in ``param_groups`` order, which is the model's ``parameters()`` order
for ``optimizer(model.parameters())``); else they are named ``param N``.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from castwise._dtypes import short
from castwise.errors import CastwiseError
from castwise.ledger.values import UNKNOWN, Entry, Ledger, group_rows, listed
from castwise.rules.api import Finding

__all__ = ["CHECKPOINT_SUFFIXES", "ledger_from_checkpoint", "read_checkpoint", "resume_findings"]

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
_MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict")
_OPT_KEYS = ("optimizer", "optimizer_states", "optimizer_state_dict", "optim")
# safetensors dtype names -> torch's
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_SCHEME = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def _safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CastwiseError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", head)
        if size > os.path.getsize(path) - 8:
            raise CastwiseError(f"{path}: not a safetensors file (its header length {size} runs past the file)")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise CastwiseError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    return {
        k: (_ST_DTYPES.get(str(v.get("dtype")), str(v.get("dtype")).lower()), tuple(v.get("shape") or ()))
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict)
    }


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, tuple[str, tuple[int, ...]]], Any]:
    """(model tensors: name -> (dtype, shape), the optimizer state_dict or None) of a file."""
    p = Path(path)
    if not p.is_file():
        raise CastwiseError(f"{p}: no such checkpoint file")
    if p.suffix.lower() == ".safetensors":
        return _safetensors(p), None
    import pickle

    import torch

    try:
        data = torch.load(p, map_location="meta", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # (torch's message carries terminal colours)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # the unpickler's own reason ("Unsupported global: GLOBAL __main__.Boom"), else torch's first line
        first = next((line for line in lines if "Unpickler error" in line), lines[0] if lines else type(exc).__name__)
        raise CastwiseError(
            f"{p}: torch.load(weights_only=True) refused it ({first}). castwise reads checkpoints of tensors and "
            "plain containers only and never runs code from a file; valid: a model state_dict, an optimizer "
            "state_dict, or a dict of both (torch.save), or a .safetensors file"
        ) from None
    if not isinstance(data, Mapping):
        raise CastwiseError(f"{p}: holds a {type(data).__name__}; valid: a state_dict or a dict holding them")
    opt = _optimizer_of(data)
    # the model's tensors: under one of the usual keys, else the file's own (none in an optimizer's)
    found = next((data[k] for k in _MODEL_KEYS if isinstance(data.get(k), Mapping)), data)
    model: Mapping[str, Any] = {} if opt is data else found
    tensors = {str(k): (_name(v.dtype), tuple(v.shape)) for k, v in model.items() if isinstance(v, torch.Tensor)}
    return tensors, opt


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _optimizer_of(data: Mapping[str, Any]) -> Any:
    if "state" in data and "param_groups" in data:
        return data
    for k in _OPT_KEYS:
        v = data.get(k)
        if isinstance(v, list | tuple) and v and isinstance(v[0], Mapping):
            v = v[0]  # Lightning: one state_dict per optimizer; the first
        if isinstance(v, Mapping) and "state" in v and "param_groups" in v:
            return v
    return None


def _state_entries(state: Mapping[str, Any], group: Mapping[str, Any], who: str) -> dict[str, Entry]:
    import torch

    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step" and v.dim() > 0}
    if not tensors:
        return {"state": Entry("none", who, "no per-element state"), "scheme": Entry("none", who)}
    keys = ", ".join(sorted(tensors))
    wide = {k: v for k, v in tensors.items() if v.is_floating_point() and "master" not in k and "comp" not in k}
    if any(not v.is_floating_point() for v in tensors.values()):  # codes (bitsandbytes state1/state2 uint8)
        codes = sorted({_name(v.dtype) for v in tensors.values() if not v.is_floating_point()})
        bits = "8-bit" if all(c in ("uint8", "int8") for c in codes) else UNKNOWN
        kept, scheme = Entry("/".join(codes), who, f"codes: {keys}"), Entry(bits, who, f"{keys}")
    else:
        dts = sorted({_name(v.dtype) for v in wide.values()})
        kept = Entry("/".join(dts), who, f"optimizer state: {keys}")
        scheme = Entry("/".join(_SCHEME.get(d, d) for d in dts), who, f"optimizer state: {keys}")
    out: dict[str, Entry] = {"state": kept, "scheme": scheme}
    master = next((v for k, v in tensors.items() if "master" in k or k in ("fp32_param", "main_param")), None)
    if master is not None:
        out["master"] = Entry(_name(master.dtype), who, "a master copy in the optimizer state")
    if any("comp" in k or "kahan" in k for k in tensors):
        out["rounding"] = Entry("kahan", who, "a compensation tensor in the optimizer state")
    elif group.get("bf16_stochastic_round"):
        out["rounding"] = Entry("stochastic", who, "param group bf16_stochastic_round=True")
    return out


def _pair(tensors: Mapping[str, tuple[str, tuple[int, ...]]], opt: Mapping[str, Any]) -> dict[Any, str]:
    """Optimizer parameter numbers -> model tensor names, by order and shape (all or none)."""
    import torch

    names = list(tensors)
    out: dict[Any, str] = {}
    at = 0
    for g in opt.get("param_groups") or []:
        for i in g.get("params") or []:
            st = (opt.get("state") or {}).get(i, {})
            shape = next((tuple(v.shape) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            while at < len(names) and (shape is not None and tensors[names[at]][1] != shape):
                at += 1
            if at >= len(names):
                return {}
            out[i] = names[at]
            at += 1
    return out


def ledger_from_checkpoint(path: str | os.PathLike[str]) -> Ledger:
    """The ledger a checkpoint file holds: per group of tensors, their storage dtype on disk and,
    with an optimizer state_dict, its state's dtype and scheme per param group."""
    tensors, opt = read_checkpoint(path)
    where = f"the file ({Path(path).name})"
    per: list[tuple[str, dict[str, Entry]]] = []
    paired = _pair(tensors, opt) if opt is not None and tensors else {}
    seen: set[str] = set()
    for gi, g in enumerate((opt or {}).get("param_groups") or []):
        lr = g.get("lr")
        who = f"optimizer param group {gi}" + (f" (lr={lr:g})" if isinstance(lr, float | int) else "")
        for i in g.get("params") or []:
            name = paired.get(i, f"param {i}")
            entries = _state_entries((opt.get("state") or {}).get(i, {}), g, who)
            if name in tensors:
                seen.add(name)
                entries["storage"] = Entry(tensors[name][0], where, "stored dtype")
                entries["checkpoint_save"] = Entry(tensors[name][0], where)
            per.append((name, entries))
    for name, (dtype, _) in tensors.items():
        if name not in seen:
            per.append((name, {"storage": Entry(dtype, where, "stored dtype"), "checkpoint_save": Entry(dtype, where)}))
    notes = []
    if opt is not None and tensors and not paired:
        notes.append("the optimizer's parameter numbers could not be paired with the model's tensors by shape")
    if opt is None:
        notes.append("no optimizer state_dict in the file: state fields unknown")
    return Ledger(group_rows(per), f"checkpoint {path}", tuple(notes))


_COMPARED = ("storage", "state", "scheme", "master")


def _values(rows: Any, field: str, names: set[str] | None) -> set[str]:
    out = set()
    for r in rows:
        if names is not None and not names & set(r.params):
            continue
        e = r.entries()[field]
        if e.known:
            out.add(e.value)
    return out


def resume_findings(ckpt: Ledger, target: Ledger) -> list[Finding]:
    """CW155: the fields a resume from the checkpoint into ``target`` (a model and its optimizer, or
    a configuration) gives another precision than the file holds; by parameter name where the
    target names the file's parameters, else the whole file against the whole target."""
    target_names = {n for r in target.rows for n in r.params}
    by_name = any(set(r.params) & target_names for r in ckpt.rows)  # a model's ledger: compare by name
    changes = []
    for r in ckpt.rows:
        names = set(r.params) & target_names or None
        if by_name and names is None:
            continue  # a tensor the run does not train (a buffer): not in its ledger
        for field in _COMPARED:
            have = r.entries()[field]
            want = _values(target.rows, field, names)
            if have.known and want and have.value not in want:
                who = listed(r.params)
                changes.append(f"{field} {short(have.value)} -> {'/'.join(short(v) for v in sorted(want))} ({who})")
    if not changes:
        return []
    shown = "; ".join(changes[:8]) + (f"; (+{len(changes) - 8} more)" if len(changes) > 8 else "")
    return [
        Finding(
            code="CW155",
            message=f"resuming from {ckpt.source.removeprefix('checkpoint ')} into {target.source} changes the "
            f"precision of: {shown}. load_state_dict copies into the existing parameters, keeping their dtype "
            "(torch Module._load_from_state_dict), and torch's Optimizer.load_state_dict casts floating state to "
            "its parameter's dtype.",
            fix="Resume into the precision the checkpoint was trained in (the same dtype, master weights and "
            "optimizer), or convert on purpose and check the loss right after the resume.",
            details=(("changes", tuple(changes)),),
        )
    ]
