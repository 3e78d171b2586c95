"""Kyutai's Moshi protocol: its framing, the endpoint, and the server's Ogg/Opus out."""
