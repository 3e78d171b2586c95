"""Refusals before the upgrade (`ChatServer.busy`): a full engine or a draining replica answers the websocket's
request with 503, `Retry-After` and "refused: REASON" as the body, so a load balancer can try another replica; /healthz
answers 503 with the reason while a conversation would be refused; each opened conversation is told its replica."""

from __future__ import annotations

import json

import pytest
from test_idle_clients import TURN, opened, speak_and_listen
from test_server import http_status, metric, run_with_server
from tests_support import next_snapshot, until
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from server.app import ServerOptions
from server.moshi.client import refusal_of
from server.moshi.protocol import Kind, metadata_of

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

FULL = "refused: the engine holds its maximum of 1 conversations"


async def refused(url: str) -> tuple[int, str | None, str]:
    """A conversation asked for that must be refused before the upgrade: the status, `Retry-After` and the body."""
    with pytest.raises(InvalidStatus) as e:
        async with connect(url):
            pass
    return e.value.response.status_code, e.value.response.headers.get("Retry-After"), refusal_of(e.value)


async def healthy_or_none(url: str) -> tuple[int, str] | None:
    health = await http_status(f"{url}/healthz")
    return health if health[0] == 200 else None


def test_a_full_engine_refuses_before_the_upgrade_and_its_health_check_says_why(parts) -> None:
    """One conversation at most: while it is open a second gets 503 with the engine's reason (counted as the
    engine's own refusals are), and /healthz answers 503 with it; once it closes, /healthz is "ok" and a
    conversation opens again."""

    async def body(url, server):
        out = {"before": await http_status(f"{url}/healthz")}
        async with connect(url + TURN) as first:
            assert (await opened(first))[0]  # open: it holds the engine's one slot
            out["second"] = await refused(url + TURN)
            out["health while full"] = await http_status(f"{url}/healthz")
        out["health after"] = await until(  # the server sees the close a moment after the client
            lambda: healthy_or_none(url), what="the server did not take conversations again after the close"
        )
        out["refused"] = (await next_snapshot(server.engine)).stats.refused  # (/metrics shows the snapshot too)
        async with connect(url + TURN) as again:
            out["again"] = (await opened(again))[0]
        return out

    out = run_with_server(parts, body, max_conversations=1)
    assert out["before"] == (200, "ok\n")
    assert out["second"] == (503, "1", FULL), out
    assert out["health while full"] == (503, FULL.removeprefix("refused: ") + "\n"), out
    assert out["health after"] == (200, "ok\n"), out
    assert out["refused"] == 1, "the refusal before the upgrade is not counted, or the health checks are"
    assert out["again"]


def test_a_draining_replica_refuses_new_conversations_and_serves_its_open_one(parts) -> None:
    """After `drain()`: /healthz answers 503 "draining", a new conversation (Moshi's or the Realtime API's) is
    refused with 503 "refused: this replica is draining", and the conversation already open still gets its reply."""

    async def body(url, server):
        out = {}
        async with connect(url + TURN) as live:
            assert (await opened(live))[0]
            server.drain()
            out["health"] = await http_status(f"{url}/healthz")
            out["moshi"] = await refused(url + TURN)
            out["realtime"] = await refused(f"{url}/v1/realtime")
            out["reply"] = await speak_and_listen(live)
        out["draining gauge"] = metric((await http_status(f"{url}/metrics"))[1], "s2s_draining")
        return out

    out = run_with_server(parts, body, max_conversations=4)
    assert out["health"] == (503, "draining\n"), out
    assert out["moshi"] == out["realtime"] == (503, "1", "refused: this replica is draining"), out
    reply = out["reply"]
    assert reply.done and not reply.errors and reply.samples > 0, reply
    assert out["draining gauge"] == 1


def test_the_opened_message_names_the_replica(parts) -> None:
    """Moshi's first metadata message and the Realtime API's `session.created` carry `replica`: the server's
    `replica_id`."""

    async def body(url, server):
        async with connect(url + TURN) as ws:
            assert (await ws.recv())[0] == Kind.HANDSHAKE
            message = await ws.recv()
            assert message[0] == Kind.METADATA, message
            moshi = metadata_of(message)
        async with connect(f"{url}/v1/realtime") as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created", created
        return moshi, created["session"]

    moshi, session = run_with_server(parts, body, ServerOptions(port=0, replica_id="r7"))
    assert moshi["replica"] == "r7" and moshi["mode"] == "turn", moshi
    assert session["replica"] == "r7", session
