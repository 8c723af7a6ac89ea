"""From what a run recorded to findings: each refused op through the rules' checks in
precedence order, the model's own error, merged across modes and repeated blocks."""

from __future__ import annotations

import dataclasses
import linecache
import re
from typing import Any

import torch
from torch import nn

from castwise import devices
from castwise.auditor.context import RunRecord, culprits_of, make_ctx
from castwise.report import CodeFix, Finding
from castwise.rules import audit as audit_rules
from castwise.rules.audit import cw115, cw125, cw130, cw902, ordered_checks
from castwise.rules.audit._base import Diag
from castwise.rules.audit._text import where
from castwise.trace import provenance
from castwise.trace.attribution import disabled_by
from castwise.trace.events import Event, Mode, Origin

# what a dtype error says: a mismatch or a dtype a kernel lacks, never the bare word "dtype"
# (a KeyError("not a dtype problem") is not a dtype error)
_DTYPE_ERROR = re.compile(
    r"scalar type|same dtype|dtypes? (?:mismatch|do(?:es)? not match)|to have the same|should be the same|"
    r"mixed dtype|expected (?:both|all)?.{0,40}(?:dtype|type)|found (?:BFloat16|Half|Float|Double)|"
    r"(?:BFloat16|Half|Float|Double|float16|bfloat16|float32) (?:!=|and) |"
    r"got (?:BFloat16|Half|Float|Double|float16|bfloat16|float32|torch\.\w+)|"
    r"dtype .{0,40}(?:!=|but got|instead|does not match)|dtypes match|data ?type|"
    r"only supports? (?:fp16|bf16|half|float16|bfloat16)",
    re.IGNORECASE,
)
# a check that an index tensor is integral, raised before an op dispatched (one_hot's TORCH_CHECK)
_NEEDS_INDEX = re.compile(
    r"only applicable to index tensor|index tensor(?:s)? (?:must|should) be|used as indices must be"
)
_DTYPE_EXCEPTIONS = (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError)
_UNSUPPORTED_TEXT = re.compile(
    r"not implemented for '(\w+)'|[Uu]nsupported dtype:? '?(\w+)|not supported for (?:dtype )?'?(\w+)'?|"
    r"does(?: not|n't) support (?:dtype |tensors of type:? )?'?(\w+)'?|dtypes not supported\. Got (\w+)",
)
_SCALAR_NAMES = {
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
    "Float": torch.float32,
    "Double": torch.float64,
    "ComplexHalf": torch.complex32,
    "Long": torch.int64,
    "Int": torch.int32,
    "Bool": torch.bool,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_CUDA_RUNTIME = re.compile(
    r"nvidia driver|cuda driver|cuda error|torch not compiled with cuda|no cuda gpus|cudaerror|"
    r"cuda runtime|cuda_visible_devices|cudnn|hasprimarycontext",  # the C++ autograd engine's context check
    re.IGNORECASE,
)
_FAKE_LIMITS = frozenset(
    {
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
        "GuardOnDataDependentSymNode",
    }
)


def is_dtype_error(exc: BaseException) -> bool:
    """An exception that reports dtypes (a kernel's or a layer's own dtype check)."""
    text = str(exc)
    return isinstance(exc, _DTYPE_EXCEPTIONS) and bool(_DTYPE_ERROR.search(text) or _NEEDS_INDEX.search(text))


def unsupported_dtype(text: str) -> torch.dtype | bool:
    """The dtype an "unsupported dtype" error names; True for a kernel that names none (oneDNN);
    False: not such an error."""
    if "could not create a primitive descriptor" in text:
        return True  # oneDNN has no kernel for these operands (e.g. a float16 LSTM on CPU)
    match = _UNSUPPORTED_TEXT.search(text)
    if match is None:
        return False
    word = next((g for g in match.groups() if g), "")
    # only a dtype the kernel names makes it a dtype problem ("does not support X" may be anything)
    return _SCALAR_NAMES.get(word, False)


def _cuda_runtime_error(exc: BaseException) -> bool:
    """The exception came from touching the real CUDA runtime (a fake CUDA audit's limit)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return "AcceleratorError" in names or bool(_CUDA_RUNTIME.search(str(exc)))


def _data_dependent(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    text = str(exc).lower()
    return (
        bool(names & {"DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode"})
        or "data-dependent" in text
        or "data dependent" in text
        or "not supported for tensor subclasses" in text  # `.numpy()`: values read outside torch
    )


def _fake_limit(exc: BaseException) -> bool:
    """The fake-tensor machinery could not run an op: a limit of the audit, not a model error."""
    names = {c.__name__ for c in type(exc).__mro__}
    text = str(exc).lower()
    return bool(names & _FAKE_LIMITS) or "nestedtensorimpl" in text or "fake tensor" in text or _data_dependent(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def classify(r: RunRecord, **event: Any) -> Diag:
    """The first rule check (in precedence order) that explains this refused op."""
    ctx = make_ctx(
        **event,
        compute=r.compute,
        device=r.device or devices.CPU,
        dominant=r.dominant,
        off_policy=r.off_policy(),
        converted=r.converted,
    )
    for check in ordered_checks():
        diag = check.match(ctx)
        if diag is not None:
            return diag
    raise RuntimeError("castwise: no audit rule matched (the catch-all CW110 is missing)")


def _from_event(ev: Event, r: RunRecord) -> Diag:
    v = ev.violation
    text = v.message if v is not None else f"{type(ev.error).__name__}: {ev.error}"
    culprits = culprits_of(ev.dtypes, v.culprits if v is not None else (), r.compute)
    return classify(
        r,
        phase=ev.phase,
        module=ev.module,
        op=ev.op,
        kind=v.kind if v is not None else None,
        text=text,
        dtypes=ev.dtypes,
        provs=ev.provs,
        culprits=culprits,
        is_fast=ev.fastpath,
        autocast=ev.autocast,
        expected=v.expected if v is not None else None,
        disabled_by=ev.disabled_by,
        region_module=r.submodule(ev.disabled_by),
    )


def _forward_echo(ev: Event, forward: list[Event]) -> bool:
    """A backward violation that only repeats a forward one: the fake run went on past a forward
    error (the real run would have stopped there), and the same op's backward meets the same mix."""
    return ev.phase == "backward" and any(f.module == ev.module or f.op == ev.op for f in forward)


def _recent_operands(r: RunRecord, module: str) -> list[torch.Tensor]:
    """The last tensors made in ``module`` before the raise, when their dtypes are mixed: the
    operands of a call that checks dtypes before it dispatches (sdpa's q/k/v check)."""
    if r.producer is None:
        return []
    refused = r.producer.refused
    if refused is not None and refused[0] == module and len({t.dtype for t in refused[1]}) > 1:
        return refused[1]  # the very operands sdpa refused (q, k, v and a floating mask)
    recent = [t for m, t in r.producer.recent if m == module and t.is_floating_point()][-3:]
    return recent if len({t.dtype for t in recent}) > 1 else []


def _region_off(stack: list[Any], dtypes: tuple[torch.dtype, ...]) -> str | None:
    """The module whose forward turned autocast off around the raise, as the tracer reads the stack
    for an op: here the op autocast casts is a linear or conv layer's own, met with mixed dtypes."""
    return disabled_by(stack, dtypes, lambda f: isinstance(f.module, (nn.Linear, nn.modules.conv._ConvNd)))


_DTYPE_READ = re.compile(r"([A-Za-z_][\w.]*)\.dtype\b")


def _dtype_reads(exc: BaseException) -> tuple[str, list[torch.Tensor]] | None:
    """The raising line and the tensors whose ``.dtype`` it reads (a model's own ``assert q.dtype
    == k.dtype``), resolved in the frame that raised; None when that line reads no dtype."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    frame = tb.tb_frame
    line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
    names = _DTYPE_READ.findall(line)
    if not names:
        return None
    found: list[torch.Tensor] = []
    for dotted in dict.fromkeys(names):
        head, *attrs = dotted.split(".")
        value = frame.f_locals.get(head)
        try:
            for attr in attrs:
                value = getattr(value, attr)
        except Exception:  # a property that raises without the run around it: not readable here
            continue
        if isinstance(value, torch.Tensor) and all(value is not t for t in found):
            found.append(value)
    return (line, found) if found else None  # a dtype read off no tensor (a config's): not this case


def _index_arg(exc: BaseException, made: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor given as the first argument to the function an index check names ("one_hot is
    only applicable to index tensor ...": ``F.one_hot(idx, n)`` -> ``idx``), read in the raising frame:
    a (dotted) name is read there; an expression (``labels.int()``) is the last tensor the module made,
    as Python evaluates the argument right before the call."""
    fn = re.match(r"\w+", str(exc))
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if fn is None or tb is None:
        return None
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    call = re.search(rf"\b{fn.group(0)}\(\s*(?:([A-Za-z_][\w.]*)\s*[,)])?", line)
    if call is None:
        return None
    value: object = made[-1] if call.group(1) is None and made else None
    if call.group(1) is not None:
        head, *attrs = call.group(1).split(".")
        value = tb.tb_frame.f_locals.get(head)
        try:
            for attr in attrs:
                value = getattr(value, attr)
        except Exception:  # a property that raises outside the run: not readable here
            return None
    return value if isinstance(value, torch.Tensor) and value.dtype != torch.int64 else None


def _raised_in_python(
    r: RunRecord,
    module: str,
    kind: str | None,
    text: str,
    bad: torch.dtype | None,
    read: list[torch.Tensor] | None,
    exc: BaseException | None = None,
) -> Diag:
    """Code raised on dtypes before any op dispatched (a strict layer's own check, sdpa's q/k/v
    check, the model's own dtype assert): the tensors whose dtypes the raising line reads (no
    provenance for them: no origin, rather than an unrelated weight), else the last operands made
    in the module if they mix dtypes, else its inputs and weights."""
    trace = r.trace
    frame = trace.stack[-1] if trace.stack else None
    prov_of = r.producer.prov_of if r.producer is not None else (lambda t: None)
    recent = read or _recent_operands(r, module)
    here = [t for m, t in r.producer.recent if m == module] if r.producer is not None else []
    own = {} if recent else r.module_params.get(module, {})
    tensors = recent or ([t for t in frame.inputs if t.is_floating_point()] if frame else [])
    made = [t for t in here if t.is_floating_point()][-1:] if not recent else []
    cast = made and (p := prov_of(made[0])) is not None and p.kind == "cast" and p.module == module
    if cast and own and made[0].dtype not in own.values():
        # the module's forward changed its input's dtype itself (`x.float()`) before the layer's
        # own check raised: that tensor, not the input it was given, met the weights
        tensors = made
    expected = "int64" if _NEEDS_INDEX.search(text) else None
    index = _index_arg(exc, here[-1:]) if expected is not None and exc is not None else None
    if index is not None:
        # a composite's own check (one_hot's) that its index is integral: that argument is the
        # culprit, not a precision clash between the line's other tensors
        tensors, own = [index], {}
    provs = tuple(prov_of(t) for t in tensors) + tuple(provenance.param(module, n, d) for n, d in own.items())
    dtypes = tuple(t.dtype for t in tensors) + tuple(own.values())
    return classify(
        r,
        phase=trace.error_phase,
        module=module,
        op=None,
        kind=kind,
        text=text,
        dtypes=dtypes,
        provs=provs,
        culprits=culprits_of(dtypes, (0,) if index is not None else (), r.compute, own),
        is_fast=False,
        autocast=frame.autocast if frame else None,
        expected=expected,
        unsupported=bad,
        disabled_by=_region_off(trace.stack, dtypes),
        region_module=r.submodule(_region_off(trace.stack, dtypes)),
    )


def _fake_kernel_refused(fail: Event, text: str, simulated_cuda: bool) -> Diag:
    """torch's fake kernel refused dtypes the contract table does not say the real kernel refuses
    (it would have flagged the op before it ran): "Real error" only where the table says so."""
    return cw902.diagnose(
        module=fail.module,
        op=fail.op,
        text=f"torch's fake kernel refused: {text}; the contract table does not predict this error for the real kernel",
        cuda_limit=False,
        data_dependent=False,
        simulated_cuda=simulated_cuda,
    )


def _c10d_call(exc: BaseException) -> str:
    """`` (in torch.distributed.all_to_all_single)``: the torch.distributed function the user called
    where ``exc`` was raised inside it (c10d's own checks raise before any op dispatches), else ""."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py"):
            return f" (in torch.distributed.{code.co_name})"  # the outermost: the API the user called
        tb = tb.tb_next
    return ""


def _raised(r: RunRecord, exc: BaseException) -> Diag | None:
    """The finding for what the model raised (None: already reported as a predicted violation)."""
    trace, fail = r.trace, r.trace.failure
    last = trace.events[-1] if trace.events else None
    if fail is not None and last is not None and last.op == fail.op and last.module == fail.module:
        return None  # the real kernel raised what the table predicted (real mode): already reported
    forward = [ev for ev in trace.events if ev.phase == "forward"]
    if forward and trace.error_phase == "backward" and r.fake:
        return None  # backward of a forward the real run would not have finished
    module = trace.stack[-1].name if trace.stack else (fail.module if fail else "")
    text = f"{type(exc).__name__}: {_first_line(exc)}{_c10d_call(exc)}"
    grad_hooks = [c for c in trace.hook_changes if c.kind == "grad"]
    if grad_hooks and "changed the type of value" in str(exc):
        change = grad_hooks[-1]  # autograd checks each hook's result as it returns: the last one raised
        return cw115.grad_hook_diag(change, text, Origin(change.module or None, None, change.tensor))
    unsupported = unsupported_dtype(str(exc))
    kind = "unsupported" if unsupported is not False else None
    bad = unsupported if isinstance(unsupported, torch.dtype) else None
    simulated_cuda = r.fake and r.device is not None and r.device.kernels == "cuda"
    cuda_limit = simulated_cuda and _cuda_runtime_error(exc)
    # torch.compile inside the model (flex_attention's wrapper) refuses the tracer's own dispatch mode
    own_mode = "non-infra torch dispatch mode present" in str(exc)
    if ((r.fake and (_fake_limit(exc) or cuda_limit)) or own_mode) and kind is None:
        return cw902.diagnose(
            module=fail.module if fail else module,
            op=fail.op if fail else None,
            text=text,
            cuda_limit=cuda_limit,
            data_dependent=_data_dependent(exc),
            simulated_cuda=simulated_cuda,
            own_mode=own_mode,
        )
    dtype_error = kind is not None or is_dtype_error(exc)
    if dtype_error and fail is not None and r.fake and fail.op.startswith("aten."):
        return _fake_kernel_refused(fail, text, simulated_cuda)
    if dtype_error and fail is not None:
        # an op raised on dtypes (a custom op's own check, a kernel in a real run)
        return classify(
            r,
            phase=fail.phase,
            module=fail.module,
            op=fail.op,
            kind=kind,
            text=text,
            dtypes=fail.dtypes,
            provs=fail.provs,
            culprits=culprits_of(fail.dtypes, (), r.compute),
            is_fast=fail.fastpath,
            autocast=fail.autocast,
            expected=None,
            unsupported=bad,
            disabled_by=fail.disabled_by,
            region_module=r.submodule(fail.disabled_by),
        )
    line_read = _dtype_reads(exc) if fail is None else None
    if dtype_error or line_read is not None:
        if line_read is not None and not str(exc):
            text = f"{type(exc).__name__}: {line_read[0]}"  # a bare assert: its line says what failed
        return _raised_in_python(r, module, kind, text, bad, line_read[1] if line_read else None, exc)
    if r.fake and r.trace.sizes:
        # the run went on with assumed values (CW903): what they lead to need not happen for real
        return cw902.diagnose(
            module=fail.module if fail else module,
            op=fail.op if fail else None,
            text=text,
            cuda_limit=False,
            data_dependent=True,
            simulated_cuda=simulated_cuda,
            assumed=True,
        )
    return cw130.diagnose(module=module, op=fail.op if fail else None, exc=exc)


def _with_hook(d: Diag, r: RunRecord) -> Diag:
    """A forward hook's finding (CW115 at the layer its output reaches) with the hook's name and
    its code fix, from what the run recorded of the hook."""
    made = d.origin.op if d.origin is not None else None
    if d.code != "CW115" or d.details or made is None or "in forward hook" not in made:
        return d
    hook = made.split("in forward hook", 1)[1].strip()
    change = next((c for c in r.trace.hook_changes if c.kind == "forward" and c.hook == hook), None)
    if change is None:
        return d
    return dataclasses.replace(
        d, code_fix=d.code_fix or change.code_fix, details=(("hook", hook), ("hook_kind", "forward"))
    )


def diags_of_run(r: RunRecord) -> list[Diag]:
    """The error findings of one run: contract violations, then what the model raised."""
    return [d for d, _phase in phased_diags(r)]


def phased_diags(r: RunRecord) -> list[tuple[Diag, str | None]]:
    """:func:`diags_of_run`'s findings with the phase of the op each stands on (None: a raise)."""
    forward = [ev for ev in r.trace.events if ev.phase == "forward"]
    out: list[tuple[Diag, str | None]] = [
        (_with_hook(_from_event(ev, r), r), ev.phase) for ev in r.trace.events if not _forward_echo(ev, forward)
    ]
    # a compiled run's raise is torch.compile's or one the eager run of its mode triages too (the
    # same code runs between graphs): its text is in the report's compiled summary
    if r.trace.error is not None and r.trace.kind == "eager":
        raised = _raised(r, r.trace.error)
        if raised is not None:
            out.append((_with_hook(raised, r), None))
    return out


def eager_only(diags: list[tuple[Diag, str | None]], compiled: RunRecord) -> list[Diag]:
    """An eager run's findings, those the compiled run of its mode shows the compiled program
    runs made CW125 warnings: an op refusal in a (module, phase) whose ops the compiled run
    walked, where that run completed without any refusal. A compiled run that refused anything,
    or stopped, decides nothing (the real program stops at its first refusal, and nothing after
    it was checked); a raise, a hook's dtype (the graphs do not show hooks) and what the compiled
    run did not walk stay as they are."""
    c = compiled.trace.compiled
    if c is None or c.error is not None or compiled.trace.error is not None or compiled.trace.events:
        return [d for d, _phase in diags]
    walked = {(op[0], op[2]) for op in compiled.trace.ops}
    catalog = audit_rules.rules()
    out = []
    for d, phase in diags:
        rule = catalog.get(d.code)
        refused = d.op is not None and rule is not None and rule.meta.severity == "error" and d.code != "CW115"
        out.append(cw125.diagnose(d, c.decompositions) if refused and (d.module, phase) in walked else d)
    return out


def merge(per_mode: dict[str, list[Diag]]) -> list[Finding]:
    """One finding per (code, op): the first diagnosis, its modes, the other places it shows."""
    merged: dict[tuple[str, str | None], tuple[Diag, list[str], list[str]]] = {}
    for mode, diags in per_mode.items():
        for d in diags:
            key = (d.code, d.op)
            if key not in merged:
                merged[key] = (d, [mode], [d.module])
                continue
            first, modes, places = merged[key]
            if mode not in modes:
                modes.append(mode)
            if d.module not in places:
                places.append(d.module)
            extra = tuple(m for m in d.culprit_modules if m not in first.culprit_modules)
            if extra:
                merged[key] = (dataclasses.replace(first, culprit_modules=first.culprit_modules + extra), modes, places)
    order: tuple[Mode, ...] = ("train", "eval")
    return [_finding(d, tuple(m for m in order if m in modes), places) for d, modes, places in merged.values()]


def _finding(d: Diag, modes: tuple[Mode, ...], places: list[str]) -> Finding:
    message = d.message.rstrip()
    if not message.endswith((".", "?", "!")):
        message += "."
    if len(places) > 1:
        # the root module's name is "": say so rather than print an empty name
        more = ", ".join(where(p) for p in places[1:4]) + (", ..." if len(places) > 4 else "")
        message += f" Also at {more}." if len(places) == 2 else f" Also at {len(places) - 1} more modules: {more}."
    details: list[tuple[str, Any]] = []
    if d.culprit_modules:
        details.append(("culprit_modules", list(d.culprit_modules)))
    if len(places) > 1:
        details.append(("also_at", places[1:]))
    details.extend(d.details)
    code_fix = CodeFix(*d.code_fix) if d.code_fix is not None else None
    return Finding(
        code=d.code,
        message=message,
        module=d.module,
        op=d.op,
        origin=d.origin,
        modes=modes,
        fix=d.fix,
        details=tuple(details),
        source=d.source,
        code_fix=code_fix,
        compiled_only=d.compiled_only,
    )
