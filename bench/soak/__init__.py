"""The soak benchmark's parts (`s2s bench soak`, run from `bench/soak_bench.py`).

`plans` (what each simulated user does, seeded) -> `client` (one user over Moshi's protocol: a microphone that
streams in real time, turns, barge-ins, silences, a close or an abort) -> `load` (the capacity probe, and waves of
clients kept at a share of it) -> `sampler` (/metrics and the server's RSS every few seconds, and the clients'
events, as one row per interval) -> `report` (the issue's targets, the summary table and the plot).
"""
