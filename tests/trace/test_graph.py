"""The compiled program's records: module names and source lines read off Dynamo's graph nodes."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

from castwise.trace.graph import autocast_regions, module_name, user_line

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


def test_autocast_regions_follow_the_graphs_own_state_changes() -> None:
    """A ``torch.autocast`` block (enter/exit nodes, nested on another device too) and direct
    state changes (a mixed policy's) give each node the autocast it runs under on one device."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    before = graph.call_function(torch.relu, (x,), name="before")
    block = graph.call_function(_enter_autocast, ("cpu", torch.bfloat16, True, None), name="block")
    other = graph.call_function(_enter_autocast, ("cuda", torch.float16, True, None), name="other")
    inside = graph.call_function(torch.relu, (before,), name="inside")
    graph.call_function(_exit_autocast, (other,), name="other_exit")
    still = graph.call_function(torch.relu, (inside,), name="still")
    graph.call_function(_exit_autocast, (block,), name="block_exit")
    after = graph.call_function(torch.relu, (still,), name="after")
    graph.call_function(torch.set_autocast_enabled, ("cpu", True), name="on")
    graph.call_function(torch.set_autocast_dtype, ("cpu", torch.float16), name="f16")
    policy = graph.call_function(torch.relu, (after,), name="policy")
    graph.output(policy)
    regions = autocast_regions(fx.GraphModule(torch.nn.Module(), graph), "cpu")
    assert regions["before"] is None and regions["after"] is None
    assert regions["inside"] is torch.bfloat16 and regions["still"] is torch.bfloat16
    assert regions["policy"] is torch.float16
