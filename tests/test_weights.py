"""Weight sync (issue 30): a trainer pushes versions, followers apply each whole and in place,
against the real server: worker processes, late joiners, slow workers, a trainer killed
mid-push, a server restart, replicas through NATS, and every refusal naming the entry."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import tannery
import tannery.aio
from tannery.weights import AsyncFollower, AsyncPublisher, Follower, Publisher
from tannery_protocol.errors import AliasError, AlreadyExists, ArchiveError, NotFound

from .server_harness import running_server
from .weights_worker import digests, model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def srv(tmp_path):
    with running_server(tmp_path) as server:
        yield server


def step(module: torch.nn.Module, by: float) -> dict[str, torch.Tensor]:
    """A training step, as far as weights go: every parameter moves; the state dict after it."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * by)
    return {key: t.clone() for key, t in module.state_dict().items()}


def worker_process(target: str, name: str, until: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "tests.weights_worker", target, name, "--until", str(until),
                                *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert json.loads(process.stdout.readline()) == {"ready": True}, process.stderr.read()
    return process


def lines(process: subprocess.Popen, timeout: float = 60) -> list[dict[str, Any]]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


class Following:
    """A follower on a thread of this process: the versions it applied, as Applied records."""

    def __init__(self, follower: Follower, pause: float = 0.0, until: int | None = None) -> None:
        self.follower, self.pause, self.until = follower, pause, until
        self.applied: list[Any] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                applied = next(self.follower)
            except StopIteration:
                return
            except ArchiveError as error:  # a refused version: the follower goes on
                self.errors.append(error)
                continue
            self.applied.append(applied)
            if self.until is not None and applied.version >= self.until:
                return
            time.sleep(self.pause)

    def versions(self) -> list[int]:
        return [applied.version for applied in self.applied]

    def wait_for(self, version: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not self.applied or self.applied[-1].version < version:
            assert time.monotonic() < deadline, f"version {version} not applied; got {self.versions()}"
            time.sleep(0.01)

    def stop(self) -> None:
        self.follower.close()
        self.thread.join(10)


def test_three_worker_processes_apply_every_version_whole_in_order_and_in_place(srv):
    trainer = model(seed=0)
    workers = [worker_process(srv.target, "policy", 4) for _ in range(3)]
    pushed = {}
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        for version in range(5):
            pushed[version] = digests(step(trainer, 0.1))
            result = publisher.push(trainer, version)
            assert (result.version, result.archive) == (version, f"policy/v{version}")
            time.sleep(0.3)  # each worker sees each version (a worker that is behind skips: tested below)
        assert client.resolve("policy") == "policy/v4"
        assert [info.name for info in client.list("policy/")] == [f"policy/v{v}" for v in range(5)]
    for process in workers:
        seen = lines(process)
        assert [line["version"] for line in seen] == [0, 1, 2, 3, 4]
        assert [line["via"] for line in seen] == ["channel"] * 5  # streamed to the running workers
        for line in seen:
            assert line["digests"] == pushed[line["version"]], f"version {line['version']} is not bit-exact"
            assert line["in_place"], "a parameter was reallocated"


def test_a_worker_killed_disturbs_no_one_else(srv):
    trainer = model(seed=0)
    doomed, survivor = (worker_process(srv.target, "policy", 2) for _ in range(2))
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(step(trainer, 0.1), 0)
        assert json.loads(doomed.stdout.readline())["version"] == 0
        doomed.kill()
        doomed.wait(10)
        for version in (1, 2):
            started = time.monotonic()
            latest = digests(step(trainer, 0.1))
            publisher.push(trainer, version)
            assert time.monotonic() - started < 5  # no wait on the dead one
            time.sleep(0.3)
    seen = lines(survivor)
    assert [line["version"] for line in seen] == [0, 1, 2] and seen[-1]["digests"] == latest


def test_a_bfloat16_worker_gets_each_version_cast_in_place(srv):
    trainer = model(seed=0)
    process = worker_process(srv.target, "policy", 1, "--dtype", "bfloat16")
    expected = {}
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        for version in range(2):
            state = step(trainer, 0.1)
            expected[version] = digests({key: t.to(torch.bfloat16) for key, t in state.items()})
            publisher.push(state, version)
            time.sleep(0.3)
    seen = lines(process)
    assert [line["version"] for line in seen] == [0, 1]
    assert all(line["digests"] == expected[line["version"]] and line["in_place"] for line in seen)


def test_a_row_shard_receives_only_its_rows(srv):
    trainer = {"w": torch.randn(8, 16), "b": torch.randn(8)}
    shard = {"w": torch.zeros(4, 16), "b": torch.zeros(8)}
    where = shard["w"].data_ptr()
    with tannery.Client(srv.target) as client:
        Publisher(client, "tp").push(trainer, 0)
        with Follower(client, "tp", shard, rows={"w": (4, 8)}) as follower:
            applied = next(follower)
            assert applied.via == "store" and applied.nbytes == (4 * 16 + 8) * 4  # only the shard's rows came
            assert torch.equal(shard["w"], trainer["w"][4:8]) and torch.equal(shard["b"], trainer["b"])
            trainer = {key: t + 1 for key, t in trainer.items()}
            Publisher(client, "tp").push(trainer, 1)
            assert next(follower).via == "channel"  # the whole tensor came: the shard took its rows
    assert torch.equal(shard["w"], trainer["w"][4:8]) and torch.equal(shard["b"], trainer["b"])
    assert shard["w"].data_ptr() == where


def test_a_follower_without_the_channel_takes_every_version_from_the_store(srv):
    trainer = model(seed=0)
    worker = model(seed=1)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        with Follower(client, "policy", worker, stream=False) as follower:
            for version in range(3):
                latest = step(trainer, 0.1)
                assert publisher.push(latest, version).streamed
                applied = next(follower)
                assert (applied.version, applied.via) == (version, "store")
    assert digests(worker.state_dict()) == digests(latest)


def test_the_assembler_hands_out_only_whole_versions_of_one_push():
    from tannery.weights.stream import Assembler, version_payloads

    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    assembler = Assembler("w")
    payloads = list(version_payloads(7, "push-a", state))  # manifest, a, b, end
    assert [assembler.add(p) for p in payloads[1:]] == [None, None, None]  # joined midway: nothing
    assert [assembler.add(p) for p in payloads[:2]] == [None, None]
    assert assembler.pending == 7
    assert assembler.add(next(version_payloads(8, "push-b", state))) is None  # v7 cut off by v8's manifest
    assert assembler.dropped == 1 and assembler.pending == 8
    assert assembler.add(torch.ones(2, 2)) is None  # 'a' should be [3]: the version is dropped
    assert assembler.dropped == 2 and assembler.pending is None
    # Two publishers interleaved: the end of one push after the other's manifest is refused.
    other = list(version_payloads(9, "push-c", state))
    for payload in [payloads[0], other[0], payloads[1], payloads[2], payloads[3]]:
        assert assembler.add(payload) is None
    assert [assembler.add(p) for p in other[1:]] == [None, None, None]  # its tensors came after a stranger's end
    for payload in payloads[:-1]:
        assert assembler.add(payload) is None
    whole = assembler.add(payloads[-1])
    assert (whole.version, whole.push, list(whole.tensors)) == (7, "push-a", ["a", "b"])
    assert torch.equal(whole.tensors["b"], state["b"])


def test_a_trainer_started_again_that_pushes_a_number_once_more_brings_every_follower_to_it(srv):
    # A trainer killed after streaming v1 but before storing it leaves the running followers on
    # its v1; the trainer started again pushes its own v1: every follower applies that one.
    trainer = model(seed=0)
    worker = model(seed=1)
    with tannery.Client(srv.target) as client:
        Publisher(client, "policy").push(step(trainer, 0.1), 0)
        with Follower(client, "policy", worker) as follower:
            assert next(follower).version == 0
            from tannery.weights.stream import version_payloads

            lost = step(trainer, 0.1)
            client.publish("policy", version_payloads(1, "the-killed-push", lost))  # streamed, never stored
            applied = next(follower)
            assert (applied.version, applied.via) == (1, "channel") and digests(worker.state_dict()) == digests(lost)
            again = step(trainer, 0.1)
            Publisher(client, "policy").push(again, 1)  # learns v0 from the alias: pushes 1 again
            applied = next(follower)
            assert applied.version == 1 and digests(worker.state_dict()) == digests(again)


def test_keep_prunes_only_the_versions_of_these_weights(srv):
    with tannery.Client(srv.target) as client:
        client.store("policy/value-head", {"w": torch.ones(2)})
        client.store("policy/v9-notes", {"w": torch.ones(2)})
        publisher = Publisher(client, "policy", keep=1)
        for version in range(3):
            pushed = publisher.push({"w": torch.full((2,), float(version))}, version)
        assert pushed.pruned == ("policy/v1",)
        assert [info.name for info in client.list("policy/")] == ["policy/v2", "policy/v9-notes", "policy/value-head"]


def test_one_push_at_a_time_per_publisher(srv):
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        pushing = publisher._pushing
        pushing.lock.acquire()  # as while another thread's push is under way
        with pytest.raises(RuntimeError, match="a push is under way; push one version at a time"):
            publisher.push({"w": torch.ones(2)}, 0)
        pushing.lock.release()
        assert publisher.push({"w": torch.ones(2)}, 0).version == 0


def test_a_second_thread_pushing_meanwhile_fails_at_once_and_the_first_push_lands(srv):
    """Two threads push through one publisher: the second, while the first is under way (held
    inside it), raises RuntimeError at once; the first lands; the publisher is free after."""
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        pushing = publisher._pushing
        real, entered, release = pushing.learn, threading.Event(), threading.Event()

        def held(core):
            entered.set()
            assert release.wait(30), "never released"
            return (yield from real(core))

        pushing.learn = held
        first: list[Any] = []
        thread = threading.Thread(target=lambda: first.append(publisher.push({"w": torch.ones(2)}, 0)))
        thread.start()
        try:
            assert entered.wait(30)
            second: list[BaseException] = []
            started = time.monotonic()

            def push_again() -> None:
                try:
                    publisher.push({"w": torch.full((2,), 2.0)}, 1)
                except BaseException as exc:  # noqa: BLE001: the test looks at it
                    second.append(exc)

            other = threading.Thread(target=push_again)
            other.start()
            other.join(30)
            assert time.monotonic() - started < 5  # at once: it did not wait for the first
            assert len(second) == 1 and isinstance(second[0], RuntimeError), second
            assert "a push is under way; push one version at a time" in str(second[0])
        finally:
            release.set()
            thread.join(60)
        assert [p.version for p in first] == [0] and client.resolve("policy") == "policy/v0"
        del pushing.learn
        assert publisher.push({"w": torch.full((2,), 2.0)}, 1).version == 1


def test_a_late_joiner_starts_from_the_latest_version_then_follows(srv):
    trainer = model(seed=0)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy", keep=2)
        for version in range(3):
            publisher.push(step(trainer, 0.1), version)
        assert [info.name for info in client.list("policy/")] == ["policy/v1", "policy/v2"]  # keep=2
        late = model(seed=1)
        following = Following(Follower(client, "policy", late))
        following.wait_for(2)
        assert following.versions() == [2] and following.applied[0].previous is None
        latest = step(trainer, 0.1)
        publisher.push(latest, 3)
        following.wait_for(3)
        following.stop()
        assert following.versions() == [2, 3]
        assert digests(late.state_dict()) == digests(latest)


def test_a_slow_worker_skips_to_the_newest_version(srv):
    trainer = model(seed=0)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push(step(trainer, 0.1), 0)
        slow = model(seed=1)
        following = Following(Follower(client, "policy", slow), pause=1.0)
        following.wait_for(0)
        for version in range(1, 6):
            latest = step(trainer, 0.1)
            publisher.push(latest, version)
        following.wait_for(5)
        following.stop()
    versions = following.versions()
    assert versions[0] == 0 and versions[-1] == 5 and len(versions) < 6, versions  # no backlog replayed
    assert versions == sorted(set(versions))
    assert [applied.previous for applied in following.applied] == [None, *versions[:-1]]
    assert digests(slow.state_dict()) == digests(latest)


def test_a_follower_started_before_any_push_waits_for_the_first(srv):
    worker = model(seed=1)
    with tannery.Client(srv.target) as client:
        following = Following(Follower(client, "later", worker), until=0)
        time.sleep(0.5)
        assert following.applied == []
        trainer = model(seed=0)
        Publisher(client, "later").push(trainer, 0)
        following.wait_for(0)
        following.stop()
    assert digests(worker.state_dict()) == digests(trainer.state_dict())


TRAINER = """
import sys, time, torch, tannery
from tannery.weights import Publisher
with tannery.Client(sys.argv[1], transport="grpc") as client:
    publisher = Publisher(client, "policy")
    big = {f"layer{i}": torch.full((16, 1 << 20), float(i)) for i in range(16)}  # 1 GiB: killed while it streams
    print("pushing", flush=True)
    publisher.push(big, 1)
    print("pushed", flush=True)
"""


def test_a_trainer_killed_mid_push_leaves_the_workers_and_the_store_on_the_old_version(srv, tmp_path):
    trainer = model(seed=0)
    with tannery.Client(srv.target) as client:
        first = step(trainer, 0.1)
        Publisher(client, "policy").push(first, 0)
        worker = model(seed=1)
        following = Following(Follower(client, "policy", worker))
        following.wait_for(0)
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        process = subprocess.Popen([sys.executable, str(script), srv.target], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "pushing"
        time.sleep(0.3)
        process.kill()
        assert process.wait(10) == -9 and process.stdout.read() == "", "the push ended before the kill"
        time.sleep(0.5)
        assert client.resolve("policy") == "policy/v0"
        with pytest.raises(NotFound):
            client.describe("policy/v1")
        assert following.versions() == [0] and following.errors == []
        assert digests(worker.state_dict()) == digests(first)
        Publisher(client, "policy").push(step(trainer, 0.1), 1)  # the next trainer goes on
        following.wait_for(1)
        following.stop()


def test_followers_survive_a_server_restart_and_go_on_from_the_stored_latest(tmp_path):
    trainer = model(seed=0)
    worker = model(seed=1)
    with running_server(tmp_path) as server:
        port = int(server.target.rsplit(":", 1)[1])
        with tannery.Client(server.target) as client:
            Publisher(client, "policy").push(step(trainer, 0.1), 0)
        follower_client = tannery.Client(server.target, retries=30)
        following = Following(Follower(follower_client, "policy", worker))
        following.wait_for(0)
    with running_server(tmp_path, port=port) as server:
        with tannery.Client(server.target) as client:
            latest = step(trainer, 0.1)
            Publisher(client, "policy").push(latest, 1)
        following.wait_for(1, timeout=30)
        following.stop()
        follower_client.close()
    assert following.versions() == [0, 1] and digests(worker.state_dict()) == digests(latest)


def test_followers_on_replica_b_of_a_trainer_on_replica_a_through_nats(tmp_path, postgres_url, s3_url, nats_url):
    from .backends import SHARED_TIMINGS

    shared = {"catalog": postgres_url, "blobs": s3_url, "nats": nats_url, **SHARED_TIMINGS}
    trainer = model(seed=0)
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        with tannery.Client(a.target) as on_a, tannery.Client(b.target) as on_b:
            publisher = Publisher(on_a, "policy")
            publisher.push(step(trainer, 0.1), 0)
            workers = [model(seed=1), model(seed=2)]
            followings = [Following(Follower(on_b, "policy", worker)) for worker in workers]
            for version in range(1, 4):
                latest = step(trainer, 0.1)
                started = time.monotonic()
                publisher.push(latest, version)
                for following in followings:
                    following.wait_for(version)
                assert time.monotonic() - started < 5
            for following in followings:
                following.stop()
    assert all(digests(worker.state_dict()) == digests(latest) for worker in workers)


@pytest.mark.parametrize("wrong, named", [
    (lambda s: {k: v for k, v in s.items() if k != "2.bias"}, r"no entries for the module's keys '2\.bias'"),
    (lambda s: {**s, "extra": torch.zeros(3)}, r"entries the module has no key for: 'extra'"),
    (lambda s: {**s, "0.weight": torch.zeros(48, 65)}, r"0\.weight: shape \[48, 65\] in the archive, \[48, 64\]"),
    (lambda s: {**s, "1.bias": torch.zeros(48, dtype=torch.int64)},
     r"1\.bias: dtype int64 in the archive cannot be cast to the module's float32"),
])
def test_a_version_that_does_not_fit_is_refused_naming_the_entry_and_changes_nothing(srv, wrong, named):
    trainer = model(seed=0)
    worker = model(seed=1)
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        good = step(trainer, 0.1)
        publisher.push(good, 0)
        with Follower(client, "policy", worker) as follower:
            assert next(follower).version == 0
            publisher.push(wrong(step(trainer, 0.1)), 1)
            with pytest.raises(ArchiveError, match=named) as refused:
                next(follower)
            assert "Follower of 'policy' (version 1)" in str(refused.value)
            assert digests(worker.state_dict()) == digests(good) and follower.version == 0
            fixed = step(trainer, 0.1)
            publisher.push(fixed, 2)
            assert next(follower).version == 2  # the follower goes on after a refusal
    assert digests(worker.state_dict()) == digests(fixed)


def test_the_publisher_refuses_a_version_that_does_not_go_up_and_a_second_trainer(srv):
    with tannery.Client(srv.target) as client:
        publisher = Publisher(client, "policy")
        publisher.push({"w": torch.ones(2)}, 3)
        with pytest.raises(ValueError, match="version 3 is not newer than version 3, the latest pushed"):
            publisher.push({"w": torch.ones(2)}, 3)
        assert Publisher(client, "policy").version == 3  # a new publisher learns where the alias is
        quiet = Publisher(client, "policy", stream=False)  # learns v3 now
        assert quiet.version == 3
        rival = Publisher(client, "policy")
        rival.push({"w": torch.zeros(2)}, 4)
        with pytest.raises(AliasError, match="points at 'policy/v4', not at 'policy/v3'.*another publisher"):
            publisher.push({"w": torch.ones(2)}, 5)  # refused before any follower sees it
        with pytest.raises(AliasError, match="'policy'.*policy/v4"):
            quiet.push({"w": torch.ones(2)}, 5)  # not streamed: stored, refused by the alias, deleted again
        assert client.resolve("policy") == "policy/v4"
        assert [info.name for info in client.list("policy/")] == ["policy/v3", "policy/v4"]
        with pytest.raises(ValueError, match="keep is True"):
            Publisher(client, "policy", keep=0)


def test_the_asyncio_twins_push_and_follow(srv):
    trainer = model(seed=0)
    worker = model(seed=1)

    async def scenario() -> list[int]:
        async with tannery.aio.Client(srv.target) as client:
            publisher = AsyncPublisher(client, "policy", keep=False)
            await publisher.push(step(trainer, 0.1), 0)
            seen = []
            async with AsyncFollower(client, "policy", worker) as follower:
                async for applied in follower:
                    seen.append(applied.version)
                    if applied.version == 2:
                        break
                    await publisher.push(step(trainer, 0.1), applied.version + 1)
            assert [info.name for info in await client.list("policy/")] == ["policy/v2"]  # keep=False
            return seen

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert digests(worker.state_dict()) == digests(trainer.state_dict())


def test_load_state_dict_of_a_gpt2_saved_by_save_pretrained_fills_its_tied_head(srv, tmp_path):
    transformers = pytest.importorskip("transformers")
    import safetensors.torch

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64)
    saved = transformers.GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path / "gpt2")
    weights = safetensors.torch.load_file(tmp_path / "gpt2" / "model.safetensors")
    assert "lm_head.weight" not in weights  # stored once, under the embeddings' name
    loaded = transformers.GPT2LMHeadModel(config)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with tannery.Client(srv.target) as client:
        client.store("gpt2", weights)
        missing, unexpected = client.load_state_dict(loaded, "gpt2")  # strict
        assert (missing, unexpected) == ([], [])
        assert torch.equal(loaded.lm_head.weight, saved.transformer.wte.weight)
        Publisher(client, "gpt2-live").push(weights, 0)
        with Follower(client, "gpt2-live", transformers.GPT2LMHeadModel(config)) as follower:
            applied = next(follower)
            assert applied.entries == len(weights)  # the tied head applied once, never missing
        with pytest.raises(ArchiveError, match=r"no entries for the module's keys 'transformer\.h\.1\.attn"):
            client.store("gpt2-short", {k: v for k, v in weights.items() if not k.startswith("transformer.h.1.attn")})
            client.load_state_dict(transformers.GPT2LMHeadModel(config), "gpt2-short")
