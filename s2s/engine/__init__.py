"""The engine: its API and loop, commands, sessions and turns, frames, codec I/O, events and metrics."""
