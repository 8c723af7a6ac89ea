"""Accumulation in 16-bit (CW143): a tensor added into over many contributions in bf16/f16.

A part of the precision observer (``castwise.trace.precision``), called only for the ops it reads
(``OPS``: the add family, the scatter-adds, cumsum), so its per-op cost is one set lookup.

- A python-loop chain (``acc = acc + x``, ``acc += x``): an add whose 16-bit result continues an
  accumulator made by an add in the same module counts one more contribution. A residual stream
  is no such chain: its adds sit in a new block each layer, and where one module loops over
  blocks (``x = x + block(x)``) the addend is computed from the accumulator (a child module was
  given it), an update of the value rather than a contribution to a sum. A compensated
  (Kahan) loop subtracts the old sum from the new one to recover the rounding: not reported.
- ``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)`` / ``scatter_reduce_(sum)``
  on a 16-bit tensor where the kernel adds each contribution into the 16-bit element: on CUDA
  all of them (``gpuAtomicAdd`` on the element in ``indexAddSmallIndex`` / ``indexAddLargeIndex``,
  ``indexing_backward_kernel`` casting to ``scalar_t`` after each duplicate index, both in
  ``aten/src/ATen/native/cuda/Indexing.cu``; the scatter kernels' atomic adds,
  ``ScatterGatherKernel.cu``); on CPU the ones measured to (``_cpu_adds_in_16bit``).
  Contributions per slot: the largest count where the run knows the index values, else writes /
  slots.
- ``cumsum`` on CUDA: ``launch_cumsum_cuda_kernel`` (``cuda/CumsumKernel.cu``) scans with
  ``std::plus<scalar_t>``, adding in the 16-bit dtype; the CPU kernel accumulates in float
  (``ReduceOpsKernel.cpp``, ``cumsum_cpu_kernel``: ``at::acc_type<scalar_t, false>``), as do
  ``sum`` and ``mean`` everywhere (``cuda/ReduceSumProdKernel.cu``): those are not reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from castwise._dtypes import LOW, name_of
from castwise.rules.audit._precision import MIN_CONTRIBUTIONS, Accumulation
from castwise.trace import source
from castwise.trace.attribution import tensors_of

if TYPE_CHECKING:
    from castwise.trace.events import Frame, Prov
    from castwise.trace.observers import OpCall

_ADDS = frozenset({"aten.add", "aten.add_", "aten.sub", "aten.sub_"})
_SCATTERS = frozenset(
    {
        "aten.index_add",
        "aten.index_add_",
        "aten.scatter_add",
        "aten.scatter_add_",
        "aten.index_put",
        "aten.index_put_",
        "aten._index_put_impl_",
        "aten.scatter_reduce",
        "aten.scatter_reduce_",
    }
)
_CUMSUM = frozenset({"aten.cumsum", "aten.cumsum_"})
OPS = _ADDS | _SCATTERS | _CUMSUM  # the only ops this part is called for


def _is_low(t: torch.Tensor) -> bool:
    return name_of(t.dtype) in LOW


class _Chain:
    """One accumulator's adds so far (shared by every tensor of the chain). Two chains one add
    joins (Kahan's sum and its compensation, ``acc + y``) are one from then on: ``parent``."""

    __slots__ = ("compensated", "count", "dtype", "line", "module", "parent", "prov", "residual", "shape")

    def __init__(self, module: str, dtype: torch.dtype, shape: tuple[int, ...], prov: Prov | None) -> None:
        self.module = module
        self.dtype = dtype
        self.shape = shape
        self.prov = prov
        self.count = 1
        self.line: str | None = None
        self.parent: _Chain | None = None
        self.compensated = False  # the rounding recovered (Kahan): (new sum - old sum) taken
        self.residual = False  # an addend computed from the accumulator: an update, not a sum

    def root(self) -> _Chain:
        chain = self
        while chain.parent is not None:
            chain = chain.parent
        return chain

    def found(self) -> Accumulation | None:
        root = self.root()
        if self.count < MIN_CONTRIBUTIONS or root.compensated or root.residual:
            return None
        return Accumulation("aten.add", self.module, self.dtype, self.shape, self.count, self.prov, self.line)


class Accumulations:
    """Follows 16-bit accumulators (see the module's docstring)."""

    def __init__(self) -> None:
        self.chains: WeakIdKeyDictionary = WeakIdKeyDictionary()  # accumulator tensor -> _Chain
        # what a child module computed from an accumulator it was given -> that chain
        self.derived: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.long: list[_Chain] = []  # chains that reached MIN_CONTRIBUTIONS (judged at the end)
        self.ops: dict[tuple[str, str], Accumulation] = {}  # scatters and scans, per op and module

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        name = call.info.name
        if name in _ADDS:
            self._add(call, name, outputs)
        elif name in _SCATTERS:
            self._scatter(call, name)
        elif call.run.device.kernels == "cuda":
            self._cumsum(call, name)

    def module_exit(self, frame: Frame, output: Any) -> None:
        if not self.chains:
            return
        chain = next((self._chain_of(t) for t in frame.inputs if self._chain_of(t) is not None), None)
        if chain is not None:
            for t in tensors_of(output):
                self.derived[t] = chain

    def _chain_of(self, t: torch.Tensor) -> _Chain | None:
        found: _Chain | None = self.chains.get(t)  # type: ignore[no-untyped-call]
        if found is None:
            found = self.derived.get(t)  # type: ignore[no-untyped-call]
        return found

    def _add(self, call: OpCall, name: str, outputs: list[torch.Tensor]) -> None:
        out = outputs[0] if outputs else None
        if out is None or not out.is_floating_point() or not _is_low(out):
            return
        found = [self.chains.get(t) for t in call.tensors]  # type: ignore[no-untyped-call]
        roots = [c.root() for c in found if c is not None and c.module == call.module]
        if name.startswith("aten.sub") and len(roots) == 2 and roots[0] is roots[1]:
            roots[0].compensated = True  # (new sum - old sum): Kahan's recovered rounding
            return
        if not roots:
            first = call.tensors[0] if call.tensors else out
            self.chains[out] = _Chain(call.module, out.dtype, tuple(out.shape), call.prov_of(first))
            return
        chain = max(roots, key=lambda c: c.count)
        for other in roots:
            if other is not chain:
                other.parent = chain
                chain.compensated |= other.compensated
                chain.residual |= other.residual
        if any((d := self.derived.get(t)) is not None and d.root() is chain for t in call.tensors):  # type: ignore[no-untyped-call]
            chain.residual = True
        chain.count += 1
        if chain.count == MIN_CONTRIBUTIONS:
            chain.line = source.where()  # the accumulating line, once per long chain
            self.long.append(chain)
        self.chains[out] = chain

    def _scatter(self, call: OpCall, name: str) -> None:
        target = call.tensors[0] if call.tensors else None
        if target is None or not target.is_floating_point() or not _is_low(target):
            return
        if name.startswith(("aten.index_put", "aten._index_put")) and not _accumulates(call):
            return
        if name.startswith("aten.scatter_reduce") and _reduce(call) not in ("sum", "mean"):
            return
        if call.run.device.kernels == "cpu" and not _cpu_adds_in_16bit(name, target):
            return
        count, known = self._per_slot(call, name, target)
        self._record(call, name, target, count, known)

    def _cumsum(self, call: OpCall, name: str) -> None:
        x = call.tensors[0] if call.tensors else None
        if x is None or not x.is_floating_point() or not _is_low(x) or x.dim() == 0:
            return
        dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", -1)
        dtype = call.kwargs.get("dtype")
        if dtype is not None and name_of(dtype) not in LOW:
            return  # asked to scan in float32
        self._record(call, name, x, int(x.shape[int(dim)]), False)

    def _record(self, call: OpCall, name: str, target: torch.Tensor, count: int, known: bool) -> None:
        key = (name, call.module)
        if count < MIN_CONTRIBUTIONS or (key in self.ops and self.ops[key].count >= count):
            return
        line = source.where()
        self.ops[key] = Accumulation(
            name, call.module, target.dtype, tuple(target.shape), count, call.prov_of(target), line, known
        )

    def _per_slot(self, call: OpCall, name: str, target: torch.Tensor) -> tuple[int, bool]:
        """Contributions per element: the largest count where the index values are known, else the
        mean (writes / slots)."""
        slots = max(target.numel(), 1)
        if name.startswith("aten.index_add"):
            index, src = call.args[2], call.args[3]
            known = call.run.values.known(index, assume=False)
            if known is not None and known.numel():
                with _disable_current_modes():
                    _, counts = torch.unique(known.flatten(), return_counts=True)
                    return int(counts.max()), True
            return -(-int(src.numel()) // slots), False
        if name.startswith(("aten.index_put", "aten._index_put")):
            indices = [i for i in call.args[1] if isinstance(i, torch.Tensor)]
            values = call.args[2]
            writes = max(int(values.numel()), max((int(i.numel()) for i in indices), default=0))
            return -(-writes // slots), False
        index = call.args[2]  # scatter_add(self, dim, index, src), scatter_reduce likewise
        return -(-int(index.numel()) // slots), False


def _cpu_adds_in_16bit(name: str, target: torch.Tensor) -> bool:
    """Whether the CPU kernel adds each contribution into the 16-bit element. Measured on CPU
    (torch 2.14, tests/rules/audit/test_cw143.py: 512 bf16 ones into one slot): an accumulating
    ``index_put_`` and a 1-D ``index_add_`` stop at 256; ``scatter_add`` / ``scatter_reduce`` and
    ``index_add_`` of slices reach 512 (their kernels accumulate in float: the expanded-index path,
    ``cpu_scatter_reduce_expanded_index``, with an ``opmath_t`` buffer)."""
    if name.startswith("aten.index_add"):
        return target.dim() <= 1
    return name.startswith(("aten.index_put", "aten._index_put"))


def _accumulates(call: OpCall) -> bool:
    if "accumulate" in call.kwargs:
        return bool(call.kwargs["accumulate"])
    return len(call.args) > 3 and bool(call.args[3])


def _reduce(call: OpCall) -> str | None:
    found = call.kwargs.get("reduce", call.args[4] if len(call.args) > 4 else None)
    return str(found) if found is not None else None


def found(parts: Accumulations) -> tuple[Accumulation, ...]:
    """What the run recorded: each module's longest chain, and the scatters and scans."""
    best: dict[tuple[str, str | None], Accumulation] = {}
    for chain in parts.long:
        acc = chain.found()
        if acc is not None:
            key = (acc.module, acc.line)
            if key not in best or best[key].count < acc.count:
                best[key] = acc
    return (*best.values(), *parts.ops.values())
