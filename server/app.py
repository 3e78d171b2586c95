"""ChatServer: the websocket protocols and plain HTTP (/healthz, /metrics, the web page at / with its files under
/web/, and /api/voices for its settings) on one port.

Each websocket path is a protocol on the connection core (`server/connection.py`): /api/chat is Moshi's
(`server/moshi/endpoint.py`), /v1/realtime OpenAI's Realtime API (`server/realtime/`), one conversation in the engine
per connection. Bad input gets an error message or is dropped, never a crash and never an effect on another
connection; a connection that goes away at any moment closes its conversation, which frees its pages. Who may
connect is decided in one place, `refusal`, for every protocol and for the servers built on this one (the cascade);
how many conversations one client may hold at once, by one `PerClient` for the whole server.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import itertools
import json
import os
import signal
import socket
import ssl
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString
from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from s2s import SamplingParams
from s2s.engine.metrics import TICK_BUCKETS
from server.connection import Endpoint, Limits, PerClient, serve_connection
from server.gc_pause import freeze_startup_heap
from server.moshi.endpoint import MoshiEndpoint
from server.ports import PortInUse
from server.realtime import RealtimeEndpoint
from server.turn_metrics import TurnMetrics
from server.vad.config import VadConfig
from server.vad.turn_gate import TurnGate

if TYPE_CHECKING:
    from s2s import Engine
    from server.frontends.engine_client import EngineClient

WEB_DIR = Path(__file__).parent / "web"
WEB_FILES = {  # the page's files and their types
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "opus.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8998
    token: str | None = None  # required on every websocket, as ?token= or `Authorization: Bearer`; None: no token
    allowed_origins: list[str] = field(default_factory=list)  # browser origins besides the server's own
    max_message_bytes: int = 1 << 20
    limits: Limits = field(default_factory=Limits)  # back-pressure on each connection, what one client may hold
    vad: VadConfig = field(default_factory=VadConfig)  # turn mode endpointing
    handshake_timeout_s: float = 10.0  # a connection whose HTTP request and upgrade take longer is cut
    served_model_name: str | None = None  # the one `model` a Realtime client may ask for; None: any
    ssl_certfile: Path | None = None  # with `ssl_keyfile`: https and wss (a browser elsewhere needs it for its mic)
    ssl_keyfile: Path | None = None
    replica_id: str | None = None  # told to each client at open (`s2s cluster`'s placement); None: not told
    forwarded_allow_ips: list[str] = field(default_factory=list)  # proxies whose X-Forwarded-For names the client
    # a bound Unix socket (`proxy_listener`) for the proxy in front (`s2s cluster`'s HAProxy), served beside the port
    # (by every front end: it travels to them with these options); the one listener whose X-Forwarded-For is believed
    # without `forwarded_allow_ips` (`PerClient`)
    proxy_listener: socket.socket | None = None

    def __post_init__(self) -> None:
        if self.token == "":  # would otherwise read as "no token": authentication off, silently
            raise ValueError("token must not be empty: leave it out to serve without one")
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake timeout must be over 0 s, got {self.handshake_timeout_s}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both a certificate file and a key file")
        for path in (self.ssl_certfile, self.ssl_keyfile):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"no such file: {path}")

    def tls(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None (plain http and ws)."""
        if self.ssl_certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return context


def refusal(request: Request, options: ServerOptions) -> tuple[HTTPStatus, str] | None:
    """Why a websocket request may not connect, or None. The token, when the server has one (as `?token=`, or as
    `Authorization: Bearer`, as OpenAI's SDKs send it), is compared in constant time. A browser (the only client that
    sends `Origin`) must come from the server's own origin or one of `allowed_origins`: otherwise any page a visitor
    opens could hold a conversation in their name (cross-site websocket hijacking). Clients without `Origin` are not
    browsers, and are let in."""
    if options.token is not None:
        given = urllib.parse.parse_qs(request.path.partition("?")[2]).get("token", [""])[0]
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        given = given or (bearer.strip() if scheme.lower() == "bearer" else "")
        if not hmac.compare_digest(given.encode(), options.token.encode()):
            return HTTPStatus.UNAUTHORIZED, "a valid token is required\n"
    origin = request.headers.get("Origin")
    if origin is None or origin in options.allowed_origins:
        return None
    if urllib.parse.urlsplit(origin).netloc.lower() != request.headers.get("Host", "").lower():
        return HTTPStatus.FORBIDDEN, "origin not allowed\n"
    return None


