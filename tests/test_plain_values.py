"""Plain values kept beside an archive's tensors (issue 40): typed exactly, in memory, on a
real server (describe, show, pull), in safetensors files and .tannic pairs; and every hostile
value refused with nothing stored."""

from __future__ import annotations

import enum
import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch

import tannery
from tannery import Archive, ArchiveError, FormatError, load_safetensors, load_tannic, save_safetensors, save_tannic
from tannery import plain

from .test_cli import Cli

NAN_BITS = "7ff8000000000123"  # a nan with a payload: its bits must come back, not just "a nan"


def bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def state() -> dict:
    """A training state's shape: tensors, an optimizer's plain values, RNG states of three kinds."""
    rng = np.random.default_rng(3)
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(3)}, 1: {}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None,
                                    "amsgrad": False, "name": "dense"}]},
        "step": 2**70, "loss": float("-inf"), "odd": struct.unpack(">d", bytes.fromhex(NAN_BITS))[0], "zero": -0.0,
        "python_rng": random.Random(5).getstate(), "numpy_rng": np.random.RandomState(7).get_state(),
        "gen": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
        "scalars": [np.float32(0.25), np.int64(-3), np.bool_(True), np.float16(1.5)],
        "arr": np.arange(4, dtype=np.uint32), "text": "é\ud800", "empty": [(), {}, []],
    }


def same(a, b) -> bool:
    """Same types all the way down and the same bits (floats by their bits, tensors and arrays by bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(x) is type(y) for x, y in zip(a, b)) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and tannery.torch.serialize(a) == tannery.torch.serialize(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return bits(a) == bits(b)
    if isinstance(a, np.generic):
        return a.tobytes() == b.tobytes()
    return a == b


def test_a_training_state_comes_back_whole_and_typed_in_memory():
    value = state()
    archive = Archive.of_value(value, "ck")
    assert "ck.optim.state.0.exp_avg" in archive.names() and "ck.step" not in archive.names()
    back = archive.to_value(prefix="ck")
    assert same(back, value)
    assert bits(back["odd"]) == NAN_BITS and math.copysign(1, back["zero"]) == -1
    assert list(back["optim"]["state"]) == [0, 1]  # int keys stay ints
    np.random.RandomState().set_state(back["numpy_rng"])
    random.Random().setstate(back["python_rng"])
    # A part of the state, by its prefix: the optimizer's, a scalar, one tensor of a tuple.
    assert same(archive.to_value(prefix="ck.optim"), value["optim"])
    assert archive.to_value(prefix="ck.step") == 2**70
    assert same(archive.to_value(prefix="ck.numpy_rng.1"), value["numpy_rng"][1])
    optim_like = {"state": {0: {"step": torch.empty(()), "exp_avg": torch.empty(3)}, 1: {}},
                  "param_groups": [{"lr": 0.0, "betas": None, "params": [9, 9], "foreach": None, "amsgrad": True}]}
    group = archive.to_value(optim_like, prefix="ck.optim")["param_groups"][0]  # the like's keys, the kept values
    assert same(group, {key: value["optim"]["param_groups"][0][key] for key in optim_like["param_groups"][0]})


def test_a_like_takes_the_plain_values_kept_and_keeps_its_own_elsewhere():
    archive = Archive.of_value({"w": torch.ones(2), "lr": 0.5, "betas": (0.8, 0.9)}, "opt")
    got = archive.to_value({"w": torch.empty(2), "lr": 0.1, "betas": None, "mine": "kept"}, prefix="opt")
    assert got["lr"] == 0.5 and got["betas"] == (0.8, 0.9) and got["mine"] == "kept"
    assert Archive.of_value(None, "nothing").to_value("a like's own", prefix="nothing") is None  # a null kept


@pytest.mark.parametrize("value, message", [
    ({"a": {(1, 2): 3}}, r"^Archive.of_value: run.a: a key \(1, 2\) of type tuple; the keys of kept dicts are str "),
    ({"a": {True: 3}}, r"^Archive.of_value: run.a: a key True of type bool; "),
    ({"a": [print]}, r"^Archive.of_value: run.a.0 is a builtin_function_or_method, neither a tensor nor a plain value"),
    ({"a": np.longdouble(1)}, r"^Archive.of_value: run.a is a numpy float128 scalar, which is not kept"),
    ({"a": np.complex64(1)}, r"^Archive.of_value: run.a is a numpy complex64 scalar, which is not kept"),
    ({"a": np.array(["x"])}, r"^Archive.of_value: run.a is a numpy array of dtype <U1, which no entry holds; "
                             r"convert it \(array.tolist\(\) keeps it as plain values\)"),
    ({"a": [2**20_000]}, r"^Archive.of_value: run.a.0: an int of 20001 bits, over the bound of 14000 bits"),
    ({"a": {2**20_000: 1}}, r"^Archive.of_value: run.a: an int of 20001 bits"),
])
def test_what_is_not_kept_is_refused_naming_its_path(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Archive.of_value(value, "run")


class Sneaky(str):
    """A str whose pickling would run code: it must never be stored as if it were a str."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('ran code from the store')",))


