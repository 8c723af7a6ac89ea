"""Reports the HTML tests render: the five stories, a small Llama audit, a numerics report."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch

import castwise
from castwise.report import Report


def story_report(number: int) -> Report:
    """The report castwise gives for story ``number`` (1-4: audits as the user ran them; 5: lint)."""
    from castwise.stories import SIMPLETUNER_ENV, STORIES

    if number == 5:
        from castwise.lint import lint_config

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "config.env")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(SIMPLETUNER_ENV)
            return lint_config(path)
    story = STORIES[number - 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = story.build()
        return castwise.audit(model, inputs, policy=story.policy, device=story.device, mode="both")


def llama_report(layers: int = 2, small: bool = True) -> Report:
    """A fake-tensor audit of a Llama on the meta device: the 7B benchmark's shape (LlamaConfig's
    defaults) with ``small=False``, else narrow layers (hidden 256, vocabulary 1000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers)
    if small:  # narrow layers: the same structure, a fraction of the shapes
        config.hidden_size, config.intermediate_size, config.vocab_size = 256, 512, 1000
        config.num_attention_heads = config.num_key_value_heads = 4
        config.head_dim = 256 // 4
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (1, 16))
    return castwise.audit(model, ids, policy="bf16-mixed", device="cuda", mode="both")


def numerics_data() -> dict[str, Any]:
    """A numerics report's JSON form in the documented shape (one dict per module, CW3xx finding)."""
    rows = []
    for i in range(6):
        rows.append(
            {
                "module": f"layers.{i}.mlp",
                "dtype": "f16",
                "absmax": 8.0 * 4.0**i,
                "margin_pow2": 16 - 3 - 2 * i,
                "out_err": 1e-4 * 3**i,
                "added_err": 5e-5 * 2**i,
                "tolerance": 2e-3,
            }
        )
    rows.append(
        {
            "module": "layers.6.mlp",
            "dtype": "f16",
            "absmax": "inf",
            "margin_pow2": None,
            "out_err": "nan",
            "added_err": "nan",
            "tolerance": 2e-3,
            "first_nonfinite": True,
        }
    )
    return {
        "title": "castwise numerics (forecast f16)",
        "findings": [
            {
                "code": "CW301",
                "name": "nonfinite-first-producer",
                "category": "OVERFLOW",
                "severity": "error",
                "module": "layers.6.mlp",
                "op": "aten.mm",
                "origin": None,
                "modes": ["train"],
                "message": "layers.6.mlp overflows float16's range.",
                "fix": "keep[layers.*.mlp]=f32",
            }
        ],
        "runs": [{"mode": "train", "device": "cpu", "policy": "16-mixed", "status": "error"}],
        "summary": {},
        "numerics": rows,
    }
