"""Test-session setup: ``gpu`` tests need a real CUDA device and say so when there is none; the
session's torch.compile (Inductor) runs use a cache of their own."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
_own_cache: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # Inductor's on-disk caches are shared by every process of the user (/tmp/torchinductor_<user>):
    # a test run would read what other runs wrote (measured: a run with ATEN_CPU_CAPABILITY=avx2
    # loaded entries that gave another compiled output than a fresh compile), and leave its own
    if _INDUCTOR_CACHE not in os.environ:
        path = tempfile.mkdtemp(prefix="castwise-tests-inductor-")
        os.environ[_INDUCTOR_CACHE] = path
        _own_cache.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _own_cache:
        os.environ.pop(_INDUCTOR_CACHE, None)
        shutil.rmtree(path, ignore_errors=True)
    _own_cache.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = pytest.mark.skip(reason="needs a CUDA device (gpu marker): run `pytest -m gpu` on a GPU machine")
    for item in gpu_items:
        item.add_marker(reason)
