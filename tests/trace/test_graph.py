"""The compiled program's records: module names and source lines read off Dynamo's graph nodes."""

from __future__ import annotations

import pytest

from castwise.trace.graph import module_name, user_line

KNOWN = frozenset({"", "layers", "layers.0", "layers.0.attn", "head"})


@pytest.mark.parametrize(
    ("fqn", "name"),
    [
        ("L['self'].layers[0].attn", "layers.0.attn"),
        ("L['self']._modules['layers']._modules['0']._modules['attn']", "layers.0.attn"),
        ("L['self'].layers.0", "layers.0"),
        ("L['self']._orig_mod.head", "head"),  # a compiled submodule's wrapper is never in a name
        ("L['self'].head.weight", "head"),  # a path into a module's tensor: its module
        ("L['self']", ""),
        ("L['mod'].layers[0]", "layers.0"),  # a forward whose first argument is not called self
    ],
)
def test_module_names_are_the_users(fqn: str, name: str) -> None:
    assert module_name(fqn, KNOWN) == name


def test_user_line_is_the_innermost_user_frame() -> None:
    trace = (
        '  File "/home/u/proj/model.py", line 12, in forward\n    return self.head(x)\n'
        '  File "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", line 125, in forward\n'
        "    return F.linear(input, self.weight, self.bias)\n"
    )
    line = user_line(trace)
    assert line is not None and line.endswith("model.py:12")
    assert user_line(None) is None
    assert user_line('  File "/x/site-packages/torch/nn/functional.py", line 3, in f\n') is None
