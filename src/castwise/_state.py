"""Global torch state an audit must leave as it found it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from castwise import _autocast


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """Restore autocast, default dtype, grad mode, the MHA fast-path flag, the global random
    generators' states and the global module hook registries on exit, whatever happened inside."""
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
    # a real run draws from the global generators (dropout, random init in forward): the caller's
    # random stream must not depend on whether it audited
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for name, content in saved.items():
            registry = getattr(module_mod, name)
            registry.clear()
            registry.update(content)
        autocast_state.restore()
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(grad)
        torch.backends.mha.set_fastpath_enabled(fastpath_flag)
        fake_log.setLevel(log_level)
