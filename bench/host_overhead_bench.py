"""The engine's own work per tick (everything but the model's forward and sampling) against live conversations.

    s2s bench host-overhead [--quick] [--ticks T] [--warmup W] [--json PATH] [--plot PATH]

An engine on `tiny` with seeded weights, codec-free (two codebooks of 1024 codes, the 1.5 kbps codec's shape: the
codec's calls are not the engine's bookkeeping), with N duplex conversations, N in 16, 64, 256, 512 (`--quick`: 16
and 64). Each is fed 4 frames of codes a tick, as the server's ticks take them, and the engine ticks back to back
(`step()` in this thread, then the engine loop's `_behind()`, its check for input ahead of real time). Per tick:
its wall time, the time inside `ModelRunner.forward` and `ModelRunner.sample` (timed around them), and the rest,
which is host work, also as the engine thread's CPU time (`time.thread_time`: on a shared machine, what another
process's load does not inflate): taking commands, scheduling, the prefix cache's re-match and inserts, page
reservation, the per-conversation loops, events, the snapshot and the loop's check. The first `--warmup` ticks
(default 3: while each conversation's first frames go in; 600: until every window of 2250 steps is full and pages
leave it) are not counted. A second table splits the host CPU by phase (`PHASES`: each timed
around the engine method that does it, less any forward or sampling inside), so that what grows with N shows. The
phases are timed on ticks of their own, as many again after the measured ones: their clocks (the thread's CPU time, a
system call each, about 30 phases a tick) would otherwise add to the host time they split.

Each N runs twice: on the model's forward and sampling, and on a stand-in that hands back logits and codes of the
same shapes at once: the host work back to back. On this VM the same host work costs up to twice as much when the
thread has been away tens of milliseconds between its pieces, whatever it did there (the forward, or a sleep or a
spin as long: bench/RESULTS.md): the model's figure holds that, the stand-in's does not.
"""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from bench.common import environment, parser, print_table, save_outputs, write_json
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import Engine, EngineConfig
from server.gc_pause import freeze_startup_heap

FRAMES_PER_TICK = 4
FORWARDS = ("model", "stand-in")


PHASES = {  # where the engine thread's host CPU goes: (object, method) wrapped, by name
    "commands": ("engine", "_apply_commands"),  # each conversation's pushed codes, as a command
    "encode": ("audio", "encode"),  # pushed codes become user frames
    "take": ("lane", "take"),  # the lane's rows and their step tokens
    "schedule": ("engine", "_schedule"),  # per round: the scheduler's pick, page reservations, the lane's rows
    "computed": ("rounds", "computed"),  # the forward's steps into the sessions
    "accept": ("rounds", "accept"),  # the sampled codes into the lane's rows and the sessions
    "give_back": ("lane", "give_back_all"),  # the rows' steps back to their sessions
    "decode": ("audio", "decode"),  # complete frames out as each conversation's events
    "publish": ("engine", "_publish"),  # the snapshot
}


def measure(model: S2SModel, n: int, ticks: int, forward: str, warmup: int = 3) -> dict:
    """`forward`: "model" (the tiny model's forward and sampling, on this CPU), or "stand-in" (logits and codes of
    the same shapes, made at once: the host work back to back)."""
    cfg = EngineConfig(
        frames_per_tick=FRAMES_PER_TICK,
        calibration_ticks=0,
        max_conversations=n,
        num_pages=n * ((warmup + 2 * ticks) * FRAMES_PER_TICK // 16 + 4),  # each one's frames, and room
    )
    engine = Engine(model, None, cfg)
    freeze_startup_heap()  # as `s2s serve` does once started: full passes walk only what is made after
    inside = [0.0, 0.0]  # seconds in the model's forward and sampling this tick: wall, the thread's CPU
    phase_cpu = dict.fromkeys(PHASES, 0.0)  # this tick's thread CPU in each phase (the model's excluded)
    splitting = [False]  # this tick times its phases

    def timed(fn, phase: str | None = None):
        def run(*args, **kwargs):
            if phase is not None and not splitting[0]:
                return fn(*args, **kwargs)
            t, cpu, model_cpu = time.perf_counter(), time.thread_time(), inside[1]
            out = fn(*args, **kwargs)
            if phase is None:
                inside[0] += time.perf_counter() - t
                inside[1] += time.thread_time() - cpu
            else:
                phase_cpu[phase] += time.thread_time() - cpu - (inside[1] - model_cpu)
            return out

        return run

    if forward == "stand-in":
        mcfg, draw = model.config, np.random.default_rng(1)
        logits = torch.randn(n, mcfg.num_codebooks, mcfg.vocab_size)

        def stand_in_sample(batch):
            drawn = batch.sampling()[0]
            return None if drawn is None else torch.from_numpy(draw.integers(0, mcfg.codebook_size, drawn.shape[:2]))

        engine.runner.forward = lambda batch: logits[: len(batch)]
        engine.runner.sample = stand_in_sample
    engine.runner.forward = timed(engine.runner.forward)
    engine.runner.sample = timed(engine.runner.sample)
    owners = {"engine": engine, "audio": engine.audio, "lane": engine.lane, "rounds": engine.rounds}
    for phase, (owner, method) in PHASES.items():
        setattr(owners[owner], method, timed(getattr(owners[owner], method), phase))
    rng = np.random.default_rng(0)
    cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(n)]
    user = rng.integers(0, 1024, (2, FRAMES_PER_TICK * (warmup + 2 * ticks)))
    tick_s, model_s, host_cpu_s, phases, split_cpu_s = [], [], [], [], []
    for t in range(warmup + 2 * ticks):  # after the warmup, the measured ticks, then as many whose phases are timed
        splitting[0] = t >= warmup + ticks
        frames = user[:, t * FRAMES_PER_TICK : (t + 1) * FRAMES_PER_TICK]
        for cid in cids:
            engine.push_codes(cid, frames)
        inside[:] = 0.0, 0.0
        phase_cpu.update(dict.fromkeys(PHASES, 0.0))
        start, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        engine._behind()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        for cid in cids:  # what the server's readers do: the events go
            q = engine.event_queue(cid)
            while q.qsize():
                q.get_nowait()
        if splitting[0]:
            phases.append(dict(phase_cpu))
            split_cpu_s.append(cpu - inside[1])
        elif t >= warmup:
            tick_s.append(elapsed)
            model_s.append(inside[0])
            host_cpu_s.append(cpu - inside[1])
    tick, model_ms = np.array(tick_s) * 1000, np.array(model_s) * 1000
    host, host_cpu = tick - model_ms, np.array(host_cpu_s) * 1000
    mean_phase = {p: float(np.mean([ph[p] for ph in phases])) * 1000 for p in PHASES}
    return {
        "conversations": n,
        "forward": forward,
        "ticks": ticks,
        "warmup_ticks": warmup,
        "tick_ms_p50": float(np.percentile(tick, 50)),
        "model_ms_p50": float(np.percentile(model_ms, 50)),
        "host_ms_p50": float(np.percentile(host, 50)),
        "host_ms_p95": float(np.percentile(host, 95)),
        "host_cpu_ms_p50": float(np.percentile(host_cpu, 50)),
        "host_cpu_ms_p95": float(np.percentile(host_cpu, 95)),
        "host_share": float(np.median(host / tick)),
        "host_ms_per_conversation": float(np.percentile(host, 50)) / n,
        **{f"cpu_ms_{p}": v for p, v in mean_phase.items()},
        "cpu_ms_other": float(np.mean(split_cpu_s)) * 1000 - sum(mean_phase.values()),  # (and the phases' clocks)
    }


