"""The cluster's control socket (a Unix socket in its run folder, the owner's alone): `s2s cluster add|drain|status`
ask the process that owns the replicas. One JSON request a connection; the answer is JSON lines, `{"progress":
TEXT}` while it works, then `{"result": ...}` or `{"error": TEXT}`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

from server.cluster.manager import Cluster


async def serve_control(cluster: Cluster, path: Path) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(message: dict) -> None:
            writer.write(json.dumps(message).encode() + b"\n")
            await writer.drain()

        async def tell(text: str) -> None:
            await send({"progress": text})

        try:
            request = json.loads(await reader.readline())
            command = request.get("command")
            if command == "status":
                result = await asyncio.to_thread(cluster.status)
            elif command == "add":
                result = await cluster.add(tell)
            elif command == "drain":
                result = await cluster.drain(str(request.get("replica")), float(request.get("timeout_s", 600)), tell)
            else:
                raise ValueError(f"unknown command {command!r}: status, add or drain")
            await send({"result": result})
        except (ValueError, RuntimeError, OSError) as e:
            await send({"error": str(e)})
        finally:
            writer.close()

    server = await asyncio.start_unix_server(answer, path)
    path.chmod(0o600)
    return server


def ask(path: Path, request: dict) -> Iterator[dict]:
    """The cluster's answers to `request`, as they come."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise RuntimeError(f"no cluster is running with its control socket at {path}") from None
        s.sendall(json.dumps(request).encode() + b"\n")
        with s.makefile() as lines:
            for line in lines:
                yield json.loads(line)
