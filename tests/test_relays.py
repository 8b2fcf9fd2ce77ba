"""Relays (docs/weight-sync.md, "Relays"): followers pass each version on to each other, so the
server sends it about once; every failure ends with every follower on a whole version, bit-exact.

The plan's rules are checked on :class:`~tannery_server.relay_plan.RoutePlanner` itself; the
relaying on loopback with an in-process server; the failures against real processes on
simulated hosts (:mod:`tests.netns`: network namespaces behind shaped links), skipped, naming
why, where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import tannery
from tannery.dataplane.links import next_published
from tannery.dataplane.readers import PayloadReader
from tannery.dataplane import relay_port
from tannery.dataplane.relay_port import RELAY_ID
from tannery.weights.relays import _connect_parent
from tannery.weights.stream import Assembler, version_payloads
from tannery_protocol.datalink import LinkError, PeerFailed
from tannery_server.failures import Malformed
from tannery_server.relay_plan import Member, RoutePlanner, relay_address

from .benchmarks.relay_fleet import Fleet
from .netns import Hosts, unavailable
from .server_harness import running_server, wait_for
from .test_channel_tcp import READ_TOKEN, WRITE_TOKEN
from .test_security import pki  # noqa: F401  (a fixture)

#: The simulated model and links of the failure tests: a version takes about 1.3 s per link.
SIZE, RATE = 16 << 20, "100mbit"


# -- the plan -----------------------------------------------------------------------------------


def _routes(planner: RoutePlanner, members: list[Member]) -> dict[str, str]:
    """Each member's latest route (its parent's address, "" for the server), from its queued updates."""
    routes = {}
    for member in members:
        while not member.updates.empty():
            update = member.updates.get_nowait()
            if update is not None:
                routes[member.id] = update.parent
    return routes


def test_the_plan_is_a_chain_that_heals_with_as_few_moves_as_it_can():
    async def run() -> None:
        planner = RoutePlanner(fanout=1)
        members = [Member(f"m{i}", f"10.0.0.{i}:7000", bytes(16)) for i in range(5)]
        for member in members:
            planner.join("w", member)
        routes = _routes(planner, members)
        assert routes == {"m0": "", "m1": "10.0.0.0:7000", "m2": "10.0.0.1:7000", "m3": "10.0.0.2:7000",
                          "m4": "10.0.0.3:7000"}

        def moved() -> dict[str, str]:
            told = _routes(planner, members)
            changed = {key: parent for key, parent in told.items() if parent != routes.get(key)}
            routes.update(told)
            return changed

        planner.leave("w", members[1])  # its child takes its grandparent; nobody else moves
        assert moved() == {"m2": "10.0.0.0:7000"}
        again = Member("m3", "10.0.0.3:7000", bytes(16))  # m3 calls again: m2 could not be read
        assert planner.join("w", again, unreachable="10.0.0.2:7000") is members[3]
        members[3] = again
        assert moved() == {"m3": "10.0.0.0:7000", "m2": "10.0.0.4:7000"}  # around m2, now the last, a leaf
        assert [member.id for member in planner.plans["w"].slots] == ["m0", "m3", "m4", "m2"]
        planner.leave("w", members[1])  # a member no longer in the plan: nothing moves
        assert moved() == {}

    asyncio.run(run())


def test_a_fanout_lays_a_tree_and_the_server_feeds_only_its_first_tier():
    async def run() -> None:
        planner = RoutePlanner(fanout=2)
        members = [Member(f"m{i}", f"h{i}:1", bytes(16)) for i in range(7)]
        for member in members:
            planner.join("w", member)
        routes = _routes(planner, members)
        assert [routes[f"m{i}"] for i in range(7)] == ["", "", "h0:1", "h0:1", "h1:1", "h1:1", "h2:1"]
        planner.leave("w", members[1])  # the last member takes its slot: fed by the server, feeding m4 and m5
        told = _routes(planner, members)
        assert {key: told[key] for key in ("m6", "m4", "m5")} == {"m6": "", "m4": "h6:1", "m5": "h6:1"}
        with pytest.raises(ValueError, match="fan-out"):
            RoutePlanner(fanout=0)

    asyncio.run(run())


def test_a_relay_address_names_its_host_or_takes_the_callers():
    assert relay_address("10.1.2.3:7000", "ipv4:10.9.9.9:5000") == "10.1.2.3:7000"
    assert relay_address(":7000", "ipv4:10.9.9.9:5000") == "10.9.9.9:7000"
    assert relay_address(":7000", "ipv6:[fd00::2]:5000") == "[fd00::2]:7000"
    for bad in ("10.1.2.3", ":0", ":99999", "host:port"):
        with pytest.raises(Malformed, match="host:port"):
            relay_address(bad, "ipv4:10.9.9.9:5000")
    with pytest.raises(Malformed, match="name the host"):
        relay_address(":7000", "unix:/run/tannery.sock")


# -- on loopback --------------------------------------------------------------------------------


def _state(seed: int | None = None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {"a": torch.zeros(512, 1024), "b": torch.zeros(300)}
    generator = torch.Generator().manual_seed(seed)
    return {"a": torch.rand(512, 1024, generator=generator), "b": torch.rand(300, generator=generator)}


def test_followers_relay_on_loopback_and_the_server_feeds_one(tmp_path: Path):
    with running_server(tmp_path, data_port=0, socket="off") as server:
        target = f"127.0.0.1:{server.port}"
        with tannery.Client(target, transport="tcp") as trainer:
            publisher = tannery.weights.Publisher(trainer, "w")
            publisher.push(_state(0), 0)
            followers, applied = [], {}
            for index in range(3):
                client = tannery.Client(target, transport="tcp")
                state = _state()
                follower = tannery.weights.Follower(client, "w", state, relay=True)
                followers.append((client, follower, state))

                def follow(follower=follower, index=index) -> None:
                    for done in follower:
                        applied.setdefault(index, []).append((done.version, done.via))

                threading.Thread(target=follow, daemon=True).start()
            try:
                assert wait_for(lambda: server.hub.subscribers == 1, 10), "one follower subscribes, the others relay"
                assert wait_for(lambda: all(f._relaying.route is not None for _, f, _ in followers), 10)
                for version in (1, 2):
                    publisher.push(_state(version), version)
                    assert wait_for(lambda: all(any(v == version for v, _ in applied.get(i, [])) for i in range(3)), 30)
                assert server.hub.subscribers == 1
                expected = _state(2)
                for _, follower, state in followers:
                    assert all(torch.equal(state[key], expected[key]) for key in expected)
                assert all((2, "channel") in applied[i] for i in range(3)), applied
            finally:
                for client, follower, _ in followers:
                    follower.close()
                    client.close()


def _sha(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_large_tensors_relayed_version_after_version_stay_exact(tmp_path: Path):
    """Tensors gathered in maps that grow (over 32 MiB) and maps a later payload reuses (over
    4 MiB): what a relay passes on is what it received, version after version, pushed back to back."""
    shapes = {"embed": (10 << 20,), "mlp": (1536, 1024), "bias": (300,)}  # 40 MiB, 6 MiB, 1.2 KiB of float32

    def version(seed: int | None) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed or 0)
        return {key: (torch.rand(shape, generator=generator) if seed is not None else torch.zeros(shape))
                for key, shape in shapes.items()}

    with running_server(tmp_path, data_port=0, socket="off") as server:
        target = f"127.0.0.1:{server.port}"
        with tannery.Client(target, transport="tcp") as trainer:
            publisher = tannery.weights.Publisher(trainer, "big", keep=2, delta=False)
            publisher.push(version(100), 0)
            clients = [tannery.Client(target, transport="tcp") for _ in range(3)]
            states = [version(None) for _ in clients]
            followers = [tannery.weights.Follower(client, "big", state, relay=True)
                         for client, state in zip(clients, states)]
            seen: dict[int, list[tuple[int, str, str]]] = {}
            try:
                for index, (follower, state) in enumerate(zip(followers, states)):
                    assert next(follower).version == 0

                    def follow(follower=follower, state=state, index=index) -> None:
                        for done in follower:
                            seen.setdefault(index, []).append((done.version, done.via, _sha(state)))

                    threading.Thread(target=follow, daemon=True).start()
                assert wait_for(lambda: server.hub.subscribers == 1 and followers[2]._relaying.route is not None
                                and followers[2]._relaying.route[0] != "", 10)
                expected = {}
                for number in (1, 2, 3):
                    pushed = version(number)
                    expected[number] = _sha(pushed)
                    publisher.push(pushed, number)
                assert wait_for(lambda: all(any(v == 3 for v, _, _ in seen.get(i, [])) for i in range(3)), 60), seen
                for index in range(3):
                    for number, via, digest in seen[index]:
                        assert digest == expected[number], f"follower {index} holds other bytes for version {number}"
                assert all(via == "channel" for _, via, _ in seen[2]), seen[2]
            finally:
                for follower, client in zip(followers, clients):
                    follower.close()
                    client.close()


# -- on simulated hosts ---------------------------------------------------------------------------

needs_namespaces = pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}")


def _fleet(hosts: Hosts, tmp_path: Path) -> Fleet:
    fleet = Fleet(hosts, tmp_path, SIZE, count=8).__enter__()
    try:
        fleet.push(0)
    except BaseException:
        fleet.close()
        raise
    return fleet


def _whole(lines: list[dict], pushed: dict) -> None:
    """Every worker's line holds the version pushed, bit for bit."""
    assert [line["version"] for line in lines] == [pushed["version"]] * len(lines)
    assert all(line["sha"] == pushed["sha"] for line in lines), "a follower holds other bytes than the trainer's"


