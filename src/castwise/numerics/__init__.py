"""Numerics: values, not dtypes, on real tensors (compare, tune; locate, forecast, watch)."""
