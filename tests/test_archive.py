"""Archives in memory: building, reading, the checks and every message of the issue."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import OrderedDict, namedtuple
from typing import Sequence

import numpy as np
import pytest
import torch

import tannery_protocol.codec
import tannery
from tannery import Archive, ArchiveError
from tannery.archive import MemoryArchive, TensorInfo, UnionArchive
from tannery.values import named_leaves
from tannery_protocol.names import join, owned, owns


def message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


@pytest.fixture
def archive() -> Archive:
    return Archive.of_list(
        [
            ("w", torch.arange(4, dtype=torch.float32).reshape(2, 2)),
            ("half", torch.ones(3, dtype=torch.bfloat16)),
            ("count", torch.tensor([1, 2], dtype=torch.int32)),
            ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ]
    )


class CountingArchive(MemoryArchive):
    """A real in-memory archive that records the entries each _fetch asked for."""

    __slots__ = ("fetches",)

    def __init__(self, tensors) -> None:
        super().__init__(tensors)
        self.fetches: list[list[str]] = []

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        self.fetches.append(list(names))
        return super()._fetch(names)


# -- of_list, union, the collection ----------------------------------------------------


def test_of_list_takes_pairs_or_a_mapping_and_copies_nothing():
    w, b = torch.ones(2), torch.zeros(3)
    for entries in ([("w", w), ("b", b)], {"w": w, "b": b}, iter([("w", w), ("b", b)])):
        a = Archive.of_list(entries)
        assert a.find("w") is w and a.find("b") is b
        assert a.names() == ["b", "w"]


def test_of_list_refuses_an_empty_name():
    with pytest.raises(ValueError) as e:
        Archive.of_list([("", torch.ones(1))])
    assert message(e) == "Archive.of_list: an empty name"


def test_of_list_refuses_a_name_given_twice():
    with pytest.raises(ValueError) as e:
        Archive.of_list([("w", torch.ones(1)), ("v", torch.ones(1)), ("w", torch.zeros(1))])
    assert message(e) == "Archive.of_list: 'w' is named twice"


def test_of_list_refuses_what_is_not_a_tensor_or_cannot_be_stored():
    with pytest.raises(TypeError, match=r"^Archive.of_list: w: list is not a tensor$"):
        Archive.of_list([("w", [1.0, 2.0])])
    with pytest.raises(TypeError, match=r"^Archive.of_list: an entry name is a str, not int$"):
        Archive.of_list([(7, torch.ones(1))])
    with pytest.raises(TypeError, match=r"^Archive.of_list: f: torch.float8_e4m3fnuz has no tannic dcode"):
        Archive.of_list([("f", torch.zeros(2, dtype=torch.float8_e4m3fnuz))])
    with pytest.raises(TypeError, match=r"^Archive.of_list: s: a torch.sparse_coo tensor"):
        Archive.of_list([("s", torch.eye(2).to_sparse())])


def test_numpy_arrays_become_tensors_that_share_their_memory():
    import ml_dtypes

    f = np.arange(6, dtype=np.float32).reshape(2, 3)
    bf = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    f8 = np.array([0.5, 448.0], dtype=ml_dtypes.float8_e4m3fn)
    strided = np.arange(10, dtype=np.int64)[::2]
    a = Archive.of_list({"f": f, "bf": bf, "f8": f8, "strided": strided})
    assert [a.info(n).dtype for n in ("f", "bf", "f8", "strided")] == ["float32", "bfloat16", "float8_e4m3fn", "int64"]
    assert a.find("bf").tolist() == [1.5, -2.0] and a.find("f8").tolist() == [0.5, 448.0]
    assert a.find("strided").tolist() == [0, 2, 4, 6, 8]
    f[0, 0], bf[0], strided[1] = 42.0, 3.0, 99
    assert a.find("f")[0, 0].item() == 42.0
    assert a.find("bf")[0].item() == 3.0
    assert a.find("strided")[1].item() == 99


def test_names_are_sorted_and_the_collection_answers_len_and_in(archive):
    assert archive.names() == ["count", "half", "scalar", "w"]
    assert len(archive) == 4
    assert "w" in archive and "absent" not in archive and 3 not in archive
    names = archive.names()
    names.append("x")
    assert archive.names() == ["count", "half", "scalar", "w"]  # a copy: the archive is immutable


def test_find_gives_the_tensor_or_none(archive):
    assert archive.find("absent") is None
    assert archive.find("w") is archive.find("w")
    assert archive.find("w").tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_union_has_the_entries_of_all():
    a = Archive.of_list({"a": torch.ones(1)})
    b = Archive.of_list({"b": torch.zeros(2), "c": torch.ones(3, dtype=torch.int8)})
    u = Archive.union([a, b, Archive.of_list({})])
    assert u.names() == ["a", "b", "c"]
    assert u.find("b") is b.find("b") and u.info("c") == TensorInfo("int8", (3,), 3)
    assert len(Archive.union([])) == 0
    # A union of unions keeps pointing at the archives that hold the entries.
    uu = Archive.union([u, Archive.of_list({"d": torch.ones(1)})])
    assert isinstance(uu, UnionArchive) and uu.names() == ["a", "b", "c", "d"]
    assert uu.find("a") is a.find("a")


def test_union_refuses_a_name_in_two_archives():
    a = Archive.of_list({"w": torch.ones(1), "a": torch.ones(1)})
    b = Archive.of_list({"w": torch.zeros(1)})
    with pytest.raises(ValueError) as e:
        Archive.union([a, b])
    assert message(e) == "Archive.union: 'w' is in two archives"
    with pytest.raises(ValueError, match="'a' is in two archives"):
        Archive.union([a, a])
    with pytest.raises(TypeError, match="Archive.union: dict is not an Archive"):
        Archive.union([a, {"x": torch.ones(1)}])


def test_union_fetches_once_per_source_archive():
    a = CountingArchive({"a1": torch.ones(1), "a2": torch.ones(2)})
    b = CountingArchive({"b1": torch.zeros(1)})
    u = Archive.union([a, b])
    value = u.to_value({"a1": torch.empty(1), "b1": torch.empty(1), "a2": torch.empty(2)})
    assert a.fetches == [["a1", "a2"]] and b.fetches == [["b1"]]
    assert value["a2"] is a.find("a2")


# -- info ------------------------------------------------------------------------------


def test_info_reads_metadata_only_into_a_small_frozen_record(archive):
    info = archive.info("w")
    assert info == TensorInfo("float32", (2, 2), 16)
    assert (info.dtype, info.shape, info.nbytes, info.numel) == ("float32", (2, 2), 16, 4)
    assert repr(info) == "TensorInfo(float32 [2, 2], 16 bytes)"
    assert str(archive.info("scalar")) == "float64 []"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.dtype = "int8"  # type: ignore[misc]
    with pytest.raises(ArchiveError) as e:
        archive.info("absent")
    assert message(e) == "Archive.info: absent: no entry in the archive"


def test_info_and_checks_do_not_fetch():
    a = CountingArchive({"w": torch.ones(2, 2), "i": torch.ones(2, dtype=torch.int32)})
    a.info("w"), a.names(), len(a), "w" in a
    for ask in (lambda: a.tensor("w", [4], "float32"), lambda: a.tensor("w", [2, 2], "float64"),
                lambda: a.float("i", [2], "float32"), lambda: a.tensor("x", [1], "float32")):
        with pytest.raises(ArchiveError):
            ask()
    assert a.fetches == []


# -- tensor ----------------------------------------------------------------------------


def test_tensor_gives_the_entry_as_stored(archive):
    w = archive.find("w")
    assert archive.tensor("w", [2, 2], torch.float32) is w
    assert archive.tensor("w", (2, 2), "float32") is w
    assert archive.tensor("w", torch.Size([2, 2]), tannery_protocol.codec.DTYPES["float32"]) is w
    assert archive.tensor("scalar", [], torch.float64).item() == 2.5


def test_tensor_names_a_missing_entry(archive):
    with pytest.raises(ArchiveError) as e:
        archive.tensor("absent", [2], torch.float32)
    assert message(e) == "Archive.tensor: absent: no entry in the archive"
    assert isinstance(e.value, ValueError)


def test_tensor_names_a_shape_mismatch(archive):
    with pytest.raises(ArchiveError) as e:
        archive.tensor("w", [4], torch.float32)
    assert message(e) == "Archive.tensor: w: shape [2, 2] in the archive, [4] asked for"
    with pytest.raises(ArchiveError) as e:
        archive.tensor("scalar", [1], torch.float64)
    assert message(e) == "Archive.tensor: scalar: shape [] in the archive, [1] asked for"


def test_tensor_names_a_dtype_mismatch(archive):
    with pytest.raises(ArchiveError) as e:
        archive.tensor("half", [3], torch.float32)
    assert message(e) == "Archive.tensor: half: bfloat16 in the archive, float32 asked for"


def test_tensor_refuses_a_dtype_that_does_not_exist(archive):
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        archive.tensor("w", [2, 2], "float33")
    with pytest.raises(TypeError, match="a dtype is a torch.dtype or a name"):
        archive.tensor("w", [2, 2], 4)


# -- float -----------------------------------------------------------------------------


def test_float_gives_the_entry_itself_at_its_own_dtype(archive):
    assert archive.float("half", [3], torch.bfloat16) is archive.find("half")
    assert archive.float("w", [2, 2], "float32") is archive.find("w")


def test_float_casts_into_a_new_tensor_on_each_call(archive):
    first = archive.float("half", [3], torch.float32)
    second = archive.float("half", [3], "float32")
    assert first.dtype == torch.float32 and first.tolist() == [1.0, 1.0, 1.0]
    assert first is not second and first.data_ptr() != second.data_ptr()
    first += 1
    assert archive.find("half").tolist() == [1.0, 1.0, 1.0]
    assert archive.float("scalar", [], torch.float16).item() == 2.5


def test_float_refuses_to_target_another_dtype(archive):
    with pytest.raises(ValueError) as e:
        archive.float("w", [2, 2], torch.float8_e5m2)
    assert message(e) == "Archive.float: float8_e5m2 is not float16, bfloat16, float32 or float64"
    assert not isinstance(e.value, ArchiveError)


def test_float_refuses_an_entry_of_another_dtype(archive):
    with pytest.raises(ArchiveError) as e:
        archive.float("count", [2], torch.float32)
    assert message(e) == "Archive.float: count: int32 in the archive, not float16, bfloat16, float32 or float64"


def test_float_names_a_missing_entry_and_a_shape_mismatch(archive):
    with pytest.raises(ArchiveError) as e:
        archive.float("absent", [2], torch.float32)
    assert message(e) == "Archive.float: absent: no entry in the archive"
    with pytest.raises(ArchiveError) as e:
        archive.float("w", [4], torch.float32)
    assert message(e) == "Archive.float: w: shape [2, 2] in the archive, [4] asked for"


# -- of_value --------------------------------------------------------------------------


def model_value() -> dict:
    return {
        "model": {
            "blocks": [torch.ones(2), torch.zeros(3), (torch.arange(2), "relu")],
            "scale": torch.tensor(2.0, dtype=torch.float64),
            "steps": 10,
        },
        "empty": [],
    }


def test_of_value_names_each_tensor_by_its_path_and_copies_nothing():
    value = model_value()
    a = Archive.of_value(value, skip_non_tensors=True)
    assert a.names() == ["model.blocks.0", "model.blocks.1", "model.blocks.2.0", "model.scale"]
    assert a.find("model.blocks.1") is value["model"]["blocks"][1]
    assert a.find("model.scale") is value["model"]["scale"]


def test_of_value_puts_names_under_a_prefix():
    a = Archive.of_value(model_value(), prefix="run", skip_non_tensors=True)
    assert a.names() == ["run.model.blocks.0", "run.model.blocks.1", "run.model.blocks.2.0", "run.model.scale"]
    a = Archive.of_value(torch.ones(2), prefix="w")
    assert a.names() == ["w"]
    assert len(Archive.of_value({"steps": 3, "name": "x", "nothing": [[], {}, ()]}, skip_non_tensors=True)) == 0


def test_of_value_keeps_plain_values_and_refuses_any_other_leaf_naming_its_path():
    """A non-tensor leaf never vanishes: plain values are kept, anything else is named, with the way to leave it out."""
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2), "step": 5}}}, "name": "x", "hook": object()}
    with pytest.raises(TypeError) as e:
        Archive.of_value(state)
    assert message(e).startswith("Archive.of_value: hook is an object, neither a tensor nor a plain value ")
    assert "skip_non_tensors=True" in message(e)
    with pytest.raises(TypeError, match=r"^Archive.of_value: run.m.0 is a range, neither "):
        Archive.of_value({"m": [range(3)]}, prefix="run")
    with pytest.raises(ValueError, match=r"^Archive.of_value: a leaf at the root has no name; give a prefix"):
        Archive.of_value("notatensor")
    del state["hook"]
    assert Archive.of_value(state).to_value() == state
    # Empty containers are kept too, but are no entries.
    assert Archive.of_value({"w": torch.ones(1), "nothing": [[], {}, ()]}).names() == ["w"]
    assert Archive.of_value(state, skip_non_tensors=True).names() == ["optimizer.state.0.exp_avg"]


def test_of_value_names_dict_keys_of_any_type_by_their_str():
    # The shape of an SGD optimizer's state_dict (torch.optim itself takes seconds to import).
    state = {"state": {0: {"momentum_buffer": torch.ones(2)}, 1: {"momentum_buffer": None}},
             "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]}
    a = Archive.of_value(state, prefix="optim", skip_non_tensors=True)
    assert a.names() == ["optim.state.0.momentum_buffer"]
    like = {"state": {0: {"momentum_buffer": torch.empty(2)}, 1: {"momentum_buffer": None}},
            "param_groups": [{"lr": 0.5, "momentum": 0.9, "params": [0, 1]}]}
    got = a.to_value(like, prefix="optim")
    assert got["state"][0]["momentum_buffer"] is state["state"][0]["momentum_buffer"]
    assert got["param_groups"][0]["lr"] == 0.5 and list(got["state"]) == [0, 1]


def test_of_value_refuses_a_leaf_at_the_root_without_a_prefix():
    with pytest.raises(ValueError) as e:
        Archive.of_value(torch.ones(2))
    assert message(e) == "Archive.of_value: a leaf at the root has no name; give a prefix"


def test_of_value_refuses_two_leaves_of_one_name():
    with pytest.raises(ValueError) as e:
        Archive.of_value({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    assert message(e) == "Archive.of_value: a.b: two leaves have this name"


def test_of_value_refuses_a_leaf_whose_keys_are_all_empty():
    with pytest.raises(ValueError, match=r"^Archive.of_value: a leaf at \[''\] has an empty name; give a prefix$"):
        Archive.of_value({"": torch.ones(1)})
    assert Archive.of_value({"": torch.ones(1)}, prefix="p").names() == ["p."]


# -- to_value --------------------------------------------------------------------------


def like_of(value):
    """``value`` with every tensor replaced by an uninitialised one of its dtype and shape."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: like_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [like_of(v) for v in value]
    if isinstance(value, tuple):
        return tuple(like_of(v) for v in value)
    return value


