"""The STT -> LLM -> TTS cascade that `s2s bench cascade` measures this server against: `server.py` (its websocket
server, a protocol on `server/connection.py`), `text.py` (its text decoder), `stt.py` (pocketsphinx in worker
processes; `pip install -e '.[bench]'`), `serve.py` (`python -m bench.cascade.serve`)."""
