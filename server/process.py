"""`s2s serve` in a child process, for tests and benchmarks that must not share a GIL with their clients."""

from __future__ import annotations

import subprocess
import sys
import threading


class ServerProcess:
    """Start `s2s serve ARGS --port 0` (or `python -m MODULE ARGS --port 0`, another server on
    `server.cli.serve_until_sigterm`), wait for its "serving" line, give its ws:// URL; stop it on exit.

    The server's output is kept (`output`) so a failure can show it.
    """

    def __init__(self, *args: str, module: str | None = None, timeout_s: float = 120.0):
        self.command = ["-m", module] if module else ["-m", "server.cli", "serve"]
        self.args, self.timeout_s = [str(a) for a in args], timeout_s
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> str:
        cmd = [sys.executable, "-u", *self.command, "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        url: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("serving ") and not url:
                    url.append(line.split()[1].removesuffix("/api/chat"))
                    ready.set()
            ready.set()  # the process ended

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