def test_to_value_gives_the_entries_in_likes_structure():
    value = model_value()
    like = like_of(value)
    like["model"]["steps"] = 99
    got = Archive.of_value(value, prefix="p", skip_non_tensors=True).to_value(like, prefix="p")
    assert got["model"]["blocks"][1] is value["model"]["blocks"][1]
    assert got["model"]["blocks"][2][0] is value["model"]["blocks"][2][0]
    assert isinstance(got["model"]["blocks"][2], tuple) and got["model"]["blocks"][2][1] == "relu"
    assert got["model"]["steps"] == 99  # like's own non-tensor leaves
    assert got["empty"] == [] and got["empty"] is not like["empty"]
    assert like["model"]["blocks"][1] is not value["model"]["blocks"][1]  # like is left alone


def test_to_value_does_not_read_likes_tensors_and_keeps_entries_off_the_meta_device():
    value = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    like = {"w": torch.empty(3, 4, device="meta"), "b": torch.empty(4, device="meta")}
    got = Archive.of_value(value).to_value(like)
    assert got["w"] is value["w"] and got["w"].device.type == "cpu"


def test_to_value_moves_entries_to_the_device_of_likes_tensors():
    got = Archive.of_list({"w": torch.ones(2)}).to_value({"w": torch.empty(2, device="cpu")})
    assert got["w"].device == torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to move to")
    got = Archive.of_list({"w": torch.ones(2)}).to_value({"w": torch.empty(2, device="cuda")})
    assert got["w"].device.type == "cuda" and got["w"].tolist() == [1.0, 1.0]


