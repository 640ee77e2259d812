"""Prometheus text exposition of the stand-in's counters, under SGLang's metric names.

Only the names the pipeline and the occupancy benchmark read are produced; the stand-in's own
occupancy figures use a `tracegen_sim:` prefix so they never collide with a real SGLang metric.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"histogram buckets must be sorted, got {self.buckets}")
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {self.n}")
        return lines


@dataclass(slots=True)
class Metrics:
    """Counters and histograms the HTTP layer updates as requests come and go."""

    prompt_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    queue_time: Histogram = field(default_factory=Histogram)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items())


def render(
    scheduler_labels: dict[str, str],
    tokenizer_labels: dict[str, str],
    metrics: Metrics,
    gauges: dict[str, float],
    counters: dict[str, float],
    sim: dict[str, float],
    by_priority: dict[str, dict[str, int]] | None = None,
) -> str:
    """The /metrics body, labelled as SGLang labels it: `gauges` (and the queue-time histogram) are the
    scheduler's, `counters` and the latency histograms the tokenizer manager's; names are SGLang's without
    the `sglang:` prefix. With priority scheduling the labels carry priority="" (the totals), and
    `by_priority` adds a series per priority for the gauges it names."""
    scheduler, tokenizer = _labels(scheduler_labels), _labels(tokenizer_labels)
    lines: list[str] = []
    for name, value in gauges.items():
        lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{{{scheduler}}} {value}"]
        for priority, count in sorted((by_priority or {}).get(name, {}).items()):
            labels = _labels({**scheduler_labels, "priority": priority})
            lines.append(f"sglang:{name}{{{labels}}} {count}")
    for name, value in counters.items():
        lines += [f"# TYPE sglang:{name} counter", f"sglang:{name}{{{tokenizer}}} {value}"]
    lines += metrics.ttft.render("sglang:time_to_first_token_seconds", tokenizer)
    lines += metrics.e2e.render("sglang:e2e_request_latency_seconds", tokenizer)
    lines += metrics.queue_time.render("sglang:queue_time_seconds", scheduler)
    model = _labels({"model_name": scheduler_labels.get("model_name", "")})
    for name, value in sim.items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# TYPE tracegen_sim:{name} {kind}", f"tracegen_sim:{name}{{{model}}} {value}"]
    return "\n".join(lines) + "\n"
