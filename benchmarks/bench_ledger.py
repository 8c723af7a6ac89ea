"""The precision ledger from configs vs each engine's own answer.

For every config the truth is taken from the engine where it runs here (DeepSpeed's
``DeepSpeedConfig`` and the engine's ``get_data_types`` / ``communication_data_type`` /
``ZeROOptimizer._configure_master_weights``; transformers' ``TrainingArguments``, the Trainer's
optimizer dispatch and one real ``step()`` read from ``optimizer.state``; ``from_pretrained`` of a
local checkpoint; torch AdamW built as torchtitan builds its model), else from the engine's source
(bitsandbytes, transformers 4.57, Megatron-LM: "source" in the table). Prints per config the fields
compared, then ``ledger equal k/n, wrong fields w, unknown u``.

    python benchmarks/bench_ledger.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from castwise._dtypes import name_of
from castwise.ledger import UNKNOWN, Row, ledger_from_config

Truth = dict[str, dict[str, str]]  # row selector -> field -> value


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, str]
    truth: Callable[[Path], Truth]
    origin: str = "engine"


# -- DeepSpeed: the engine's own config parser and dtype functions --------------------------------


def _ds_truth(d: dict[str, Any]) -> Callable[[Path], Truth]:
    def truth(_: Path) -> Truth:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.engine import DeepSpeedEngine

        c = DeepSpeedConfig({"train_batch_size": d.get("gradient_accumulation_steps", 1), **d})
        eng = types.SimpleNamespace(
            _config=c, fp16_enabled=lambda: c.float16_config.enabled, bfloat16_enabled=lambda: c.bfloat16_config.enabled
        )
        model, accum = DeepSpeedEngine.get_data_types(eng)
        out = {"gradient": name_of(accum)}
        if c.torch_autocast_enabled:
            dt = name_of(c.torch_autocast_dtype)
            out.update(storage="float32", compute=dt, master="none", state="float32")
            return {"linear": {**out, "reduction": dt}, "other": {**out, "reduction": "float32"}}
        bf16 = c.bfloat16_config
        master = ZeROOptimizer._configure_master_weights(
            types.SimpleNamespace(optimizer=None),
            bf16_master_weights_and_gradients=bf16.bf16_master_weights_and_grads,
            bf16_optimizer_states=bf16.bf16_optimizer_states,
        )
        comm = DeepSpeedEngine.communication_data_type.fget(eng)  # type: ignore[attr-defined]
        comm_name = name_of(comm) if isinstance(comm, torch.dtype) else str(comm)
        state = "bfloat16" if bf16.bf16_optimizer_states else "float32"
        out.update(storage=name_of(model), master=name_of(master), state=state, reduction=comm_name)
        return {"all": out}

    return truth


def _ds(name: str, d: dict[str, Any]) -> Case:
    return Case(f"deepspeed {name}", {"ds_config.json": json.dumps(d)}, _ds_truth(d))


# -- transformers: TrainingArguments, the Trainer's optimizer, one real step ---------------------


def _state_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[str, str]:
    from castwise.ledger.model import _describe

    st = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.numel() == p.numel()}
    return _describe(next(iter(st.values()))) if st else ("none", "none")


def _hf_truth(args: dict[str, Any]) -> Callable[[Path], Truth]:
    def truth(tmp: Path) -> Truth:
        from transformers import Trainer, TrainingArguments

        kw = {k: v for k, v in args.items() if k in ("optim", "bf16", "learning_rate", "optim_args")}
        ta = TrainingArguments(output_dir=str(tmp / "out"), use_cpu=True, report_to="none", **kw)
        cls, okw = Trainer.get_optimizer_cls_and_kwargs(ta)
        dtype = getattr(torch, args.get("torch_dtype", "float32"))
        model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128)).to(dtype)
        opt = cls(model.parameters(), **okw)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        big, small = _state_of(opt, model[0].weight), _state_of(opt, model[1].weight)
        stored = name_of(dtype)
        base = {"storage": stored, "gradient": name_of(model[0].weight.grad.dtype)}
        if big == small:
            return {"all": {**base, "state": big[0], "scheme": big[1]}}
        return {"big": {**base, "state": big[0], "scheme": big[1]}, "small": {**base, "state": small[0]}}

    return truth


def _hf(name: str, args: dict[str, Any]) -> Case:
    return Case(f"transformers {name}", {"args.json": json.dumps({"output_dir": "o", **args})}, _hf_truth(args))


def _hf_load_truth(tmp: Path) -> Truth:
    """transformers 5's from_pretrained of a bf16 checkpoint, without a dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp / "ckpt")
    return {"all": {"storage": name_of(next(loaded.parameters()).dtype)}}


