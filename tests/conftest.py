"""Test-session setup: ``gpu`` tests need a real CUDA device and say so when there is none."""

from __future__ import annotations

import pytest


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
