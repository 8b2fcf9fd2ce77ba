"""``torch.distributed.checkpoint`` (DCP) backed by a tannery server.

:class:`Writer` and :class:`Reader` are DCP's ``StorageWriter`` and ``StorageReader``::

    import torch.distributed.checkpoint as dcp
    import tannery.dcp

    dcp.save(state_dict, storage_writer=tannery.dcp.Writer("host:50051", "runs/7/step-1000"))
    dcp.load(state_dict, storage_reader=tannery.dcp.Reader("host:50051", "runs/7/step-1000"))

Saving: each rank stores the items it writes (tensors, their shards, and DCP's bytes
items as uint8 tensors) as an archive of its own, ``{archive}.rank-{r}.{save id}``; the
coordinator then stores DCP's pickled ``Metadata`` (entry :data:`METADATA_ENTRY`, uint8)
and creates the final archive with one Union of those archives (no bytes copied), and
deletes the parts. The final archive exists only once every rank has written: a failed or
killed rank leaves none (its parts stay behind under ``{archive}.rank-`` /
``{archive}.metadata.`` names).

Entries are named by the item's fully qualified name (``model.layer.weight``), with the
shard's rows and columns for a part of a tensor (``model.layer.weight[0:4,0:8]``), so the
saved archive is an ordinary one: ``tannery show`` lists it and ``client.archive(name)``
reads it.

Loading reshards: each rank fetches only what its read items need, rows ``[a, b)`` of an
entry when the request covers whole rows, else the entry (then narrowed).

Saving in the background: ``dcp.async_save(state_dict, storage_writer=Writer(...),
process_group=group)`` stages a CPU copy of the state dict (so the caller may change its
tensors as soon as the call returns) and saves it in a thread, as above; the returned future
raises what the save raised, and the checkpoint still appears whole or not at all. Give it a
process group of its own (``dist.new_group(backend="gloo")``), so that its collectives never
interleave with the training loop's. ``AsyncCheckpointerType.PROCESS`` pickles the writer
into a checkpoint process: make the writer from a target then (a client is not picklable;
the process opens its own).

Versions: ``Writer(target, "runs/7/step-3000", alias="runs/7/latest", keep_last=3)`` moves the
alias to the checkpoint once it is whole, then prunes the run's older checkpoints (see
:mod:`tannery.dcp.versions`); ``Reader(target, "runs/7/latest")`` resumes from it, every rank
reading the one archive the coordinator resolved.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from tannery.archive import MemoryArchive
from tannery.calls import retention
from tannery.client import Client
from tannery.dcp.versions import Versions
from tannery.records import Pruned
from tannery_protocol.errors import NotFound
from tannery.rpc.requests import entry_ask

__all__ = ["METADATA_ENTRY", "Reader", "StoredItem", "Writer", "entry_name"]

#: The entry of a saved checkpoint that holds DCP's pickled ``Metadata`` (uint8).
METADATA_ENTRY = "__dcp_metadata__"


@dataclass(frozen=True)
class StoredItem:
    """Where a checkpoint item is (DCP's ``storage_data``): entry ``entry``, or its rows
    ``[rows[0], rows[1])`` along dim 0."""

    entry: str
    rows: tuple[int, int] | None = None


def entry_name(item: WriteItem) -> str:
    """The entry a write item is stored as: its FQN, with ``[start:stop,...]`` per dim for a
    shard (a chunk that is not the whole tensor)."""
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return fqn
    chunk = item.tensor_data.chunk
    if tuple(chunk.sizes) == tuple(item.tensor_data.size) and not any(chunk.offsets):
        return fqn
    return fqn + "[" + ",".join(f"{o}:{o + s}" for o, s in zip(chunk.offsets, chunk.sizes)) + "]"


@dataclass(frozen=True)
class _RankPart:
    archive: str  # the archive this rank stores its items as


class _Base:
    def __init__(self, client_or_target: Client | str | None, archive: str) -> None:
        if not isinstance(archive, str) or not archive:
            raise ValueError(f"tannery.dcp: the archive's name is a non-empty str, not {archive!r}")
        # A client given is used as it is; a target's client is opened on first use, by the
        # process that uses it (a pickled copy opens its own).
        self._owned = not isinstance(client_or_target, Client)
        self._client: Client | None = None if self._owned else client_or_target
        self._target = client_or_target if self._owned else None
        self.archive = archive

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self._target)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the client (AsyncCheckpointerType.PROCESS sends the writer to its
        checkpoint process this way); refused for a writer made with a client."""
        if not self._owned:
            raise TypeError(f"tannery.dcp.{type(self).__name__}: one made with a tannery.Client cannot be pickled "
                            "(as dcp.async_save(..., async_checkpointer_type=PROCESS) does): make it with the "
                            "server's target ('host:port') instead, and each process opens its own client")
        return {**self.__dict__, **{key: None for key in ("_client", "_remote") if key in self.__dict__}}

    @property
    def checkpoint_id(self) -> str:
        return self.archive

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP for a bare checkpoint_id: pass a Writer or Reader

    def close(self) -> None:
        """Close the client if this object opened it (from a target)."""
        if self._owned and self._client is not None:
            self.client.close()
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Writer(_Base, StorageWriter):
    """DCP's ``StorageWriter`` storing a checkpoint as tannery archive ``archive``.

    ``client_or_target`` is a :class:`tannery.Client` or its target (``host:port``; each
    rank then opens its own client). ``replace`` lets the save replace an existing archive
    of that name (else the coordinator refuses before anything is written). ``progress``
    (optional) is called with the payload bytes this rank sends, as they go.

    ``alias`` (optional): once the checkpoint is whole, the alias is moved to it,
    compare-and-set against where it pointed when the save began (a move by anyone else
    meanwhile is refused: AliasError, the checkpoint saved, nothing pruned). ``keep_last``
    (optional, 1 or more): then every checkpoint under ``prune_prefix`` (default: the name up
    to its last ``/``) but the newest ``keep_last`` and the aliased ones is deleted;
    :attr:`pruned` says what was. See :mod:`tannery.dcp.versions`.
    """

    def __init__(self, client_or_target: Client | str | None, archive: str, *, replace: bool = False,
                 progress: Callable[[int], Any] | None = None, alias: str | None = None,
                 keep_last: int | None = None, prune_prefix: str | None = None) -> None:
        super().__init__(client_or_target, archive)
        self.replace = replace
        self.progress = progress
        self.versions = Versions(alias, keep_last, prune_prefix)
        if keep_last is not None:
            self.versions.prefix(archive)  # a name with no run prefix is refused at once
        #: What the last save's prune did (on the coordinator; None when it pruned nothing).
        self.pruned: Pruned | None = None
        self._expect: str | None = None
        self.save_id = ""
        self.is_coordinator = False
        self.rank: int | None = None
        self._parts: list[str] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.archive = str(checkpoint_id)
        if self.save_id:  # the last save of this writer is over, whole or not
            retention.saved(self.save_id)
        self.save_id = ""
        self._parts = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        if not kwargs.get("use_collectives", True):
            raise NotImplementedError("tannery.dcp.Writer: saving without collectives (use_collectives=False)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.replace and self._exists(self.archive):
            raise FileExistsError(f"tannery.dcp.Writer: archive {self.archive!r} exists (replace=True to replace it)")
        self._expect = self.versions.begin(self.client, self.archive) if self.versions.wanted else None
        self.pruned = None
        self.save_id = uuid.uuid4().hex[:16]
        retention.saving(self.save_id)  # before any part exists: no prune in this process deletes them meanwhile
        self._parts = [f"{self.archive}.rank-{i}.{self.save_id}" for i in range(len(plans))]
        return [dataclasses.replace(plan, storage_data=_RankPart(part)) for plan, part in zip(plans, self._parts)]

    def _exists(self, name: str) -> bool:
        try:
            self.client.describe(name)
        except NotFound:
            return False
        return True

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        part: _RankPart = plan.storage_data
        tensors: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            name = entry_name(item)
            if name in tensors:
                raise ValueError(f"tannery.dcp.Writer: two write items are both stored as {name!r}")
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            else:
                tensor = data.detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                tensor = tensor.contiguous()
            tensors[name] = tensor
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=StoredItem(name)))
        if tensors:
            self.client.store(part.archive, MemoryArchive(tensors), replace=True, progress=self.progress)
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        sources = [part for part, rank in zip(self._parts, results) if rank]
        meta_archive = f"{self.archive}.metadata.{self.save_id}"
        raw = pickle.dumps(metadata)
        try:
            self.client.store(meta_archive, MemoryArchive({METADATA_ENTRY: torch.frombuffer(bytearray(raw),
                                                                                           dtype=torch.uint8)}),
                              replace=True)
            sources.append(meta_archive)
            self.client.union(self.archive, sources, replace=self.replace)
        finally:
            retention.saved(self.save_id)  # whole, or failed: its parts are pruned as any from now on
        for name in sources:
            try:
                self.client.delete(name)
            except Exception:  # the checkpoint is saved; a part left behind is only garbage
                pass
        if self.versions.wanted:  # the checkpoint is whole: now the alias, then the prune
            self.pruned = self.versions.commit(self.client, self.archive, self._expect)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.archive, save_id=self.save_id)


