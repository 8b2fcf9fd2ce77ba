"""Archives in files: safetensors files and .tannic pairs, memory-mapped, lazy and strict."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import tannery
from tannery import Archive, ArchiveError, load_safetensors, load_tannic, save_safetensors, save_tannic
from tannery.formats import checkpoint
from tannery_protocol.codec import DTYPES, FormatError
from tannery.formats.safetensors_format import CODES, encode_header

SAFETENSORS_NAMES = [name for name in DTYPES if name != "complex128"]


def sample(dtype_name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of any dtype with varied elements (raw bits for the floats, so NaNs too)."""
    dtype = tannery.torch.torch_dtype(dtype_name)
    numel = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_)).reshape(shape)
    itemsize = DTYPES[dtype_name].itemsize
    raw = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(tannery.torch.buffer_of(a)) == bytes(tannery.torch.buffer_of(b))


def every_dtype(names=SAFETENSORS_NAMES) -> dict[str, torch.Tensor]:
    shapes = [(2, 3), (), (0,), (4, 0, 2), (5,)]
    return {f"{name}.{i}": sample(name, shape, i) for name in names for i, shape in enumerate(shapes)}


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps ``path``, from /proc/self/maps."""
    target = os.path.realpath(path)
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def is_view_of_map(tensor: torch.Tensor, path: Path) -> bool:
    ptr = tensor.data_ptr()
    return any(start <= ptr and ptr + tensor.nbytes <= end for start, end in mapped_ranges(path))


# -- safetensors -----------------------------------------------------------------------


def test_safetensors_round_trips_every_dtype(tmp_path):
    tensors = every_dtype()
    path = tmp_path / "all.safetensors"
    save_safetensors(path, Archive.of_list(tensors))
    loaded = load_safetensors(path)
    assert loaded.names() == sorted(tensors)
    for name, tensor in tensors.items():
        got = loaded.tensor(name, tensor.shape, tensor.dtype)
        assert same(got, tensor), name
        assert loaded.info(name).nbytes == tensor.numel() * tensor.element_size()


def test_safetensors_dtypes_are_those_of_the_package(tmp_path):
    assert set(CODES) == set(SAFETENSORS_NAMES)
    path = tmp_path / "codes.safetensors"
    save_safetensors(path, Archive.of_list({name: sample(name, (1,)) for name in SAFETENSORS_NAMES}))
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + length])
    assert {name: header[name]["dtype"] for name in SAFETENSORS_NAMES} == {
        "bool": "BOOL", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
        "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
        "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
        "complex64": "C64",
    }


def test_the_safetensors_package_reads_what_we_write_and_we_read_what_it_writes(tmp_path):
    tensors = every_dtype()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_safetensors(ours, Archive.of_list(tensors))
    by_package = safetensors.torch.load_file(ours)
    assert by_package.keys() == tensors.keys()
    assert all(same(by_package[name], tensors[name]) for name in tensors)
    safetensors.torch.save_file(tensors, theirs, metadata={"format": "pt"})
    loaded = load_safetensors(theirs)
    assert all(same(loaded.find(name), tensors[name]) for name in tensors)


def test_complex128_has_no_safetensors_dtype_and_nothing_is_written(tmp_path):
    path = tmp_path / "z.safetensors"
    path.write_bytes(b"old")
    archive = Archive.of_list({"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(TypeError) as e:
        save_safetensors(path, archive)
    assert str(e.value).startswith("save_safetensors: z: complex128 has no safetensors dtype; safetensors has bool,")
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["z.safetensors"]


def test_loaded_tensors_view_a_private_map_of_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(path, Archive.of_list({"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(8)}))
    before = path.read_bytes()
    archive = load_safetensors(path)
    w = archive.tensor("w", [1024], torch.float32)
    assert is_view_of_map(w, path) and is_view_of_map(archive.find("b"), path)
    assert archive.find("w") is w
    w += 1  # copy-on-write: the tensor changes, the file does not
    assert archive.find("w")[0].item() == 1.0
    assert path.read_bytes() == before
    assert load_safetensors(path).find("w")[0].item() == 0.0


def test_saving_writes_the_values_of_any_strides_and_views(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    tensors = {"t": base.t(), "slice": base[1], "step": base[:, ::2], "conj": z.conj(), "neg": z.conj().imag}
    archive = Archive.of_list(tensors)
    save_safetensors(tmp_path / "v.safetensors", archive)
    save_tannic(tmp_path / "v", archive)
    loaded = load_safetensors(tmp_path / "v.safetensors")
    pair = load_tannic(tmp_path / "v", like=tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded.find(name), tensor.resolve_conj().resolve_neg()), name
        assert torch.equal(pair.find(name), tensor.resolve_conj().resolve_neg()), name


def test_tied_tensors_are_saved_once_per_name(tmp_path):
    """safetensors.torch.save_file refuses tensors that share memory; an archive's names are
    distinct entries, so each is written."""
    w = torch.arange(6.0).reshape(2, 3)
    save_safetensors(tmp_path / "tied.safetensors", Archive.of_value({"enc": w, "dec": w, "dec_t": w.t()}, "m"))
    loaded = load_safetensors(tmp_path / "tied.safetensors")
    assert torch.equal(loaded.find("m.enc"), w) and torch.equal(loaded.find("m.dec"), w)
    assert torch.equal(loaded.find("m.dec_t"), w.t())


def test_a_file_archive_saves_to_the_other_format_and_over_itself(tmp_path):
    tensors = every_dtype()
    save_safetensors(tmp_path / "a.safetensors", Archive.of_list(tensors))
    first = load_safetensors(tmp_path / "a.safetensors")
    save_tannic(tmp_path / "a", first)
    second = load_tannic(tmp_path / "a", like=tensors)
    save_safetensors(tmp_path / "a.safetensors", second)  # replaces the file `first` maps
    third = load_safetensors(tmp_path / "a.safetensors")
    for name, tensor in tensors.items():
        assert same(first.find(name), tensor) and same(third.find(name), tensor), name


def test_an_empty_archive_round_trips(tmp_path):
    save_safetensors(tmp_path / "e.safetensors", Archive.of_list({}))
    assert len(load_safetensors(tmp_path / "e.safetensors")) == 0
    save_tannic(tmp_path / "e", Archive.of_list({}))
    assert len(load_tannic(tmp_path / "e")) == 0


# -- malformed safetensors files ---------------------------------------------------------


def write_safetensors(path: Path, header: object, data: bytes = b"", raw_header: bytes | None = None) -> Path:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


MALFORMED = {
    "not JSON": (None, b"", b"{nope", "the header is not JSON"),
    "not UTF-8": (None, b"", b'{"\xff": 1}', "the header is not UTF-8"),
    "not an object": (None, b"", b"[1, 2]", "the header does not start with '{'"),
    "a JSON constant": (None, b"", b'{"w": NaN}', "the header holds NaN, which is not JSON"),
    "a name twice": (None, b"\0" * 8, b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                     b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "'w' appears twice in the header"),
    "bad metadata": ({"__metadata__": {"k": 1}}, b"", None, "__metadata__ is not an object of strings"),
    "an empty name": ({"": entry("F32", [1], 0, 4)}, b"\0" * 4, None, "an entry has an empty name"),
    "an entry not an object": ({"w": [1]}, b"", None, "w: an entry is an object of dtype, shape and data_offsets"),
    "a key too many": ({"w": entry("F32", [1], 0, 4) | {"extra": 1}}, b"\0" * 4, None,
                       "w: an entry is an object of dtype, shape and data_offsets, got ['data_offsets', 'dtype', 'extra', 'shape']"),
    "an unknown dtype": ({"w": entry("F33", [1], 0, 4)}, b"\0" * 4, None, "w: dtype 'F33' is not one tannery reads"),
    "a dtype tannery lacks": ({"w": entry("F8_E8M0", [1], 0, 1)}, b"\0", None, "w: dtype 'F8_E8M0' is not one tannery reads"),
    "a negative dimension": ({"w": entry("F32", [-1], 0, 4)}, b"\0" * 4, None,
                             "w: shape [-1] is not a list of non-negative integers"),
    "a float dimension": ({"w": entry("F32", [1.0], 0, 4)}, b"\0" * 4, None, "w: shape [1.0] is not a list"),
    "a bool dimension": ({"w": entry("F32", [True], 0, 4)}, b"\0" * 4, None, "w: shape [True] is not a list"),
    "a shape too large for torch": ({"w": entry("F32", [2**62, 2**62, 0], 0, 0)}, b"", None,
                                    f"w: shape [{2**62}, {2**62}, 0] is too large for a tensor"),
    "three offsets": ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 4, None,
                      "w: data_offsets [0, 4, 8] is not two non-negative integers"),
    "offsets backwards": ({"w": entry("F32", [0], 4, 0)}, b"\0" * 4, None, "w: data_offsets [4, 0] end before they begin"),
    "a size that is not the shape's": ({"w": entry("F32", [2, 2], 0, 12)}, b"\0" * 12, None,
                                       "w: data_offsets [0, 12] hold 12 bytes, shape [2, 2] of float32 takes 16"),
    "an entry past the end": ({"w": entry("F32", [4], 0, 16)}, b"\0" * 12, None,
                              "w: bytes [0, 16) are outside the data (12 bytes)"),
    "overlapping entries": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, b"\0" * 12, None,
                            "b at [4, 12) overlaps a at [0, 8)"),
    "a gap": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, b"\0" * 12, None,
              "bytes [4, 8) of the data belong to no entry"),
    "trailing bytes": ({"a": entry("F32", [1], 0, 4)}, b"\0" * 6, None,
                       "trailing bytes: the entries end at 4, the data has 6 bytes"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_safetensors_files_raise_format_errors(tmp_path, case):
    header, data, raw, expected = MALFORMED[case]
    path = write_safetensors(tmp_path / "bad.safetensors", header, data, raw)
    with pytest.raises(FormatError) as e:
        load_safetensors(path)
    assert str(e.value).startswith(f"{path}: ")
    assert expected in str(e.value)


def test_safetensors_header_lengths_that_lie_raise_format_errors(tmp_path):
    path = tmp_path / "bad.safetensors"
    for content, expected in [
        (b"", "the file is empty \\(0 bytes\\); a safetensors file starts with an 8-byte header length"),
        (b"\x02\0\0", "3 bytes, too short for the 8-byte header length"),
        (struct.pack("<Q", 100) + b"{}", "truncated: a header of 100 bytes, 2 bytes after its length"),
        (struct.pack("<Q", 2**63) + b"{}", f"header length {2**63} is over the limit of 100000000 bytes"),
    ]:
        path.write_bytes(content)
        with pytest.raises(FormatError, match=expected):
            load_safetensors(path)


def test_every_truncation_of_a_safetensors_file_raises_a_format_error(tmp_path):
    good = tmp_path / "good.safetensors"
    save_safetensors(good, Archive.of_list({"a": torch.ones(3), "b": torch.ones(2, dtype=torch.int8)}))
    content = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for size in range(len(content)):
        cut.write_bytes(content[:size])
        with pytest.raises(FormatError):
            load_safetensors(cut)
    cut.write_bytes(content + b"\0")
    with pytest.raises(FormatError, match="trailing bytes"):
        load_safetensors(cut)


def test_corrupted_headers_raise_a_format_error_or_give_tensors_inside_the_file(tmp_path):
    """Every byte of a header, replaced by each of a few values: never a crash, never a tensor
    that reaches outside the data region or disagrees with its own info."""
    good = tmp_path / "good.safetensors"
    save_safetensors(good, Archive.of_list({"a": torch.ones(3), "b": torch.ones(2, 2, dtype=torch.int16)}))
    content = good.read_bytes()
    (length,) = struct.unpack("<Q", content[:8])
    bad = tmp_path / "bad.safetensors"
    outcomes = {"error": 0, "loaded": 0}
    for pos in range(8 + length):
        for value in (0x00, 0x20, 0x31, 0x39, 0x7B, 0x7D, 0xFF):
            mutated = bytearray(content)
            mutated[pos] = value
            bad.write_bytes(mutated)
            try:
                archive = load_safetensors(bad)
            except FormatError:
                outcomes["error"] += 1
                continue
            outcomes["loaded"] += 1
            data_nbytes = len(content) - 8 - length
            assert sum(archive.info(n).nbytes for n in archive.names()) == data_nbytes
            for name in archive.names():
                info = archive.info(name)
                tensor = archive.tensor(name, info.shape, info.dtype)
                assert tensor.numel() * tensor.element_size() == info.nbytes
    assert outcomes["error"] > 0 and outcomes["loaded"] > 0


# -- .tannic pairs -----------------------------------------------------------------------


def test_tannic_pairs_round_trip_every_dtype_with_like(tmp_path):
    tensors = every_dtype(list(DTYPES))
    save_tannic(tmp_path / "all", Archive.of_list(tensors))
    assert (tmp_path / "all.tannic").is_file() and (tmp_path / "all.metadata.tannic").is_file()
    loaded = load_tannic(tmp_path / "all.tannic", like=tensors)
    assert loaded.names() == sorted(tensors)
    for name, tensor in tensors.items():
        assert same(loaded.tensor(name, tensor.shape, tensor.dtype), tensor), name


def test_tannic_entries_are_flat_without_like(tmp_path):
    tensors = {"w": torch.arange(6, dtype=torch.int16).reshape(2, 3), "s": torch.tensor(1.5),
               "flags": torch.tensor([True, False, True]), "none": torch.empty(0, 4)}
    save_tannic(tmp_path / "p", Archive.of_list(tensors))
    loaded = load_tannic(tmp_path / "p")
    assert {n: loaded.info(n) for n in loaded.names()} == {
        "flags": tannery.TensorInfo("bool", (8,), 1),  # bit-packed: eight elements per byte
        "none": tannery.TensorInfo("float32", (0,), 0),
        "s": tannery.TensorInfo("float32", (1,), 4),
        "w": tannery.TensorInfo("int16", (6,), 12),
    }
    assert loaded.find("w").tolist() == [0, 1, 2, 3, 4, 5]
    assert loaded.find("flags").tolist()[:3] == [True, False, True]
    assert is_view_of_map(loaded.find("w"), tmp_path / "p.tannic")
    # like gives shapes to the entries it names; the others stay flat.
    partial = load_tannic(tmp_path / "p", like={"w": torch.empty(3, 2, dtype=torch.int16)})
    assert partial.info("w").shape == (3, 2) and partial.info("s").shape == (1,)


def test_tannic_like_under_a_prefix(tmp_path):
    value = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    save_tannic(tmp_path / "p", Archive.of_value(value, prefix="model"))
    loaded = load_tannic(tmp_path / "p", like=value, prefix="model")
    got = loaded.to_value(value, prefix="model")
    assert torch.equal(got["w"], value["w"]) and torch.equal(got["b"], value["b"])


def test_tannic_like_must_match_the_pair(tmp_path):
    save_tannic(tmp_path / "p", Archive.of_list({"w": torch.ones(4), "i": torch.ones(2, dtype=torch.int32)}))
    cases = [
        ({"x": torch.empty(4)}, "load_tannic: x: no entry in the file, a leaf in like"),
        ({"i": torch.empty(2)}, "load_tannic: i: int32 in the file, float32 in like"),
        ({"w": torch.empty(3)}, "load_tannic: w: 16 bytes in the file, shape [3] of float32 in like takes 12"),
    ]
    for like, expected in cases:
        with pytest.raises(ArchiveError) as e:
            load_tannic(tmp_path / "p", like=like)
        assert str(e.value) == expected
    with pytest.raises(ValueError, match="load_tannic: a leaf at the root has no name; give a prefix"):
        load_tannic(tmp_path / "p", like=torch.empty(4))


def test_malformed_tannic_pairs_raise_format_errors(tmp_path):
    save_tannic(tmp_path / "p", Archive.of_list({"a": torch.ones(4), "b": torch.ones(2)}))
    data, metadata = (tmp_path / "p.tannic").read_bytes(), (tmp_path / "p.metadata.tannic").read_bytes()
    for size in range(len(data)):
        (tmp_path / "p.tannic").write_bytes(data[:size])
        with pytest.raises(FormatError):
            load_tannic(tmp_path / "p")
    (tmp_path / "p.tannic").write_bytes(data)
    for size in range(len(metadata)):
        (tmp_path / "p.metadata.tannic").write_bytes(metadata[:size])
        with pytest.raises(FormatError):
            load_tannic(tmp_path / "p")
    a, b = (checkpoint.PairEntry(n, DTYPES["float32"], off, 16) for n, off in (("a", 0), ("b", 8)))
    (tmp_path / "p.metadata.tannic").write_bytes(checkpoint.encode_metadata([a, b]))
    with pytest.raises(FormatError, match="b at \\[8, 24\\) overlaps a at \\[0, 16\\)"):
        load_tannic(tmp_path / "p")


def test_union_of_file_archives(tmp_path):
    save_safetensors(tmp_path / "m.safetensors", Archive.of_value({"w": torch.ones(2)}, prefix="model"))
    save_tannic(tmp_path / "o", Archive.of_value({"m": torch.zeros(2)}, prefix="optim"))
    both = Archive.union([load_safetensors(tmp_path / "m.safetensors"), load_tannic(tmp_path / "o")])
    assert both.names() == ["model.w", "optim.m"]
    assert both.to_value({"w": torch.empty(2)}, prefix="model")["w"].tolist() == [1.0, 1.0]
    save_safetensors(tmp_path / "both.safetensors", both)
    assert load_safetensors(tmp_path / "both.safetensors").names() == ["model.w", "optim.m"]


# -- pairs written by the peers ----------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layer = torch.nn.Linear(784, 512)
        self.output_layer = torch.nn.Linear(512, 10)


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convolutional_layer = torch.nn.Conv2d(1, 32, 3)
        self.output_layer = torch.nn.Linear(25088, 10)


def raw_float32(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Read an entry independently of tannery: the data file's bytes after its 15-byte header."""
    return np.fromfile(path, dtype="<f4", count=nbytes // 4, offset=15 + offset)


@pytest.mark.parametrize("stem, module", [("MLP", MLP), ("CNN", CNN)])
def test_pytannic_pairs_load_into_their_models(tannic_nn, stem, module):
    model = module()
    like = model.state_dict()
    archive = load_tannic(tannic_nn / stem, like=like)
    assert archive.names() == sorted(like)
    model.load_state_dict(archive.to_value(like))
    offset = 0
    for name, tensor in like.items():  # pytannic wrote them in state_dict order, back to back
        stored = model.state_dict()[name]
        assert archive.info(name) == tannery.TensorInfo("float32", tuple(tensor.shape), tensor.nbytes)
        assert np.array_equal(stored.numpy().reshape(-1), raw_float32(tannic_nn / f"{stem}.tannic", offset, tensor.nbytes))
        assert torch.isfinite(stored).all() and stored.abs().sum() > 0
        offset += tensor.nbytes


def test_a_pytannic_pair_without_shapes_is_flat(tannic_nn):
    archive = load_tannic(tannic_nn / "dev-embd.metadata.tannic")
    assert archive.names() == ["weight"]
    assert archive.info("weight") == tannery.TensorInfo("float32", (8192,), 32768)
    weight = archive.tensor("weight", [8192], torch.float32)
    assert np.array_equal(weight.numpy(), raw_float32(tannic_nn / "dev-embd.tannic", 0, 32768))
    assert is_view_of_map(weight, tannic_nn / "dev-embd.tannic")


def test_a_pair_written_by_pytannic_here_loads(tmp_path, monkeypatch):
    from pytannic.torch.modules import write

    monkeypatch.chdir(tmp_path)  # pytannic writes <stem>.tannic in the working directory
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    write(model, "seq")
    state = model.state_dict()
    loaded = load_tannic(tmp_path / "seq", like=state).to_value(state)
    assert all(torch.equal(loaded[name], state[name]) for name in state)


# -- laziness: opening and asking read no entry's bytes ------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the pages wholly inside the tensor's memory are in the page cache (mincore(2)).

    Pages it shares with its neighbours (the header's, which was written) are left out.
    """
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    length = (tensor.data_ptr() + tensor.nbytes) // page * page - start
    vector = (ctypes.c_ubyte * (length // page))()
    if _libc.mincore(start, length, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((np.frombuffer(vector, dtype=np.uint8) & 1).sum())


#: A large file: 16 entries of 256 MiB (4 GiB), written sparse so that none of its data is
#: on disk or in the page cache until something reads it.
BIG_SHAPE = (8192, 8192)
BIG_NAMES = [f"layers.{i:02d}.w" for i in range(16)]


def big_like() -> dict:
    return {"layers": {name.split(".")[1]: {"w": torch.empty(BIG_SHAPE, device="meta")} for name in BIG_NAMES}}


def assert_nothing_read(archive: Archive) -> None:
    """Ask everything an archive answers without reading, then check with mincore that no
    page of any entry is in the page cache, then that reading one element shows up."""
    assert archive.names() == BIG_NAMES
    nbytes = math.prod(BIG_SHAPE) * 4
    assert all(archive.info(n) == tannery.TensorInfo("float32", BIG_SHAPE, nbytes) for n in BIG_NAMES)
    asked = [archive.tensor(n, BIG_SHAPE, torch.float32) for n in BIG_NAMES]
    asked += [archive.float(n, BIG_SHAPE, torch.float32) for n in BIG_NAMES]
    asked += [archive.find(n) for n in BIG_NAMES]
    value = archive.to_value(big_like(), prefix="")
    asked += [value["layers"][n.split(".")[1]]["w"] for n in BIG_NAMES]
    union = Archive.union([archive, Archive.of_list({"x": torch.ones(1)})])
    asked += [union.tensor(n, BIG_SHAPE, "float32") for n in BIG_NAMES]
    assert all(t.shape == BIG_SHAPE and t.device.type == "cpu" for t in asked)
    assert [resident_pages(t) for t in asked] == [0] * len(asked)
    # The check can see a read: one element brings at least its page in.
    last = archive.find(BIG_NAMES[-1])
    assert last[BIG_SHAPE[0] // 2, 0].item() == 0.0
    assert resident_pages(last) >= 1


def test_a_large_safetensors_file_is_opened_and_asked_without_reading_its_entries(tmp_path):
    path = tmp_path / "big.safetensors"
    nbytes = math.prod(BIG_SHAPE) * 4
    header = encode_header([(name, "F32", BIG_SHAPE, nbytes) for name in BIG_NAMES])
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + nbytes * len(BIG_NAMES))
    with safetensors.safe_open(path, "pt") as reference:  # the package agrees the file is valid
        assert sorted(reference.keys()) == BIG_NAMES
    assert os.stat(path).st_blocks * 512 < 1 << 20  # sparse: the data is not on disk
    assert_nothing_read(load_safetensors(path))


def test_a_large_tannic_pair_is_opened_and_asked_without_reading_its_entries(tmp_path):
    nbytes = math.prod(BIG_SHAPE) * 4
    entries = [checkpoint.PairEntry(name, DTYPES["float32"], i * nbytes, nbytes) for i, name in enumerate(BIG_NAMES)]
    (tmp_path / "big.metadata.tannic").write_bytes(checkpoint.encode_metadata(entries))
    with open(tmp_path / "big.tannic", "wb") as f:
        f.write(checkpoint.file_header(nbytes * len(BIG_NAMES)))
        f.truncate(15 + nbytes * len(BIG_NAMES))
    assert_nothing_read(load_tannic(tmp_path / "big", like=big_like()))
