"""Weight deltas (issue 37): a version streamed as its changes from the one before, applied
only onto its exact base and checked by digest; every other follower takes it whole. Each
case runs against the real server (worker processes where a process matters) and ends with
every follower on a whole version, bit-exact: the SHA-256 of every tensor matches."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tannery
import tannery.aio
from tannery.weights.deltas import DELTA_LIMIT, Base, apply_changes, diff_entry, diff_version
from tannery.weights.stream import DELTA, Assembler, delta_payloads, version_payloads
from tannery.weights.versions import PUSH_KEY
from tannery.weights import AsyncFollower, AsyncPublisher, Follower, Publisher

from .server_harness import running_server
from .test_weights import Following, lines, worker_process
from .weights_worker import RL_SHAPES, RLTrainer, digests, rl_target

ROOT = Path(__file__).resolve().parent.parent
MODEL_BYTES = sum(rows * cols * 2 for rows, cols in RL_SHAPES.values())


@pytest.fixture
def srv(tmp_path):
    with running_server(tmp_path) as server:
        yield server


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return digests(a) == digests(b)


# --- the encoding, on its own ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex128])
def test_a_delta_rebuilds_the_new_tensor_bit_for_bit_in_every_dtype(dtype):
    generator = torch.Generator().manual_seed(1)
    base = (torch.randn(64, 33, generator=generator) * 100).to(dtype)
    new = base.clone()
    flat = new.view(-1)
    picked = torch.randperm(flat.numel(), generator=generator)[:40]
    flat[picked] = (torch.randn(40, generator=generator) * 100).to(dtype) if dtype != torch.bool else ~flat[picked]
    change = diff_entry("w", base, new)
    assert change.kind == "delta" and change.payloads[0].numel() <= 40 * (2 if dtype == torch.complex128 else 1)
    held = base.clone()
    assert apply_changes({"w": held}, [change]) == []
    assert same_bits({"w": held}, {"w": new})


def test_changes_are_told_by_their_bits_nan_and_negative_zero_included():
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 64)
    new = base.clone()
    new[0] = -0.0  # equal as a float, other bits
    new[1] = float("-nan") if torch.tensor(float("-nan")).view(torch.int32) != base[1].view(torch.int32) else 7.0
    change = diff_entry("w", base, new)
    assert change.kind == "delta" and sorted(change.payloads[0].tolist()) == [0, 1]
    held = base.clone()
    assert apply_changes({"w": held}, [change]) == [] and same_bits({"w": held}, {"w": new})


def test_an_unchanged_tensor_sends_nothing_and_a_mostly_changed_one_goes_whole():
    base = torch.randn(1000)
    assert diff_entry("w", base, base.clone()).kind == "same"
    assert diff_entry("w", base, base.clone()).payloads == []
    assert diff_entry("w", base, torch.randn(1000)).kind == "whole"
    # 4 bytes of index and 4 of value a changed float32: 30% changed is 60% of the tensor
    third = base.clone()
    third[:300] += 1
    assert diff_entry("w", base, third).kind == "whole"
    assert DELTA_LIMIT == 0.5


def test_a_version_goes_whole_when_its_keys_shapes_or_size_of_changes_say_so():
    base = {"a": torch.randn(100), "b": torch.randn(100)}
    assert diff_version(base, {"a": base["a"].clone()}) is None  # a key less
    assert diff_version(base, {"a": base["a"].clone(), "b": torch.randn(10)}) is None  # a shape
    assert diff_version(base, {"a": base["a"].double(), "b": base["b"].clone()}) is None  # a dtype
    assert diff_version(base, {"a": torch.randn(100), "b": torch.randn(100)}) is None  # more than half
    one = {"a": base["a"].clone(), "b": base["b"].clone()}
    one["a"][3] = 9.0
    assert [c.kind for c in diff_version(base, one)] == ["delta", "same"]


def test_a_digest_that_fails_undoes_every_change():
    base = {"a": torch.randn(100), "b": torch.randn(100)}
    new = {key: t.clone() for key, t in base.items()}
    new["a"][5], new["b"][7] = 1.5, 2.5
    changes = diff_version(base, new)
    changes[1].payloads[1][0] ^= 1  # damaged on the way: a bit of b's value
    held = {key: t.clone() for key, t in base.items()}
    assert apply_changes(held, changes) == ["b"]
    assert same_bits(held, base), "a failed delta left changes behind"


def test_the_assembler_completes_a_delta_only_whole_and_refuses_a_hostile_manifest():
    base, new = {"w": torch.randn(256)}, {"w": torch.randn(256)}
    new["w"][:] = base["w"]
    new["w"][9] = 3.0
    keeper = Base()
    keeper.take(4, "p4", base, None)
    payloads = list(delta_payloads(5, "p5", (4, "p4"), new, keeper.changes(new)))
    assembler = Assembler("w")
    done = [assembler.add(p) for p in payloads]
    assert done[:-1] == [None] * (len(payloads) - 1)
    version = done[-1]
    assert (version.version, version.base, [c.kind for c in version.changes]) == (5, (4, "p4"), ["delta"])
    torn = Assembler("w")
    assert [torn.add(p) for p in payloads[:2] + payloads[-1:]] == [None, None, None] and torn.dropped == 1
    manifest = json.loads(payloads[0].numpy().tobytes()[len(DELTA):])
    manifest["entries"][0][5] = 10**9  # more changed elements than the tensor has
    forged = torch.frombuffer(bytearray(DELTA + json.dumps(manifest).encode()), dtype=torch.uint8)
    fooled = Assembler("w")
    assert [fooled.add(p) for p in [forged, *payloads[1:]]] == [None] * len(payloads) and fooled.dropped == 1


# --- against the real server -------------------------------------------------------------------

def test_three_worker_processes_apply_rl_versions_as_deltas_bit_exact(srv):
    trainer = RLTrainer(seed=0)
    workers = [worker_process(srv.target, "policy", 3, "--rl") for _ in range(3)]
    pushed, sizes = {}, {}
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        for version in range(4):
            state = trainer.state() if version == 0 else trainer.step()
            pushed[version] = digests(state)
            result = publisher.push(state, version)
            sizes[version] = (result.delta, result.streamed_bytes)
            time.sleep(0.3)
    assert sizes[0] == (False, MODEL_BYTES)  # nothing to diff against: whole
    for version in (1, 2, 3):
        delta, sent = sizes[version]
        assert delta and 0 < sent < 0.15 * MODEL_BYTES, f"version {version}: {sizes[version]}"
    for process in workers:
        seen = lines(process)
        assert [(line["version"], line["via"], line["delta"]) for line in seen] == [
            (0, "channel", False), (1, "channel", True), (2, "channel", True), (3, "channel", True)]
        for line in seen:
            assert line["digests"] == pushed[line["version"]], f"version {line['version']} is not bit-exact"
            assert line["in_place"]


def test_a_follower_that_missed_the_base_takes_the_version_whole_from_the_store(srv):
    trainer = RLTrainer(seed=0)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(trainer.state(), 0)
        behind, along = rl_target(), rl_target()
        with Follower(client, "policy", behind) as late, Follower(client, "policy", along) as running:
            assert next(late).version == 0 and next(running).version == 0
            for version in (1, 2):  # `late` does not iterate meanwhile: it misses version 1
                state = trainer.step()
                assert publisher.push(state, version).delta
                applied = next(running)
                assert (applied.version, applied.delta) == (version, True)
            taken = [next(late)]  # its newest streamed is the delta of 2 onto 1, which it lacks
            while taken[-1].version < 2:
                taken.append(next(late))
            assert taken[0].via == "store" and not taken[0].delta  # the delta of 2 onto 1 is not applied onto 0
            for applied in taken[1:]:  # then (the store brought 1): 2 as a delta onto 1, or whole
                assert not applied.delta or applied.previous == applied.version - 1
            assert same_bits(behind, state) and same_bits(along, state)
            state = trainer.step()  # from the store it learned version 2's push: deltas again
            publisher.push(state, 3)
            assert next(late).delta and next(running).delta
    assert same_bits(behind, state) and same_bits(along, state)


@pytest.mark.parametrize("damage", ["a value's bit", "an index out of range"])
def test_a_delta_damaged_on_the_way_is_undone_logged_and_the_version_taken_whole(srv, caplog, damage):
    trainer = RLTrainer(seed=0)
    first = trainer.state()
    with tannery.Client(srv.target) as client:
        Publisher(client, "policy").push(first, 0)
        push = client.describe("policy/v0").metadata[PUSH_KEY]
        held = rl_target()
        following = Following(Follower(client, "policy", held))
        following.wait_for(0)
        second = trainer.step()
        keeper = Base()
        keeper.take(0, push, first, None)
        changes = keeper.changes(second)
        if damage == "a value's bit":
            changes[2].payloads[1][0] ^= 1  # one bit of one value, flipped on the way
        else:
            changes[2].payloads[0][-1] = 10**8  # past the tensor's end
        with caplog.at_level(logging.WARNING, logger="tannery.weights"):
            client.publish("policy", delta_payloads(1, "damaged", (0, push), second, changes))
            deadline = time.monotonic() + 10
            while "fails its digest" not in caplog.text:
                assert time.monotonic() < deadline, "the damaged delta was never tried"
                time.sleep(0.02)
        assert "blocks.2.weight" in caplog.text
        assert following.versions() == [0] and same_bits(held, first), "a damaged delta left changes behind"
        Publisher(client, "policy", stream=False).push(second, 1)  # the store brings version 1 whole
        following.wait_for(1)
        following.stop()
    assert following.applied[-1].via == "store" and same_bits(held, second)


TRAINER = """
import sys, time, torch, tannery
from tannery.weights import Publisher
from tannery.weights.stream import delta_payloads
from tests.weights_worker import RLTrainer
trainer = RLTrainer(seed=0)
with tannery.Client(sys.argv[1], transport="grpc") as client:
    publisher = Publisher(client, "policy")
    publisher.push(trainer.step(), 1)  # whole: this publisher had no base
    state = trainer.step()
    base = publisher._pushing.base
    changes = base.changes(state)
    def cut_off():
        for index, payload in enumerate(delta_payloads(2, "cut", (base.version, base.push), state, changes)):
            yield payload
            if index == 2:
                print("pushing", flush=True)
                time.sleep(60)  # killed here, mid-delta
    client.publish("policy", cut_off())
    print("pushed", flush=True)
