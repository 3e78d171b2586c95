"""`s2s cluster`: run replicas behind HAProxy (`s2s cluster --replicas N --port P [serve options]`), and ask a
running one to `status`, `add` a replica, or `drain REPLICA [--timeout S]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import stat
import tempfile
from pathlib import Path

from server.cli.options import add_serve_args
from server.cluster import leftovers
from server.cluster.control import ask, serve_control
from server.cluster.manager import Cluster, ClusterConfig

COMMANDS = ("status", "add", "drain")


def run_dir_of(port: int) -> Path:
    """The run folder of the cluster on `port`: in this user's runtime folder, else in the temporary folder under
    this user's id."""
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / f"s2s-cluster-{port}"
    return Path(tempfile.gettempdir()) / f"s2s-cluster-{os.getuid()}-{port}"


def own_folder(path: Path) -> None:
    """Make `path` (mode 700), or check that it is a folder of this user's that nobody else can use: the cluster
    writes HAProxy's config there and listens on sockets in it."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise RuntimeError(
                f"{path} is not a folder of this user's that only it can use (mode 700): remove it or choose another "
                "--run-dir"
            ) from None


def _where(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8998, help="the cluster's port (names its run folder)")
    p.add_argument("--run-dir", type=Path, default=None, help="the cluster's run folder (default: by --port)")


def main(argv: list[str]) -> None:
    if argv and argv[0] in COMMANDS:
        command(argv[0], argv[1:])
    else:
        run(argv)


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="s2s cluster",
        description="N `s2s serve` replicas behind HAProxy; the other options are `s2s serve`'s, for every replica. "
        "Then: s2s cluster status | add | drain REPLICA",
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1", help="HAProxy's address (the replicas listen on 127.0.0.1)")
    _where(p)
    p.add_argument("--max-replicas", type=int, default=16, help="replica slots in HAProxy, for `s2s cluster add`")
    p.add_argument(
        "--balance",
        default="voice",
        choices=["voice", "roundrobin"],
        help="conversations with ?voice=: consistent hashing on it, bounded by --balance-factor; or round robin",
    )
    p.add_argument("--balance-factor", type=int, default=150, help="no replica over this %% of the average load")
    p.add_argument("--stats-port", type=int, default=0, help="HAProxy's /metrics and /stats (default: a free port)")
    args, serve_args = p.parse_known_args(argv)
    serve = argparse.ArgumentParser(prog="s2s cluster (serve options)")
    add_serve_args(serve)
    taken = ("--port", "--host", "--replica-id", "--forwarded-allow-ips", "--proxy-socket")
    if any(a.split("=")[0] in taken for a in serve_args):
        p.error(f"{', '.join(taken)} are the cluster's to set for its replicas")
    if any(a.split("=")[0] in ("--ssl-certfile", "--ssl-keyfile") for a in serve_args):
        p.error("replicas speak plain HTTP to HAProxy on loopback: put TLS in front of the cluster's port")
    serve.parse_args(serve_args)  # a bad option fails here, not in every replica

    run_dir = args.run_dir or run_dir_of(args.port)
    try:
        cfg = ClusterConfig(
            serve_args,
            replicas=args.replicas,
            host=args.host,
            port=args.port,
            stats_port=args.stats_port,
            max_replicas=args.max_replicas,
            balance=args.balance,
            balance_factor=args.balance_factor,
            run_dir=run_dir,
        )
    except ValueError as e:
        p.error(str(e))
    try:
        asyncio.run(_run(cfg))
    except RuntimeError as e:
        raise SystemExit(f"s2s cluster: {e}") from None


async def _run(cfg) -> None:
    own_folder(cfg.run_dir)
    leftovers.clear_run_dir(cfg.run_dir)
    control = cfg.run_dir / "control.sock"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    cluster = Cluster(cfg)
    try:
        if not await _unless_stopped(cluster.start(), stop):
            return
        server = await serve_control(cluster, control)
        names = " ".join(f"r{i}" for i in range(1, cfg.replicas + 1))
        print(
            f"serving ws://{cfg.host}:{cfg.port}/api/chat  (and /v1/realtime; HAProxy before replicas {names}; its "
            f"metrics at http://127.0.0.1:{cfg.stats_port}/metrics; s2s cluster status --port {cfg.port})",
            flush=True,
        )
        if not await _unless_stopped(asyncio.to_thread(cluster.haproxy.wait), stop):
            server.close()
            return
        raise RuntimeError(f"HAProxy exited (status {cluster.haproxy.returncode}): the cluster stops")
    finally:
        control.unlink(missing_ok=True)
        await cluster.stop()


async def _unless_stopped(work, stop: asyncio.Event) -> bool:
    """Run `work` until it ends (True) or `stop` is set (False: it is cancelled)."""
    done, pending = await asyncio.wait(
        [task := asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    for p in pending:
        p.cancel()
    if task in done:
        task.result()  # its exception, if any
        return True
    return False


def _timeout(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a number of seconds, 0 or more, not {text!r}")
    return value


def command(name: str, argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=f"s2s cluster {name}")
    _where(p)
    if name == "drain":
        p.add_argument("replica", help="a replica's id (r1, r2, ...: s2s cluster status)")
        p.add_argument("--timeout", type=_timeout, default=600.0, help="seconds to wait for its conversations to end")
    if name == "status":
        p.add_argument("--json", action="store_true", help="print the status as JSON")
    args = p.parse_args(argv)
    request = {"command": name}
    if name == "drain":
        request.update(replica=args.replica, timeout_s=args.timeout)
    try:
        for answer in ask((args.run_dir or run_dir_of(args.port)) / "control.sock", request):
            if "progress" in answer:
                print(answer["progress"], flush=True)
            elif "error" in answer:
                raise SystemExit(f"s2s cluster {name}: {answer['error']}")
            else:
                _print_result(name, answer["result"], getattr(args, "json", False))
    except RuntimeError as e:
        raise SystemExit(f"s2s cluster {name}: {e}") from None


def _print_result(name: str, result: dict, as_json: bool) -> None:
    if name == "add":
        print(f"{result['replica']} is serving on port {result['port']} and in the pool")
    elif name == "drain":
        cut = result["cut"]
        if cut is None:
            said = "it exited or stopped answering while it drained: what it held was cut"
        else:
            said = f"{cut} live conversations were cut (the timeout passed)" if cut else "no conversation was cut"
        print(f"{result['replica']} drained and stopped after {result['seconds']} s; {said}")
    elif as_json:
        print(json.dumps(result, indent=2))
    else:
        columns = ("replica", "port", "state", "connections", "conversations", "pages_used", "pages", "cache_hit_rate")
        rows = [[str(r.get(c, "")) for c in columns] for r in result["replicas"]]
        widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]
        for row in [list(columns), *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        print(f"HAProxy metrics: http://127.0.0.1:{result['stats_port']}/metrics")
