"""What only tannery.aio has: awaiting in a loop of its own, async iterables, ``async with``
subscriptions, concurrency, and the server's status on refused client-streaming calls.

(The scenarios both clients share run through both in tests/test_client.py.)
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import tannery
import tannery.aio

from .server_harness import running_server

#: Refused calls per test: grpc.aio alone misreports about one in twenty (grpc/grpc#36066),
#: so a regression fails these tests with high probability, never spuriously.
REFUSALS = 60


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path, chunk_size=64 << 10) as running:
        yield running


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


async def until(condition, timeout: float = 10, interval: float = 0.02) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds, polled without blocking the loop."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(interval)
    return condition()


def test_tannery_aio_is_a_submodule_reachable_as_an_attribute():
    import tannery as package

    assert package.aio.Client is tannery.aio.Client


def test_a_refused_store_reports_the_servers_status_while_the_client_writes(server):
    """The server refuses the entry at its header (another shape than the one stored) before
    reading the 4 MiB still being written."""

    async def main() -> list[str]:
        async with tannery.aio.Client(server.target) as client:
            await client.store("taken", {"w": torch.zeros(1)})
            kinds = []
            for _ in range(REFUSALS):
                with pytest.raises(tannery.ServiceError) as caught:
                    await client.store("taken", {"w": torch.zeros(1 << 20)})
                kinds.append(f"{type(caught.value).__name__}: {caught.value}")
            return kinds

    kinds = run(main())
    assert set(kinds) == {"AlreadyExists: archive 'taken' already exists with other content: entry 'w' differs "
                          "(float32 [1] there, float32 [1048576] sent) (give replace=True to replace it)"}


def test_a_refused_publish_reports_the_servers_status_while_the_client_writes(server):
    async def main() -> set[str]:
        async with tannery.aio.Client(server.target) as client:
            kinds = set()
            for _ in range(REFUSALS):
                with pytest.raises(tannery.ServiceError) as caught:
                    await client.publish("bad\x00name", [torch.zeros(1 << 20)])
                kinds.add(type(caught.value).__name__)
            return kinds

    assert run(main()) == {"InvalidArgument"}


def test_publish_takes_an_async_iterable_and_subscriptions_are_async_iterators(server):
    async def frames():
        for i in range(5):
            await asyncio.sleep(0)
            yield torch.full((1000,), float(i))

    async def main() -> None:
        async with tannery.aio.Client(server.target, chunk_size=3000) as client:
            async with client.subscribe("frames") as subscription:  # registered on entering
                published = await client.publish("frames", frames())
                assert published.payloads == 5
                got = []
                async for tensor in subscription:
                    got.append(tensor)
                    if len(got) == 5:
                        break
            assert [t[0].item() for t in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
            # Leaving the block ended the subscription on the server too.
            assert await until(lambda: server.hub.subscribers == 0), f"{server.hub.subscribers} left"
            subscription = await client.subscribe("frames")  # registered once awaited
            assert server.hub.subscribers == 1
            await client.publish("frames", [torch.ones(3)])
            assert torch.equal(await subscription.__anext__(), torch.ones(3))
            subscription.close()
            assert [t async for t in subscription] == []
            assert await until(lambda: server.hub.subscribers == 0), f"{server.hub.subscribers} left"

    run(main())


def test_a_task_waiting_on_a_subscription_can_be_cancelled(server):
    async def main() -> None:
        async with tannery.aio.Client(server.target) as client:
            subscription = await client.subscribe("quiet")
            waiting = asyncio.ensure_future(subscription.__anext__())
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            subscription.close()
            # The server forgot it (grpc cancels a call whose read is cancelled): its hub holds
            # no subscription, and a publish reaches nobody.
            assert await until(lambda: server.hub.subscribers == 0), f"{server.hub.subscribers} left"
            published = await client.publish("quiet", [torch.zeros(10)])
            assert published.payloads == 1 and published.dropped_subscribers == 0
            assert server.hub.dropped_subscribers == 0

    run(main())


class InFlight:
    """Wraps a function the server's worker threads call once per Fetch (``Storage.open_blob``):
    counts the calls in progress, and holds each until ``until`` are in progress at once, so
    calls that can overlap do and :attr:`peak` says how many did. Calls made one at a time
    never get there: the first gives up after ``timeout`` seconds and no call waits again."""

    def __init__(self, fn, until: int, timeout: float = 20) -> None:
        self.fn, self.until, self.timeout = fn, until, timeout
        self.now = self.peak = 0
        self.waiting = True
        self._condition = threading.Condition()

    def __call__(self, *args, **kwargs):
        with self._condition:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self._condition.notify_all()
            if self.waiting and not self._condition.wait_for(lambda: self.peak >= self.until, self.timeout):
                self.waiting = False
        try:
            return self.fn(*args, **kwargs)
        finally:
            with self._condition:
                self.now -= 1


def test_many_reads_proceed_concurrently(server, monkeypatch):
    async def main() -> None:
        async with tannery.aio.Client(server.target) as client:
            state = {f"layer{i}.w": torch.full((5000,), float(i)) for i in range(8)}
            await client.store("m", state)
            archive = await client.archive("m")
            assert "layer3.w" in archive and len(archive) == 8 and archive.info("layer3.w").shape == (5000,)
            # Each read opens its blob on the server: all eight are opened at once, none
            # waiting for another to finish (an observation on the server, not a timing).
            opening = InFlight(server.storage.open_blob, until=len(state))
            monkeypatch.setattr(server.storage, "open_blob", opening)
            got = await asyncio.gather(*(archive.tensor(name, [5000], torch.float32) for name in state))
            monkeypatch.undo()
            assert opening.peak == len(state), f"at most {opening.peak} of {len(state)} reads in progress at once"
            assert all(torch.equal(g, state[name]) for g, name in zip(got, state))
            with pytest.raises(tannery.ArchiveError, match=r"^Archive.tensor: layer0.w: shape \[5000\] in the archive"):
                await archive.tensor("layer0.w", [5001], torch.float32)

    run(main())