def test_to_value_round_trips_a_module_state_dict():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = model.state_dict()
    archive = Archive.of_value(state, prefix="model")
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    loaded = archive.to_value(other.state_dict(), prefix="model")
    assert type(loaded) is OrderedDict and loaded._metadata == state._metadata
    other.load_state_dict(loaded)
    for key, tensor in other.state_dict().items():
        assert torch.equal(tensor, state[key]), key


def test_to_value_keeps_namedtuples_and_list_subclasses():
    Pair = namedtuple("Pair", "a b")

    class Tensors(list):
        pass

    value = {"pair": Pair(torch.ones(1), 3), "list": Tensors([torch.zeros(2)])}
    got = Archive.of_value(value, skip_non_tensors=True).to_value(like_of(value) | {"pair": Pair(torch.empty(1), 3)})
    assert type(got["pair"]) is Pair and got["pair"].a is value["pair"].a and got["pair"].b == 3


def test_to_value_names_a_leaf_with_no_entry():
    a = Archive.of_value({"blocks": [torch.ones(2)]}, prefix="model")
    like = {"blocks": [torch.empty(2)], "scale": torch.empty((), dtype=torch.float64)}
    with pytest.raises(ArchiveError) as e:
        a.to_value(like, prefix="model")
    assert message(e) == "Archive.to_value: model.scale: no entry in the archive, a leaf in the value"


