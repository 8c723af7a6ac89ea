"""The precision ledger (issue 35): per parameter group, the dtypes of storage, compute,
gradient, reduction, master copy, optimizer state and checkpoint, read from where each is
decided. Torch-free here; ``castwise.ledger.model`` (torch) reads a model and its optimizer."""

from __future__ import annotations

from castwise.ledger.config import ledger_from_config
from castwise.ledger.values import FIELDS, UNKNOWN, Entry, Ledger, Row, group_rows

__all__ = ["FIELDS", "UNKNOWN", "Entry", "Ledger", "Row", "group_rows", "ledger_from_config"]
