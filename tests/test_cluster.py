"""`s2s cluster`: three `tiny` replicas behind HAProxy on loopback. Voice affinity, the balance factor's bound,
spill from a full replica, drain that waits out live conversations, `add`, and a replica killed with SIGKILL.

The tests share one cluster and run in file order: the drain test stops a replica and adds one back, the last test
kills one."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tests_support import until, wait_until
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from codec.pcm import load_wav, save_wav, to_pcm16
from server.cluster.control import ask
from server.moshi import protocol
from server.moshi.protocol import Control, Kind, metadata_of
from server.ports import free_port
from server.process import ServerProcess

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

FACTOR = 150  # --balance-factor
PER_REPLICA = 6  # --max-conversations


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)


def test_without_haproxy_the_cluster_says_so_and_exits_non_zero(tmp_path: Path) -> None:
    """Runs wherever: PATH without haproxy."""
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    command = [sys.executable, "-m", "server.cli", "cluster", "--replicas", "1", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "haproxy is not installed" in done.stderr, done


needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/setup.sh installs it, as root)"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running cluster: (ws:// URL, run folder)."""
    root = tmp_path_factory.mktemp("cluster")
    speech = load_wav(Path(__file__).parents[1] / "speech" / "data" / "speech.wav")
    (root / "voices").mkdir()
    for i, name in enumerate("abcd"):  # four short voice prompts
        save_wav(root / "voices" / f"{name}.wav", speech[i * 12000 : (i + 1) * 12000])
    port = free_port()
    args = ["--replicas", "3", "--port", str(port), "--run-dir", str(root / "run"), "--balance-factor", str(FACTOR)]
    args += ["--preset", "tiny", "--threads", "1", "--prompts", str(root / "voices"), "--max-reply-frames", "40"]
    args += ["--max-conversations", str(PER_REPLICA), "--admission-headroom", "1000", "--kv-pages", "512"]
    with ServerProcess(*args, subcommand="cluster", timeout_s=240) as url:
        yield url, root / "run"


def settled(run_dir: Path) -> None:
    """Once every replica is UP and holds no conversation, and HAProxy has let go of every closed connection. Until
    then a conversation that follows at once can be placed off its voice's replica: HAProxy counts closed connections
    in the balance factor's load (an empty cluster bounds each replica at 1), and a replica that was full a moment ago
    (closed conversations leave its engine a tick later) is DOWN until its next health check."""
    wait_until(
        lambda: all(
            r["state"] == "UP" and r.get("conversations") == 0 and not r["connections"] for r in replicas(run_dir)
        ),
        20,
        lambda: f"the cluster did not settle: {replicas(run_dir)}",
    )


def replicas(run_dir: Path) -> list[dict]:
    """The cluster's status, asked on its control socket (no CLI process)."""
    return list(ask(run_dir / "control.sock", {"command": "status"}))[-1]["result"]["replicas"]


def state_of(run_dir: Path, name: str) -> str | None:
    return next((r["state"] for r in replicas(run_dir) if r["replica"] == name), None)


def conversations_on(run_dir: Path, name: str) -> int | None:
    return next((r.get("conversations") for r in replicas(run_dir) if r["replica"] == name), None)


