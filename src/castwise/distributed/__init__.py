"""castwise at scale: internals of ``castwise.fsdp2`` and of the distributed audit.

- ``castwise.distributed.plan``: unit discovery and the per-unit plan (a frozen value with a
  readable ``str``) that ``castwise.fsdp2.plan`` returns and ``castwise.fsdp2.fully_shard``
  carries out.
- ``castwise.distributed.audit``: ``castwise.audit`` on a model sharded by FSDP2 (DTensor
  parameters): per-unit gather / compute / reduce dtypes, and the findings of the equivalent
  unsharded run.

Nothing here imports ``torch.distributed`` at import time.
"""

from __future__ import annotations
