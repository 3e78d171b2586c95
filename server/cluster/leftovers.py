"""What an earlier cluster may have left, found before a new one loads any model: a socket in its run folder that
nobody answers (the control socket, HAProxy's, a replica slot's, after a SIGKILL) is removed; one that answers refuses
the start with what to do. A port another process listens on refuses it too (`server.ports.check_free`, in
`Cluster.start`): never a cluster that says it serves beside another's HAProxy."""

from __future__ import annotations

import socket
from pathlib import Path


def clear_run_dir(run_dir: Path) -> None:
    """Remove the sockets in `run_dir` that nobody answers; `RuntimeError` if one answers."""
    for path in sorted(run_dir.glob("*.sock")):
        if _answers(path):
            raise RuntimeError(
                f"a cluster still runs from {run_dir} ({path.name} answers): stop it, or give this one another "
                "--port or --run-dir"
            )
        path.unlink()


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True
