"""The engine's counters and latency histograms (the HTTP side formats them for /metrics)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# seconds: fine at the bottom (a decode step is ~2 ms on an H200), coarse at the top (a long prefill)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Latency histogram: ``hits[i]`` observations in (bounds[i-1], bounds[i]] (the last: above
    every bound); ``cumulative()`` is Prometheus' shape, counts <= each bound."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    hits: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: int = 0
    sum: float = 0.0

    def observe(self, x: float) -> None:
        self.hits[bisect.bisect_left(self.bounds, x)] += 1
        self.total += 1
        self.sum += x

    def cumulative(self) -> list[int]:
        """Observations <= bounds[i], for each i."""
        out, n = [], 0
        for h in self.hits[:-1]:
            n += h
            out.append(n)
        return out


@dataclass
class Metrics:
    prompt_tokens: int = 0  # prompt tokens prefilled
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead (runtime/prefix.py)
    generated_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    steps: int = 0
    model_seconds: float = 0.0  # in the runner's calls and the sampler (on a GPU: the steps and their waits)
    # structured output (engine.DefaultSampler): tokens drawn freely and checked against their rule, those of them the
    # rule refused (drawn again through its mask), and tokens drawn through their rule's mask made first
    structured_checked: int = 0
    structured_refused: int = 0
    structured_masked: int = 0
    ttft: Histogram = field(default_factory=Histogram)  # arrival -> first token, seconds
    itl: Histogram = field(default_factory=Histogram)  # between a request's successive tokens, seconds