@needs_namespaces
def test_a_chain_carries_whole_versions_and_deltas_with_the_server_sending_each_once(tmp_path: Path):
    with Hosts(6, rate=RATE) as hosts:
        fleet = _fleet(hosts, tmp_path)
        try:
            workers = fleet.chain([1, 2, 3, 4])
            time.sleep(1.0)
            for version, delta in ((1, False), (2, True), (3, False)):
                sent = fleet.egress()
                pushed = fleet.push(version, delta=delta)
                lines = fleet.applied(version, workers)
                _whole(lines, pushed)
                assert [line["via"] for line in lines] == ["channel"] * 4
                assert pushed["delta"] == delta
                egress = fleet.egress() - sent
                limit = 1.2 * SIZE if not delta else 0.2 * SIZE
                assert egress <= limit, f"the server sent {egress / SIZE:.2f}x the model for version {version}"
            late = fleet.worker(5, wait=True)
            fleet.start_push(4)
            time.sleep(0.4)
            late.tell("go")  # joins mid-push: the version in flight comes whole, from the store or the chain
            pushed = fleet.pushed(4)
            _whole(fleet.applied(4, [*workers, late]), pushed)
            time.sleep(1.0)
            pushed = fleet.push(5)
            lines = fleet.applied(5, [*workers, late])
            _whole(lines, pushed)
            assert lines[-1]["via"] == "channel", "the late joiner is in the chain for the next version"
        finally:
            fleet.close()


