"""Hypothesis settings for quant tests: few examples, deterministic, no deadline (CPU noise)."""

from hypothesis import settings

quick = settings(max_examples=25, deadline=None, derandomize=True)