class Color(enum.StrEnum):
    RED = "red"


def deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("value, error, message", [
    ({"d": deep(10_000)}, ValueError, r"^Client.store\('h'\): ck.d.0.0.0.0.0.0.0...: nested deeper than 100 levels"),
    ({"big": "x" * (plain.MAX_BYTES + 1 - len(plain.encode({"dict": [["w", {"tensor": "w"}], ["big", ""]]})))},
     ArchiveError, rf"^Client.store\('h'\): the plain values come to {plain.MAX_BYTES + 1} bytes encoded, over the "
     r"bound of 16777216 bytes; the largest leaf is ck.big \(167771\d\d bytes\): store large data as a tensor"),
    ({"k": {(1, 2): torch.ones(1)}}, TypeError, r"^Client.store\('h'\): ck.k: a key \(1, 2\) of type tuple"),
    ({"s": Sneaky("x")}, TypeError, r"^Client.store\('h'\): ck.s is a Sneaky \(a subclass of str, whose own code is "
                                    r"not kept\), neither a tensor nor a plain value .*convert it to a plain str"),
    ({"c": Color.RED}, TypeError, r"^Client.store\('h'\): ck.c is a Color \(a subclass of str"),
    ({0: torch.ones(1), "0": 1}, ValueError, r"^Client.store\('h'\): ck.0: a tensor and a plain value have this name"),
])
def test_a_hostile_value_is_refused_and_nothing_is_stored(server, value, error, message):
    with tannery.Client(server.target) as client:
        with pytest.raises(error, match=message):
            client.store("h", {"w": torch.ones(1), **value}, prefix="ck")
        assert client.list() == []


def test_plain_values_of_exactly_the_bound_are_kept():
    overhead = len(plain.encode({"dict": [["big", ""]]}))
    archive = Archive.of_value({"big": "x" * (plain.MAX_BYTES - overhead)})
    assert len(plain.encode(archive._plain()[""])) == plain.MAX_BYTES


def test_a_union_refuses_a_plain_value_named_like_a_tensor():
    with pytest.raises(ValueError, match=r"^Archive.union: a.b: a tensor and a plain value have this name"):
        Archive.union([Archive.of_value({"b": 1}, "a"), Archive.of_list({"a.b": torch.ones(1)})])
    with pytest.raises(ValueError, match=r"^Archive.union: plain values kept under 'a' and under 'a.c'"):
        Archive.union([Archive.of_value({"b": 1}, "a"), Archive.of_value({"d": 1}, "a.c")])


def test_documents_are_checked_and_a_newer_version_is_refused():
    document = json.loads(plain.encode({"dict": [["lr", 0.5]]}))
    assert plain.decode(json.dumps(document), "x") == {"dict": [["lr", 0.5]]}
    with pytest.raises(FormatError, match=r"^x: the plain values were written by format version 2, newer than this "
                                          r"tannery reads \(up to 1\): read them with a newer release$"):
        plain.decode(json.dumps({**document, "version": 2}), "x")
    hostile = ({"object": "os.system"}, {"dict": [[1.5, 2]]}, {"float": "nan"}, {"tensor": 3},
               {"numpy": "object", "value": 1}, {"tuple": [], "dict": []}, {"numpy": "int8", "value": 300},
               {"numpy": "float32", "value": ["float"]}, {"numpy": "bool", "value": {"float": "zz"}})
    for node in hostile:
        with pytest.raises(FormatError, match="is not a node of plain values"):
            plain.decode(json.dumps({**document, "value": node}), "x")
    with pytest.raises(FormatError, match="^x: the plain values are not a readable document"):
        plain.decode("[" * 100_000 + "]" * 100_000, "x")


def test_a_newer_document_in_a_safetensors_file_is_refused(tmp_path: Path):
    path = tmp_path / "a.safetensors"
    save_safetensors(path, Archive.of_value({"w": torch.ones(1), "step": 1}))
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    newer = json.dumps({**json.loads(metadata["@values"]), "version": 9})
    safetensors.torch.save_file({"w": torch.ones(1)}, str(path), metadata={"@values": newer})
    with pytest.raises(FormatError, match="written by format version 9, newer than this tannery reads"):
        load_safetensors(path)


