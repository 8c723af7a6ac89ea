"""``castwise.audit(torch.compile(model))``: Dynamo and AOTAutograd compile a copy on fake tensors
during the audit, and the compiled graphs' ops go through the same contract table and rules as
the eager run; names are the user's (never ``_orig_mod``); the user's compiled module and
Dynamo's caches are left as they were."""

from __future__ import annotations

import gc
import inspect
import json
import logging
import random
from typing import Any

import pytest
import torch
from benchmarks.zoo.faults import FAULTS
from torch import nn
from torch._dynamo.utils import counters

import castwise
from castwise._compiled import CompileOptions
from castwise.auditor.findings import diags_of_run
from castwise.auditor.session import _run_once
from castwise.report import Report


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.proj(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Scaled(nn.Module):
    """A bf16 model whose first block scales by a buffer left in f32 (the issue's example)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.scale)


def _bf16_with_f32_buffer() -> nn.Module:
    torch.manual_seed(0)
    model = Scaled().to(torch.bfloat16)
    model.scale = model.scale.float()
    return model


def _errors(report: Report) -> set[tuple[str, str | None]]:
    return {(f.code, f.origin.module if f.origin else None) for f in report.findings if f.level == "error"}


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_compiled_audit_runs_dynamo_and_names_the_users_modules() -> None:
    model = _bf16_with_f32_buffer()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    eager = castwise.audit(model, x)
    before = _graphs()
    compiled = castwise.audit(torch.compile(model), x)
    assert _graphs() - before >= 2  # a graph per mode, compiled during the audit
    summary = compiled.summary["compiled"]
    assert summary["train"]["graphs"] >= 1 and summary["train"]["backward_graphs"] >= 1
    assert summary["eval"]["graphs"] >= 1
    assert _errors(eager) and _errors(compiled) == _errors(eager)
    assert "_orig_mod" not in json.dumps(compiled.to_dict(), default=str)
    assert [r.kind for r in compiled.runs] == ["eager", "eager", "compiled", "compiled"]


def test_the_compiled_graphs_alone_find_what_the_eager_run_finds() -> None:
    model = _bf16_with_f32_buffer()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    runs = {
        kind: _run_once(model, x, None, "cpu", "train", True, torch.bfloat16, True, compiled=opts)
        for kind, opts in (("eager", None), ("compiled", CompileOptions()))
    }
    assert runs["compiled"].trace.kind == "compiled" and runs["compiled"].trace.compiled is not None
    assert runs["compiled"].trace.compiled.graphs >= 1
    found = {k: [(d.code, d.origin.module if d.origin else None) for d in diags_of_run(r)] for k, r in runs.items()}
    # the same first refused op (the real program raises there); the eager fake run may go on
    assert found["compiled"] and found["compiled"][0] == found["eager"][0]
    assert set(found["compiled"]) <= set(found["eager"])
    # provenance through the graphs: the culprit is the buffer, made at no user line (it is a buffer)
    first = next(ev for ev in runs["compiled"].trace.events if ev.phase == "forward")
    assert any(p is not None and p.kind == "buffer" and p.tensor == "buffer scale" for p in first.provs)


_FAULTS = [
    "buffer_left_fp32",
    "stray_fp32_module",
    "plain_tensor_attribute",
    "factory_in_forward",
    "float64_module",
    "output_hook_dtype",  # the eager run names the hook (CW115); the graphs see only its cast
]


@pytest.mark.parametrize("fault", _FAULTS)
def test_planted_faults_are_found_on_the_compiled_model_as_on_the_eager_one(fault: str) -> None:
    torch.manual_seed(1)
    model = Net().to(torch.bfloat16)
    planted = FAULTS[fault].plant(model, random.Random(3))
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    eager = castwise.audit(model, x)
    before = _graphs()
    compiled = castwise.audit(torch.compile(model), x)
    assert _graphs() > before
    assert _errors(eager), f"{fault}: the eager audit finds nothing to compare"
    assert _errors(compiled) == _errors(eager)
    origins = {m for _c, m in _errors(compiled)}
    assert any(m is not None and (m + ".").startswith(planted.expected_origin + ".") for m in origins) or any(
        planted.expected_origin in (f.details and dict(f.details).get("culprit_modules", [])) for f in compiled.findings
    )
    assert "_orig_mod" not in json.dumps(compiled.to_dict(), default=str)


def _entries(code: Any) -> int:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def test_the_users_compiled_model_and_dynamos_caches_are_left_as_they_were() -> None:
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8)
    y0 = compiled(x)
    entries = _entries(Net.forward.__code__)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = _graphs()
    castwise.audit(compiled, x, policy="bf16-mixed")
    assert _graphs() > before  # the audit compiled its own copy
    before = _graphs()
    y1 = compiled(x)
    assert _graphs() == before  # the user's entry still serves the call: nothing recompiled
    assert _entries(Net.forward.__code__) == entries  # the audit's entries are gone
    torch.testing.assert_close(y0, y1)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())


class Breaks(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        torch._dynamo.graph_break()  # the line the report names
        return self.head(self.blocks[1](self.blocks[0](x)))


def test_graph_breaks_are_listed_with_the_users_line() -> None:
    report = castwise.audit(torch.compile(Breaks()), torch.randn(2, 8), mode="eval")
    compiled = report.summary["compiled"]["eval"]
    assert compiled["graphs"] == 2
    assert any("test_compiled.py:" in (b["source"] or "") for b in compiled["graph_breaks"])


def test_fullgraph_is_compiled_as_the_user_asked() -> None:
    report = castwise.audit(torch.compile(Net(), fullgraph=True), torch.randn(2, 8), policy="bf16-mixed", mode="eval")
    compiled = report.summary["compiled"]["eval"]
    assert compiled["fullgraph"] and compiled["graphs"] == 1 and compiled["error"] is None
    assert report.ok


def test_a_compiled_audit_where_lightning_has_wrapped_torch_compile() -> None:
    # importing Lightning Fabric puts a wrapper over torch.compile that deep-copies its keyword
    # arguments; the audit compiles with torch's own function
    import lightning.fabric.wrappers  # noqa: F401

    assert torch.compile is not inspect.unwrap(torch.compile)
    report = castwise.audit(torch.compile(Net()), torch.randn(2, 8), policy="bf16-mixed", mode="eval")
    assert report.summary["compiled"]["eval"]["graphs"] >= 1 and report.ok


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)) * self.scale)


def test_a_compiled_audit_on_the_simulated_cuda_device() -> None:
    model = Mlp().to(torch.bfloat16)
    model.scale = model.scale.float()  # f32 activations reach `down`'s bf16 matmul
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    host = (torch.cuda.is_initialized(), torch.accelerator.is_available())  # type: ignore[no-untyped-call]
    eager = castwise.audit(model, x, device="cuda")
    report = castwise.audit(torch.compile(model), x, device="cuda")
    assert report.summary["compiled"]["train"]["graphs"] >= 1
    assert _errors(report) and _errors(report) == _errors(eager)
    # this machine's answers as they were (no GPU here: CUDA never initialised)
    assert (torch.cuda.is_initialized(), torch.accelerator.is_available()) == host  # type: ignore[no-untyped-call]


class MadeOnTheDevice(nn.Module):
    """Tensors made from data on the input's device (transformers' KV cache starts with an empty
    one): under the simulation a fake tensor must not reach for a GPU this machine lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.tensor([], dtype=x.dtype, device=x.device)
        two = torch.tensor([2.0], device=x.device)
        return torch.cat([empty, (self.lin(x) * two).flatten()])


