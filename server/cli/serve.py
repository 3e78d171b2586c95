"""`s2s serve`: the websocket server, in one process or beside front-end processes."""

from __future__ import annotations

import argparse
import sys

import uvloop

from server.app import ChatServer, serve_until_sigterm
from server.cli.engine_args import engine_of
from server.cli.options import server_options
from server.frontends.processes import default_frontends, serve_with_frontends
from server.malloc_heap import cap_malloc_arenas, trim_heap_every
from server.ports import PortInUse, check_free


def run(args: argparse.Namespace) -> None:
    cap_malloc_arenas()  # before the engine's and the server's threads
    options = server_options(args)
    frontends = default_frontends() if args.frontends is None else args.frontends
    if frontends < 0:
        raise SystemExit(f"--frontends must be 0 or more, got {frontends}")
    try:
        check_free(options.host, options.port)  # before the model loads: a taken port is told at once
        engine = engine_of(args, frontends)[0]
        trim_heap_every(idle=lambda: not engine.sessions)
        if frontends:
            sys.exit(serve_with_frontends(engine, options, frontends))
        uvloop.run(serve_until_sigterm(ChatServer(engine, options)))
    except PortInUse as e:
        raise SystemExit(f"s2s serve: {e}") from None