def test_to_value_names_a_shape_mismatch():
    a = Archive.of_value({"blocks": [torch.ones(2), torch.ones(3)]}, prefix="model")
    with pytest.raises(ArchiveError) as e:
        a.to_value({"blocks": [torch.empty(2), torch.empty(2)]}, prefix="model")
    assert message(e) == "Archive.to_value: model.blocks.1: shape [3] in the archive, [2] in the value"


def test_to_value_names_a_dtype_mismatch():
    a = Archive.of_value({"scale": torch.tensor(1, dtype=torch.int32)}, prefix="model")
    with pytest.raises(ArchiveError) as e:
        a.to_value({"scale": torch.tensor(1.0, dtype=torch.float64)}, prefix="model")
    assert message(e) == "Archive.to_value: model.scale: int32 in the archive, float64 in the value"


def test_to_value_names_an_entry_with_no_leaf():
    a = Archive.of_value({"blocks": [torch.ones(2), torch.ones(3), torch.ones(4)]}, prefix="model")
    with pytest.raises(ArchiveError) as e:
        a.to_value({"blocks": [torch.empty(2), torch.empty(3)]}, prefix="model")
    assert message(e) == "Archive.to_value: model.blocks.2: an entry in the archive, no leaf in the value"


def test_to_value_names_an_entry_at_the_prefix_itself_or_below_a_leaf():
    at_prefix = Archive.of_list({"model": torch.ones(1), "model.w": torch.ones(2)})
    with pytest.raises(ArchiveError) as e:
        at_prefix.to_value({"w": torch.empty(2)}, prefix="model")
    assert message(e) == "Archive.to_value: model: an entry in the archive, no leaf in the value"
    below = Archive.of_list({"model.w": torch.ones(2), "model.w.x": torch.ones(2)})
    with pytest.raises(ArchiveError) as e:
        below.to_value({"w": torch.empty(2)}, prefix="model")
    assert message(e) == "Archive.to_value: model.w.x: an entry in the archive, no leaf in the value"
    non_tensor = Archive.of_list({"model.w": torch.ones(2), "model.steps": torch.ones(1)})
    with pytest.raises(ArchiveError, match="model.steps: an entry in the archive, no leaf in the value"):
        non_tensor.to_value({"w": torch.empty(2), "steps": 3}, prefix="model")


