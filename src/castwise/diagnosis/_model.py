"""The fitted explain model: a multinomial logistic regression over named evidence (torch-free).

``model.json`` (written by ``benchmarks/fit_explain.py`` from the train split of
``benchmarks/data/explain/reports.jsonl``) holds one weight per (feature, category) and a bias
per category. A report's score for a category is the bias plus the weights of the features it
shows; a softmax at the fitted temperature turns the scores into the printed confidence, which
the held-out test split shows to be calibrated (see the note in ``docs``).

Reading the table needs no ML library: a few hundred multiplications in plain Python.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

MODEL_FILE = "model.json"


@dataclass(frozen=True)
class Model:
    categories: tuple[str, ...]
    bias: tuple[float, ...]
    weights: dict[str, Sequence[float]]
    temperature: float
    unsure_below: float
    # (a, b, c): confidence = sigmoid(a * logit(p1) + c * log(p1 / p2) + b), p1/p2 the top two
    confidence_map: tuple[float, float, float]
    descriptions: dict[str, str]  # feature -> what it means, for "what would settle it"
    meta: dict[str, Any]

    def logits(self, x: dict[str, float]) -> list[float]:
        out = list(self.bias)
        for name, value in x.items():
            w = self.weights.get(name)
            if w is None or not value:
                continue
            for i, wi in enumerate(w):
                out[i] += value * wi
        return out

    def probabilities(self, x: dict[str, float]) -> list[float]:
        z = [v / self.temperature for v in self.logits(x)]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        return [v / total for v in e]

    def calibrated(self, probs: list[float]) -> list[float]:
        """The probabilities with the top one mapped to the confidence the out-of-fold answers bear
        out. A lower top scales every candidate down alike (the scores then sum to less than one:
        the rest is "none of these"); a higher top takes its gain from the others. Either way the
        ranking is unchanged."""
        i = max(range(len(probs)), key=lambda k: probs[k])
        p = min(max(probs[i], 1e-6), 1 - 1e-6)
        runner_up = max((v for k, v in enumerate(probs) if k != i), default=0.0)
        margin = math.log(p / max(runner_up, 1e-12))
        a, b, c = self.confidence_map
        conf = 1 / (1 + math.exp(-(a * math.log(p / (1 - p)) + c * margin + b)))
        if conf <= p:
            return [v * conf / p for v in probs]
        return [conf if k == i else v * (1 - conf) / (1 - p) for k, v in enumerate(probs)]

    def contributions(self, x: dict[str, float], category: str, against: str | None) -> list[tuple[float, str]]:
        """Each present feature's push toward ``category`` (relative to ``against``, the
        runner-up, when given): what decided the answer, strongest first."""
        i = self.categories.index(category)
        j = self.categories.index(against) if against is not None else None
        out: list[tuple[float, str]] = []
        for name, value in x.items():
            w = self.weights.get(name)
            if w is None or not value:
                continue
            push = value * (w[i] - (w[j] if j is not None else 0.0))
            if push > 0.05:
                out.append((push, name))
        out.sort(key=lambda t: (-t[0], t[1]))
        return out

    def settlers(self, x: dict[str, float], candidates: list[str], limit: int = 3) -> list[tuple[str, str]]:
        """For each candidate, the absent observable feature that would most favour it over the
        others: what to look for (or paste) to settle between them."""
        idx = [self.categories.index(c) for c in candidates]
        out: list[tuple[str, str]] = []
        for k, c in zip(idx, candidates, strict=True):
            best: tuple[float, str] | None = None
            for name, w in self.weights.items():
                if name in x or name not in self.descriptions:
                    continue
                margin = w[k] - max(w[o] for o in idx if o != k)
                if best is None or margin > best[0] or (margin == best[0] and name < best[1]):
                    best = (margin, name)
            if best is not None and best[0] > 0.3:
                out.append((c, self.descriptions[best[1]]))
        return out[:limit]


def from_dict(d: dict[str, Any]) -> Model:
    cats = tuple(d["categories"])
    return Model(
        categories=cats,
        bias=tuple(float(v) for v in d["bias"]),
        # the lists as json gives them: converting ~6000 floats would cost more than the answer
        weights=d["weights"],
        temperature=float(d["temperature"]),
        unsure_below=float(d["unsure_below"]),
        confidence_map=_confidence_map(d.get("confidence_map", (1.0, 0.0))),
        descriptions=dict(d.get("descriptions", {})),
        meta=dict(d.get("meta", {})),
    )


def _confidence_map(raw: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c); a file written before the margin term has no c (0: the top probability alone)."""
    values = [float(v) for v in raw] + [0.0] * (3 - len(raw))
    return values[0], values[1], values[2]


@lru_cache(maxsize=1)
def load() -> Model:
    text = resources.files("castwise.diagnosis").joinpath(MODEL_FILE).read_text(encoding="utf-8")
    return from_dict(json.loads(text))
