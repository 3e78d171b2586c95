"""Hostile clients and careless operators: each finding of issues 25 and 45, measured on the code before and this
checkout side by side, in one run.

    s2s bench hostile --before PATH [--quick] [--model DIR | --preset NAME] [--json PATH] [--plot PATH]

Each tree's servers run in child processes: this venv's Python with the tree first on its path (`--before`: a
worktree of an older commit). The speech server is `s2s serve --admission-headroom 1000` (none is refused: what is
measured is what a client does to the others) on the weights a user runs: by default each tree's shipped codec and
echo model (what its `s2s serve` serves with no flags), or `--model DIR`, or `--preset NAME` (seeded weights; `tiny`
is what the figures before issue 48 ran); each row's `model` says which. The cascade is `python -m
bench.cascade.serve`, whose text decoder is a preset's: `--preset NAME`'s, else tiny's beside `--model DIR` or this
checkout's shipped echo model. The operators' probes start servers of their own, on `--preset tiny`. Per tree, each on
a fresh server:
- hostile input (`bench/hostile/input.py`, issue 25): out-of-range settings, a foreign `Origin`, the `Server`
  header, one 1 MiB message beside a duplex stream, Opus garbage, slots taken by bad seeds, the cascade's token;
- a VAD flood (`bench/hostile/churn.py`): a Realtime client alternating two `server_vad` settings with 480-byte
  appends at 100 messages a second for 8 s, beside a healthy duplex client streaming 8 s of speech in real time;
  then one that sends appends as fast as it can and drops its socket: how long its conversation outlives it;
- churn (`bench/hostile/churn.py`): after one 12 s duplex conversation, Moshi-protocol conversations that open,
  send 2 s of speech, hear their first reply audio and close, two at a time, and Realtime ones that append, commit
  and hear their first response audio: the server's RSS growth per conversation after a warm-up (glibc maps blocks
  from 64 KiB up on their own there, so that what a closed conversation keeps shows in hundreds of cycles, not
  only in the thousands where reuse of freed space hides it);
- operators (`bench/hostile/operators.py`): `--frontends 2` started on a port with sockets left in TIME-WAIT by a
  busy single-process run; `s2s serve` and `--frontends 2` on a port another process listens on; `s2s cluster
  --replicas 1` with a per-client limit of 1, reached straight at its replica with spoofed `X-Forwarded-For`, then
  SIGKILLed and started again on its port.

`--quick`: no stall, 20 Opus messages, 150 churn cycles (not 600), 500 busy requests (not 5,000).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

from bench.common import (
    add_device_args,
    add_model_args,
    device_server_args,
    environment,
    model_choice,
    parser,
    print_table,
    save_outputs,
)
from bench.hostile.churn import backlog, churn, vad_flood
from bench.hostile.input import TOKEN, cascade, inputs
from bench.hostile.operators import operators
from s2s.models.shipped import shipped
from server.process import ServerProcess

HERE = Path(__file__).resolve().parents[1]


def revision(tree: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()


def measure(tree: Path, serve_args: list[str], cascade_args: list[str], quick: bool) -> dict[str, object]:
    """Every finding against servers from `tree`: `s2s serve SERVE_ARGS`, the cascade's server with CASCADE_ARGS."""
    os.environ.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")  # the tree's code first, not the working directory
    with (server := ServerProcess(*serve_args, timeout_s=600)) as url:  # a first use builds the C++ kernel
        values = asyncio.run(inputs(url, server.proc.pid, quick))
    with (server := ServerProcess(*serve_args, timeout_s=600)) as url:
        values.update(asyncio.run(vad_flood(url, server.proc.pid)))
        values.update(asyncio.run(backlog(url)))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # (churn's server: see `churn`)
    with (server := ServerProcess(*serve_args, timeout_s=600)) as url:
        values.update(asyncio.run(churn(url, server.proc.pid, quick)))
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    with ServerProcess(*cascade_args, "--token", TOKEN, module="bench.cascade.serve", timeout_s=600) as url:
        values.update(asyncio.run(cascade(url)))
    values.update(operators(quick))
    return values


def main() -> None:
    p = parser("hostile", __doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a worktree of the code before, measured first")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the servers")
    add_model_args(p)
    add_device_args(p)
    args = p.parse_args()
    choice = model_choice(args)
    # admission's cost model learns on this loaded machine and may refuse a probe's second conversation: what is
    # measured here is what each conversation does to the others, not admission
    common = ["--threads", str(args.threads), "--admission-headroom", "1000", *device_server_args(args)]
    serve_args = [*choice.serve_args(), *common]
    # the cascade's text decoder is a preset's (tiny but for --preset); its speech, the model folder's or the shipped
    cascade_args = ["--preset", choice.preset or "tiny", *common]
    if choice.preset is None:
        cascade_args += ["--model", str(choice.folder or shipped("model"))]
    trees = {"before": args.before.resolve(), "after": HERE}
    started = time.monotonic()
    values = {name: measure(tree, serve_args, cascade_args, args.quick) for name, tree in trees.items()}
    revisions = {name: revision(tree) for name, tree in trees.items()}
    env = {"revisions": revisions, "model": choice.label, "preset": choice.preset, **environment()}
    rows = [
        {"bench": "hostile", "finding": k, "before": values["before"].get(k, "-"), "after": v, **env}
        for k, v in values["after"].items()
    ]
    title = f"Hostile clients and operators, {choice.label}: {revisions['before']} (before) against "
    title += f"{revisions['after']} (after), {time.monotonic() - started:.0f} s"
    tables = print_table(title, rows, [("finding", "finding"), ("before", "before"), ("after", "after")])
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
