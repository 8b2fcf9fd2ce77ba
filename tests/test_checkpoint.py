""".tannic checkpoint pairs: tannery's write/read, pytannic's files, and every malformed file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tannery_protocol import codec
from tannery.formats import checkpoint
from tannery import torch as tt
from tannery.formats.checkpoint import ENTRY, PairEntry, parse_metadata
from tannery_protocol.codec import FormatError

from .conftest import peer


@pytest.fixture
def pytannic_modules():
    """pytannic's module files, for the tests that read what it writes (only they need it)."""
    return peer("pytannic.torch.modules")


HEADER = struct.Struct("<IBHQ")
MAGIC = 0x43495245


def header(nbytes: int, magic: int = MAGIC, version: int = 1) -> bytes:
    return HEADER.pack(magic, version, 0xABCD, nbytes)


def entry(name: str | bytes, code: int = 24, offset: int = 0, nbytes: int = 4, namelength: int | None = None) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    return ENTRY.pack(code, offset, nbytes, len(raw) if namelength is None else namelength) + raw


def metadata(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return header(len(body)) + body


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(tt.buffer_of(a)) == bytes(tt.buffer_of(b))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Conv1d(5, 3, 2))


def mapped_files() -> list[tuple[int, int, str]]:
    """The file-backed ranges of this process's address space."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, fields[5]))
    return ranges


# ----------------------------------------------------------------------------- round trips


def test_round_trip_with_like(tmp_path):
    module = mlp()
    state = module.state_dict()
    tt.write(module, tmp_path / "model")
    back = tt.read(tmp_path / "model", like=state)
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert same(back[name], tensor), name


def test_round_trip_without_like_is_one_dimensional(tmp_path):
    state = mlp().state_dict()
    tt.write(state, tmp_path / "model.tannic")
    back = tt.read(tmp_path / "model.metadata.tannic")
    for name, tensor in state.items():
        assert back[name].shape == (tensor.numel(),)
        assert same(back[name], tensor.reshape(-1)), name


def test_round_trip_of_every_dtype(tmp_path):
    state = {
        "flag": torch.tensor([True, False, True, True, False, False, False, True, True]),
        "half": torch.randn(3, 2).half(),
        "brain": torch.randn(4).bfloat16(),
        "index": torch.arange(5, dtype=torch.int64),
        "complex": torch.randn(2, 2, dtype=torch.complex128),
        "fp8": torch.randn(6).to(torch.float8_e4m3fn),
        "u16": torch.arange(7, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(20, dtype=torch.int32).reshape(4, 5).T,
    }
    tt.write(state, tmp_path / "all")
    back = tt.read(tmp_path / "all", like=state)
    for name, tensor in state.items():
        assert same(back[name], tensor.contiguous()), name
    flat = tt.read(tmp_path / "all")
    assert flat["flag"].shape == (16,) and flat["flag"][:9].tolist() == state["flag"].tolist()
    assert flat["scalar"].shape == (1,) and flat["empty"].shape == (0,)


def test_entries_are_in_state_dict_order_and_back_to_back(tmp_path):
    state = mlp().state_dict()
    tt.write(state, tmp_path / "m")
    pair = checkpoint.open_pair(tmp_path / "m")
    offset = 0
    assert [e.name for e in pair.entries] == list(state)
    for e, tensor in zip(pair.entries, state.values()):
        assert (e.offset, e.nbytes, e.dtype.name) == (offset, tensor.nbytes, "float32")
        offset += e.nbytes


def test_write_goes_into_the_directory_of_path(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "checkpoints" / "run1"
    target.mkdir(parents=True)
    tt.write(mlp(), target / "model")
    assert sorted(p.name for p in target.iterdir()) == ["model.metadata.tannic", "model.tannic"]
    assert list(cwd.iterdir()) == []


def test_write_sizes_the_data_header_from_the_state_dict_buffers_included(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    module.train()(torch.randn(8, 4))  # running statistics that differ from their initial values
    state = module.state_dict()
    tt.write(module, tmp_path / "bn")
    data = (tmp_path / "bn.tannic").read_bytes()
    total = sum(t.nbytes for t in state.values())
    assert total > sum(p.nbytes for p in module.parameters())
    assert HEADER.unpack_from(data)[3] == total == len(data) - HEADER.size
    back = tt.read(tmp_path / "bn", like=state)
    assert back["1.num_batches_tracked"].dtype == torch.int64 and back["1.num_batches_tracked"].item() == 1
    for name, tensor in state.items():
        assert same(back[name], tensor), name


def test_metadata_header_and_entries_bytes(tmp_path):
    tt.write({"w": torch.zeros(2, 3), "é": torch.zeros(1, dtype=torch.int8)}, tmp_path / "x")
    expected = metadata(entry("w", 24, 0, 24), entry("é", 12, 24, 1))
    assert (tmp_path / "x.metadata.tannic").read_bytes() == expected


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_write_errors(tmp_path):
    with pytest.raises(TypeError, match="write: n: int is not a tensor"):
        tt.write({"n": 3}, tmp_path / "x")
    with pytest.raises(TypeError, match="complex32"):
        tt.write({"c": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "x")
    with pytest.raises(ValueError, match="empty name"):
        tt.write({"": torch.zeros(2)}, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_rewriting_replaces_both_files(tmp_path):
    tt.write({"a": torch.zeros(100)}, tmp_path / "x")
    tt.write({"b": torch.ones(2, dtype=torch.int64)}, tmp_path / "x")
    assert list(tt.read(tmp_path / "x")) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.metadata.tannic", "x.tannic"]


@pytest.mark.parametrize("name", ["model", "model.tannic", "model.metadata.tannic"])
def test_pair_paths(tmp_path, name):
    assert checkpoint.pair_paths(tmp_path / name) == (tmp_path / "model.tannic", tmp_path / "model.metadata.tannic")


# ------------------------------------------------------------------------ read and like


def test_read_is_memory_mapped_not_copied(tmp_path):
    tensor = torch.randn(1 << 18)  # 1 MiB: well past any small-read path
    tt.write({"big": tensor, "small": torch.arange(3)}, tmp_path / "m")
    back = tt.read(tmp_path / "m")
    data_path = str(tmp_path / "m.tannic")
    for name in ("big", "small"):
        ptr = back[name].data_ptr()
        assert any(start <= ptr < end and path == data_path for start, end, path in mapped_files()), name
    back["big"][0] = 1234.0  # a private map: writable, and the file is untouched
    assert tt.read(tmp_path / "m")["big"][0].item() == tensor[0].item()


def test_like_mismatches_name_the_entry(tmp_path):
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    tt.write(state, tmp_path / "m")
    with pytest.raises(ValueError, match=r"read: w: 24 bytes in the checkpoint, shape \[5\] of float32 in like \(20 bytes\)"):
        tt.read(tmp_path / "m", like={"w": torch.zeros(5)})
    with pytest.raises(ValueError, match="read: b: float32 in the checkpoint, float64 in like"):
        tt.read(tmp_path / "m", like={"b": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="read: missing: in like, not in the checkpoint"):
        tt.read(tmp_path / "m", like={"missing": torch.zeros(1)})
    partial = tt.read(tmp_path / "m", like={"w": torch.empty(3, 2)})
    assert partial["w"].shape == (3, 2) and partial["b"].shape == (3,)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        tt.read(tmp_path / "nothing")
    tt.write({"a": torch.zeros(1)}, tmp_path / "m")
    (tmp_path / "m.metadata.tannic").unlink()
    with pytest.raises(FileNotFoundError):
        tt.read(tmp_path / "m")


# ------------------------------------------------------------------------- pytannic's files


def test_pytannic_write_is_read_back_bit_for_bit(tmp_path, monkeypatch, capsys, pytannic_modules):
    monkeypatch.chdir(tmp_path)  # pytannic writes into the current directory, whatever the path says
    module = mlp()
    pytannic_modules.write(module, "elsewhere/net")
    capsys.readouterr()  # pytannic prints its metadata
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.metadata.tannic", "net.tannic"]
    state = module.state_dict()
    back = tt.read(tmp_path / "net", like=state)
    for name, tensor in state.items():
        assert same(back[name], tensor), name
    # And tannery writes the very same bytes.
    ours = tmp_path / "ours"
    ours.mkdir()
    tt.write(module, ours / "net")
    for suffix in (".tannic", ".metadata.tannic"):
        assert (ours / f"net{suffix}").read_bytes() == (tmp_path / f"net{suffix}").read_bytes()


def test_pytannic_file_of_a_module_with_buffers_is_refused_clearly(tmp_path, monkeypatch, capsys, pytannic_modules):
    # pytannic sizes the data header from parameters() and writes state_dict(): with a
    # BatchNorm the header undercounts the file, which tannery reports rather than guesses.
    monkeypatch.chdir(tmp_path)
    pytannic_modules.write(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), "bn")
    capsys.readouterr()
    with pytest.raises(FormatError, match=r"bn.tannic: trailing bytes: the header says 84 bytes follow it, the file has 116"):
        tt.read(tmp_path / "bn")


# --------------------------------------------------------------------- the real fixtures

#: The fixtures' README table: (stem, name, dcode, offset, nbytes, shape).
FIXTURE_ENTRIES = [
    ("MLP", "input_layer.weight", 24, 0, 1605632, (512, 784)),
    ("MLP", "input_layer.bias", 24, 1605632, 2048, (512,)),
    ("MLP", "output_layer.weight", 24, 1607680, 20480, (10, 512)),
    ("MLP", "output_layer.bias", 24, 1628160, 40, (10,)),
    ("CNN", "convolutional_layer.weight", 24, 0, 1152, (32, 1, 3, 3)),
    ("CNN", "convolutional_layer.bias", 24, 1152, 128, (32,)),
    ("CNN", "output_layer.weight", 24, 1280, 1003520, (10, 25088)),
    ("CNN", "output_layer.bias", 24, 1004800, 40, (10,)),
    ("dev-embd", "weight", 24, 0, 32768, (8192,)),
]
FIXTURE_HEADERS = {"MLP": (1628200, 154), "CNN": (1004840, 170), "dev-embd": (32768, 27)}


def fixture_entries(stem: str):
    return [row[1:] for row in FIXTURE_ENTRIES if row[0] == stem]


@pytest.mark.parametrize("stem", sorted(FIXTURE_HEADERS))
def test_real_pairs_entries(tannic_nn, stem):
    data_nbytes, metadata_nbytes = FIXTURE_HEADERS[stem]
    data = (tannic_nn / f"{stem}.tannic").read_bytes()
    meta = (tannic_nn / f"{stem}.metadata.tannic").read_bytes()
    assert HEADER.unpack_from(data) == (MAGIC, 1, 0xABCD, data_nbytes)
    assert HEADER.unpack_from(meta) == (MAGIC, 1, 0xABCD, metadata_nbytes)
    pair = checkpoint.open_pair(tannic_nn / stem)
    assert [(e.name, e.dtype.code, e.offset, e.nbytes) for e in pair.entries] == [
        (name, code, offset, nbytes) for name, code, offset, nbytes, _ in fixture_entries(stem)
    ]


@pytest.mark.parametrize("stem", sorted(FIXTURE_HEADERS))
def test_real_pairs_read_with_like(tannic_nn, stem):
    entries = fixture_entries(stem)
    like = {name: torch.empty(shape) for name, _, _, _, shape in entries}
    tensors = tt.read(tannic_nn / stem, like=like)
    assert list(tensors) == [name for name, *_ in entries]
    data = (tannic_nn / f"{stem}.tannic").read_bytes()
    for name, _, offset, nbytes, shape in entries:
        tensor = tensors[name]
        assert tensor.dtype == torch.float32 and tensor.shape == shape
        start = HEADER.size + offset
        assert bytes(tt.buffer_of(tensor)) == data[start : start + nbytes]
        assert torch.isfinite(tensor).all()  # trained weights, not garbage


def test_real_pairs_read_without_like_are_flat(tannic_nn):
    tensors = tt.read(tannic_nn / "MLP.tannic")
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "input_layer.weight": (401408,),
        "input_layer.bias": (512,),
        "output_layer.weight": (5120,),
        "output_layer.bias": (10,),
    }


def test_real_pairs_wrong_like_names_the_entry(tannic_nn):
    with pytest.raises(ValueError, match=r"read: output_layer.bias: 40 bytes in the checkpoint, shape \[11\]"):
        tt.read(tannic_nn / "CNN", like={"output_layer.bias": torch.empty(11)})


def test_real_pairs_rewritten_by_tannery_are_byte_identical(tannic_nn, tmp_path):
    for stem in FIXTURE_HEADERS:
        tt.write(tt.read(tannic_nn / stem), tmp_path / stem)
        for suffix in (".tannic", ".metadata.tannic"):
            assert (tmp_path / f"{stem}{suffix}").read_bytes() == (tannic_nn / f"{stem}{suffix}").read_bytes()


# ---------------------------------------------------------------------- malformed files


def write_pair(tmp_path: Path, data: bytes, meta: bytes) -> Path:
    (tmp_path / "bad.tannic").write_bytes(data)
    (tmp_path / "bad.metadata.tannic").write_bytes(meta)
    return tmp_path / "bad"


GOOD_DATA = header(8) + bytes(range(8))
GOOD_META = metadata(entry("a", 24, 0, 4), entry("b", 13, 4, 4))


def test_the_good_pair_is_good(tmp_path):
    back = tt.read(write_pair(tmp_path, GOOD_DATA, GOOD_META))
    assert back["a"].dtype == torch.float32 and back["b"].tolist() == [0x0504, 0x0706]


@pytest.mark.parametrize(
    "data,meta,message",
    [
        (header(8, magic=0x4D4F4F42) + bytes(8), GOOD_META, r"bad.tannic: bad magic 0x4D4F4F42, expected 0x43495245"),
        (GOOD_DATA, header(0, magic=0), r"bad.metadata.tannic: bad magic 0x00000000"),
        (header(8, version=2) + bytes(8), GOOD_META, r"bad.tannic: unsupported version 2"),
        (GOOD_DATA, header(0, version=0), r"bad.metadata.tannic: unsupported version 0"),
        (GOOD_DATA[:-1], GOOD_META, r"bad.tannic: truncated: the header says 8 bytes follow it, the file has 7"),
        (GOOD_DATA + b"\0", GOOD_META, r"bad.tannic: trailing bytes: the header says 8 bytes follow it, the file has 9"),
        (GOOD_DATA[:10], GOOD_META, r"bad.tannic: 10 bytes, too short for a 15-byte header"),
        (b"", GOOD_META, r"bad.tannic: 0 bytes, too short"),
        (GOOD_DATA, GOOD_META[:10], r"bad.metadata.tannic: 10 bytes, too short for a 15-byte header"),
        (GOOD_DATA, GOOD_META[:-1], r"bad.metadata.tannic: truncated: the header says 44 bytes follow it, the file has 43"),
        (GOOD_DATA, metadata(entry("a", 24, 0, 4), b"\x18\0\0"), r"entry 1 is truncated: 3 of 21 bytes"),
        (GOOD_DATA, metadata(entry("a", 24, 0, 4, namelength=9)), r"entry 0: name of 9 bytes, only 1 bytes left"),
        (GOOD_DATA, metadata(entry("a", 24, 0, 4, namelength=2**32 - 1)), r"entry 0: name of 4294967295 bytes"),
        (GOOD_DATA, metadata(entry(b"\xff\xfe", 24, 0, 4)), r"entry 0: name is not UTF-8 \(invalid start byte at byte 0\)"),
        (GOOD_DATA, metadata(entry("a", 24, 0, 4), entry("a", 24, 4, 4)), r"'a' appears twice"),
        (GOOD_DATA, metadata(entry("", 24, 0, 4)), r"entry 0 has an empty name"),
        (GOOD_DATA, metadata(entry("a", 24, 6, 4)), r"a: bytes \[6, 10\) are outside the data \(8 bytes\)"),
        (GOOD_DATA, metadata(entry("a", 24, 2**64 - 4, 8)), r"a: bytes \[18446744073709551612, 18446744073709551620\) are outside"),
        (GOOD_DATA, metadata(entry("a", 24, 0, 8), entry("b", 13, 4, 4)), r"b at \[4, 8\) overlaps a at \[0, 8\)"),
        (GOOD_DATA, metadata(entry("a", 99, 0, 4)), r"a: unknown dcode 99"),
        (GOOD_DATA, metadata(entry("a", 0, 0, 4)), r"a: unknown dcode 0"),
        (GOOD_DATA, metadata(entry("a", 25, 0, 4)), r"a: 4 bytes is not a whole number of float64 elements"),
    ],
)
def test_malformed_pairs_raise_format_errors_that_name_the_problem(tmp_path, data, meta, message):
    path = write_pair(tmp_path, data, meta)
    with pytest.raises(FormatError, match=message):
        checkpoint.open_pair(path)
    with pytest.raises(ValueError, match=message):
        tt.read(path)


def test_parse_metadata_directly():
    entries = parse_metadata(GOOD_META, 8)
    assert entries == [PairEntry("a", codec.DTYPES["float32"], 0, 4), PairEntry("b", codec.DTYPES["int16"], 4, 4)]
    with pytest.raises(FormatError, match=r"metadata: b: bytes \[4, 8\) are outside the data \(7 bytes\)"):
        parse_metadata(GOOD_META, 7)
    assert parse_metadata(metadata(), 0) == []
    # Zero-size entries may share an offset; Tannic C++'s complex codes are accepted.
    assert len(parse_metadata(metadata(entry("x", 24, 0, 0), entry("y", 24, 0, 0), entry("z", 35, 0, 8)), 8)) == 3
    assert parse_metadata(np.frombuffer(GOOD_META, np.uint8), 8) == entries
