"""Diff of two 1 GiB archives, on a server of its own (its RSS is read from /proc): bounded memory
whatever the entries' sizes (the values are streamed a window at a time), and only the tensors
whose digests differ are read."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tannery

from .server_harness import ServerProcess

#: Tensors of each archive, and elements of each (128 MiB of float32): 1 GiB an archive.
TENSORS = 8
ELEMENTS = 32 << 20
#: What the server may grow by while it compares: its windows, work arrays and a few blocks. An
#: implementation that held one entry whole would grow by 128 MiB at least, one that held an
#: archive by 1 GiB.
GROWTH_LIMIT = 64 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc")


class _PeakRss:
    """The largest RSS of process ``pid`` seen while the block runs (sampled every 5 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, _rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_a_1_gib_pair_is_compared_in_bounded_memory(tmp_path):
    with ServerProcess(tmp_path / "data").start() as server, tannery.Client(server.target, retries=0) as client:
        generator = torch.Generator().manual_seed(1)
        for i in range(TENSORS):  # one tensor in this process at a time
            tensor = torch.randn(ELEMENTS, generator=generator)
            client.store(f"a{i}", {f"layer{i}.weight": tensor})
            tensor += 1e-3
            client.store(f"b{i}", {f"layer{i}.weight": tensor})
            del tensor
        client.union("A", [f"a{i}" for i in range(TENSORS)])
        client.union("B", [f"b{i}" for i in range(TENSORS)])
        client.union("A1", [*(f"a{i}" for i in range(TENSORS - 1)), f"b{TENSORS - 1}"])  # all but one shared
        before = _rss(server.pid)
        with _PeakRss(server.pid) as rss:
            started = time.monotonic()
            every = client.diff("A", "B")
            seconds = time.monotonic() - started
            one = client.diff("A", "A1")
        data = TENSORS * ELEMENTS * 4
        assert every.value_changed == TENSORS and every.bytes_read == 2 * data
        assert all(e.values.differing == ELEMENTS for e in every.entries)
        assert one.same == TENSORS - 1 and one.value_changed == 1 and one.bytes_read == 2 * ELEMENTS * 4
        assert rss.peak - before < GROWTH_LIMIT, (
            f"the server grew by {(rss.peak - before) >> 20} MiB comparing two 1 GiB archives "
            f"(from {before >> 20} MiB; limit {GROWTH_LIMIT >> 20} MiB)")
        print(f"diff of two 1 GiB archives: {seconds:.2f} s ({2 * data / seconds / 2**30:.2f} GiB/s compared), "
              f"server RSS {before >> 20} -> {rss.peak >> 20} MiB")