def test_to_value_ignores_entries_the_prefix_does_not_own():
    model = {"w": torch.ones(2)}
    optim = {"state": {0: {"momentum": torch.zeros(2)}}, "lr": 0.1}
    one_file = Archive.union(
        [Archive.of_value(model, prefix="model"), Archive.of_value(optim, prefix="optim", skip_non_tensors=True),
         Archive.of_list({"models.w": torch.ones(5), "modelx": torch.ones(1)})]
    )
    assert one_file.to_value({"w": torch.empty(2)}, prefix="model")["w"] is model["w"]
    got = one_file.to_value({"state": {0: {"momentum": torch.empty(2)}}, "lr": 0.5}, prefix="optim")
    assert got["state"][0]["momentum"] is optim["state"][0]["momentum"] and got["lr"] == 0.5
    # The empty prefix owns every entry.
    with pytest.raises(ArchiveError, match="an entry in the archive, no leaf in the value"):
        one_file.to_value({"model": {"w": torch.empty(2)}})


def test_to_value_refuses_likes_that_name_badly():
    a = Archive.of_list({"w": torch.ones(1)})
    with pytest.raises(ValueError) as e:
        a.to_value(torch.empty(1))
    assert message(e) == "Archive.to_value: a leaf at the root has no name; give a prefix"
    assert a.to_value(torch.empty(1), prefix="w") is a.find("w")
    with pytest.raises(ValueError) as e:
        a.to_value({"a.b": torch.empty(1), "a": {"b": torch.empty(1)}})
    assert message(e) == "Archive.to_value: a.b: two leaves have this name"


