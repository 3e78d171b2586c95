"""The cluster's control socket (a Unix socket in its run folder, the owner's alone): `s2s cluster add|drain|status`
ask the process that owns the replicas. One JSON request a connection; the answer is JSON lines, `{"progress":
TEXT}` while it works, then `{"result": ...}` or `{"error": TEXT}`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

from server.cluster.manager import Cluster


async def serve_control(cluster: Cluster, path: Path) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(message: dict) -> None:
            """To the asker, if it is still there: a command goes on to its end when the asker goes (a drain
            half done would leave its replica taking nothing and never stopped)."""
            with contextlib.suppress(OSError):
                writer.write(json.dumps(message).encode() + b"\n")
                await writer.drain()

        async def tell(text: str) -> None:
            await send({"progress": text})

        try:
            await send({"result": await run(await reader.readline(), tell)})
        except Exception as e:  # any failure is the asker's answer, never the end of the cluster
            await send({"error": str(e) or type(e).__name__})
        finally:
            writer.close()

    async def run(line: bytes, tell) -> dict:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
        command = request.get("command")
        if command == "status":
            return await asyncio.to_thread(cluster.status)
        if command == "add":
            return await cluster.add(tell)
        if command == "drain":
            return await cluster.drain(str(request.get("replica")), float(request.get("timeout_s", 600)), tell)
        raise ValueError(f"unknown command {command!r}: status, add or drain")

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
            answered = False
            for line in lines:
                answer = json.loads(line)
                answered = answered or "progress" not in answer
                yield answer
        if not answered:
            raise RuntimeError("the cluster closed without an answer (see its output)")
