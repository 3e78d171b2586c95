"""The prefix benchmark's parts (`s2s bench prefix`, run from `bench/prefix_bench.py`).

`config` (the engines' settings and the run's scale) -> `driver` (conversation scripts against one engine) ->
`workloads` (the scripts and their seeded prompts) -> `run` (one measured run) and `fit` (the fit table) ->
`stats` (rows and ratios over rounds) -> `report` (tables and plot). `engine_reads` holds what they read of an
engine beyond its calls.
"""
