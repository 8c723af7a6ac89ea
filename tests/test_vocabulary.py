"""One vocabulary: low precision, autocast device types, errors, random streams, the JSON schema."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch
from torch import nn

import castwise
from castwise import _autocast, _dtypes, devices, errors
from castwise._state import preserved_state
from castwise.integrations import _steps


def test_low_precision_is_one_definition_for_names_and_dtypes() -> None:
    assert _dtypes.LOW == ("bfloat16", "float16")
    names = ("bfloat16", "float16", "float32", "float8_e4m3fn")
    assert [_dtypes.is_low(n) for n in names] == [True, True, False, False]
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    assert [_dtypes.is_low(d) for d in dtypes] == [True, True, False, False]
    assert _dtypes.low_dtypes() == (torch.bfloat16, torch.float16)


def test_autocast_device_types_come_from_the_registry() -> None:
    assert _autocast.DEVICE_TYPES == devices.autocast_types() == ("cpu", "cuda")
    toy = dataclasses.replace(devices.CPU, name="toyxpu", autocast_type="xpu")
    devices.register(toy)
    try:
        assert devices.autocast_types() == ("cpu", "cuda", "xpu")
    finally:
        devices.unregister("toyxpu")
    assert devices.autocast_types() == ("cpu", "cuda")


def test_errors_live_in_errors_and_stay_importable_where_users_import_them() -> None:
    from castwise.distributed.plan import ShardError
    from castwise.export import ExportError
    from castwise.integrations.run import RunStopped
    from castwise.report._chromium import BrowserError
    from castwise.report.html import HtmlWriteError

    moved = (ShardError, ExportError, RunStopped, BrowserError, HtmlWriteError)
    assert moved == (
        errors.ShardError,
        errors.ExportError,
        errors.RunStopped,
        errors.BrowserError,
        errors.HtmlWriteError,
    )
    assert all(issubclass(e, castwise.CastwiseError) and e.__module__ == "castwise.errors" for e in moved)


def test_an_audit_leaves_every_random_stream_as_it_found_it() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with preserved_state():  # what an audit runs in: the model may draw from any of them
        random.random(), np.random.rand(), torch.rand(())
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    assert _steps.random_streams_kept is castwise._state.random_streams_kept  # one preserver


def test_the_report_json_names_its_schema() -> None:
    report = castwise.audit(nn.Linear(4, 4), torch.randn(2, 4), mode="eval")
    data = report.to_dict()
    assert data["schema"] == 1 and list(data)[:2] == ["schema", "findings"]
