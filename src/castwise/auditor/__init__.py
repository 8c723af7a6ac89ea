"""``castwise.audit``: run a model (forward, and backward in train mode) and report its dtype flow.

The audit runs on a fake copy of the model (no weight memory, any size) on the target device,
under the user's policy, with the tracer (castwise.trace) recording every op and the origin of
every tensor's dtype, and its observers checking each op against the real kernels' dtype
contracts. The rules (castwise.rules.audit, one module per code) turn what the runs recorded
into findings; a suggested policy is searched for by re-auditing the rules' fixes. The user's
model and every global setting are left exactly as they were.

Layout: ``session`` (copy, apply, run each mode), ``context`` (what rules read), ``findings``
(events through the rules), ``suggest`` (the verified policy), ``entry`` (a request, a sharded
model), ``target`` (CLI targets).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from castwise._compiled import compiled_blocks, compiled_parts, user_view
from castwise._state import preserved_state
from castwise.auditor.entry import audited
from castwise.auditor.session import MODES
from castwise.auditor.suggest import suggest_policy
from castwise.errors import AuditError
from castwise.ledger.runtime import step_spec
from castwise.policy import Policy
from castwise.report import Report
from castwise.run import RunRequest, check


def audit(
    model: nn.Module | Any,
    inputs: Any,
    *,
    policy: Policy | str | None = None,
    device: str | None = None,
    mode: str = "both",
    fake: bool = True,
    torch: str | None = None,
    optimizer: Any = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Report:
    """Run ``model`` on ``inputs`` (forward, and backward in train mode) and report its dtype flow.

    ``inputs``: what the model is called on, the same rule for every castwise entry: a dict is
    keyword arguments (``model(**inputs)``), a plain tuple or list positional arguments
    (``model(*inputs)``), any other object (a tensor, a namedtuple, a dataclass, a ModelOutput,
    a batch object) one argument (``model(inputs)``). ``policy``: a
    Policy or any string ``Policy.parse`` accepts (None: the model as it is, no autocast).
    ``device``: the target device to simulate (a registered name: "cpu", "cuda"; default where
    the model is). ``mode``: "train" (forward + backward), "eval" (eval() under no_grad) or
    "both". ``fake``: fake tensors (no weight memory, any size); False: real tensors on this
    machine. The user's model and every global setting are left as they were, also when the
    model raises. A ``torch.compile``'d model is audited as its user wrote it (module names
    without ``_orig_mod``) and as compiled: Dynamo and AOTAutograd compile a copy on the same
    fake tensors, and every op of their graphs is checked too (the report's ``compiled``).
    ``torch``: a recorded torch release ("2.11"): autocast casts as that release's would
    (its recorded lists replace this torch's), without installing it. ``model`` may also be the
    rank programs of a pipeline / expert-parallel mesh (PipelineStages, or
    ``castwise.distributed.programs.RankPrograms``): one audit per distinct program, findings
    naming their ranks, send/recv and collective dtypes compared between programs.
    ``optimizer``: the user's optimizer, stepped once after the train run's backward (the precision
    ledger: ``to_dict()["ledger"]``, and CW150-CW151 findings naming the param groups): a
    ``torch.optim`` class (with ``optimizer_kwargs``, over every trainable parameter), an optimizer
    over ``model``'s parameters (its param groups), or a function ``model -> optimizer``.
    """
    from castwise.distributed.audit import is_sharded
    from castwise.distributed.programs import is_programs

    if (optimizer is not None or optimizer_kwargs is not None) and (
        is_programs(model) or is_sharded(model, real=not fake)
    ):
        # the step's storage and reduce dtypes live in each engine's per-parameter state: not modelled here
        raise AuditError(
            "audit(optimizer=...) steps an unsharded model only: for sharded or pipeline/expert-parallel models "
            "the optimizer step is not modelled. Audit without optimizer=, or run the script under "
            "`castwise run`, whose ledger reads FSDP2's real compute and reduce dtypes per parameter."
        )
    if is_programs(model):  # pipeline / expert parallel: one audit per distinct rank program
        from castwise.auditor.programs import audit_programs

        return audit_programs(model, inputs, audit, policy=policy, device=device, mode=mode, fake=fake, torch=torch)
    if is_sharded(model, real=not fake):  # FSDP2 or FSDP1: per-unit dtypes, findings of what the units compute
        from castwise.auditor.entry import audit_sharded

        return audit_sharded(model, inputs, policy=policy, device=device, mode=mode, fake=fake, torch=torch)
    parts = compiled_parts(model)
    if parts is not None:  # torch.compile'd: the module it compiled, run eagerly and compiled
        model = parts[0]
    blocks = compiled_blocks(model) if isinstance(model, nn.Module) else ()
    if blocks:  # modules compiled on their own inside (block by block, Fabric's): the same, per block
        model = user_view(model)
        if parts is None:
            whole = blocks[0][0] == ""  # the root compiled in place (model.compile())
            parts = (model, replace(blocks[0][1], blocks=() if whole else tuple(b for b, _o in blocks)))
    request = check("audit", model, inputs, policy=policy, device=device, mode=mode, fake=fake, torch_release=torch)
    if optimizer is not None or optimizer_kwargs is not None:
        request = replace(request, step=step_spec(model, optimizer, optimizer_kwargs, mode))
    return audited(request, parts[1] if parts is not None else None)


__all__ = ["MODES", "RunRequest", "audit", "preserved_state", "suggest_policy"]
