"""``codes="cpp"`` (issue 17): the writers put complex64 and complex128 under Tannic C++'s
codes 35 and 36 instead of pytannic's 37 and 38, and change nothing else; tannery reads
both. Byte-level: no C++ compiler with C++23 and no Tannic checkout are assumed here."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch

from tannery_protocol import codec
from tannery.formats import checkpoint
from tannery import load_tannic
from tannery import torch as tt

from .test_cli import Cli
from .test_torch_codec import CODES, DTYPES, assert_same, sample

#: The codes a Tannic C++ reader expects where they differ from the default ones.
CPP = {torch.complex64: 35, torch.complex128: 36}
SHAPES = [(), (0,), (3, 4), (2, 3, 5)]
#: Where a payload's dcode is: after the 15-byte header.
DCODE_AT = codec.HEADER.size


def _dcode(payload: bytes) -> int:
    return payload[DCODE_AT]


def _pair_codes(path: Path) -> dict[str, int]:
    """Every entry's dcode in a pair's metadata file, by name, read straight from the bytes."""
    data = checkpoint.pair_paths(path)[1].read_bytes()
    codes, pos = {}, codec.HEADER.size
    while pos < len(data):
        code, _offset, _nbytes, length = checkpoint.ENTRY.unpack_from(data, pos)
        pos += checkpoint.ENTRY.size
        codes[data[pos : pos + length].decode()] = code
        pos += length
    return codes


@pytest.mark.parametrize("dtype", list(CPP), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_complex_codes_35_36_with_cpp_37_38_by_default(dtype, shape):
    tensor = sample(dtype, shape)
    seed, cpp = tt.serialize(tensor), tt.serialize(tensor, codes="cpp")
    assert _dcode(seed) == CODES[dtype] == _dcode(tt.serialize(tensor, codes="seed"))
    assert _dcode(cpp) == CPP[dtype]
    # Only the code byte differs.
    assert len(seed) == len(cpp) and seed[:DCODE_AT] == cpp[:DCODE_AT] and seed[DCODE_AT + 1 :] == cpp[DCODE_AT + 1 :]
    assert b"".join(map(bytes, tt.serialize_parts(tensor, codes="cpp"))) == cpp


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in CPP], ids=str)
def test_every_other_dtype_has_the_same_bytes_under_both(dtype):
    for shape in SHAPES:
        tensor = sample(dtype, shape)
        seed = tt.serialize(tensor)
        assert tt.serialize(tensor, codes="cpp") == seed
        assert _dcode(seed) == CODES[dtype]


@pytest.mark.parametrize("codes", ["seed", "cpp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_through_tannerys_reader(dtype, codes):
    tensor = sample(dtype, (2, 3, 5), seed=3)
    data = tt.serialize(tensor, codes=codes)
    assert_same(tt.deserialize(bytearray(data)), tensor)
    assert_same(tt.deserialize(data), tensor)
    info = codec.parse(data)
    assert (info.dtype, info.shape) == (tt.codec_dtype(dtype), (2, 3, 5))


@pytest.mark.parametrize("codes", ["seed", "cpp"])
def test_write_pair_codes_and_read_back(tmp_path: Path, codes: str):
    state = {f"t.{str(d).removeprefix('torch.')}": sample(d, (3, 4), seed=i) for i, d in enumerate(DTYPES)}
    tt.write(state, tmp_path / "m", codes=codes)
    expected = {name: (CPP if codes == "cpp" else CODES).get(t.dtype, CODES[t.dtype]) for name, t in state.items()}
    assert _pair_codes(tmp_path / "m.tannic") == expected
    back = tt.read(tmp_path / "m", like=state)
    assert back.keys() == state.keys() and all(assert_same(back[k], v) is None for k, v in state.items())
    # The data files are the same under both: only the metadata's codes differ.
    tt.write(state, tmp_path / "other", codes="cpp" if codes == "seed" else "seed")
    assert (tmp_path / "m.tannic").read_bytes() == (tmp_path / "other.tannic").read_bytes()


@pytest.mark.parametrize("bad", ["CPP", "tannic", "", None, 35])
def test_a_bad_codes_value_is_refused_naming_the_allowed_ones(tmp_path: Path, bad):
    tensor = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=re.escape(f"codes={bad!r}: use one of 'seed', 'cpp'")):
        tt.serialize(tensor, codes=bad)
    with pytest.raises(ValueError, match="use one of 'seed', 'cpp'"):
        tt.serialize_parts(tensor, codes=bad)
    with pytest.raises(ValueError, match="use one of 'seed', 'cpp'"):
        tt.write({"z": tensor}, tmp_path / "m", codes=bad)
    assert not list(tmp_path.iterdir())  # refused before any file is written
    with pytest.raises(ValueError, match="use one of 'seed', 'cpp'"):
        checkpoint.write_pair(tmp_path / "m", [], codes=bad)
    assert not list(tmp_path.iterdir())


def test_wire_code_is_the_one_place():
    for dtype in codec.DTYPES.values():
        assert codec.wire_code(dtype) == dtype.code
        assert codec.wire_code(dtype, "cpp") == {"complex64": 35, "complex128": 36}.get(dtype.name, dtype.code)
        assert codec.dtype_of_code(codec.wire_code(dtype, "cpp")) is dtype
    prefix = codec.encode_prefix(codec.DTYPES["complex128"], [2], "cpp")
    assert struct.unpack_from("<B", prefix, DCODE_AT) == (36,)


# -- tannery pull --codes ----------------------------------------------------------------------


@pytest.fixture
def cli(server, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(server.target, capsys)


def test_pull_codes_cpp_writes_35_36(cli: Cli, tmp_path: Path) -> None:
    state = {
        "z64": sample(torch.complex64, (3, 4), seed=1),
        "z128": sample(torch.complex128, (5,), seed=2),
        "w": sample(torch.float32, (2, 2), seed=3),
        "mask": sample(torch.bool, (13,), seed=4),
        "h": sample(torch.float16, (4,), seed=5),
    }
    torch.save(state, tmp_path / "in.pt")
    cli.ok("push", str(tmp_path / "in.pt"), "--as", "c")

    cli.ok("pull", "c", "-o", str(tmp_path / "x.tannic"), "--codes", "cpp")
    assert _pair_codes(tmp_path / "x.tannic") == {"z64": 35, "z128": 36, "w": 24, "mask": 1, "h": 23}
    cli.ok("pull", "c", "-o", str(tmp_path / "seed.tannic"))
    assert _pair_codes(tmp_path / "seed.tannic") == {"z64": 37, "z128": 38, "w": 24, "mask": 1, "h": 23}
    cli.ok("pull", "c", "-o", str(tmp_path / "s2.tannic"), "--codes", "seed")
    assert (tmp_path / "s2.metadata.tannic").read_bytes() == (tmp_path / "seed.metadata.tannic").read_bytes()
    assert (tmp_path / "x.tannic").read_bytes() == (tmp_path / "seed.tannic").read_bytes()
    for stem in ("x", "seed"):
        pair = load_tannic(tmp_path / f"{stem}.tannic", like=state)
        assert all(assert_same(pair.find(k), v) is None for k, v in state.items())
    # `tannery push` reads the cpp pair back as the same dtypes.
    cli.ok("push", str(tmp_path / "x.tannic"), "--as", "back")
    dtypes = {e["name"]: e["dtype"] for e in cli.json("show", "back")["entries"]}
    assert dtypes == {e["name"]: e["dtype"] for e in cli.json("show", "c")["entries"]}


def test_pull_codes_refused(cli: Cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"z": torch.ones(2, dtype=torch.complex64)}, tmp_path / "in.pt")
    cli.ok("push", str(tmp_path / "in.pt"), "--as", "c")
    err = cli.fails("pull", "c", "-o", str(tmp_path / "c.safetensors"), "--codes", "cpp")
    assert "--codes cpp: only a .tannic pair has dtype codes" in err
    assert not (tmp_path / "c.safetensors").exists()
    with pytest.raises(SystemExit) as exit:
        cli("pull", "c", "-o", str(tmp_path / "c.tannic"), "--codes", "rust")
    assert exit.value.code == 2
    assert "invalid choice: 'rust' (choose from" in capsys.readouterr().err
    assert not list(tmp_path.glob("c*.tannic"))



def test_numpy_payloads_and_saved_pairs_take_codes_too(tmp_path):
    import numpy as np

    from tannery_protocol import codec
    from tannery.archive import MemoryArchive
    from tannery.formats.files import save_tannic

    array = np.arange(6, dtype=np.complex64)
    assert codec.encode_numpy(array, codes="cpp") != codec.encode_numpy(array)
    assert codec.parse(codec.encode_numpy(array, codes="cpp")).dtype.name == "complex64"
    save_tannic(tmp_path / "c", MemoryArchive({"z": torch.from_numpy(np.arange(4, dtype=np.complex128))}), codes="cpp")
    save_tannic(tmp_path / "s", MemoryArchive({"z": torch.from_numpy(np.arange(4, dtype=np.complex128))}))
    cpp, seed = (tmp_path / "c.metadata.tannic").read_bytes(), (tmp_path / "s.metadata.tannic").read_bytes()
    assert cpp != seed and len(cpp) == len(seed)
    with pytest.raises(ValueError, match="use one of 'seed', 'cpp'"):
        codec.encode_numpy(array, codes="c++")
