"""`s2s serve` in a child process, for tests and benchmarks that must not share a GIL with their clients."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
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
        preexec_fn: Callable[[], None] | None = None,
    ):
        self.command = ["-m", module] if module else ["-m", "server.cli", subcommand]
        self.args, self.timeout_s = [str(a) for a in args], timeout_s
        self.lines: deque[str] = deque(maxlen=10_000)  # the last of them: a replica of `s2s cluster` runs for days
        self.log = log  # where every line goes too (`s2s cluster`'s replicas)
        self.preexec_fn = preexec_fn  # run in the child before exec (`s2s cluster`'s: it dies with the cluster)
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._url: list[str] = []

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> str:
        self.start()
        return self.serving()

    def start(self) -> None:
        """Start the process, in the calling thread (a `preexec_fn` may tie the child to it), and read its output."""
        cmd = [sys.executable, "-u", *self.command, "--port", "0", *self.args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=self.preexec_fn
        )
        log = open(self.log, "a", buffering=1) if self.log else None  # noqa: SIM115 (closed when the output ends)

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if log:
                    log.write(line)
                if line.startswith("serving ") and not self._url:
                    self._url.append(line.split()[1].removesuffix("/api/chat"))
                    self._ready.set()
            self._ready.set()  # the process ended
            if log:
                log.close()

        threading.Thread(target=read, daemon=True).start()

    def serving(self) -> str:
        """Wait for the "serving" line; the server's ws:// URL (`RuntimeError` with its output if it ended first)."""
        if not self._ready.wait(self.timeout_s) or not self._url:
            self.__exit__()
            raise RuntimeError(f"{' '.join(self.command[1:])} did not start: {self.output}")
        return self._url[0]

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