def main(argv: list[str] | None = None) -> None:
    p = parser("host-overhead", __doc__.splitlines()[0])
    p.add_argument("--ticks", type=int, default=20, help="ticks measured at each N (then as many that time the phases)")
    p.add_argument("--warmup", type=int, default=3, help="ticks run before those, at each N")
    args = p.parse_args(argv)
    levels = [16, 64] if args.quick else [16, 64, 256, 512]
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0)
    env, rows = environment(), []
    for forward in FORWARDS:
        for n in levels:
            rows.append(
                {
                    "bench": "host-overhead",
                    "preset": "tiny",
                    **measure(model, n, args.ticks, forward, args.warmup),
                    **env,
                }
            )
            print(rows[-1], flush=True)
            write_json(args.json, rows)
    columns = [
        ("conversations", "N"),
        ("forward", "forward"),
        ("tick_ms_p50", "tick p50 ms"),
        ("model_ms_p50", "forward + sampling p50 ms"),
        ("host_ms_p50", "host p50 ms"),
        ("host_ms_p95", "host p95 ms"),
        ("host_cpu_ms_p50", "host CPU p50 ms"),
        ("host_cpu_ms_p95", "host CPU p95 ms"),
        ("host_share", "host share"),
        ("host_ms_per_conversation", "host ms per conversation"),
    ]
    title = (
        f"Engine host work per tick, {FRAMES_PER_TICK}-frame ticks, N duplex conversations (tiny, codec-free, "
        f"{env['torch_threads']} torch threads, {args.ticks} ticks each after {args.warmup})"
    )
    tables = print_table(title, rows, columns)
    phase_columns = [("conversations", "N"), ("forward", "forward")] + [(f"cpu_ms_{p}", p) for p in [*PHASES, "other"]]
    title = "Host CPU per tick by phase, ms (mean of the ticks that time them; other: the rest, and their clocks)"
    tables += print_table(title, rows, phase_columns)
    _plot(rows, args.plot)
    save_outputs(args, rows, tables)


def _plot(rows: list[dict], path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    model = [r for r in rows if r["forward"] == "model"]
    n = [r["conversations"] for r in model]
    ax.plot(n, [r["host_ms_p50"] for r in model], "o-", label="host p50")
    ax.plot(n, [r["host_ms_p95"] for r in model], "o--", label="host p95")
    ax.plot(n, [r["host_cpu_ms_p50"] for r in model], "^-", label="host p50, the thread's CPU time")
    ax.plot(n, [r["model_ms_p50"] for r in model], "s-", label="forward + sampling p50")
    stand_in = [r for r in rows if r["forward"] == "stand-in"]
    n = [r["conversations"] for r in stand_in]
    ax.plot(n, [r["host_cpu_ms_p50"] for r in stand_in], "v-", label="host CPU p50, a stand-in forward")
    ax.axhline(3.0, color="gray", linestyle=":", label="target: host p50 3 ms at N = 512")
    ax.set(xscale="log", yscale="log", xlabel="conversations", ylabel="ms per tick", title="Engine host work per tick")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
