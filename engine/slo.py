"""Service-level objectives for goodput: `ttft:MS,tpot:MS,e2el:MS`, the form `vllm bench serve` takes.

Shared by `bench serve` (requests per second meeting every objective) and `cluster-sim` (the
highest offered load at which enough requests meet them), so both judge a request the same way.
"""

from __future__ import annotations

import math

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50` (milliseconds) → {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        name, _, value = part.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if name not in SLO_METRICS or not limit > 0:
            raise ValueError(f"bad SLO entry {part!r}; use ttft:MS, tpot:MS, e2el:MS with a positive MS")
        slo[name] = limit / 1000.0
    return slo


def time_per_output_token(ttft: float, e2el: float, output_len: int) -> float:
    """vLLM's TPOT: the mean gap after the first token; a single-token output counts as 0."""
    return (e2el - ttft) / (output_len - 1) if output_len > 1 else 0.0


def meets_slo(slo: dict[str, float], *, ttft: float, e2el: float, output_len: int) -> bool:
    """Whether one request (latencies in seconds) is within every objective."""
    measured = {"ttft": ttft, "tpot": time_per_output_token(ttft, e2el, output_len), "e2el": e2el}
    return all(measured[name] <= limit for name, limit in slo.items())
