"""CW122 tensor-not-in-policy-dtype: A parameter or buffer stays in another dtype than the policy gives it."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Origin, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._text import (
    generalize,
    true_preset,
)

META = Rule(
    code="CW122",
    name="tensor-not-in-policy-dtype",
    category="UNCONVERTED_TENSOR_OR_BUFFER",
    severity="warning",
    summary="A parameter or buffer stays in another dtype than the policy gives it.",
    detects="After the policy is applied, a floating parameter or buffer is still not in "
    "the policy's dtype for it (param_dtype, buffers=, a module rule, an fp32 "
    "island): mixed policies cast no tensor outside islands, so a tensor cast by "
    "hand (a bf16 cache in a float32 model under bf16-mixed) stays as it is. "
    "Tensors the policy casts are not reported: applying the policy fixes them.",
    why="Autocast casts the operands of the ops it manages only; ops outside its lists "
    "(index_put, cat, in-place writes, custom kernels) meet the odd dtype as it is.",
    example="buffer `cache` made with dtype=torch.bfloat16, audited under bf16-mixed.",
    fix="Store the tensor in the policy's dtype where it is made, or say what you mean in "
    "the policy (`buffers=bf16`, `keep[<module>]=bf16`).",
)


def _fix_text(kind: str, dtype: str, want: str, want_torch: str, owner: str) -> str:
    if kind == "buffer":
        return (
            f"Store it in {want} (make it with `dtype=torch.{want_torch}` or `.to()` it where it is made), "
            f"or add `buffers={dtype}` to the policy if {dtype} is meant."
        )
    return f"Cast it back to {want} (it was probably cast by hand), or make its module an island in {dtype}: " + (
        f"`keep[{generalize(owner)}]={dtype}`." if owner else "a rule on the module that owns it."
    )


def _config_dtype(model: Any) -> str | None:
    """The dtype a Hugging Face model's config names (``dtype``; ``torch_dtype`` before
    transformers 5), as torch writes it after ``torch.``: transformers builds every weight in it
    (``from_config``, and ``from_pretrained``, whose default ``dtype="auto"`` reads it)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    # vars(): the `torch_dtype` property of transformers 5 warns that it is deprecated
    value = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    return str(value).removeprefix("torch.") if value is not None else None


def _from_config(have: Any, want: Any, policy: Any) -> tuple[str, str]:
    """(how, fix) for tensors in the dtype the model's config names: one cause for them all,
    however many modules hold them, so the fix is the build's dtype or the policy, not a rule."""
    how = (
        f"the model was built in {short_of(have)} because its config names it (config.json "
        f'"torch_dtype": "{name_of(have)}"; transformers builds every weight in it: from_config, and '
        'from_pretrained, whose default dtype="auto" reads it)'
    )
    if policy.is_mixed:
        how += f", and a mixed policy does not cast weights: it expects {short_of(want)} weights and autocasts"
    fix = (
        f"Build the model in {name_of(want)}, as {policy} expects: `from_pretrained(..., "
        f'dtype=torch.{name_of(want)})` (auditing a config.json: set its "torch_dtype" to '
        f'"{name_of(want)}"); or, if {short_of(have)} weights are meant, use the policy `{true_preset(have)}`.'
    )
    return how, fix


def _reported_elsewhere(session: Session) -> set[str]:
    """Parameters CW122 leaves out: under a mixed policy a frozen one (requires_grad=False: a
    VAE or text encoder kept in f16/bf16 on purpose, as diffusers' weight_dtype does), and a
    trainable f16 one under loss scaling (CW124 reports it, as the error it is)."""
    policy = session.policy
    if policy is None or not policy.is_mixed:
        return set()
    from castwise.rules.audit.cw124 import half_trainable

    copy = session.runs[0].copy
    frozen = {n for n, p in copy.named_parameters() if not p.requires_grad}
    scaled = set(half_trainable(copy)) if policy.loss_scale is not None and not policy.master_weights else set()
    return frozen | scaled


def _built_after_conversion(session: Session) -> set[str]:
    """Modules made after the framework converted the model: those CW118 found, each widened to
    the largest module around it whose every floating parameter kept its dtype too (a head built
    late is a whole subtree; CW118 names the layer that met the rest). Every tensor in them kept
    its dtype for that one reason, which CW118 already says."""
    found = {f.origin.module for f in session.findings if f.code == "CW118" and f.origin and f.origin.module}
    if not found:
        return set()
    stale = {f"{m}.{n}" if m else n for m, n, kind, _d, _w in session.runs[0].unexpected if kind == "param"}
    floats = [n for n, p in session.runs[0].copy.named_parameters() if p.is_floating_point()]
    out = set()
    for module in found:
        while "." in module:
            parent = module.rsplit(".", 1)[0]
            if not all(n in stale for n in floats if n.startswith(f"{parent}.")):
                break
            module = parent
        out.add(module)
    return out


def _scan(session: Session) -> list[Finding]:
    # tensors the policy leaves off the dtype it gives them (apply casts the rest)
    policy, runs = session.policy, session.runs
    if policy is None or not runs or not runs[0].unexpected:
        return []
    groups: dict[tuple[str, Any, Any], list[str]] = {}
    skip = _reported_elsewhere(session)
    late = _built_after_conversion(session)
    for m, n, kind, dtype, want in runs[0].unexpected:
        if kind == "param" and (f"{m}.{n}" if m else n) in skip:
            continue
        if any(m == x or m.startswith(f"{x}.") for x in late):
            continue  # CW118 explains it: the module was made after the framework's conversion
        groups.setdefault((kind, dtype, want), []).append(f"{m}.{n}" if m else n)
    out: list[Finding] = []
    built_in = _config_dtype(runs[0].copy)
    for (kind, dtype, want), names in groups.items():
        sample = ", ".join(f"`{x}`" for x in names[:3]) + (", ..." if len(names) > 3 else "")
        owner = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        how = (
            "mixed policies leave the model's tensors as they are and autocast at each op"
            if policy.is_mixed
            else "castwise.apply leaves it as it is"
        )
        have, should = short_of(dtype), short_of(want)
        fix = _fix_text(kind, have, should, name_of(want), owner)
        if kind == "param" and built_in == name_of(dtype):
            how, fix = _from_config(dtype, want, policy)
            owner = ""  # the whole model's build, not the module of the first tensor named
        out.append(
            Finding(
                code="CW122",
                module=owner,
                origin=Origin(owner or None, None, f"{kind} {names[0]}"),
                modes=tuple(r.mode for r in runs),
                message=(
                    f"{len(names)} {kind}(s) stay {have} under policy {policy}, which gives them {should} "
                    f"({sample}): {how}, so ops autocast does not manage (index_put, cat, in-place writes, "
                    f"custom kernels) see {have} meet {should}."
                ),
                fix=fix,
            )
        )
    return out


RULE = AuditRule(META, scan=_scan)
