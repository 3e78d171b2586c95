"""Turn endpointing: Silero VAD (`Endpointer`) and the server-wide turn gate."""
