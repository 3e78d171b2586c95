"""`s2s serve` in a child process, for tests and benchmarks that must not share a GIL with their clients."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from pathlib import Path


class ServerProcess:
    """Start `s2s serve --port 0 ARGS` (or `s2s SUBCOMMAND`, or `python -m MODULE --port 0 ARGS`, another server on
    `server.app.serve_until_sigterm`), wait for its "serving" line, give its ws:// URL; stop it on exit. A `--port`
    in ARGS wins over 0.

    The server's output is kept (`output`) so a failure can show it.
    """

    def __init__(
        self,
        *args: str,
        module: str | None = None,
        subcommand: str = "serve",
        timeout_s: float = 120.0,
        log: Path | None = None,
    ):
        self.command = ["-m", module] if module else ["-m", "server.cli", subcommand]
        self.args, self.timeout_s = [str(a) for a in args], timeout_s
        self.lines: deque[str] = deque(maxlen=10_000)  # the last of them: a replica of `s2s cluster` runs for days
        self.log = log  # where every line goes too (`s2s cluster`'s replicas)
        self.proc: subprocess.Popen | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> str:
        cmd = [sys.executable, "-u", *self.command, "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        url: list[str] = []

        log = open(self.log, "a", buffering=1) if self.log else None  # noqa: SIM115 (closed when the output ends)

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if log:
                    log.write(line)
                if line.startswith("serving ") and not url:
                    url.append(line.split()[1].removesuffix("/api/chat"))
                    ready.set()
            ready.set()  # the process ended
            if log:
                log.close()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(self.timeout_s) or not url:
            self.__exit__()
            raise RuntimeError(f"{' '.join(self.command[1:])} did not start: {self.output}")
        return url[0]

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