def status(run_dir: Path) -> dict[str, dict]:
    done = cli("cluster", "status", "--json", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return {r["replica"]: r for r in json.loads(done.stdout)["replicas"]}


async def closed(ws: ClientConnection) -> None:
    """Once the server has closed `ws` (within a minute), whatever it sent before."""
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(60):
            while True:
                await ws.recv()


def add_back(run_dir: Path) -> str:
    """`s2s cluster add`, which must succeed and leave three replicas UP; what it said."""
    added = cli("cluster", "add", "--run-dir", str(run_dir))
    assert added.returncode == 0 and "in the pool" in added.stdout, added
    assert sorted(r["state"] for r in status(run_dir).values()) == ["UP"] * 3
    return added.stdout


async def opened(url: str, voice: str | None = None) -> tuple[ClientConnection, str]:
    """A turn-mode conversation through the cluster, and the replica that serves it (the metadata's)."""
    ws = await connect(f"{url}/api/chat?mode=turn&codec=pcm16" + (f"&voice={voice}" if voice else ""))
    async for message in ws:
        if message[0] == Kind.METADATA:
            return ws, metadata_of(message)["replica"]
    raise AssertionError("closed before the metadata")


@needs_haproxy
def test_conversations_with_one_voice_land_on_one_replica(cluster) -> None:
    """One after another, three conversations per voice: each voice's go to one replica; the voices use several. A
    Realtime API client with `?voice=a` lands where Moshi's voice a did, is told so, and speaks with that voice."""
    url, run_dir = cluster

    async def body() -> dict[str, set[str]]:
        placed = {}
        for voice in "abcd":
            placed[voice] = set()
            for _ in range(3):
                ws, replica = await opened(url, voice)
                placed[voice].add(replica)
                await ws.close()
                await asyncio.to_thread(settled, run_dir)
        return placed

    async def realtime() -> dict:
        async with connect(f"{url}/v1/realtime?voice=a") as ws:
            return json.loads(await ws.recv())

    placed = asyncio.run(body())
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert len(set.union(*placed.values())) > 1, placed
    created = asyncio.run(realtime())  # the Realtime API is placed by the same voice, which it then speaks with
    assert created["type"] == "session.created" and {created["session"]["replica"]} == placed["a"], created
    assert created["session"]["audio"]["output"]["voice"] == "a", created


@needs_haproxy
def test_the_load_never_exceeds_the_balance_factor(cluster) -> None:
    """Nine conversations with one voice, held at once: no replica holds more than HAProxy's bound (the factor
    times the average, rounded up at each arrival), where the hash alone would put all nine on one."""
    url, run_dir = cluster

    async def body() -> Counter:
        await asyncio.to_thread(settled, run_dir)
        held = [await opened(url, "a") for _ in range(9)]
        for ws, _ in held:
            await ws.close()
        return Counter(replica for _, replica in held)

    load = asyncio.run(body())
    bound = math.ceil(math.ceil(9 * FACTOR / 100) / 3)
    assert sum(load.values()) == 9 and max(load.values()) <= bound and len(load) > 1, load


@needs_haproxy
def test_a_full_replica_spills_to_another(cluster) -> None:
    """Voice a's replica is filled straight through its own port: the next conversation with voice a is served by
    another replica, not refused; the full replica's health check then says why it takes nothing."""
    url, run_dir = cluster

    async def body() -> tuple[str, list[str], str]:
        ws, home = await opened(url, "a")
        await ws.close()
        await asyncio.to_thread(settled, run_dir)
        direct = f"ws://127.0.0.1:{status(run_dir)[home]['port']}"
        filling = [await opened(direct) for _ in range(PER_REPLICA)]
        served = []
        for _ in range(3):
            ws, replica = await opened(url, "a")
            served.append(replica)
            await ws.close()
        health = await asyncio.to_thread(_get, f"http://127.0.0.1:{status(run_dir)[home]['port']}/healthz")
        for ws, _ in filling:
            await ws.close()
        return home, served, health

    home, served, health = asyncio.run(body())
    assert home not in served, (home, served)
    assert health == (503, f"the engine holds its maximum of {PER_REPLICA} conversations"), health


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


@needs_haproxy
def test_drain_waits_for_live_conversations_then_stops_the_replica(cluster) -> None:
    """Two conversations open on voice b's replica when the drain starts (one through HAProxy, one to the replica's
    own port: through HAProxy, the balance factor would put the second elsewhere, the cluster being otherwise
    empty): the drain sees both, both then take a turn and get their whole reply, a new conversation with voice b
    goes elsewhere, the drain ends once both have, with none cut, and the replica is gone. `s2s cluster add` then
    brings a replica back into the pool."""
    url, run_dir = cluster
    pcm = to_pcm16(load_wav(Path(__file__).parents[1] / "speech" / "data" / "speech.wav")[: 24000 * 2])

    async def turn(where: str, seed: int, seen: asyncio.Event) -> tuple[list[str], list[dict], int]:
        """A conversation that takes its turn once the drain has seen it: errors, metadata, samples of reply."""
        errors, metadata, samples = [], [], 0
        async with connect(f"{where}/api/chat?mode=turn&codec=pcm16&voice=b&seed={seed}&temperature=0.1") as ws:

            async def read() -> None:
                nonlocal samples
                async for message in ws:
                    if message[0] == Kind.AUDIO:
                        samples += (len(message) - 1) // 2
                    elif message[0] == Kind.ERROR:
                        errors.append(message[1:].decode())
                    elif message[0] == Kind.METADATA:
                        metadata.append(metadata_of(message))
                        if metadata[-1].get("event") == "reply_done":
                            return

            reader = asyncio.create_task(read())
            await seen.wait()
            for a in range(0, len(pcm), 3840):  # 80 ms messages, in real time
                await ws.send(protocol.audio(pcm[a : a + 3840]))
                await asyncio.sleep(0.08)
            await ws.send(protocol.control(Control.END_TURN))
            await asyncio.wait_for(reader, 60)
        return errors, metadata, samples

    async def body():
        await asyncio.to_thread(settled, run_dir)  # the last test's full replica has emptied and is UP again
        ws, home = await opened(url, "b")
        await ws.close()
        await asyncio.to_thread(settled, run_dir)
        direct = f"ws://127.0.0.1:{status(run_dir)[home]['port']}"
        seen = asyncio.Event()
        turns = [asyncio.create_task(turn(where, i, seen)) for i, where in enumerate((url, direct))]
        await until(
            lambda: asyncio.to_thread(lambda: conversations_on(run_dir, home) == 2),
            30,
            lambda: f"the two conversations did not open on {home}: {replicas(run_dir)}",
        )
        drain = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "cluster", "drain", home, "--run-dir", str(run_dir),
            stdout=subprocess.PIPE,
        )  # fmt: skip
        said = (await drain.stdout.readline()).decode()  # it drains (HAProxy places nothing new there): both live
        seen.set()
        newcomer, placed = await opened(url, "b")
        await newcomer.close()
        results = await asyncio.gather(*turns)
        said += (await drain.communicate())[0].decode()
        return home, placed, results, drain.returncode, said

    home, placed, results, code, said = asyncio.run(body())
    assert placed != home, (home, placed)
    for errors, metadata, samples in results:
        assert not errors and metadata[0]["replica"] == home, (errors, metadata[:1])
        done = [m for m in metadata if m.get("event") == "reply_done"]
        assert done and samples == done[0]["frames"] * 320 > 0, (done, samples)
    assert said.startswith(f"{home}: 2 conversations live"), said
    assert code == 0 and f"{home} drained and stopped" in said and "no conversation was cut" in said, said
    assert home not in status(run_dir)
    add_back(run_dir)