def test_to_value_checks_everything_before_reading_and_reads_in_one_fetch():
    a = CountingArchive({"p.w": torch.ones(2), "p.b": torch.ones(3), "p.extra": torch.ones(1)})
    like = {"w": torch.empty(2), "b": torch.empty(3)}
    with pytest.raises(ArchiveError, match="p.extra: an entry in the archive"):
        a.to_value(like, prefix="p")
    with pytest.raises(ArchiveError, match="p.b: shape"):
        a.to_value({"w": torch.empty(2), "b": torch.empty(4), "extra": torch.empty(1)}, prefix="p")
    assert a.fetches == []
    a.to_value(like | {"extra": torch.empty(1)}, prefix="p")
    assert a.fetches == [["p.w", "p.b", "p.extra"]]


def test_to_value_takes_numpy_likes():
    a = Archive.of_list({"x.w": np.arange(3, dtype=np.int16)})
    got = a.to_value({"w": np.zeros(3, dtype=np.int16)}, prefix="x")
    assert got["w"].dtype == torch.int16 and got["w"].tolist() == [0, 1, 2]
    with pytest.raises(ArchiveError, match=r"^Archive.to_value: x.w: int16 in the archive, int32 in the value$"):
        a.to_value({"w": np.zeros(3, dtype=np.int32)}, prefix="x")


def test_of_value_then_to_value_gives_the_value_back():
    value = model_value()
    for prefix in ("", "run", "a.b"):
        got = Archive.of_value(value, prefix, skip_non_tensors=True).to_value(like_of(value), prefix)
        assert named_leaves(got).keys() == named_leaves(value).keys()
        for name, tensor in named_leaves(value).items():
            assert named_leaves(got)[name] is tensor


# -- names -----------------------------------------------------------------------------


def test_the_owned_names_rule():
    assert owns("model", "model") and owns("model", "model.w") and owns("model", "model.a.b")
    assert not owns("model", "models.w") and not owns("model", "mode") and not owns("model", "modelw")
    assert owns("", "anything") and owns("a.b", "a.b.c") and not owns("a.b", "a.bc")
    assert owned("m", ["m", "m.x", "mx", "n.m", "m.y"]) == ["m", "m.x", "m.y"]


def test_dotted_names():
    assert join("model", "blocks", "0", "w") == "model.blocks.0.w"
    assert join("", "w") == "w" and join("p") == "p" and join("") == ""


def test_the_names_module_needs_no_torch():
    code = "import sys, tannery_protocol.names, tannery.formats.safetensors_format; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_package_exports_archives_lazily():
    for name in ("Archive", "ArchiveError", "TensorInfo", "save_safetensors", "load_safetensors",
                 "save_tannic", "load_tannic"):
        assert name in dir(tannery) and getattr(tannery, name) is not None
    assert tannery.Archive is Archive


def test_repr_names_the_kind_and_the_entries(archive):
    assert repr(archive) == "<MemoryArchive of 4 entries: count, half, scalar, w>"
    assert repr(Archive.of_list({})) == "<empty MemoryArchive>"