def _source(truth: Truth) -> Callable[[Path], Truth]:
    return lambda _: truth


# -- torchtitan: the model built under set_default_dtype(training.dtype), torch AdamW ------------


def _titan_truth(dtype: str) -> Callable[[Path], Truth]:
    def truth(_: Path) -> Truth:
        old = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))  # torchtitan/train.py Trainer.__init__
        try:
            model = nn.Linear(16, 16)
        finally:
            torch.set_default_dtype(old)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        state, _ = _state_of(opt, model.weight)
        return {
            "all": {
                "storage": name_of(model.weight.dtype),
                "gradient": name_of(model.weight.grad.dtype),
                "state": state,
            }
        }

    return truth


def _titan(name: str, dtype: str | None, extra: str = "") -> Case:
    body = "[job]\n[training]\n" + (f'dtype = "{dtype}"\n' if dtype else "") + extra
    return Case(f"torchtitan {name}", {"job.toml": body}, _titan_truth(dtype or "float32"))


def _megatron(name: str, flags: str, truth: dict[str, str]) -> Case:
    # Megatron-LM is not installed here: megatron/training/arguments.py validate_args is the source
    text = f"torchrun pretrain_gpt.py {flags} --tensor-model-parallel-size 1\n"
    return Case(f"megatron {name}", {"pretrain_gpt.sh": text}, _source({"all": truth}), "source")