@needs_haproxy
def test_a_drain_goes_on_when_its_asker_goes_and_cuts_at_its_timeout(cluster) -> None:
    """A conversation held open on voice d's replica; `s2s cluster drain --timeout 3` is killed once it has said
    so. The cluster goes on with the drain: at the timeout it cuts the conversation (its client sees the close),
    stops the replica and frees its slot, which `add` then fills."""
    url, run_dir = cluster

    async def body() -> str:
        await asyncio.to_thread(settled, run_dir)
        ws, home = await opened(url, "d")
        drain = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "cluster", "drain", home, "--run-dir", str(run_dir), "--timeout", "3",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        said = (await drain.stdout.readline()).decode()
        assert said == f"{home}: 1 conversations live\n", said
        drain.kill()
        await drain.wait()
        await closed(ws)
        return home

    home = asyncio.run(body())
    wait_until(lambda: home not in {r["replica"] for r in replicas(run_dir)}, 10, f"{home} was not stopped")
    add_back(run_dir)


@needs_haproxy
def test_a_killed_replica_closes_its_clients_who_reconnect_elsewhere(cluster) -> None:
    """SIGKILL on voice c's replica while a conversation is open on it: the client sees a close, reconnects with
    the same voice and is served by another replica, and HAProxy's health check takes the dead one out; `add` puts
    a new replica in its slot."""
    url, run_dir = cluster

    async def body() -> tuple[str, str]:
        ws, home = await opened(url, "c")
        os.kill(status(run_dir)[home]["pid"], signal.SIGKILL)
        await closed(ws)
        again, replica = await opened(url, "c")
        await again.close()
        return home, replica

    home, replica = asyncio.run(body())
    assert replica != home
    wait_until(lambda: (state_of(run_dir, home) or "").endswith("(DOWN)"), 30, f"HAProxy did not take {home} out")
    assert status(run_dir)[home]["state"] == "exited (DOWN)"
    assert f"{home} had exited" in add_back(run_dir)  # the dead one's slot takes a new replica