def test_plain_values_round_trip_through_safetensors_and_tannic_pairs(tmp_path: Path):
    value = state()
    archive = Archive.of_value(value, "ck")
    save_safetensors(tmp_path / "a.safetensors", archive)
    with safetensors.safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert list(f.metadata()) == ["ck.@values"] and "ck.@values" not in f.keys()
    assert same(load_safetensors(tmp_path / "a.safetensors").to_value(prefix="ck"), value)
    # A .tannic pair has no metadata: the document is a uint8 entry, lifted out on load; the
    # pair keeps no shapes, so the like gives them.
    save_tannic(tmp_path / "p", archive)
    pair = load_tannic(tmp_path / "p", like=value, prefix="ck")
    assert "ck.@values" not in pair.names()
    got = pair.to_value(value, prefix="ck")  # a like's numpy arrays become tensors, as ever
    assert same(got["optim"], value["optim"]) and same(got["python_rng"], value["python_rng"])
    assert bits(got["odd"]) == NAN_BITS and same(got["scalars"], value["scalars"])
    assert same(pair.to_value(prefix="ck")["numpy_rng"], value["numpy_rng"])  # 1-D: the pair's own shape


def test_on_a_server_values_are_described_shown_fetched_and_pulled(server, capsys, tmp_path: Path):
    value = state()
    with tannery.Client(server.target) as client:
        info = client.store("ckpt", value, prefix="run")
        description = client.describe("ckpt")
        assert info.entries == len(description.entries) + 1  # the tensors and the document of plain values
        assert [(v.prefix, v.entry) for v in description.values] == [("run", "run.@values")]
        assert "run.@values" not in client.fetch("ckpt").names()
        assert same(client.fetch("ckpt").to_value(prefix="run"), value)  # an in-memory fetch keeps them too
        narrower = client.fetch("ckpt", prefix="run.optim").to_value()  # not the values kept under a wider prefix
        assert list(narrower) == ["run.optim.state.0.exp_avg", "run.optim.state.0.step"]
        assert "run.@values" not in [name for name, _ in client.fetch_iter("ckpt")]  # entries: tensors alone
        assert same(client.archive("ckpt").to_value(prefix="run"), value)
        assert same(client.archive("ckpt").to_value(prefix="run.optim"), value["optim"])
    cli = Cli(server.target, capsys)
    shown = cli.ok("show", "ckpt")
    assert "plain values under 'run':\n" in shown
    assert "  'step': 1180591620717411303424\n" in shown and "  'loss': -inf\n" in shown
    assert "  'optim': {'state': {0: {'step': <tensor run.optim.state.0.step>, 'exp_avg': <tensor run.optim" in shown
    assert "  'scalars': [np.float32(0.25), np.int64(-3), np.bool(True), np.float16(1.5)]\n" in shown
    assert cli.json("show", "ckpt")["values"]["run"]["dict"][2] == ["step", 2**70]
    cli.ok("pull", "ckpt", "-o", str(tmp_path / "c.safetensors"))
    assert same(load_safetensors(tmp_path / "c.safetensors").to_value(prefix="run"), value)
    cli.ok("push", str(tmp_path / "c.safetensors"), "--as", "again")  # and back: the values with the archive
    with tannery.Client(server.target) as client:
        assert same(client.archive("again").to_value(prefix="run"), value)
        assert client.describe("again").metadata == {}


def test_a_union_on_the_server_carries_the_plain_values_under_its_prefixes(server):
    with tannery.Client(server.target) as client:
        client.store("a", {"w": torch.ones(1), "step": 1})
        client.store("b", {"w": torch.ones(2), "lr": 0.5})
        client.union("u", {"x": "a", "y": "b"})
        back = client.archive("u").to_value()
        assert back["x"]["step"] == 1 and back["y"]["lr"] == 0.5 and torch.equal(back["y"]["w"], torch.ones(2))
        assert client.archive("u").to_value(prefix="y")["lr"] == 0.5
        with pytest.raises(tannery.InvalidArgument, match="'@values' is in two sources, 'a' and 'b'"):
            client.union("v", ["a", "b"])  # two values at one root: give each a prefix


def test_the_aio_client_gives_the_plain_values_back_too(server):
    import asyncio

    import tannery.aio

    value = state()

    async def round_trip() -> tuple:
        async with tannery.aio.Client(server.target) as client:
            await client.store("aio", value, prefix="run")
            remote = await client.archive("aio")
            whole = await remote.to_value(prefix="run")
            lr = (await remote.to_value({"lr": 0.0}, prefix="run.optim.param_groups.0"))["lr"]
            fetched = (await client.fetch("aio")).to_value(prefix="run")
            return whole, lr, fetched

    whole, lr, fetched = asyncio.run(round_trip())
    assert same(whole, value) and same(fetched, value) and lr == 1e-3
