"""Watch: an alias followed on the real server (both backends), across two replicas on one
PostgreSQL, by the read token, the asyncio client and ``tannery watch``."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tannery
import tannery.aio
from tannery_protocol.errors import NotFound, Unavailable

from .server_harness import HOST, free_port, running_server

WRITE, READ = "watch-write-5d2a", "watch-read-81bc"


@pytest.fixture
def srv(tmp_path, backend):
    with running_server(tmp_path, **backend) as server:
        yield server


def versions(client: tannery.Client, *names: str) -> None:
    for index, name in enumerate(names):
        client.store(name, {"w": torch.full((2,), float(index + 1))})


def polled(server) -> list[str]:
    return server._running.watches.polled()


def eventually(check, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.02)


def test_the_current_target_first_then_each_move(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2", "v3")
        tagged = client.tag("prod", "v1")
        with client.watch("prod") as watch:
            first = next(watch)
            assert (first.alias, first.archive, first.moved) == ("prod", "v1", tagged.alias.moved)
            for target in ("v2", "v3"):
                moved_at = time.monotonic()
                client.tag("prod", target)
                assert next(watch).archive == target
                assert time.monotonic() - moved_at < 1.0
            assert polled(srv) == ["prod"]
        eventually(lambda: polled(srv) == [])  # closing ended the server's stream and its poller


def test_a_slow_watcher_gets_only_the_latest_target(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2", "v3")
        client.tag("prod", "v1")
        with client.watch("prod") as watch:
            assert next(watch).archive == "v1"
            client.tag("prod", "v2")
            time.sleep(0.8)  # the server has sent v2 by now; nobody reads it
            client.tag("prod", "v3")
            time.sleep(0.8)
            assert next(watch).archive == "v3"  # not v2: no backlog
            client.tag("prod", "v1")
            assert next(watch).archive == "v1"


def test_an_unknown_alias_an_archive_and_a_removed_alias_are_refused_naming_them(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1")
        with pytest.raises(NotFound, match="alias 'nope' not found.*tannery tag nope"):
            next(client.watch("nope"))
        with pytest.raises(NotFound, match="alias 'v1' not found: it is an archive's name"):
            next(client.watch("v1"))
        client.tag("prod", "v1")
        watch = client.watch("prod")
        assert next(watch).archive == "v1"
        client.untag("prod")
        with pytest.raises(NotFound, match="alias 'prod' was removed while watched"):
            next(watch)
        eventually(lambda: polled(srv) == [])


def test_leaving_the_loop_ends_the_call_and_one_poller_serves_every_watcher(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2")
        client.tag("prod", "v1")
        with client.watch("prod") as one, client.watch("prod") as two:
            assert next(one).archive == next(two).archive == "v1"
            assert polled(srv) == ["prod"]
            client.tag("prod", "v2")
            assert next(one).archive == next(two).archive == "v2"
        eventually(lambda: polled(srv) == [])
        for moved in client.watch("prod"):
            assert moved.archive == "v2"
            break
        gc.collect()
        eventually(lambda: polled(srv) == [])


def test_the_asyncio_client_watches(srv):
    async def run() -> None:
        async with tannery.aio.Client(srv.target) as client:
            await client.store("v1", {"w": torch.zeros(1)})
            await client.store("v2", {"w": torch.ones(1)})
            await client.tag("prod", "v1")
            seen = []
            async with client.watch("prod") as watch:
                async for moved in watch:
                    seen.append(moved.archive)
                    if len(seen) == 1:
                        await client.tag("prod", "v2")
                    else:
                        break
            assert seen == ["v1", "v2"]
            with pytest.raises(NotFound, match="alias 'nope'"):
                await anext(client.watch("nope"))

    asyncio.run(run())
    eventually(lambda: polled(srv) == [])


def test_the_read_token_may_watch(tmp_path):
    with running_server(tmp_path, tokens=f"{WRITE}:write,{READ}:read") as server:
        with tannery.Client(server.target, token=WRITE) as writer, tannery.Client(server.target, token=READ) as reader:
            versions(writer, "v1", "v2")
            writer.tag("prod", "v1")
            with reader.watch("prod") as watch:
                assert next(watch).archive == "v1"
                writer.tag("prod", "v2")
                assert next(watch).archive == "v2"


def test_a_server_shutting_down_ends_the_watch_unavailable(tmp_path):
    with running_server(tmp_path) as server:
        with tannery.Client(server.target, retries=0) as client:
            versions(client, "v1")
            client.tag("prod", "v1")
            watch = client.watch("prod")
            assert next(watch).archive == "v1"
            server.stop()
            with pytest.raises(Unavailable, match="shutting down"):
                next(watch)


def test_a_watch_resumes_after_the_server_restarts_and_repeats_no_target(tmp_path):
    port = free_port()
    with tannery.Client(f"{HOST}:{port}", retries=8) as client:
        with running_server(tmp_path, port=port):
            versions(client, "v1", "v2", "v3")
            client.tag("prod", "v1")
            watch = client.watch("prod")
            assert next(watch).archive == "v1"
            client.tag("prod", "v2")
            assert next(watch).archive == "v2"
        with running_server(tmp_path, port=port) as server:
            eventually(lambda: polled(server) == ["prod"], timeout=15)  # watching again, v2 not repeated
            client.tag("prod", "v3")
            assert next(watch).archive == "v3"
            watch.close()


def test_a_watcher_on_one_replica_sees_a_move_made_on_the_other_within_a_second(tmp_path, postgres_url, s3_url):
    from .backends import SHARED_TIMINGS

    shared = {"catalog": postgres_url, "blobs": s3_url, **SHARED_TIMINGS}
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        with tannery.Client(a.target) as on_a, tannery.Client(b.target) as on_b:
            versions(on_a, "v1", "v2")
            on_a.tag("prod", "v1")
            with on_b.watch("prod") as watch:
                assert next(watch).archive == "v1"
                moved_at = time.monotonic()
                on_a.tag("prod", "v2")
                assert next(watch).archive == "v2"
                assert time.monotonic() - moved_at < 1.0


def moves_heard_within(client_a: tannery.Client, client_b: tannery.Client, moves: int) -> list[float]:
    """Tag "prod" on ``client_a`` ``moves`` times, watched on ``client_b``: the seconds each took to be heard."""
    versions(client_a, "v1", "v2")
    client_a.tag("prod", "v1")
    delays = []
    with client_b.watch("prod") as watch:
        assert next(watch).archive == "v1"
        for move in range(moves):
            target = "v2" if move % 2 == 0 else "v1"
            moved_at = time.monotonic()
            client_a.tag("prod", target)
            assert next(watch).archive == target
            delays.append(time.monotonic() - moved_at)
    return delays


def test_a_move_is_heard_at_once_not_a_poll_later(srv):
    # A Tag reads the alias again for its watchers: with the poll made 10 s here, a move heard
    # within a second was announced, not polled.
    srv._running.watches._interval = 10.0
    with tannery.Client(srv.target) as client:
        delays = moves_heard_within(client, client, 5)
    assert max(delays) < 1.0, delays


def test_a_move_on_one_replica_is_announced_to_the_others_through_nats(tmp_path, postgres_url, s3_url, nats_url):
    from .backends import SHARED_TIMINGS

    shared = {"catalog": postgres_url, "blobs": s3_url, "nats": nats_url, **SHARED_TIMINGS}
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        b._running.watches._interval = 10.0  # as above: heard within a second, so announced
        with tannery.Client(a.target) as on_a, tannery.Client(b.target) as on_b:
            delays = moves_heard_within(on_a, on_b, 5)
    assert max(delays) < 1.0, delays


def _watch_process(target: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tannery.cli", "--target", target, "watch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def test_the_cli_prints_a_json_line_per_move_until_ctrl_c(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2")
        client.tag("prod", "v1")
        process = _watch_process(srv.target, "prod", "--json")
        try:
            first = json.loads(process.stdout.readline())
            assert (first["alias"], first["archive"]) == ("prod", "v1") and first["moved"].endswith("Z")
            client.tag("prod", "v2")
            assert json.loads(process.stdout.readline())["archive"] == "v2"
            process.send_signal(signal.SIGINT)
            _out, err = process.communicate(timeout=10)
        finally:
            process.kill()
        assert process.returncode == 130
        assert "Traceback" not in err and "interrupted" in err


def test_the_cli_says_when_the_alias_is_removed(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1")
        client.tag("prod", "v1")
        process = _watch_process(srv.target, "prod")
        try:
            line = process.stdout.readline()
            assert "prod points at v1" in line
            client.untag("prod")
            out, err = process.communicate(timeout=10)
        finally:
            process.kill()
        assert process.returncode == 1
        assert "alias 'prod' was removed while watched" in err and "Traceback" not in err
