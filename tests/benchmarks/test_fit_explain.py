"""The explain fitting script's comparison of a re-fit with the stored model."""

from __future__ import annotations

from typing import Any

from benchmarks.fit_explain import WORD_KEEP, same


def _model(weights: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "categories": ["A", "B"],
        "bias": [0.0, 0.0],
        "temperature": 1.0,
        "meta": {"lambda": [10.0, 10.0, 1.0]},
        "weights": weights,
    }


def test_a_word_at_the_pruning_threshold_may_be_kept_on_one_machine_only() -> None:
    base = {"msg:x": [1.0, -1.0]}
    edge = _model(base | {"word:lora": [WORD_KEEP, 0.0]})
    assert same(edge, _model(base))


def test_a_missing_weighty_word_or_structural_feature_is_a_difference() -> None:
    base = {"msg:x": [1.0, -1.0]}
    assert not same(_model(base | {"word:lora": [0.5, 0.0]}), _model(base))
    assert not same(_model(base | {"msg:y": [WORD_KEEP, 0.0]}), _model(base))
    assert not same(_model({"msg:x": [1.0, -0.9]}), _model(base))