class _EngineCollector:
    """Prometheus metrics from the engine's snapshot at scrape time (never its live state, which its thread owns),
    and whether the server drains."""

    def __init__(self, server: ChatServer):
        self.server = server

    def collect(self):
        yield GaugeMetricFamily(
            "s2s_draining", "1 while this replica takes no new conversation", value=self.server.draining
        )
        snapshot = self.server.engine.snapshot()
        cache, stats = snapshot.cache, snapshot.stats
        yield GaugeMetricFamily("s2s_conversations", "open conversations", value=snapshot.conversations)
        pages = GaugeMetricFamily("s2s_kv_pages", "K/V pages by state", labels=["state"])
        for state in ("free", "cached_evictable", "cached_locked", "private"):
            pages.add_metric([state], getattr(cache, state))
        yield pages
        yield CounterMetricFamily("s2s_refused", "conversations refused at admission", value=stats.refused)
        yield CounterMetricFamily("s2s_deadline_misses", "duplex frames sent late", value=stats.deadline_misses)
        yield CounterMetricFamily("s2s_ticks", "engine ticks", value=stats.ticks)
        yield CounterMetricFamily("s2s_busy_seconds", "time spent in ticks", value=stats.busy_seconds)
        yield CounterMetricFamily("s2s_preempted", "conversations preempted for K/V pages", value=stats.preempted)
        yield CounterMetricFamily("s2s_prefill_steps", "steps computed as prefill", value=stats.prefill_steps)
        yield CounterMetricFamily(
            "s2s_copied_steps",
            "steps whose K/V were copied from a shared page, not computed",
            value=stats.copied_steps,
        )
        yield CounterMetricFamily("s2s_cache_hit_steps", "prefix cache hit steps", value=cache.hit_steps)
        yield CounterMetricFamily("s2s_cache_missed_steps", "prefix cache missed steps", value=cache.missed_steps)
        phases = CounterMetricFamily("s2s_tick_phase_seconds", "time spent in ticks, by phase", labels=["phase"])
        for phase, seconds in stats.phase_seconds.items():
            phases.add_metric([phase], seconds)
        yield phases
        bounds = [*map(floatToGoString, TICK_BUCKETS), "+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(stats.tick_buckets), strict=True))
        yield HistogramMetricFamily("s2s_tick_seconds", "tick time", buckets=buckets, sum_value=stats.busy_seconds)
        yield CounterMetricFamily("s2s_kv_checks", "page integrity checks (run when idle)", value=stats.kv_checks)
        yield CounterMetricFamily(
            "s2s_kv_check_failures", "page integrity checks that failed", value=stats.kv_check_failures
        )


class ChatServer:
    def __init__(
        self,
        engine: Engine | EngineClient,
        options: ServerOptions | None = None,
        clients: PerClient | None = None,
        reuse_port: bool = False,
    ):
        """`engine`: this process's, or the engine core's (a front end of `s2s serve --frontends`, with the core's
        `clients` counts, listening with SO_REUSEPORT beside the others)."""
        self.engine, self.reuse_port = engine, reuse_port
        self.options = options or ServerOptions()
        self.registry = CollectorRegistry()  # what /metrics shows
        counters = self.registry  # where the server's own counters are kept
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # a front end: every front end's, summed from their files
            MultiProcessCollector(self.registry)
            counters = CollectorRegistry()
        self.gate = TurnGate(engine, self.options.vad, counters)  # every connection's VAD turn ends pass through it
        self.turns = TurnMetrics(counters)
        vad, name = self.options.vad, self.options.served_model_name
        self.endpoints: dict[str, Endpoint] = {
            "/api/chat": MoshiEndpoint(engine, vad, self.gate, self.turns),
            "/v1/realtime": RealtimeEndpoint(engine, vad, self.gate, name, self.turns),
        }
        self.registry.register(_EngineCollector(self))
        self.clients = clients or PerClient(
            self.options.limits.max_conversations_per_client, self.options.forwarded_allow_ips
        )
        self.draining = False
        self._server: Server | None = None
        self._proxy_server: Server | None = None  # on `options.proxy_listener`

    def drain(self) -> None:
        """Take no new conversation (the health check and every upgrade answer 503); the live ones go on."""
        self.draining = True

    async def start(self) -> int:
        """Start the engine thread and listen; returns the port (useful with port 0)."""
        self.engine.start()
        return await self._listen()

    async def _listen(self) -> int:
        settings = dict(
            process_request=self._http,
            max_size=self.options.max_message_bytes,
            open_timeout=self.options.handshake_timeout_s,  # a request that stalls half-sent holds a socket
            ping_interval=20,
            compression=None,  # audio does not deflate (Opus, base64 PCM): it cost the loop a tenth of its time
            server_header="s2s",  # not websockets' default, which tells Python's version and its own
        )
        try:
            self._server = await serve(
                self._connect,
                self.options.host,
                self.options.port,
                ssl=self.options.tls(),
                reuse_port=self.reuse_port,
                **settings,
            )
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(self.options.host, self.options.port) from None
            raise
        if self.options.proxy_listener is not None:  # the proxy's way in: the port's settings, without TLS
            self._proxy_server = await unix_serve(self._connect, sock=self.options.proxy_listener, **settings)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._proxy_server is not None:  # its file goes with it
            Path(self.options.proxy_listener.getsockname()).unlink(missing_ok=True)
        for server in (self._server, self._proxy_server):
            if server is not None:
                server.close()
                await server.wait_closed()
        await asyncio.to_thread(self.engine.stop)

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path == "/healthz":  # a load balancer's question: can this replica take a conversation now?
            if problem := "draining" if self.draining else self.engine.admission_problem():
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"{problem}\n")
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/metrics":
            body = generate_latest(self.registry)
            return Response(200, "OK", Headers([("Content-Type", "text/plain; version=0.0.4")]), body)
        if path == "/" or path.startswith("/web/"):
            return self._page_file(connection, path.removeprefix("/web/") if path != "/" else "index.html")
        if path == "/api/voices":
            body = json.dumps(self._settings()).encode()
            return Response(200, "OK", Headers([("Content-Type", "application/json")]), body)
        if path not in self.endpoints:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        if refused := refusal(request, self.options):
            return connection.respond(*refused)
        if busy := self.busy(connection, request):
            response = connection.respond(*busy)
            response.headers["Retry-After"] = "1"
            return response
        return None

    def busy(self, connection: ServerConnection, request: Request) -> tuple[HTTPStatus, str] | None:
        """Why a connection that may connect cannot be served now, told before the upgrade (with `Retry-After`), so
        that a load balancer can try another replica (HAProxy's `retry-on 503`): 503 while this replica drains or
        its engine would refuse a conversation, 429 while the client holds its limit of them."""
        if self.draining:
            return HTTPStatus.SERVICE_UNAVAILABLE, "refused: this replica is draining\n"
        client = self.clients.address(connection.remote_address, request.headers)
        if reason := self.clients.problem(client):
            return HTTPStatus.TOO_MANY_REQUESTS, f"refused: {reason}\n"
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"  # a plain GET is no refused conversation
        if reason := self.engine.admission_problem(count=upgrade):
            return HTTPStatus.SERVICE_UNAVAILABLE, f"refused: {reason}\n"
        return None

    def _page_file(self, connection: ServerConnection, name: str) -> Response:
        """A file of the web page (`server/web/`): only those, by name, never a path out of it."""
        if name not in WEB_FILES:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        body = (WEB_DIR / name).read_bytes()
        return Response(200, "OK", Headers([("Content-Type", WEB_FILES[name]), ("Cache-Control", "no-cache")]), body)

    def _settings(self) -> dict:
        """What the page offers: the voice prompts by name, the modes (a model with a text stream, Moshi's, is duplex
        only), and the sampling defaults with their bounds."""
        defaults = SamplingParams()
        return {
            "voices": sorted(self.engine.voices),
            "modes": ["duplex"] if self.engine.model.config.text_stream else ["turn", "duplex"],
            "sampling": {"temperature": defaults.temperature, "top_k": defaults.top_k, "top_p": defaults.top_p},
            "max_top_k": self.engine.model.config.codebook_size,
            "token_required": self.options.token is not None,
        }

    async def _connect(self, ws: ServerConnection) -> None:
        endpoint = self.endpoints[urllib.parse.urlsplit(ws.request.path).path]
        limits, replica = self.options.limits, self.options.replica_id
        await serve_connection(ws, endpoint, limits, self.clients, replica, self.turns.dropped)


def serving_line(options: ServerOptions, port: int) -> str:
    """What a server prints once it listens (`ServerProcess` waits for it)."""
    host, s = options.host, "s" if options.ssl_certfile else ""
    return f"serving ws{s}://{host}:{port}/api/chat  (http{s}://{host}:{port}/ the page, /healthz, /metrics)"


def proxy_listener(path: Path) -> socket.socket:
    """A Unix socket bound at `path` for `ServerOptions.proxy_listener`, its owner's alone (mode 600; it listens
    only once the server starts, so nobody connects before the mode is set)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o600)
    return listener


async def serve_until_sigterm(server: ChatServer, note: Callable[[], str] | None = None) -> None:
    """Start `server`, print `note()` (if any) and the "serving" line `ServerProcess` waits for, serve until
    SIGTERM, then stop it. SIGUSR1 drains it (`ChatServer.drain`: `s2s cluster drain`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # `ServerProcess` stops it so
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    try:
        port = await server.start()  # (in the `try`: a start that fails stops the engine it started)
        freeze_startup_heap()  # the process is a server from here: see server/gc_pause.py
        if note is not None:
            print(note())
        print(serving_line(server.options, port), flush=True)
        await stop.wait()
    finally:
        await server.stop()
