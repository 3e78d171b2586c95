"""HAProxy for `s2s cluster`: its configuration (the template `haproxy.cfg` beside this file), the process, and its
runtime API (the admin socket), through which replicas join, drain and leave without a reload.

HAProxy reaches each replica slot by a Unix socket in the cluster's run folder (`slot_socket`), the one listener
where a replica believes X-Forwarded-For: no other user can reach it, where any local process can reach a port."""

from __future__ import annotations

import csv
import io
import shutil
import socket
import string
import subprocess
from dataclasses import dataclass
from pathlib import Path

from server.cluster.parent_death import die_with_parent

TEMPLATE = Path(__file__).with_name("haproxy.cfg")
BACKENDS = ("by_voice", "by_load")  # every replica slot is a server in both
BALANCES = ("voice", "roundrobin")


@dataclass
class Slot:
    """A server line in both backends: a replica's Unix socket (`slot_socket`), disabled while the slot is free."""

    name: str
    serving: bool


def slot_socket(run_dir: Path, name: str) -> Path:
    """Where HAProxy reaches slot `name`'s replica (its `--proxy-socket`)."""
    return run_dir / f"{name}.sock"


def haproxy_binary() -> str:
    """The `haproxy` executable; `RuntimeError` with what to do where it is missing."""
    found = shutil.which("haproxy")
    if found is None:
        raise RuntimeError("haproxy is not installed: apt-get install haproxy (scripts/setup.sh does, as root)")
    return found


def render(
    run_dir: Path, host: str, port: int, stats_port: int, balance: str, balance_factor: int, slots: list[Slot]
) -> str:
    """The configuration for these replica slots; `balance`: "voice" or "roundrobin", for conversations with one."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    by_voice = ["balance url_param voice", "hash-type consistent", f"hash-balance-factor {balance_factor}"]

    def line(slot: Slot, options: str) -> str:
        where = f"unix@{slot_socket(run_dir, slot.name)}"
        return f"    server {slot.name} {where} {options}{'' if slot.serving else ' disabled'}"

    return string.Template(TEMPLATE.read_text()).substitute(
        run_dir=run_dir,
        host=host,
        port=port,
        stats_port=stats_port,
        voice_balance="\n".join(f"    {line}" for line in (by_voice if balance == "voice" else ["balance roundrobin"])),
        retries=len(slots),
        # weight 100 (of 256), not 1: a server's points on the hash ring scale with its weight, and more points
        # spread the voices more evenly
        voice_servers="\n".join(line(s, "weight 100 check inter 500ms fall 1 rise 1") for s in slots),
        load_servers="\n".join(line(s, f"track by_voice/{s.name}") for s in slots),
    )


def start(config: Path) -> subprocess.Popen:
    """HAProxy in the foreground (`-db`: one process, which never forks away), as a child that dies with this
    process; its config is checked first (`ValueError` with HAProxy's words)."""
    binary = haproxy_binary()
    check = subprocess.run([binary, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
    if check.returncode:
        raise ValueError(f"bad HAProxy config {config}: {check.stdout}{check.stderr}")
    return subprocess.Popen([binary, "-db", "-f", str(config)], preexec_fn=die_with_parent())


class RuntimeApi:
    """HAProxy's admin socket: one command per connection."""

    def __init__(self, path: Path):
        self.path = path

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.path))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def on_every_backend(self, *actions: str, server: str) -> None:
        """`set server BACKEND/SERVER ACTION` in each backend, in order; `RuntimeError` with HAProxy's words if one
        fails (a state change answers nothing)."""
        for action in actions:
            for backend in BACKENDS:
                line = f"set server {backend}/{server} {action}"
                answer = self.command(line).strip()
                if answer:
                    raise RuntimeError(f"HAProxy: {line!r}: {answer}")

    def servers(self) -> dict[str, dict]:
        """Each slot's `status` (by_voice's: UP, DOWN, DRAIN, MAINT, ...) and `connections` (now, both backends)."""
        rows = list(csv.DictReader(io.StringIO(self.command("show stat").removeprefix("# "))))
        servers = {r["svname"]: {"status": r["status"], "connections": 0} for r in rows if r["pxname"] == "by_voice"}
        for r in rows:
            if r["pxname"] in BACKENDS and r["svname"] in servers:
                servers[r["svname"]]["connections"] += int(r["scur"] or 0)
        return {name: s for name, s in servers.items() if name not in ("FRONTEND", "BACKEND")}
