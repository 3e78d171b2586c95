"""A server's /metrics, read back: for `s2s cluster` (a replica's conversations, pages and cache) and benchmarks."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The /metrics of the server at `url` (ws:// or http://) as `samples` reads them."""
    base = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as r:
        return samples(r.read().decode())


def samples(text: str) -> dict[str, float]:
    """Prometheus text as {sample: value}, a sample named as the text names it: `name` or `name{label="value",...}`."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def quantile(m: dict[str, float], prev: dict[str, float], histogram: str, q: float) -> float:
    """The `q` quantile (0 to 1) of `histogram`'s observations between scrapes `prev` and `m`, interpolated within
    its bucket as Prometheus's `histogram_quantile` does; nan with none."""
    prefix = f'{histogram}_bucket{{le="'
    counts = sorted(
        (float(key[len(prefix) : -2]), value - prev.get(key, 0.0)) for key, value in m.items() if key.startswith(prefix)
    )
    if not counts or counts[-1][1] <= 0:
        return math.nan
    rank, below, lower = q * counts[-1][1], 0.0, 0.0
    for bound, count in counts:  # (the last bucket, +Inf, holds them all)
        if count >= rank:
            break
        below, lower = count, bound
    if math.isinf(bound) or count == below:
        return lower  # past the last finite bound: that bound is all there is to say
    return lower + (bound - lower) * (rank - below) / (count - below)