BF16, F32, F16 = "bfloat16", "float32", "float16"
CASES: list[Case] = [
    _ds("zero2 bf16", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}),
    _ds("zero0 bf16", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}),
    _ds("zero1 fp16", {"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}),
    _ds(
        "zero2 bf16 master",
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
    ),
    _ds(
        "zero3 bf16 master+states",
        {
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 3},
        },
    ),
    _ds(
        "zero2 bf16 fp32 accum+comm",
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "fp32",
            "zero_optimization": {"stage": 2},
        },
    ),
    _ds(
        "torch_autocast bf16",
        {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "zero_optimization": {"stage": 2}},
    ),
    _hf("adamw_torch bf16 weights", {"optim": "adamw_torch", "torch_dtype": BF16}),
    _hf("adamw_torch f32 + bf16 amp", {"optim": "adamw_torch", "torch_dtype": F32, "bf16": True}),
    _hf("sgd bf16 weights", {"optim": "sgd", "torch_dtype": BF16}),
    _hf("sgd momentum bf16 weights", {"optim": "sgd", "optim_args": "momentum=0.9", "torch_dtype": BF16}),
    _hf("adamw_torch_8bit bf16", {"optim": "adamw_torch_8bit", "torch_dtype": BF16}),
    _hf("adamw_torch_4bit bf16", {"optim": "adamw_torch_4bit", "torch_dtype": BF16}),
    _hf("adamw_torch_8bit f32", {"optim": "adamw_torch_8bit", "torch_dtype": F32}),
    Case(
        "transformers adamw_bnb_8bit",
        {"args.json": json.dumps({"output_dir": "o", "optim": "adamw_bnb_8bit", "torch_dtype": BF16})},
        # bitsandbytes optim/optimizer.py Optimizer8bit.init_state: uint8 state1/state2 from 4096 elements
        _source({"big": {"storage": BF16, "state": "uint8", "scheme": "8-bit"}, "small": {"state": F32}}),
        "source",
    ),
    Case(
        "transformers paged_adamw_32bit",
        {"args.json": json.dumps({"output_dir": "o", "optim": "paged_adamw_32bit", "torch_dtype": BF16})},
        _source({"all": {"storage": BF16, "state": F32, "scheme": "f32"}}),  # Optimizer2State, 32 bits
        "source",
    ),
    Case(
        "transformers 5 default load of a bf16 ckpt",
        {"args.json": json.dumps({"output_dir": "o", "model_name_or_path": "ckpt", "transformers_version": "5.24.0"})},
        _hf_load_truth,
    ),
    Case(
        "transformers 4.57 default load",
        {"args.json": json.dumps({"output_dir": "o", "model_name_or_path": "ckpt", "transformers_version": "4.57.1"})},
        # modeling_utils.py 4.57 from_pretrained: torch_dtype unset -> torch.get_default_dtype()
        _source({"all": {"storage": F32}}),
        "source",
    ),
    _titan("default", None),
    _titan("training.dtype bf16", BF16),
    _titan("f32 params, bf16 compute", F32, 'mixed_precision_param = "bfloat16"\n'),
    _megatron("bf16", "--bf16", {"storage": BF16, "gradient": F32, "reduction": F32, "master": F32, "state": F32}),
    _megatron(
        "bf16 grad-reduce-in-bf16", "--bf16 --grad-reduce-in-bf16", {"gradient": BF16, "reduction": BF16, "master": F32}
    ),
    _megatron("fp16", "--fp16", {"storage": F16, "gradient": F16, "master": F32, "state": F32}),
    _megatron(
        "fp16 fp32 allreduce", "--fp16 --accumulate-allreduce-grads-in-fp32", {"gradient": F32, "reduction": F32}
    ),
    _megatron(
        "precision-aware bf16 state",
        "--bf16 --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16",
        {"state": BF16, "master": F32, "gradient": F32},
    ),
]


def _pick(rows: tuple[Row, ...], selector: str) -> Row | None:
    if selector == "all":
        return rows[0] if len(rows) == 1 else None
    marks = {"big": ">=", "small": "< ", "linear": "Linear", "other": "other"}
    return next((r for r in rows if marks[selector] in " ".join(r.params)), None)


def _score(case: Case, tmp: Path) -> tuple[int, int, list[str]]:
    for name, text in case.files.items():
        (tmp / name).write_text(text)
    truth = case.truth(tmp)
    if case.name.startswith("transformers 4.57"):
        (tmp / "ckpt").mkdir(exist_ok=True)
        (tmp / "ckpt" / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    rows = ledger_from_config(tmp / next(iter(case.files))).rows
    wrong, unknown, notes = 0, 0, []
    for selector, fields in truth.items():
        row = _pick(rows, selector)
        got = row.values() if row is not None else {}
        for field, want in fields.items():
            have = got.get(field, UNKNOWN)
            if have == UNKNOWN:
                unknown += 1
                notes.append(f"{selector}.{field}: unknown (engine {want})")
            elif have != want:
                wrong += 1
                notes.append(f"{selector}.{field}: ledger {have}, engine {want}")
    return wrong, unknown, notes


def main() -> int:
    equal = wrong_total = unknown_total = 0
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            wrong, unknown, notes = _score(case, Path(d))
        ok = wrong == 0 and unknown == 0
        equal += ok
        wrong_total += wrong
        unknown_total += unknown
        print(f"{'ok ' if ok else 'BAD'} {case.name:<48} [{case.origin}] {'; '.join(notes)}", flush=True)
    print(f"ledger equal {equal}/{len(CASES)}, wrong fields {wrong_total}, unknown {unknown_total}")
    return 0 if equal == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
