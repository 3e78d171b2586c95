"""A server's /metrics, read back: for `s2s cluster` (a replica's conversations, pages and cache) and benchmarks."""

from __future__ import annotations

import urllib.request


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The /metrics of the server at `url` (ws:// or http://) as {name or name{labels}: value}."""
    base = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