def test_a_compiled_audit_on_the_simulated_cuda_device_checks_every_graph_it_can() -> None:
    """Each mode's graphs are walked (no torch.compile error, ops checked): where this machine has
    no GPU, the train run's backward cannot be traced by AOTAutograd (the autograd engine needs a
    CUDA context) and the report says so; on a GPU machine it is traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import proxy_tensor

    avoid, limit = FakeTensorMode.__dict__["avoid_device_init"], proxy_tensor.CONSTANT_NUMEL_LIMIT
    report = castwise.audit(torch.compile(MadeOnTheDevice()), torch.randn(2, 8), device="cuda")
    assert report.ok, str(report)
    compiled = report.summary["compiled"]
    for mode in ("train", "eval"):
        assert compiled[mode]["error"] is None and compiled[mode]["graphs"] >= 1
        assert compiled[mode]["ops_checked"] >= 3  # addmm (or mm + add), mul, cat at least
    gpu = torch.cuda.is_available()
    assert (compiled["train"]["backward_graphs"] >= 1) == gpu
    assert ("backward_untraced" in compiled["train"]) == (not gpu)
    if not gpu:
        assert "backward graphs not traced on the simulated CUDA device" in " ".join(str(report).split())
    assert FakeTensorMode.__dict__["avoid_device_init"] is avoid  # put back after the simulation
    assert limit == proxy_tensor.CONSTANT_NUMEL_LIMIT


def test_the_text_report_says_what_torch_compile_did() -> None:
    report = castwise.audit(torch.compile(Breaks()), torch.randn(2, 8), mode="eval")
    text = str(report)
    assert "compiled (eval): 2 graph(s)" in text and "test_compiled.py:" in text
    assert "aten ops checked after Inductor's decompositions, 1 graph break(s)" in " ".join(text.split())


def test_an_inductor_program_is_checked_after_inductors_decompositions() -> None:
    """Inductor decomposes a one-row ``addmm`` on CPU into a mul and a sum computed in f32: eager
    refuses f16 rows into f32 weights, the Inductor program runs and computes in f32
    (pytorch#141865). ``aot_eager`` keeps the ``addmm``, and refuses as eager does."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(1, 8, dtype=torch.float16)
    runs = {
        backend: _run_once(
            model, x, None, "cpu", "eval", True, torch.float32, True, compiled=CompileOptions(backend=backend)
        ).trace
        for backend in ("inductor", "aot_eager")
    }
    assert [ev.op for ev in runs["aot_eager"].events] == ["aten.addmm"]
    assert runs["aot_eager"].compiled is not None and runs["aot_eager"].compiled.decompositions is None
    inductor = runs["inductor"]
    assert not inductor.events and inductor.error is None
    assert inductor.compiled is not None and inductor.compiled.decompositions == "inductor"
    ops = {op: outs[0][0] for _m, op, _p, _ins, outs in inductor.ops if outs}
    assert "aten.addmm" not in ops and ops["aten.sum"] is torch.float32


_SEEN: list[int] = []  # module state: the audit's copy of a model shares it


@torch.compiler.disable
def _note_freeze_count() -> None:
    _SEEN.append(gc.get_freeze_count())


class _FreezeProbe(nn.Module):
    """Notes how many objects the garbage collector holds frozen while a run runs (a call
    Dynamo leaves to eager: the value is the run's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _note_freeze_count()
        return self.proj(x)


def test_the_compile_runs_with_the_old_objects_frozen_and_unfreezes_them() -> None:
    _SEEN.clear()
    x = torch.randn(2, 4)
    castwise.audit(torch.compile(_FreezeProbe()), x, mode="eval")
    assert _SEEN[0] == 0 and _SEEN[-1] > 0  # the eager run as it was; the compiled run frozen
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a process that froze its own objects keeps them frozen, and no more
    try:
        frozen = gc.get_freeze_count()
        castwise.audit(torch.compile(_FreezeProbe()), x, mode="eval")
        assert gc.get_freeze_count() <= frozen  # (frozen objects the audit freed leave the count)
    finally:
        gc.unfreeze()


class _AutocastAcrossABreak(nn.Module):
    """The model's own autocast block, with a graph break inside it and an op after the break
    that refuses mixed dtypes (the bf16 product and an f32 buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("extra", torch.ones(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.proj(x)
            torch._dynamo.graph_break()
            y = y.index_add(0, torch.tensor([0, 1]), self.extra)
        return y.float() + 1


def test_the_autocast_of_a_graph_node_is_its_region_also_after_a_graph_break() -> None:
    torch.manual_seed(0)
    run = _run_once(
        _AutocastAcrossABreak(),
        torch.randn(4, 8),
        None,
        "cpu",
        "eval",
        True,
        torch.float32,
        True,
        compiled=CompileOptions(backend="aot_eager"),
    )
    assert run.trace.compiled is not None and run.trace.compiled.graphs >= 2
    refused = run.trace.events[0]
    assert refused.op == "aten.index_add" and refused.autocast is torch.bfloat16


class F64Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).to(x.dtype)


def _bf16_with_f64_norm() -> nn.Module:
    torch.manual_seed(0)
    model = F64Norm().to(torch.bfloat16)
    model.norm.double()
    return model


def test_what_only_eager_refuses_is_a_warning_on_the_compiled_model() -> None:
    """A bf16 model with a LayerNorm left in f64: eager refuses the norm, the Inductor program
    (its decompositions promote) runs it, checked for real here. The compiled model's audit says
    so as a warning (CW125, with the eager refusal in it); the eager model's audit, and an
    aot_eager program (no decompositions: the same refusal in its graph), keep the error."""
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="mixed dtype"):
        _bf16_with_f64_norm()(x)
    torch._dynamo.reset()
    compiled = torch.compile(_bf16_with_f64_norm())
    compiled(x).float().sum().backward()  # the compiled program trains
    torch._dynamo.reset()

    report = castwise.audit(torch.compile(_bf16_with_f64_norm()), x, device="cpu")
    assert report.ok and [(f.code, f.module, f.modes) for f in report.findings] == [
        ("CW125", "norm", ("train", "eval"))
    ], str(report)
    assert "eager refuses (CW113)" in report.findings[0].message
    assert not castwise.audit(_bf16_with_f64_norm(), x, device="cpu").ok
    aot = castwise.audit(torch.compile(_bf16_with_f64_norm(), backend="aot_eager"), x, device="cpu")
    assert {f.code for f in aot.errors} == {"CW113"}, str(aot)


def _gpt2() -> nn.Module:
    """HF GPT-2 from a toy config (dropout 0.1, as GPT-2's own)."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_mixed_policy_audit_compiles_across_a_graph_break() -> None:
    """HF GPT-2 (its loss logs: a graph break inside the policy's autocast block) under the
    policies whose dtype is not the device's autocast default: every compiled run is checked, with
    no torch.compile error (before: BackendCompilerFailed, ops checked up to the break only)."""
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 8))
    for policy, device in (("16-mixed", "cpu"), ("bf16-mixed", "cuda")):
        report = castwise.audit(torch.compile(model), {"input_ids": ids, "labels": ids}, policy=policy, device=device)
        for mode, summary in report.summary["compiled"].items():
            assert summary["error"] is None, (policy, device, mode, summary["error"])
            assert summary["graph_breaks"], (policy, device, mode)  # the break is still there


def test_a_compiled_train_run_with_activation_checkpointing_and_dropout() -> None:
    """GPT-2 with gradient checkpointing: the compiled train graph saves the RNG state for the
    recomputed dropout (``run_and_save_rng_state``, a higher-order operator), whose fake rule
    torch registers for FakeTensorMode only; under the audit's fake mode the compile raised
    NotImplementedError and the train run checked only the graphs before it."""
    model = _gpt2()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 8))
    report = castwise.audit(torch.compile(model), {"input_ids": ids, "labels": ids}, policy="bf16-mixed", mode="train")
    compiled = report.summary["compiled"]["train"]
    assert compiled["error"] is None, compiled["error"]
    assert compiled["backward_graphs"] >= 1
    assert report.ok, str(report)
    from torch._ops import _higher_order_ops

    # the rules lent to the audit's fake mode are taken back after the run
    assert not any(
        "HostFakeTensorMode" in getattr(k, "__name__", "")
        for h in _higher_order_ops.values()
        for k in h.python_key_table
    )


class Logs(nn.Module):
    """A forward that logs (HF GPT-2's loss does): Dynamo cannot trace a logger call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logging.getLogger("castwise.tests.logs").debug("forward")
        return self.lin(x)


def test_a_compile_that_stops_is_said_not_passed_over() -> None:
    """Under fullgraph=True the logger call stops torch.compile for real; the audit's compiled run
    stops there too and says the compiled program was not checked (CW902), where it used to list
    the error and pass. Without fullgraph Dynamo breaks the graph and the audit is clean."""
    x = torch.randn(2, 4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Logger"):
        torch.compile(Logs(), fullgraph=True)(x)
    torch._dynamo.reset()
    report = castwise.audit(torch.compile(Logs(), fullgraph=True), x, device="cpu")
    stopped = [f for f in report.findings if f.code == "CW902"]
    assert not report.errors and stopped and not report.ok, str(report)
    assert "PART OF THE COMPILED PROGRAM WAS NOT CHECKED" in stopped[0].message
    assert "fullgraph=True" in stopped[0].message and set(stopped[0].modes) == {"train", "eval"}
    # the compiled runs stopped; the eager runs were checked to the end
    assert {(r.kind, r.status) for r in report.runs} == {("eager", "ok"), ("compiled", "incomplete")}
    assert castwise.audit(torch.compile(Logs()), x, device="cpu").ok
