"""How long a request's output will be, for the router's KV prediction.

max_tokens is only a bound. Chat clients often leave it out (it then defaults to the rest of
the context) or set it generously, and most outputs stop at an end-of-sequence token long
before it. Planning every request at its bound made `coordinated` admit a fraction of what
fits (bench/README.md, "Clients' max_tokens").

So the router learns from requests that finished on their own, per size class of max_tokens
(powers of two), over the last `window` of them: the longest output, and the largest share
of its budget any output used. Once a class has `min_samples` finishes, a request is planned
at min(max_tokens, max(longest, share × max_tokens)); before that, at max_tokens. Maxima, not
means or quantiles, so the plan stays an upper bound for all but a new record (about one
request in `window` from a steady distribution; one that outlives its plan falls back to its
bound, see `InFlight`). Requests that run to their budget (benchmarks with ignore_eos) have a
share of 1, so they are planned at max_tokens, as before; a fixed generous budget is planned at
the longest recent output; budgets that vary within a class (the rest of the context) at no
less than the longest output either.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class _SizeClass:
    recent: deque[tuple[int, int]]  # (output tokens, max_tokens) of the last finishes
    longest: int = 0
    share: float = 0.0  # largest output / max_tokens among them


class OutputLengths:
    """Longest recent outputs per max_tokens size class."""

    def __init__(self, window: int = 512, min_samples: int = 8):
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("output length window must be ≥ 1 and min_samples in [1, window]")
        self.window = window
        self.min_samples = min_samples
        self._classes: dict[int, _SizeClass] = {}

    def observe(self, max_tokens: int, num_output_tokens: int) -> None:
        """A request with this budget finished on its own (not aborted, not failed) after this many tokens."""
        if max_tokens < 1:
            return
        size = self._classes.setdefault(max_tokens.bit_length(), _SizeClass(deque(maxlen=self.window)))
        size.recent.append((min(num_output_tokens, max_tokens), max_tokens))
        size.longest = max(n for n, _ in size.recent)
        size.share = max(n / m for n, m in size.recent)

    def predict(self, max_tokens: int) -> int:
        """Output tokens to plan KV for: max_tokens until its class has enough finishes."""
        size = self._classes.get(max_tokens.bit_length())
        if size is None or len(size.recent) < self.min_samples:
            return max_tokens
        return max(1, min(max_tokens, max(size.longest, math.ceil(size.share * max_tokens))))
