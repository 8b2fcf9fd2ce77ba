"""kill -9 at random moments: every archive the server lists afterwards is whole.

Each iteration starts concurrent Stores (a few MiB in several entries), a Union and a
Delete, SIGKILLs the server at a seeded random moment, and restarts it on the same data
directory. Then: a call that answered OK took effect (a stored or unioned archive is
there, whole; a deleted one is gone); a call in flight took effect whole or not at all;
nothing else changed; no temporary file and no unreferenced blob survives the restart;
and scrub (run between kill and restart now and then, and at the end) finds no bad blob.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest

from tannery_protocol.names import join
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import archives_pb2_grpc

from .server_harness import ServerProcess, collect_fetch, store_requests
from .store_checks import list_all, scrub, sized_payload, store_problems

SEED = int(os.environ.get("TANNERY_KILL_SEED", "909"))
ITERATIONS = int(os.environ.get("TANNERY_KILL_ITERATIONS", "20"))
#: Archives kept between iterations (older ones are deleted first, so checks stay quick).
KEEP = 5


@dataclass
class Call:
    """One call of an iteration: what it does to the store, and how it ended."""

    kind: str
    archive: str
    #: The archive's entries if the call takes effect (None: the call removes it).
    effect: dict[str, bytes] | None
    #: A union's two source archives (under prefixes ``a`` and ``b``).
    sources: tuple[str, str] | None = None
    status: grpc.StatusCode | None = None
    details: str = ""


def run_call(call: Call, action: Callable[[], object]) -> None:
    """Run ``action`` and record how ``call`` ended (UNAVAILABLE once the server is killed)."""
    try:
        action()
        call.status = grpc.StatusCode.OK
    except grpc.RpcError as error:
        call.status, call.details = error.code(), error.details() or ""


def plan_calls(rng: random.Random, iteration: int, model: dict[str, dict[str, bytes]]) -> list[Call]:
    """Two Stores of new archives, a Union of two kept ones, and a Delete of a third."""
    calls = []
    for k in range(2):
        entries = {f"layer{i}.weight": sized_payload(rng, rng.choice([64 << 10, 256 << 10, 1 << 20]))
                   for i in range(rng.randint(3, 6))}
        calls.append(Call("store", f"it{iteration:03d}/store{k}", entries))
    names = sorted(model)
    rng.shuffle(names)
    if len(names) >= 3:
        a, b, doomed = names[:3]
        merged = {join("a", n): p for n, p in model[a].items()} | {join("b", n): p for n, p in model[b].items()}
        calls.append(Call("union", f"it{iteration:03d}/union", merged, (a, b)))
        calls.append(Call("delete", doomed, None))
    return calls


def start_call(stub, call: Call, rng: random.Random) -> threading.Thread:
    """A thread running ``call`` against ``stub``."""
    if call.kind == "store":
        chunk = rng.choice([64 << 10, 1 << 20])
        action = lambda: stub.Store(store_requests(call.archive, call.effect, chunk), timeout=60)  # noqa: E731
    elif call.kind == "union":
        assert call.sources is not None
        a, b = call.sources
        request = pb.UnionRequest(target=call.archive, sources=[pb.UnionSource(archive=a, prefix="a"),
                                                                pb.UnionSource(archive=b, prefix="b")])
        action = lambda: stub.Union(request, timeout=60)  # noqa: E731
    else:
        action = lambda: stub.Delete(pb.DeleteRequest(archive=call.archive), timeout=60)  # noqa: E731
    thread = threading.Thread(target=run_call, args=(call, action), daemon=True)
    thread.start()
    return thread


def check_after_restart(stub, model: dict[str, dict[str, bytes]], calls: list[Call]) -> tuple[list[str], dict]:
    """Problems with what the restarted server lists, and the model it holds now."""
    problems = []
    listed = {a.name for a in list_all(stub)}
    touched = {c.archive: c for c in calls}
    expected: dict[str, dict[str, bytes]] = {}
    for name in sorted(listed | set(model) | set(touched)):
        call = touched.get(name)
        before = model.get(name)
        if call is None:
            if before is not None and name not in listed:
                problems.append(f"{name!r}, stored before and untouched, is gone")
            elif before is None:
                problems.append(f"{name!r} is listed but no call made it")
            else:
                expected[name] = before
            continue
        ok = call.status is grpc.StatusCode.OK
        if call.effect is None:  # a delete
            if ok and name in listed:
                problems.append(f"{name!r} is listed after its Delete answered OK")
            elif name in listed:
                expected[name] = before  # the delete did not take effect: the archive as it was
        elif name in listed:
            expected[name] = call.effect
        elif ok:
            problems.append(f"{name!r}: its {call.kind} answered OK, but it is not listed")
        elif call.status not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, None):
            problems.append(f"{name!r}: {call.kind} answered {call.status.name} {call.details!r} before the kill")
    for name, entries in expected.items():
        fetched = collect_fetch(stub.Fetch(pb.FetchRequest(archive=name), timeout=60))
        if fetched != entries:
            problems.append(f"{name!r} is partial or wrong after the kill: {len(fetched)} entries fetched, "
                            f"{len(entries)} expected, equal: {sorted(n for n in fetched if fetched[n] == entries.get(n))}")
    return problems, expected


@pytest.mark.slow
def test_kill_9_at_random_moments_leaves_only_whole_archives(tmp_path, record_property):
    rng = random.Random(SEED)
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir)
    model: dict[str, dict[str, bytes]] = {}
    kills = effects = in_flight_whole = in_flight_absent = 0
    started = time.monotonic()
    try:
        for iteration in range(ITERATIONS):
            server.start()
            with grpc.insecure_channel(server.target) as channel:
                stub = archives_pb2_grpc.ArchivesStub(channel)
                for name in sorted(model)[: max(0, len(model) - KEEP)]:
                    stub.Delete(pb.DeleteRequest(archive=name), timeout=60)
                    del model[name]
                calls = plan_calls(rng, iteration, model)
                threads = [start_call(stub, call, rng) for call in calls]
                time.sleep(rng.uniform(0.0, 0.4))
                server.kill()
                kills += 1
                for thread in threads:
                    thread.join(60)
            if iteration % 5 == 4:
                assert scrub(data_dir) == [], f"iteration {iteration}: scrub found bad blobs after the kill"
            server.start()
            with grpc.insecure_channel(server.target) as channel:
                stub = archives_pb2_grpc.ArchivesStub(channel)
                problems, model = check_after_restart(stub, model, calls)
                assert not problems, f"seed {SEED} iteration {iteration}: " + "; ".join(problems)
                problems = store_problems(stub, data_dir, model)
                assert not problems, f"seed {SEED} iteration {iteration} after recovery: " + "; ".join(problems)
            for call in calls:
                landed = (call.archive in model) == (call.effect is not None)
                effects += call.status is grpc.StatusCode.OK
                if call.status is not grpc.StatusCode.OK:
                    in_flight_whole += landed
                    in_flight_absent += not landed
            server.kill()
        server.start()
        server.stop()
        assert scrub(data_dir) == [], "scrub found bad blobs at the end"
    finally:
        server.kill()
    summary = (f"kill loop seed {SEED}: {kills} kills survived in {time.monotonic() - started:.1f} s; "
               f"{effects} calls answered OK before the kill, calls in flight: {in_flight_whole} took effect whole, "
               f"{in_flight_absent} not at all; {len(model)} archives at the end")
    print("\n" + summary)
    record_property("kill_loop_summary", summary)
    assert kills >= ITERATIONS

