"""The OpenAI Realtime API (GA shape, and the beta's names for beta clients) at /v1/realtime, on the connection core:
`wire.py` (JSON events), `config.py` (`session.update`), `items.py` and `session.py` (items and responses over the
engine's turns), `duplex.py` (responses cut from a full-duplex model's stream by its text), `endpoint.py` (the
request: model, dialect)."""

from server.realtime.endpoint import RealtimeEndpoint

__all__ = ["RealtimeEndpoint"]
