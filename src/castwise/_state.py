"""Global state an audit (or a callback's audit) must leave as it found it."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from castwise import _autocast


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """Restore autocast, default dtype, grad mode, the MHA fast-path flag, the random streams
    (:func:`random_streams_kept`) and the global module hook registries on exit, whatever happened inside."""
    from torch.nn.modules import module as module_mod

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # fake kernels log the shape errors the audit reports itself
    registries = [
        name for name in dir(module_mod) if name.startswith("_global_") and isinstance(getattr(module_mod, name), dict)
    ]
    saved = {name: dict(getattr(module_mod, name)) for name in registries}
    autocast_state = _autocast.AutocastState.capture()
    default_dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    fastpath_flag = torch.backends.mha.get_fastpath_enabled()
    try:
        # a real run draws from the global generators (dropout, random init in forward): the
        # caller's random streams must not depend on whether it audited
        with random_streams_kept():
            yield
    finally:
        for name, content in saved.items():
            registry = getattr(module_mod, name)
            registry.clear()
            registry.update(content)
        autocast_state.restore()
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(grad)
        torch.backends.mha.set_fastpath_enabled(fastpath_flag)
        fake_log.setLevel(log_level)


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators a DataLoader's iteration draws from besides the global one: its own (the
    workers' base seed) and its sampler's (a RandomSampler's shuffle)."""
    found: list[torch.Generator] = []
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for owner in (loader, *samplers):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


@contextlib.contextmanager
def random_streams_kept(loader: Any = None) -> Iterator[None]:
    """Every random stream a fit draws from left as it was, whatever ran inside: torch's CPU (and
    CUDA) generator, python's ``random``, numpy's global one (where numpy is in use) and
    ``loader``'s own generators. A callback that draws a batch and audits before the first step
    must not change which batches the fit sees, its dropout masks, or its augmentations."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    py = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    generators = [(g, g.get_state()) for g in _loader_generators(loader)]
    iterator = getattr(loader, "_iterator", None)  # persistent workers keep the first iterator
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)
        for g, state in generators:
            g.set_state(state)
        made = getattr(loader, "_iterator", None)
        if made is not None and made is not iterator:
            # the fit's own iterator must start its workers from the restored seeds, not ours
            getattr(made, "_shutdown_workers", lambda: None)()
            loader._iterator = iterator
