"""Diff, on both storage backends: identical, disjoint, one-changed and dtype-changed archives,
aliases, kept files, hostile names and every refusal; each value figure checked against numpy on
the same tensors; the command's table and JSON."""

from __future__ import annotations

import asyncio
import json
import math

import ml_dtypes
import numpy as np
import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery.cli import main
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import running_server


@pytest.fixture
def srv(tmp_path, backend):
    with running_server(tmp_path, **backend) as server:
        yield server


def _client(srv) -> tannery.Client:
    return tannery.Client(srv.target, retries=0)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as numpy holds them (bfloat16 as ml_dtypes')."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def expected(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The figures of b against a, computed by numpy over whole arrays (what the server must find
    streaming them a window at a time)."""
    na, nb = _numpy(a).reshape(-1), _numpy(b).reshape(-1)
    if na.dtype == np.bool_:
        differing = int(np.count_nonzero(na != nb))
        norm_a = math.sqrt(np.count_nonzero(na))
        return {"elements": na.size, "differing": differing, "max_abs": float(differing > 0),
                "relative_l2": 0.0 if not differing else math.sqrt(differing) / norm_a if norm_a else math.inf,
                "nan_appeared": 0, "inf_appeared": 0}
    width = na.dtype.itemsize
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[width]
    differ = na.view(bits) != nb.view(bits)
    if width == 16:
        differ = differ.reshape(-1, 2).any(axis=1)
    wide = np.complex128 if na.dtype.kind == "c" else np.float64
    fa, fb = na.astype(wide), nb.astype(wide)
    d = fb - fa
    d = d[np.isfinite(d)]
    norm_a = np.linalg.norm(fa[np.isfinite(fa)])
    norm_d = np.linalg.norm(d)
    return {"elements": na.size, "differing": int(np.count_nonzero(differ)),
            "max_abs": float(np.abs(d).max()) if d.size else 0.0,
            "relative_l2": 0.0 if norm_d == 0 else (norm_d / norm_a if norm_a else math.inf),
            "nan_appeared": int(np.count_nonzero(np.isnan(fb) & ~np.isnan(fa))),
            "inf_appeared": int(np.count_nonzero(np.isinf(fb) & ~np.isinf(fa)))}


def _assert_figures(values: tannery.ValueChange, want: dict) -> None:
    assert values.elements == want["elements"]
    assert values.differing == want["differing"]
    assert values.nan_appeared == want["nan_appeared"] and values.inf_appeared == want["inf_appeared"]
    assert values.max_abs == pytest.approx(want["max_abs"], rel=1e-12, abs=0)
    if math.isinf(want["relative_l2"]):
        assert math.isinf(values.relative_l2)
    else:
        assert values.relative_l2 == pytest.approx(want["relative_l2"], rel=1e-9, abs=0)


def _pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions: every dtype changed in some elements, large entries over several stored blocks
    (whose windows straddle blocks), NaN and Inf appearing, a zero tensor made nonzero."""
    g = torch.Generator().manual_seed(3)
    a = {
        "f32": torch.randn(1537, 1031, generator=g),  # 6.0 MiB: windows straddle the 1 MiB blocks
        "f16": torch.randn(333, 77, generator=g).half(),
        "bf16": torch.randn(4099, generator=g).to(torch.bfloat16),
        "f64": torch.randn(3, 5, 7, dtype=torch.float64, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (1000,), generator=g),
        "u8": torch.randint(0, 255, (70001,), dtype=torch.uint8, generator=g),
        "mask": torch.rand(9999, generator=g) > 0.5,
        "c128": torch.randn(301, dtype=torch.complex128, generator=g),
        "zero": torch.zeros(16),
        "same": torch.randn(64, generator=g),
        "scalar": torch.tensor(2.5),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["f32"].view(-1)[::101] += 0.25
    b["f32"].view(-1)[5] = float("nan")
    b["f32"].view(-1)[7] = float("inf")
    b["f16"][0, :9] = -b["f16"][0, :9]
    b["bf16"][100:200] = 0.0
    b["f64"][1] *= 3.0
    b["i64"][::3] += 7
    b["u8"][-5:] = 0
    b["mask"][::7] = ~b["mask"][::7]
    b["c128"][10] = complex(1e3, -2.0)
    b["zero"][3] = 1.0
    b["scalar"] = torch.tensor(-1.0)
    return a, b


def test_values_changed_match_numpy_on_every_dtype(srv):
    a, b = _pair()
    with _client(srv) as client:
        client.store("A", a)
        client.store("B", b)
        diff = client.diff("A", "B")
    assert (diff.a, diff.b) == ("A", "B")
    changed = {e.name: e for e in diff.entries}
    assert set(changed) == set(a) - {"same"}
    assert diff.same == 1 and diff.value_changed == len(a) - 1 and not (diff.added or diff.removed or diff.type_changed)
    for name, entry in changed.items():
        assert entry.change == "value" and not entry.file, name
        assert (entry.dtype_a, entry.shape_a) == (str(a[name].dtype).removeprefix("torch."), tuple(a[name].shape))
        _assert_figures(entry.values, expected(a[name], b[name]))
    assert changed["f32"].values.nan_appeared == 1 and changed["f32"].values.inf_appeared == 1
    assert math.isinf(changed["zero"].values.relative_l2)
    data = sum(e.nbytes_a + e.nbytes_b for e in changed.values())
    assert diff.bytes_read == data  # the changed entries' tensor data, both sides; nothing of "same"


def test_identical_archives_read_nothing(srv):
    a, _ = _pair()
    with _client(srv) as client:
        client.store("A", a, metadata={"format": "pt"})
        client.store("A2", a, metadata={"format": "pt"})
        diff = client.diff("A", "A2")
        assert diff.identical and diff.entries == () and diff.same == len(a) and diff.bytes_read == 0
        listed = client.diff("A", "A2", same=True)
        assert [e.name for e in listed.entries] == sorted(a) and {e.change for e in listed.entries} == {"same"}
        assert listed.bytes_read == 0


def test_disjoint_and_dtype_or_shape_changed(srv):
    with _client(srv) as client:
        client.store("A", {"x": torch.ones(3), "t": torch.ones(2, 3), "d": torch.ones(4)}, metadata={"k": "1"})
        client.store("B", {"y": torch.ones(3, dtype=torch.int8), "t": torch.ones(3, 2), "d": torch.ones(4).double()},
                     metadata={"k": "2", "new": "v"})
        diff = client.diff("A", "B")
        by_name = {e.name: e for e in diff.entries}
        assert by_name["x"].change == "removed" and by_name["x"].dtype_b == "" and by_name["x"].shape_a == (3,)
        assert by_name["y"].change == "added" and by_name["y"].dtype_b == "int8"
        assert by_name["t"].change == "type" and (by_name["t"].shape_a, by_name["t"].shape_b) == ((2, 3), (3, 2))
        assert by_name["d"].change == "type" and (by_name["d"].dtype_a, by_name["d"].dtype_b) == ("float32", "float64")
        assert (diff.added, diff.removed, diff.type_changed, diff.bytes_read) == (1, 1, 2, 0)
        assert diff.metadata == {"k": ("1", "2"), "new": (None, "v")}
        client.store("C", {"z": torch.ones(1)})
        disjoint = client.diff("A", "C")
        assert (disjoint.added, disjoint.removed, disjoint.same) == (1, 3, 0)


def test_aliases_are_resolved_and_named(srv):
    a, b = _pair()
    with _client(srv) as client:
        client.store("v1", a)
        client.store("v2", b)
        client.tag("prod", "v1")
        client.tag("next", "v2")
        diff = client.diff("prod", "next", names=["f64"])
    assert (diff.a, diff.b) == ("v1", "v2")
    assert [e.name for e in diff.entries] == ["f64"]
    _assert_figures(diff.entries[0].values, expected(a["f64"], b["f64"]))


def test_asyncio_twin(srv):
    a, b = _pair()
    with _client(srv) as client:
        client.store("A", a)
        client.store("B", b)

    async def run() -> tannery.ArchiveDiff:
        async with tannery.aio.Client(srv.target, retries=0) as client:
            return await client.diff("A", "B", prefix="f16")

    diff = asyncio.run(run())
    assert [e.name for e in diff.entries] == ["f16"] and diff.same == 0
    _assert_figures(diff.entries[0].values, expected(a["f16"], b["f16"]))


HOSTILE = ["a b", "quote\"d", "<script>alert(1)</script>", "ünï.cødé", "x.@not:file", "-rf", "%s%n", "'; DROP TABLE entries; --"]


def test_hostile_names_and_kept_files(srv):
    a = {name: torch.full((5,), float(i)) for i, name in enumerate(HOSTILE)}
    b = {name: torch.full((5,), float(i) + (name == HOSTILE[2])) for i, name in enumerate(HOSTILE)}
    with _client(srv) as client:
        client.store("ev<il>'s \"one\"", a, files={"config.json": b'{"a": 1}', "README.md": b"same"})
        client.store("two", b, files={"config.json": b'{"a": 22}', "README.md": b"same"})
        diff = client.diff("ev<il>'s \"one\"", "two")
        assert [(e.name, e.change) for e in diff.entries if not e.file] == [(HOSTILE[2], "value")]
        files = [e for e in diff.entries if e.file]
        assert [(e.name, e.change, e.values) for e in files] == [("@file:config.json", "value", None)]
        assert (files[0].nbytes_a, files[0].nbytes_b) == (8, 9)
        assert (diff.files_changed, diff.files_same, diff.value_changed, diff.same) == (1, 1, 1, len(HOSTILE) - 1)
        only = client.diff("ev<il>'s \"one\"", "two", names=[HOSTILE[7], HOSTILE[2]])
        assert [e.name for e in only.entries] == [HOSTILE[2]] and only.same == 1


def test_refusals_name_the_problem(srv):
    with _client(srv) as client:
        client.store("A", {"layer.weight": torch.ones(2)})
        with pytest.raises(tannery.NotFound, match="'nope' not found"):
            client.diff("A", "nope")
        with pytest.raises(tannery.NotFound, match="entry 'layer.wieght' is in neither archive; did you mean 'layer.weight'"):
            client.diff("A", "A", names=["layer.wieght"])
        with pytest.raises(ValueError, match="names or a prefix"):
            client.diff("A", "A", names=["x"], prefix="y")

    with pytest.raises(grpc.RpcError) as caught:
        srv.archives().Diff(pb.DiffRequest(a="A", b="A", names=["x"], prefix="y"))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "both narrow" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        srv.archives().Diff(pb.DiffRequest(a="", b="A"))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_the_command_prints_a_table_and_json(srv, capsys, monkeypatch):
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    a, b = _pair()
    with _client(srv) as client:
        client.store("A", a, files={"config.json": b"{}"})
        client.store("B", {**b, "extra": torch.ones(1)}, files={"config.json": b"{ }"})
        client.tag("prod", "A")
    capsys.readouterr()
    assert main(["--target", srv.target, "diff", "prod", "B"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:2] == ["A: A (alias prod)", "B: B"]
    assert lines[2].split()[:4] == ["ENTRY", "CHANGE", "DTYPE", "SHAPE"]
    f32 = next(line for line in lines if line.startswith("f32 "))
    assert f32.split()[1:3] == ["values", "float32"] and "1/1" in f32
    assert any(line.startswith("extra ") and " added " in line for line in lines)
    assert "file @file:config.json: changed (2 B -> 3 B)" in lines
    assert lines[-1].startswith(f"tensors: {len(a) - 1} with other values, 0 with another dtype or shape, 1 added, "
                                "0 removed, 1 the same; kept files: 1 differ, 0 the same; the server read ")
    assert main(["--target", srv.target, "diff", "prod", "B", "--json", "--names", "zero,f32"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["a"], got["b"]) == ("A", "B")
    entries = {e["name"]: e for e in got["entries"]}
    assert entries["zero"]["values"]["relative_l2"] is None  # infinite: A's norm is 0
    assert entries["f32"]["values"]["differing"] == expected(a["f32"], b["f32"])["differing"]
    assert got["summary"]["value_changed"] == 2


def test_a_damaged_block_is_data_loss_naming_the_entry(tmp_path):
    with running_server(tmp_path) as server, tannery.Client(server.target, retries=0) as client:
        a = {"big": torch.randn(1 << 20), "small": torch.ones(3)}
        client.store("A", a)
        client.store("B", {"big": a["big"] + 1, "small": torch.zeros(3)})
        digest = next(e.digest for e in client.describe("B").entries if e.name == "big")
        blob = next(p for p in (server.data_dir / "blobs").rglob(digest))
        with open(blob, "r+b") as f:  # one bit of B's second block flipped
            f.seek((1 << 20) + 5)
            byte = f.read(1)
            f.seek((1 << 20) + 5)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(tannery.DataLoss, match="entry 'big'"):
            client.diff("A", "B")
        assert client.diff("A", "B", names=["small"]).value_changed == 1  # the rest still compares


def test_a_diff_past_its_deadline_stops(tmp_path):
    with running_server(tmp_path) as server, tannery.Client(server.target, retries=0, timeout=0.05) as quick:
        with tannery.Client(server.target, retries=0) as client:
            a = torch.randn(64 << 20)
            client.store("A", {"w": a})
            client.store("B", {"w": a + 1})
        with pytest.raises(tannery.ServiceError, match="[Dd]eadline"):
            quick.diff("A", "B")
        with tannery.Client(server.target, retries=0) as client:  # the server answers the next call
            assert client.diff("A", "B").value_changed == 1
