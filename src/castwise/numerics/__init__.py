"""Numerics: values, not dtypes, on real tensors.

``compare`` (``castwise.compare``: error against float32 per module, added vs inherited),
``tune`` (``castwise.tune``: the smallest verified set of float32 islands),

``locate`` (``castwise.locate_nonfinite``: the first op that made a NaN/Inf, and why),
``forecast`` (``castwise.forecast``: where a narrower dtype would overflow or flush to zero),
``watch`` (``castwise.watch``: a training loop's first non-finite step, replayed under locate),
``observe`` (the tracer observers they share), ``cli`` (``castwise numerics``).
The package imports nothing at import: ``import castwise`` stays light.
"""