@needs_namespaces
def test_a_relay_killed_mid_version_and_a_link_cut_leave_every_follower_whole(tmp_path: Path):
    with Hosts(5, rate=RATE) as hosts:
        fleet = _fleet(hosts, tmp_path)
        try:
            first, killed, *rest = fleet.chain([1, 2, 3, 4])
            time.sleep(1.0)
            fleet.start_push(1)
            time.sleep(0.5)  # mid-version: its children have part of it
            killed.kill()
            pushed = fleet.pushed(1)
            _whole(fleet.applied(1, [first, *rest]), pushed)  # the rest of the version from the store
            time.sleep(1.0)
            pushed = fleet.push(2)
            lines = fleet.applied(2, [first, *rest])
            _whole(lines, pushed)
            assert [line["via"] for line in lines] == ["channel"] * 3, "the chain closed around the killed relay"
            fleet.start_push(3)
            time.sleep(0.4)
            hosts.link(3, up=False)  # the link of the relay in the middle, pulled mid-version
            time.sleep(3.0)
            hosts.link(3, up=True)
            pushed = fleet.pushed(3)
            _whole(fleet.applied(3, [first, *rest], timeout=60), pushed)
            pushed = fleet.push(4)
            _whole(fleet.applied(4, [first, *rest], timeout=60), pushed)
        finally:
            fleet.close()


@needs_namespaces
def test_a_slow_relay_holds_back_only_those_behind_it(tmp_path: Path):
    with Hosts(4, rate=RATE) as hosts:
        fleet = _fleet(hosts, tmp_path)
        try:
            workers = fleet.chain([1, 2, 3])
            time.sleep(1.0)
            hosts.shape(2, "20mbit")  # the middle relay: 16 MiB take it about 7 s
            pushed = fleet.push(1)
            lines = fleet.applied(1, workers, timeout=90)
            _whole(lines, pushed)
            assert lines[0]["t"] - pushed["started"] < 5.0, "the slow relay's parent was held back by it"
            hosts.shape(2, RATE)
            time.sleep(1.0)
            pushed = fleet.push(2)
            _whole(fleet.applied(2, workers, timeout=60), pushed)
        finally:
            fleet.close()


