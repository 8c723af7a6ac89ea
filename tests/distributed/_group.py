"""torch.distributed's fake process group (rank 0 of ``world``, collectives do nothing), for the
tests that shard or wrap a model in this process and audit it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
