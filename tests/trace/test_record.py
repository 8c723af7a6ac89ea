"""The run record's one writer (trace/record.py): a stretch of the record is taken and spliced in
again renamed, and an observer declares whether a reused block's record stands for it."""

from __future__ import annotations

import re
from pathlib import Path

import grimp
import torch

import castwise
from castwise.auditor.session import run_audit
from castwise.policy import Policy
from castwise.trace.events import Event, Prov
from castwise.trace.observers import ActivationBytesObserver, ContractObserver, Observer, UpcastObserver
from castwise.trace.record import Recorder
from tests.test_layout import _cycles
from tests.trace.test_reuse import _ids, _llama
from tests.trace.test_reuse import _reused as reused_blocks

BF16 = torch.bfloat16


class _Renaming:
    """block.0 -> block.1; the template's input origin -> this block's."""

    def __init__(self, old: Prov, new: Prov) -> None:
        self.old, self.new = old, new

    def name(self, module: str) -> str:
        return module.replace("block.0", "block.1")

    def prov(self, p: Prov | None) -> Prov | None:
        return self.new if p is self.old else p


def _event(module: str, phase: str, prov: Prov) -> Event:
    return Event(phase, module, "aten.mm", None, None, (BF16,), ((2, 2),), (prov,), None, False, "block.0")  # type: ignore[arg-type]


def test_a_stretch_is_spliced_renamed_and_backward_inserted_where_it_ran() -> None:
    rec = Recorder()
    x0 = Prov("input", "", None, "model input `x`", BF16)
    x1 = Prov("op", "block.0", "aten.mm", "bf16[2, 2]", BF16)
    t = torch.zeros(2, 2, dtype=BF16)
    rec.op("embed", "aten.embedding", "forward", [t], [t])
    mark = rec.mark()
    rec.op("block.0.attn", "aten.mm", "forward", [t, t], [t])
    rec.event(_event("block.0.attn", "forward", x0))
    rec.activation("bfloat16", 8)
    stretch = rec.since(mark)
    assert [r[0] for r in stretch.ops] == ["block.0.attn"] and stretch.act == {"bfloat16": 8}

    rec.splice(stretch, _Renaming(x0, x1), lambda: None)
    trace = rec.trace
    assert [r[0] for r in trace.ops] == ["embed", "block.0.attn", "block.1.attn"]
    spliced = trace.events[-1]
    assert (spliced.module, spliced.provs, spliced.disabled_by) == ("block.1.attn", (x1,), "block.1")
    assert trace.activation_bytes == {"bfloat16": 16}

    at = rec.at()
    rec.op("head", "aten.mm", "backward", [t], [t])
    rec.insert([(at, [("block.1.attn", "aten.mm", "backward", (), ())], [])])
    assert [(r[0], r[2]) for r in trace.ops[-2:]] == [("block.1.attn", "backward"), ("head", "backward")]


class _Counter(Observer):
    """An observer of one's own: it counts every op, so a reused block's record cannot stand for it."""

    name = "counter"
    needs = frozenset()

    def __init__(self) -> None:
        self.ops = 0

    def after(self, call: object, outputs: object) -> None:
        self.ops += 1


class _Splicing(_Counter):
    splices = True  # it says a reused block's record stands for what it records


def _reused(observer: Observer) -> dict[str, str]:
    observers = [ContractObserver(), UpcastObserver(), ActivationBytesObserver(), observer]
    _report, runs = run_audit(_llama(3), _ids(), Policy.parse("bf16-mixed"), "cuda", "eval", True, observers=observers)
    return reused_blocks(runs)


def test_block_reuse_follows_what_each_observer_declares() -> None:
    assert _reused(_Counter()) == {}  # not declared: every block runs for it
    assert _reused(_Splicing()) == {"model.layers.1": "model.layers.0", "model.layers.2": "model.layers.0"}


def test_trace_has_no_import_cycle_even_counting_type_checking_imports() -> None:
    """The eager producer is imported by nothing in ``trace/`` it imports: its parts (observers,
    hooks, the backward walker, block reuse) name what they ask of it as protocols."""
    graph = grimp.build_graph("castwise", exclude_type_checking_imports=False)
    trace = {m for m in graph.modules if m.startswith("castwise.trace")}
    adjacency = {m: {x for x in graph.find_modules_directly_imported_by(m) if x in trace} for m in trace}
    assert _cycles(adjacency) == []
    assert not any("castwise.trace.tracer" in adjacency[m] for m in trace if m != "castwise.trace.tracer")


def test_the_record_is_written_only_through_the_recorder_and_origins_only_by_provenance() -> None:
    """What the record holds and where origins are made each have one writer (a new producer or
    observer goes through them, so block reuse and both producers stay in step)."""
    src = Path(castwise.__file__).parent
    writes = re.compile(r"\.(ops|events|upcasts|hook_changes)\.(append|extend)\(|uncovered\.setdefault|\.failure = ")
    made = re.compile(r"\bProv\(")
    found: dict[str, list[str]] = {"writes": [], "made": []}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        text = path.read_text()
        if rel != "trace/record.py" and not rel.startswith("rules/") and writes.search(text):
            found["writes"].append(rel)  # rules/ only read runs (into their own dicts)
        if rel not in ("trace/provenance.py", "trace/events.py") and made.search(text):
            found["made"].append(rel)
    assert found == {"writes": [], "made": []}
