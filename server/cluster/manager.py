"""Cluster: N `s2s serve` replicas behind one HAProxy, owned by one process (`s2s cluster`), which adds replicas,
drains them and reports on them when `s2s cluster add|drain|status` asks (`server/cluster/control.py`). Its children
die with it (`server/cluster/parent_death.py`).

A replica is a slot of HAProxy's configuration (`r1` ... `rM`, in both backends), which HAProxy reaches by the slot's
Unix socket in the run folder (`haproxy.slot_socket`: the replica's `--proxy-socket`, where alone it believes
X-Forwarded-For); its port, on loopback, serves its /metrics and whoever connects straight to it, each counted by
its own address. Free slots are `disabled` servers: `add` starts a replica on a free slot's socket and sets it
ready; `drain` sets the slot to drain (HAProxy sends it nothing new, its live connections go on), tells the replica
(SIGUSR1: its health check and upgrades answer 503 from then), waits for its conversations to end (its /metrics),
stops it and puts the slot back in maintenance. No reload: HAProxy keeps every connection throughout."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from server.cluster import haproxy
from server.cluster.haproxy import RuntimeApi, Slot
from server.cluster.parent_death import die_with_parent
from server.ports import check_free, free_port
from server.process import ServerProcess
from server.scrape import scrape

Tell = Callable[[str], Awaitable[None]]  # a progress line for whoever asked


@dataclass
class Replica:
    name: str
    process: ServerProcess | None = None  # None: a free slot
    port: int | None = None
    draining: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.proc is not None and self.process.proc.poll() is None


@dataclass
class ClusterConfig:
    serve_args: list[str]  # `s2s serve` options every replica gets
    replicas: int = 3
    host: str = "127.0.0.1"
    port: int = 8998
    stats_port: int = 0  # HAProxy's /metrics (Prometheus) and /stats; 0: a free port
    max_replicas: int = 16  # HAProxy server slots (`s2s cluster add` fills a free one)
    balance: str = "voice"  # how conversations with a voice are placed: "voice" (consistent hash) or "roundrobin"
    balance_factor: int = 150  # no replica over this percent of the average load, among conversations with a voice
    run_dir: Path = field(default_factory=Path)  # HAProxy's config and admin socket, the control socket

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas must be 1 to --max-replicas ({self.max_replicas}), got {self.replicas}")
        if self.balance_factor <= 100:
            raise ValueError(f"the balance factor is a percent of the average load over 100, got {self.balance_factor}")


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.replicas = {f"r{i}": Replica(f"r{i}") for i in range(1, cfg.max_replicas + 1)}
        self.api = RuntimeApi(cfg.run_dir / "haproxy.sock")
        self.haproxy: subprocess.Popen | None = None
        self._slots = asyncio.Lock()  # held while slots change hands (not while a drain waits)

    async def start(self) -> None:
        """Start the replicas (together: each loads its model), then HAProxy; return once every replica is UP.
        On failure, what started is left for `stop`."""
        haproxy.haproxy_binary()  # fail before loading any model
        check_free(self.cfg.host, self.cfg.port)
        if self.cfg.stats_port:
            check_free("127.0.0.1", self.cfg.stats_port)
        first = [self.replicas[f"r{i}"] for i in range(1, self.cfg.replicas + 1)]
        started = await asyncio.gather(*(self._start_replica(r) for r in first), return_exceptions=True)
        if failed := next((e for e in started if isinstance(e, BaseException)), None):
            raise failed
        if not self.cfg.stats_port:
            self.cfg.stats_port = free_port()
        slots = [Slot(r.name, r.process is not None) for r in self.replicas.values()]
        c = self.cfg
        path = c.run_dir / "haproxy.cfg"
        path.write_text(haproxy.render(c.run_dir, c.host, c.port, c.stats_port, c.balance, c.balance_factor, slots))
        self.haproxy = haproxy.start(path)
        await self._wait_for_haproxy()
        for r in first:
            await self._wait_for(r.name, "UP")

    async def stop(self) -> None:
        if self.haproxy is not None:
            self.haproxy.terminate()
            await asyncio.to_thread(self.haproxy.wait)
        await asyncio.gather(*(asyncio.to_thread(r.process.__exit__) for r in self.replicas.values() if r.process))

    async def add(self, tell: Tell) -> dict:
        """Start one more replica in the slot of one that exited, else in a free slot, and put it in the pool."""
        async with self._slots:
            dead = [r for r in self.replicas.values() if r.process is not None and not r.alive() and not r.draining]
            free = [r for r in self.replicas.values() if r.process is None]
            if not dead + free:
                raise ValueError(f"every one of the {self.cfg.max_replicas} slots holds a replica (--max-replicas)")
            r = (dead + free)[0]
            if r.process is not None:
                await tell(f"{r.name} had exited (status {r.process.proc.returncode}): replacing it")
                r.process.__exit__()
                r.process = None
            await tell(f"starting {r.name}")
            try:
                await self._start_replica(r)
                self.api.on_every_backend("state ready", server=r.name)
                await self._wait_for(r.name, "UP")
            except BaseException:
                await self._free(r)
                raise
            return {"replica": r.name, "port": r.port}

    async def drain(self, name: str, timeout_s: float, tell: Tell) -> dict:
        """Drain `name`, wait up to `timeout_s` for its conversations to end, stop it; how many were cut (None if
        it exited meanwhile). Whatever happens while it waits, the slot ends free and in maintenance."""
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"the drain timeout must be 0 s or more, got {timeout_s}")
        async with self._slots:
            r = self.replicas.get(name)
            if r is None or not r.alive() or r.draining:
                serving = sorted(n for n, r in self.replicas.items() if r.alive() and not r.draining)
                raise ValueError(f"no serving replica {name!r}; serving: {serving}")
            r.draining = True
        started = time.monotonic()
        try:
            self.api.on_every_backend("state drain", server=name)
            r.process.proc.send_signal(signal.SIGUSR1)
            live = await self._live_conversations(r, started + timeout_s, tell)
        finally:
            async with self._slots:
                await self._free(r)
        return {"replica": name, "cut": live, "seconds": round(time.monotonic() - started, 2)}

    def status(self) -> dict:
        """Per replica: HAProxy's view (state, connections) and the replica's (conversations, pages, cache)."""
        states = self.api.servers()
        rows = []
        for r in self.replicas.values():
            process = r.process
            if process is None:
                continue
            row = {"replica": r.name, "port": r.port, "pid": process.proc.pid, **states[r.name]}
            row["state"] = row.pop("status")
            if not r.alive():
                row["state"] = f"exited ({row['state']})"
            else:
                with contextlib.suppress(OSError):  # it went meanwhile: its HAProxy state says so
                    row.update(replica_metrics(r.url))
            rows.append(row)
        return {"port": self.cfg.port, "stats_port": self.cfg.stats_port, "replicas": rows}

    async def _start_replica(self, r: Replica) -> None:
        """Start `r`'s replica on its slot's socket; return once it serves. Forked here, on the event loop's thread
        (the main one): a replica dies with the thread that forked it."""
        where = haproxy.slot_socket(self.cfg.run_dir, r.name)
        where.unlink(missing_ok=True)  # the slot's last replica's, which exited
        args = ["--replica-id", r.name, "--proxy-socket", str(where), *self.cfg.serve_args]
        log = self.cfg.run_dir / f"{r.name}.log"
        r.process, r.draining = ServerProcess(*args, log=log, preexec_fn=die_with_parent()), False
        r.process.start()  # `stop` can see it (and stop it) while it loads
        url = await asyncio.to_thread(r.process.serving)
        r.port = int(url.rsplit(":", 1)[1])

    async def _free(self, r: Replica) -> None:
        """Stop `r`'s replica, if any, and put its slot in maintenance, free for `add`."""
        if r.process is not None:
            await asyncio.to_thread(r.process.__exit__)
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.api.on_every_backend("state maint", server=r.name)
        r.process, r.port, r.draining = None, None, False

    async def _wait_for_haproxy(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.api.command("show info")
                return
            except OSError:
                if self.haproxy.poll() is not None or time.monotonic() > deadline:
                    status = self.haproxy.poll()
                    raise RuntimeError(f"HAProxy did not start (exit status {status}); see its output above") from None
                await asyncio.sleep(0.05)

    async def _wait_for(self, name: str, status: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (now := self.api.servers()[name]["status"]) != status:
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy has {name} {now}, not {status}, after {timeout_s:g} s")
            await asyncio.sleep(0.1)

    async def _live_conversations(self, r: Replica, deadline: float, tell: Tell) -> int | None:
        """Wait until the draining replica `r` holds no conversation (seen twice, half a second apart: one that was
        being opened as the drain began is counted by then), or `deadline`; the conversations left, or None if the
        replica exited (or stopped answering) meanwhile."""
        zeros, said, live = 0, None, None
        while True:
            if not r.alive():
                return None
            try:
                metrics = await asyncio.to_thread(scrape, r.url, 2.0)
                live = int(metrics["s2s_conversations"]) if metrics.get("s2s_draining") == 1 else live
            except OSError:
                pass  # busy, or gone: the next pass sees which
            zeros = zeros + 1 if live == 0 else 0
            if zeros == 2 or time.monotonic() > deadline:
                return live
            if live is not None and live != said:
                await tell(f"{r.name}: {live} conversations live")
                said = live
            await asyncio.sleep(0.5)


def replica_metrics(url: str) -> dict:
    """A replica's conversations, K/V pages in use, prefix-cache hit rate and whether it drains, from /metrics."""
    m = scrape(url, timeout_s=2)
    pages = {s: m[f's2s_kv_pages{{state="{s}"}}'] for s in ("free", "cached_evictable", "cached_locked", "private")}
    hit, missed = m["s2s_cache_hit_steps_total"], m["s2s_cache_missed_steps_total"]
    return {
        "conversations": int(m["s2s_conversations"]),
        "pages_used": int(sum(pages.values()) - pages["free"]),
        "pages": int(sum(pages.values())),
        "cache_hit_rate": round(hit / (hit + missed), 3) if hit + missed else None,
        "draining": bool(m["s2s_draining"]),
    }
