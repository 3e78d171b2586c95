"""Per-turn stage times and conversations opened, by protocol, and connections the server closed, by why, for
`/metrics`: the same figures for each protocol."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

STAGES = {  # stage: (from, to), the engine's turn timestamps (`Turn.times`)
    "turn_latency": ("end_of_turn", "first_audio_out"),
    "prefill": ("reply_start", "prefill_done"),
    "first_step": ("reply_start", "first_step"),
}


class TurnMetrics:
    def __init__(self, registry: CollectorRegistry):
        buckets = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0)
        self.stages = Histogram(
            "s2s_turn_stage_seconds", "per-turn stage times", ["protocol", "stage"], registry=registry, buckets=buckets
        )
        self.connections = Counter("s2s_connections", "conversations opened", ["protocol"], registry=registry)
        self.closed = Counter(
            "s2s_connections_closed",
            "connections the server closed: idle, slow_reader, invalid_request",
            ["reason"],
            registry=registry,
        )

    def dropped(self, reason: str) -> None:
        self.closed.labels(reason).inc()

    def opened(self, protocol: str) -> None:
        self.connections.labels(protocol).inc()

    def observe(self, protocol: str, times: dict[str, float]) -> None:
        """A finished reply's stage times (those it has: a reply asked for before its audio was in has no prefill)."""
        for stage, (start, stop) in STAGES.items():
            if start in times and stop in times:
                self.stages.labels(protocol, stage).observe(times[stop] - times[start])