@needs_namespaces
def test_a_relay_that_refuses_its_key_is_routed_around(tmp_path: Path):
    with Hosts(4, rate=RATE) as hosts:
        fleet = _fleet(hosts, tmp_path)
        try:
            fleet.member(3, "tests.relay_impostor")  # first in the plan: the server routes the next through it
            workers = fleet.chain([1, 2])
            time.sleep(1.5)
            sent = fleet.egress()
            pushed = fleet.push(1)
            lines = fleet.applied(1, workers)
            _whole(lines, pushed)
            assert [line["via"] for line in lines] == ["channel"] * 2, "the refused child was not routed around"
            assert fleet.egress() - sent <= 1.2 * SIZE
            log = "".join(path.read_text() for path in tmp_path.glob("worker1-*.log"))
            assert "could not be read" in log and "refused the key" in log, log[-2000:]
        finally:
            fleet.close()


def test_relay_links_take_tls_and_the_key_when_the_server_does(tmp_path: Path, pki):  # noqa: F811
    """A follower of a TLS server serves its relay port over TLS with a certificate made at start,
    which its children pin; a plain connection gets nothing, and a wrong key is refused."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{WRITE_TOKEN} write\n{READ_TOKEN} read\n")
    tls = tannery.TLS(ca=pki["ca"])
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tokens_file=tokens,
                        data_port=0, socket="off") as server:
        with tannery.Client(server.target, token=WRITE_TOKEN, tls=tls, transport="tcp") as trainer:
            publisher = tannery.weights.Publisher(trainer, "w")
            publisher.push(_state(0), 0)
            clients = [tannery.Client(server.target, token=READ_TOKEN, tls=tls, transport="tcp") for _ in range(2)]
            states = [_state(), _state()]
            followers = [tannery.weights.Follower(client, "w", state, relay=True) for client, state in zip(clients, states)]
            try:
                for follower in followers:
                    assert next(follower).version == 0
                head, tail = (f._relaying for f in followers)
                assert wait_for(lambda: tail.route is not None and tail.route[0] == head.address, 10), tail.route
                assert tail.route[2].startswith(b"-----BEGIN CERTIFICATE-----")
                with socket.create_connection((head.port.host, head.port.port), timeout=5) as plain:
                    plain.sendall(b"\0\0\0\2hi")  # not a TLS hello: the port says nothing to it
                    plain.settimeout(5)
                    try:
                        said = plain.recv(64)
                    except ConnectionResetError:
                        said = b""
                    assert RELAY_ID.encode() not in said, "a relay port of a TLS fleet welcomed a plain connection"
                with pytest.raises((LinkError, OSError)) as refused:
                    link = _connect_parent(head.address, b"x" * 32, tail.route[2])
                    next_published(link, PayloadReader())
                assert "refused the key" in str(refused.value)
                assert wait_for(lambda: head.port.children == 1, 10)
                publisher.push(_state(1), 1)
                applied = next(followers[1])
                assert (applied.version, applied.via) == (1, "channel")
                assert all(torch.equal(states[1][key], _state(1)[key]) for key in states[1])
                assert server.hub.subscribers == 1
            finally:
                for follower, client in zip(followers, clients):
                    follower.close()
                    client.close()


# -- a relay port on its own ----------------------------------------------------------------------


def _frames(link, timeout: float = 10.0) -> list:
    """Every frame (and its bytes' length) a child reads until the port ends its feed: a
    ``failure`` frame, or ("cut", 0) when the connection ends (in a piece or between)."""
    link.sock.settimeout(timeout)
    got: list = []
    while True:
        try:
            received, _ = link.receive()
            kind = received.WhichOneof("kind")
            if kind == "failure":
                return got + [("failure", received.failure.code)]
            if kind == "entry":
                link.receive_exactly(received.entry.payload_bytes)
                got.append(("entry", received.entry.payload_bytes))
            else:
                got.append((kind, 0))
        except PeerFailed as failed:
            return got + [("failure", failed.code)]
        except (LinkError, OSError):
            return got + [("cut", 0)]


def test_a_child_joining_mid_payload_starts_at_the_next_and_a_slow_one_is_dropped(monkeypatch):
    monkeypatch.setattr(relay_port, "CHILD_BUFFER", 1 << 20)
    monkeypatch.setattr(relay_port, "CHILD_TIMEOUT", 0.5)
    port = relay_port.RelayPort("127.0.0.1", 0)
    try:
        address = f"127.0.0.1:{port.port}"
        early = _connect_parent(address, port.key, b"")
        assert wait_for(lambda: port.children == 1, 5)
        piece = memoryview(bytearray(1000))
        port.piece(piece)  # payload 1 begins
        late = _connect_parent(address, port.key, b"")  # joins in the middle of payload 1
        assert wait_for(lambda: port.children == 2, 5)
        late_frames: list = []
        reading = threading.Thread(target=lambda: late_frames.extend(_frames(late, 30)), daemon=True)
        reading.start()  # the late child keeps up
        port.piece(piece)
        port.payload_done()
        port.piece(memoryview(bytearray(300)))  # payload 2: both get it
        port.abandon()
        big = memoryview(bytearray(1 << 20))
        started = time.monotonic()
        for _ in range(48):  # the early child reads nothing: its queue fills, and it is dropped
            port.piece(big)
            port.payload_done()
        assert time.monotonic() - started < 20, "a child that reads nothing held its parent"
        assert wait_for(lambda: port.children == 1, 10), "the child that reads nothing was not dropped"
        early_frames = _frames(early)
        assert early_frames[:4] == [("entry", 1000), ("entry", 1000), ("entry", 300), ("abandoned", 0)]
        assert early_frames[-1] in (("failure", "RESOURCE_EXHAUSTED"), ("cut", 0))
        port.close()
        reading.join(30)
        assert late_frames[:2] == [("entry", 300), ("abandoned", 0)], "the late child got the tail of payload 1"
        assert late_frames[-1] == ("failure", "UNAVAILABLE"), late_frames[-3:]
        assert sum(size for kind, size in late_frames if kind == "entry") == 300 + len(late_frames[2:-1]) * (1 << 20)
    finally:
        port.close()


def test_a_whole_version_carries_each_tensor_digest_and_bytes_changed_on_the_way_are_caught():
    """Through relays a version's bytes pass several hands: the end payload carries each tensor's
    CRC-32C, and a follower checks them before it applies anything."""
    state = _state(7)
    payloads = [p.clone() for p in version_payloads(3, "push1", state)]
    assembler = Assembler("w")
    for payload in payloads[:-1]:
        assert assembler.add(payload) is None
    payloads[1].view(-1)[5] += 1.0  # a byte flipped on the way, after it was received
    streamed = assembler.add(payloads[-1])
    assert streamed is not None and streamed.version == 3
    assert streamed.torn() == ["a"]
    clean = Assembler("w")
    versions = [clean.add(p) for p in version_payloads(4, "push2", state)]
    assert versions[-1] is not None and versions[-1].torn() == []
    assert set(versions[-1].digests) == {"a", "b"}


def test_asyncio_followers_relay_too(tmp_path: Path):
    async def run(target: str, server) -> None:
        async with tannery.aio.Client(target, transport="tcp") as trainer:
            publisher = tannery.weights.AsyncPublisher(trainer, "w")
            await publisher.push(_state(0), 0)
            clients = [tannery.aio.Client(target, transport="tcp") for _ in range(2)]
            states = [_state(), _state()]
            followers = [tannery.weights.AsyncFollower(client, "w", state, relay=True)
                         for client, state in zip(clients, states)]
            try:
                for follower in followers:
                    assert (await anext(follower)).version == 0
                tail = followers[1]._relaying
                deadline = time.monotonic() + 10
                while not (tail.route and tail.route[0] == followers[0]._relaying.address) or server.hub.subscribers != 1:
                    assert time.monotonic() < deadline, (tail.route, server.hub.subscribers)
                    await asyncio.sleep(0.05)
                await publisher.push(_state(1), 1)
                for follower, state in zip(followers, states):
                    applied = await asyncio.wait_for(anext(follower), 30)
                    assert (applied.version, applied.via) == (1, "channel")
                    assert all(torch.equal(state[key], _state(1)[key]) for key in state)
            finally:
                for follower, client in zip(followers, clients):
                    await follower.aclose()
                    await client.close()

    with running_server(tmp_path, data_port=0, socket="off") as server:
        asyncio.run(run(f"127.0.0.1:{server.port}", server))
