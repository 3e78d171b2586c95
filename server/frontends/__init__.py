"""`s2s serve --frontends N`: websocket front-end processes and the engine core they reach over ZeroMQ."""