class Reader(_Base, StorageReader):
    """DCP's ``StorageReader`` loading a checkpoint saved by :class:`Writer` as archive ``archive``.

    ``progress`` (optional) is called with the payload bytes of each message received
    (to count what this rank fetched).
    """

    def __init__(self, client_or_target: Client | str | None, archive: str, *,
                 progress: Callable[[int], Any] | None = None) -> None:
        super().__init__(client_or_target, archive)
        self.progress = progress
        self.storage_data: dict[MetadataIndex, StoredItem] = {}
        self._remote = None
        self.load_id = ""

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.archive = str(checkpoint_id)
        self.storage_data = {}
        self._remote = None
        self.load_id = uuid.uuid4().hex[:16]

    def _archive(self):
        if self._remote is None:
            # Described whole at once: a rank reads most entries (one Describe, not one each).
            self._remote = self.client.archive(self.archive, progress=self.progress, lazy=False)
        return self._remote

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _metadata_of(self._archive())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"tannery.dcp.Reader: {self.archive!r}: the checkpoint's metadata has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank reads the archive the coordinator opened (an alias it resolved): see _agree.
        return [dataclasses.replace(plan, storage_data=self._archive().name) for plan in plans]

    def _agree(self, chosen: Any) -> None:
        """Read archive ``chosen`` (the coordinator's) if this rank opened another: an alias moved
        between the ranks' opens. This rank planned with its own metadata, so the two must lay
        out the same items the same way; else the load is refused (loading again agrees)."""
        mine = self._archive()
        if not isinstance(chosen, str) or chosen == mine.name:
            return
        theirs = self.client.archive(chosen, progress=self.progress, lazy=False)
        ours, other = _metadata_of(mine), _metadata_of(theirs)
        if (other.state_dict_metadata, other.storage_data) != (ours.state_dict_metadata, ours.storage_data):
            raise ValueError(f"tannery.dcp.Reader: {self.archive!r} moved during the load: this rank read "
                             f"{mine.name!r}, the coordinator {chosen!r}, and the two checkpoints differ in layout: "
                             "load again (every rank then reads the same one)")
        self._remote = theirs

    def _ask(self, req: ReadItem) -> tuple[str, tuple[int, int] | None, int]:
        """(entry, rows or None for the whole entry, the row the fetched tensor starts at)."""
        stored = self.storage_data[req.storage_index]
        base = stored.rows[0] if stored.rows else 0
        if req.type == LoadItemType.BYTE_IO:
            return stored.entry, stored.rows, base
        shape = tuple(self._archive().entry(stored.entry).shape)
        if stored.rows:
            shape = (stored.rows[1] - stored.rows[0], *shape[1:])
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if shape and all(o == 0 for o in offsets[1:]) and lengths[1:] == shape[1:]:
            start = base + offsets[0]
            return stored.entry, (start, start + lengths[0]), start
        return stored.entry, stored.rows, base

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._agree(plan.storage_data)
        remote = self._archive()
        asks = [self._ask(req) for req in plan.items]
        fetched: dict[tuple[str, tuple[int, int] | None], torch.Tensor] = {}
        # One Fetch per round; a round names each entry once (rows of one entry in two asks
        # go in two rounds).
        rounds: list[dict[str, tuple[str, tuple[int, int] | None]]] = []
        for entry, rows, _ in asks:
            key = (entry, rows)
            if any(r.get(entry) == key for r in rounds):
                continue
            for r in rounds:
                if entry not in r:
                    r[entry] = key
                    break
            else:
                rounds.append({entry: key})
        for r in rounds:
            keys = list(r.values())
            got = remote._transfer([entry_ask(remote.entry(entry), rows=rows) for entry, rows in keys])
            fetched.update(zip(keys, got))
        for req, (entry, rows, start) in zip(plan.items, asks):
            data = fetched[(entry, rows)]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.contiguous().numpy().tobytes()))
                continue
            stored = self.storage_data[req.storage_index]
            base = stored.rows[0] if stored.rows else 0
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if dim == 0:
                    offset = offset + base - start
                data = data.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != data.size():
                raise ValueError(f"tannery.dcp.Reader: {req.storage_index.fqn}: read {tuple(data.size())} "
                                 f"for a destination of {tuple(target.size())}")
            target.copy_(data)
            planner.commit_tensor(req, target)
        future: Future = Future()
        future.set_result(None)
        return future


def _metadata_of(remote: Any) -> Metadata:
    """DCP's ``Metadata`` saved in a checkpoint (entry :data:`METADATA_ENTRY`)."""
    raw = remote._transfer([entry_ask(remote.entry(METADATA_ENTRY))])[0]
    return pickle.loads(raw.numpy().tobytes())