"""


def test_a_publisher_killed_mid_delta_changes_nothing_and_the_next_push_levels_everyone(srv, tmp_path):
    trainer = RLTrainer(seed=0)
    with tannery.Client(srv.target) as client:
        Publisher(client, "policy").push(trainer.state(), 0)
        held = rl_target()
        following = Following(Follower(client, "policy", held))
        following.wait_for(0)
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen([sys.executable, str(script), srv.target], stdout=subprocess.PIPE, text=True,
                                   env=env)
        assert process.stdout.readline().strip() == "pushing"
        following.wait_for(1)
        version_one = trainer.step()
        assert same_bits(held, version_one)
        process.kill()
        assert process.wait(10) == -9 and process.stdout.read() == "", "the delta ended before the kill"
        time.sleep(0.5)
        assert following.versions() == [0, 1] and following.errors == []
        assert same_bits(held, version_one), "a cut-off delta changed the target"
        version_two = trainer.step()
        Publisher(client, "policy").push(version_two, 2)  # a trainer started again: whole, then deltas
        following.wait_for(2)
        following.stop()
    assert same_bits(held, version_two)


def test_two_publishers_payloads_interleaved_never_make_a_version(srv):
    trainer, other = RLTrainer(seed=0), RLTrainer(seed=5)
    first = trainer.state()
    with tannery.Client(srv.target) as client:
        Publisher(client, "policy").push(first, 0)
        push = client.describe("policy/v0").metadata[PUSH_KEY]
        held = rl_target()
        following = Following(Follower(client, "policy", held))
        following.wait_for(0)
        mine, theirs = trainer.step(), other.step()
        keeper = Base()
        keeper.take(0, push, first, None)
        gate = [threading.Event(), threading.Event()]

        def alternating(payloads, turn):  # each payload waits for the other publisher's
            for payload in payloads:
                gate[turn].wait(5)
                gate[turn].clear()
                yield payload
                gate[1 - turn].set()

        threads = [threading.Thread(target=client.publish, args=(
                       "policy", alternating(delta_payloads(1, "mine", (0, push), mine, keeper.changes(mine)), 0))),
                   threading.Thread(target=client.publish, args=(
                       "policy", alternating(version_payloads(1, "theirs", theirs), 1)))]
        for thread in threads:
            thread.start()
        gate[0].set()
        for thread in threads:
            thread.join(30)
        time.sleep(0.5)
        assert following.versions() == [0] and same_bits(held, first), "a torn mixture was applied"
        final = trainer.step()
        Publisher(client, "policy").push(final, 1)
        following.wait_for(1)
        following.stop()
    assert same_bits(held, final)


def test_a_follower_joining_mid_delta_starts_from_the_store_then_takes_deltas(srv):
    trainer = RLTrainer(seed=0)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(trainer.state(), 0)
        state = trainer.step()
        base = publisher._pushing.base
        payloads = list(delta_payloads(1, "half", (base.version, base.push), state, base.changes(state)))
        half = len(payloads) // 2
        joined = threading.Event()

        def slow():
            yield from payloads[:half]
            joined.wait(10)
            yield from payloads[half:]

        sender = threading.Thread(target=client.publish, args=("policy", slow()))
        sender.start()
        held = rl_target()
        following = Following(Follower(client, "policy", held))  # subscribed midway through version 1
        joined.set()
        sender.join(10)
        following.wait_for(0)
        time.sleep(0.3)
        assert following.versions() == [0], "half a delta was applied"
        for version in (1, 2):
            state = trainer.step()
            assert publisher.push(state, version).delta
            following.wait_for(version)
        following.stop()
    # version 0 from the store, with its push's id: the publisher's deltas onto it apply
    assert [(a.version, a.via, a.delta) for a in following.applied] == [
        (0, "store", False), (1, "channel", True), (2, "channel", True)]
    assert same_bits(held, state)


def test_a_bfloat16_follower_applies_a_float32_delta_and_holds_the_cast(srv):
    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 256, generator=generator), "b": torch.randn(256, generator=generator)}
    held = {"w": torch.zeros(256, 256, dtype=torch.bfloat16), "b": torch.zeros(256, dtype=torch.bfloat16)}
    where = held["w"].data_ptr()
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(state, 0)
        with Follower(client, "policy", held) as follower:
            assert next(follower).version == 0
            for version in (1, 2, 3):
                state = {key: t.clone() for key, t in state.items()}
                state["w"].view(-1)[torch.randperm(65536, generator=generator)[:600]] += 0.5  # 1% of w
                assert publisher.push(state, version).delta
                applied = next(follower)
                assert (applied.version, applied.delta) == (version, True)
                assert same_bits(held, {key: t.to(torch.bfloat16) for key, t in state.items()})
    assert held["w"].data_ptr() == where


def test_a_worker_restarted_with_an_old_version_on_disk_takes_the_newest_whole_then_deltas(srv, tmp_path):
    trainer = RLTrainer(seed=0)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(trainer.state(), 0)
        old = tmp_path / "v0.pt"
        torch.save(trainer.state(), old)  # what the worker held when it went down
        for version in (1, 2):
            publisher.push(trainer.step(), version)
        process = worker_process(srv.target, "policy", 3, "--rl", "--load", str(old))
        time.sleep(0.5)
        state = trainer.step()
        publisher.push(state, 3)
        seen = lines(process)
    assert [(line["version"], line["via"], line["delta"]) for line in seen] == [
        (2, "store", False), (3, "channel", True)]
    assert seen[-1]["digests"] == digests(state)


def test_a_row_shard_takes_delta_versions_from_the_store_with_only_its_rows(srv):
    trainer = RLTrainer(seed=0)
    state = trainer.state()
    shard = {key: torch.zeros(128, 512, dtype=torch.bfloat16) for key in RL_SHAPES}
    rows = {key: (128, 256) for key in RL_SHAPES}
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(state, 0)
        with Follower(client, "policy", shard, rows=rows) as follower:
            next(follower)
            state = trainer.step()
            assert publisher.push(state, 1).delta
            applied = next(follower)
            assert (applied.version, applied.via, applied.nbytes) == (1, "store", MODEL_BYTES // 4)
    assert same_bits(shard, {key: t[128:256] for key, t in state.items()})


def test_tied_weights_take_a_delta_once_and_stay_one_tensor(srv):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.head = torch.nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    trainer, worker = Tied(), Tied()
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "tied")
        publisher.push(trainer, 0)
        with Follower(client, "tied", worker) as follower:
            next(follower)
            for version in (1, 2):
                with torch.no_grad():
                    trainer.embed.weight[version, :4] += 1.0
                assert publisher.push(trainer, version).delta
                applied = next(follower)
                assert applied.delta and applied.entries == 1
    assert worker.head.weight is worker.embed.weight
    assert same_bits(worker.state_dict(), trainer.state_dict())


def test_a_whole_new_version_and_delta_false_go_whole(srv):
    generator = torch.Generator().manual_seed(0)
    held = {"w": torch.zeros(128, 128)}
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        off = Publisher(client, "other", delta=False)
        with Follower(client, "policy", held) as follower:
            for version in range(3):
                state = {"w": torch.randn(128, 128, generator=generator)}  # every element new
                result = publisher.push(state, version)
                assert not result.delta and result.streamed_bytes == 128 * 128 * 4
                assert not next(follower).delta
            for version in range(2):
                assert not off.push(state, version).delta
    assert same_bits(held, state)


def test_the_asyncio_twins_send_and_apply_deltas(srv):
    trainer = RLTrainer(seed=0)
    held = rl_target()

    async def scenario() -> list[tuple[int, bool]]:
        async with tannery.aio.Client(srv.target) as client:
            publisher = AsyncPublisher(client, "policy", keep=2)
            await publisher.push(trainer.state(), 0)
            seen = []
            async with AsyncFollower(client, "policy", held) as follower:
                async for applied in follower:
                    seen.append((applied.version, applied.delta))
                    if applied.version == 3:
                        break
                    pushed = await publisher.push(trainer.step(), applied.version + 1)
                    assert pushed.delta
            return seen

    assert asyncio.run(scenario()) == [(0, False), (1, True), (2, True), (3, True)]
    assert same_bits(held, trainer.state())


@pytest.mark.external
def test_replica_b_relays_deltas_from_a_trainer_on_replica_a_through_nats(tmp_path, postgres_url, s3_url, nats_url):
    from .backends import SHARED_TIMINGS

    shared = {"catalog": postgres_url, "blobs": s3_url, "nats": nats_url, **SHARED_TIMINGS}
    trainer = RLTrainer(seed=0)
    held = [rl_target(), rl_target()]
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        with tannery.Client(a.target) as on_a, tannery.Client(b.target) as on_b:
            publisher = Publisher(on_a, "policy")
            publisher.push(trainer.state(), 0)
            followings = [Following(Follower(on_b, "policy", target)) for target in held]
            for following in followings:
                following.wait_for(0)
            for version in range(1, 4):
                state = trainer.step()
                assert publisher.push(state, version).delta
                for following in followings:
                    following.wait_for(version)
            for following in followings:
                following.stop()
    for following in followings:
        assert [(a.via, a.delta) for a in following.applied[1:]] == [("channel", True)] * 3
    assert all(same_bits(target, state) for target in held)


def test_a_delta_push_stores_its_version_by_derive_bit_exact(tmp_path):
    """A version streamed as a delta is stored by Derive from the version before (only the changes
    travel to the store), bit-exact with what was pushed; the first, whole, version is stored by
    its Publish (store_as): no Store call at all."""
    from .test_metrics import scrape, value

    trainer = RLTrainer(seed=3)
    pushed = {}
    with running_server(tmp_path) as srv, tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        with Follower(client, "policy", rl_target()):
            for version in range(3):
                state = trainer.state() if version == 0 else trainer.step()
                pushed[version] = {k: v.clone() for k, v in state.items()}
                assert publisher.push(state, version).delta == (version > 0)
        samples = scrape(srv.metrics_port)
        assert value(samples, "tannery_calls_total", method="Derive", code="OK") == 2
        assert value(samples, "tannery_calls_total", method="Store", code="OK") is None
        assert value(samples, "tannery_calls_total", method="Publish", code="OK") == 3
        for version, state in pushed.items():
            archive = client.fetch(f"policy/v{version}")
            assert same_bits({k: archive.find(k) for k in archive.names()}, state)


def test_a_delta_push_to_a_server_without_derive_stores_the_version_whole(tmp_path, monkeypatch):
    import grpc
    from tannery_server.archives import ArchivesServicer

    async def unimplemented(self, requests, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    monkeypatch.setattr(ArchivesServicer, "Derive", unimplemented)
    trainer = RLTrainer(seed=4)
    with running_server(tmp_path) as srv, tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        with Follower(client, "policy", rl_target()):
            publisher.push(trainer.state(), 0)
            for version in (1, 2):
                state = trainer.step()
                assert publisher.push(state, version).delta
        assert not publisher._pushing.derives  # asked once, then whole versions
        archive = client.fetch("policy/v2")
        assert same_bits({k: archive.find(k) for k in archive.names()}, state)
