"""Files the command reads and writes: checkpoints (.safetensors, .tannic pairs, torch
checkpoints) and single tensors (.npy, .pt). torch and numpy are imported where a tensor is
read or made: checking a file or an output path imports neither.

Outputs are handled one way by every command: missing parent directories are created
(:func:`output_directory`), and an existing file is replaced only with ``--force``
(:func:`refuse_existing`).

Every malformed or unsupported file is a :class:`CommandError` (or the library's
FormatError) naming the file; nothing here prints.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

from tannery_protocol import codec
from tannery_protocol._lazy import lazy_module
from tannery.archive import Archive
from tannery.formats.atomic import Replacement
from tannery.formats.files import load_safetensors, load_tannic
from tannery.values import named_leaves, non_tensor_leaves
from .errors import CommandError

np = lazy_module("numpy")
torch = lazy_module("torch")

#: Extensions of torch checkpoints, read with ``torch.load(weights_only=True)``.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
#: Dtypes a .npy file cannot record (numpy writes them as raw void bytes).
_NOT_NPY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

READABLE = ".safetensors, .tannic (a pair) or a torch checkpoint (.pt, .pth, .bin)"


def checkpoint_kind(path: str | os.PathLike[str], *, writing: bool = False) -> str:
    """``"safetensors"``, ``"tannic"`` or ``"torch"`` (.pt, .pth, .bin) by the file's extension.

    Reading, a file that is not there is a FileNotFoundError ("no such file") whatever its
    name, before its extension is looked at (a .tannic pair is there when either file is).
    """
    name = Path(path).name
    if not writing:
        check_exists(path)
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".tannic"):
        return "tannic"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    if writing:
        raise CommandError(f"{path}: cannot tell the format from the extension",
                           hint="write a .safetensors file, a .tannic pair or a torch checkpoint "
                                "(-o NAME.safetensors, -o NAME.tannic, -o NAME.pt)")
    raise CommandError(f"{path}: cannot tell the format from the extension", hint=f"give a {READABLE} file")


def check_exists(path: str | os.PathLike[str]) -> None:
    """FileNotFoundError for a file to read that is not there (for a .tannic pair: neither file)."""
    if Path(path).exists():
        return
    if Path(path).name.endswith(".tannic"):
        from tannery.formats.checkpoint import pair_paths

        if any(Path(p).exists() for p in pair_paths(path)):
            return
    raise FileNotFoundError(2, "No such file", str(path))


def read_checkpoint(path: str | os.PathLike[str]) -> Archive:
    """The archive of a checkpoint file (:func:`read_checkpoint_skipping` without its list)."""
    return read_checkpoint_skipping(path)[0]


def read_checkpoint_skipping(path: str | os.PathLike[str]) -> tuple[Archive, list[tuple[str, str]]]:
    """The archive of a checkpoint file, by extension, and the values it leaves out: the name
    and type of each non-tensor value of a torch checkpoint (``("step", "int")``), which an
    archive cannot hold. Safetensors files and .tannic pairs are memory-mapped (their entries
    are read as they are sent); a torch checkpoint is loaded.

    A .tannic pair stores no shapes: its entries are 1-D.
    """
    kind = checkpoint_kind(path)
    if kind == "safetensors":
        return load_safetensors(path), []
    if kind == "tannic":
        return load_tannic(path), []
    value = load_torch(path)
    if isinstance(value, torch.Tensor):
        raise CommandError(f"{path}: one tensor, not a checkpoint of named tensors",
                           hint="publish it (tannery publish CHANNEL FILE), or save a dict of tensors to push")
    try:
        archive = Archive.of_value(value, skip_non_tensors=True)
    except (TypeError, ValueError) as exc:
        raise CommandError(f"{path}: {exc}") from None
    skipped = [(name, type(leaf).__name__) for name, leaf in non_tensor_leaves(value)]
    if not len(archive):
        if not isinstance(value, (dict, list, tuple)):
            found = f": it holds a {type(value).__name__}, not a dict of tensors"
        else:
            found = f" (a {type(value).__name__}" + (f" of {describe_skipped(skipped)})" if skipped else ")")
        raise CommandError(f"{path}: no tensors in the checkpoint{found}",
                           hint="push a file saved from a dict of tensors (torch.save(model.state_dict(), FILE))")
    return archive, skipped


def describe_skipped(skipped: list[tuple[str, str]], most: int = 8) -> str:
    """``step (int), name (str)``: the values a push left out, the first ``most`` of them."""
    shown = ", ".join(f"{name} ({kind})" for name, kind in skipped[:most])
    return shown + (f" and {len(skipped) - most} more" if len(skipped) > most else "")


def load_torch(path: str | os.PathLike[str]) -> Any:
    """What a torch checkpoint holds, loaded with ``torch.load(weights_only=True)``:
    tensors and plain containers only (never arbitrary pickled objects)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "No such file", str(path))
    with warnings.catch_warnings():
        # torch warns about pickle protocols on stderr; a refusal is reported as an error instead.
        warnings.simplefilter("ignore")
        return _load_torch(path)


def _load_torch(path: Path) -> Any:
    try:
        # mmap keeps a large checkpoint's tensors on disk until they are sent.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise _torch_error(path, exc) from None
    except Exception as exc:
        raise _torch_error(path, exc) from None
    try:  # an old (non-zip) checkpoint cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _torch_error(path, exc) from None


def _torch_error(path: Path, exc: BaseException) -> CommandError:
    """One line for what torch.load refused: the unpickler's own reason when it gave one
    (``Unsupported global: GLOBAL pathlib.PosixPath ...``), not its advice to load unsafely."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = lines[0].split(". ")[0].rstrip(".") if lines else type(exc).__name__
    return CommandError(f"{path}: not a checkpoint torch.load(weights_only=True) can read: "
                        f"{_what_the_file_is(path, explain_unpickling(detail))}",
                        hint="push a file torch.save wrote from a dict of tensors (a state_dict), or a .safetensors file")


def _what_the_file_is(path: Path, detail: str) -> str:
    """Why torch.load refused, told by the file's first bytes where they say more than torch:
    an empty file, or one that is neither a zip archive (what torch.save writes) nor a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return detail
    if not head:
        return "the file is empty (0 bytes)"
    if head.startswith((b"PK", b"\x80")):  # a zip archive or a pickle: torch's reason is the one
        return detail
    return f"it is not a file torch.save wrote: it starts with {head!r}, neither a zip archive (torch.save's format) nor a pickle torch.load reads"


def explain_unpickling(detail: str) -> str:
    """torch.load's reason in words: an opcode number (``Unsupported operand 101``, or a bare
    ``101``) says which pickle instruction stopped the safe unpickler, and what that means."""
    import pickletools

    opcode = re.fullmatch(r"(?:Unsupported operand )?(\d+)", detail)
    if opcode is not None:
        code = int(opcode.group(1))
        op = pickletools.code2op.get(chr(code)) if code < 256 else None
        name = f" {op.name}" if op is not None else ""
        return (f"a pickle, not a file torch.save wrote (a zip archive of tensors): the safe unpickler stops at "
                f"its instruction{name} (byte {code}), which no torch.save file holds; a plain pickle.dump, perhaps")
    if detail.startswith("Invalid magic number"):
        return "it is not a file torch.save wrote (an unknown beginning: a plain pickle, or a damaged file)"
    if "failed finding central directory" in detail or "zip archive" in detail:
        return f"it is not a whole torch.save file: its zip archive is damaged or cut short ({detail})"
    return detail


def payload_total(archive: Archive, names: list[str] | None = None) -> int:
    """Bytes the entries of ``archive`` take as tannic payloads, headers included."""
    total = 0
    for name in archive.names() if names is None else names:
        info = archive.info(name)
        dtype = codec.dtype_named(info.dtype)
        total += len(codec.encode_prefix(dtype, info.shape)) + dtype.buffer_nbytes(math.prod(info.shape))
    return total


def check_writable(path: str | os.PathLike[str], dtypes: list[str], force: bool = False) -> list[Path]:
    """The files a pull into ``path`` writes (one, or a .tannic pair), after refusing, before
    anything is transferred, an output it could not or should not write: an unknown extension,
    a dtype the format lacks (safetensors has no complex128), a parent that is not a directory,
    or a file that exists (unless ``force``). Missing parent directories are created."""
    from tannery.formats.checkpoint import pair_paths

    kind = checkpoint_kind(path, writing=True)
    if kind == "safetensors":
        from tannery.formats.safetensors_format import CODES

        for dtype in dtypes:
            if dtype not in CODES:
                raise CommandError(f"{path}: safetensors has no {dtype} dtype",
                                   hint="pull into a .tannic pair instead (-o NAME.tannic)")
    paths = [Path(p) for p in pair_paths(path)] if kind == "tannic" else [Path(path)]
    refuse_existing(paths, force)
    output_directory(paths[0].parent)
    return paths


def refuse_existing(paths: list[Path], force: bool) -> None:
    """CommandError for an output file that exists, unless ``force`` (then it is replaced,
    whole, once the new one is written)."""
    if force:
        return
    for path in paths:
        if path.exists() or path.is_symlink():
            what = "a directory" if path.is_dir() else "the file"
            raise CommandError(f"{path}: {what} exists; nothing was written",
                               hint="give --force to replace it, or write elsewhere with -o")


def output_directory(directory: Path, flag: str = "-o") -> Path:
    """``directory``, created with its missing parents (as ``mkdir -p``): every command that
    writes files makes the directories it is told to write into. CommandError when a part of
    it is a file."""
    if directory.is_dir():
        return directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CommandError(f"cannot make the directory {directory}: a file is in the way",
                           hint=f"give {flag} a path in a directory, or move that file") from None
    return directory


def read_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a file with its name, in order: a .npy or .pt tensor, every tensor of a
    torch checkpoint in the order of its structure, or every entry of a .safetensors file or
    .tannic pair in name order."""
    check_exists(path)
    name = Path(path).name
    if name.endswith(".npy"):
        yield Path(path).stem, torch.from_numpy(_load_npy(path))
        return
    if name.endswith(TORCH_SUFFIXES):
        value = load_torch(path)
        if isinstance(value, torch.Tensor):
            yield Path(path).stem, value
            return
        try:
            leaves = named_leaves(value, "", str(path))
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if not leaves:
            raise CommandError(f"{path}: no tensors in the file (a {type(value).__name__})")
        for leaf_name, leaf in leaves.items():
            yield leaf_name, leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(leaf)
        return
    if name.endswith((".safetensors", ".tannic")):
        archive = read_checkpoint(path)
        for entry in archive.names():
            yield entry, archive.find(entry)
        return
    raise CommandError(f"{path}: cannot tell the format from the extension",
                       hint=f"give a .npy or .pt tensor, or a {READABLE} file")


def _load_npy(path: str | os.PathLike[str]) -> np.ndarray:
    try:
        # Copy-on-write map: nothing is read until it is sent, and torch gets a writable array.
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (ValueError, EOFError) as exc:
        raise CommandError(f"{path}: not a .npy array: {exc}") from None
    try:
        codec.dtype_of_numpy(array.dtype)
    except TypeError as exc:
        raise CommandError(f"{path}: {exc}") from None
    return array


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as a numpy array, sharing its memory when contiguous (bfloat16 and
    float8 arrays use ml_dtypes' types)."""
    tensor = tensor.detach().cpu()
    dtype = codec.dtype_named(_short(tensor))
    if dtype.name in _NOT_NPY:
        tensor = tensor.contiguous()
        bits = tensor.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
        return bits.numpy().view(dtype.numpy)
    return tensor.resolve_conj().resolve_neg().numpy()


def _short(tensor: torch.Tensor) -> str:
    from tannery.torch import short_name

    return short_name(tensor.dtype)


def save_tensor(path: str | os.PathLike[str], tensor: torch.Tensor) -> None:
    """Write one tensor as .npy (numpy) or .pt (``torch.save``), by extension, atomically."""
    path = Path(path)
    if path.suffix == ".npy":
        check_npy_dtype(path, _short(tensor))
        array = to_numpy(tensor)
        output_directory(path.parent)
        with Replacement(path) as tmp, open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
    elif path.suffix == ".pt":
        output_directory(path.parent)
        with Replacement(path) as tmp, open(tmp, "wb") as f:
            torch.save(tensor.detach().cpu(), f)
    else:
        raise CommandError(f"{path}: cannot tell the format from the extension",
                           hint="write a .npy (numpy) or .pt (torch.save) file")


def check_npy_dtype(path: str | os.PathLike[str], dtype: str) -> None:
    """CommandError when ``path`` is a .npy file and ``dtype`` one it cannot record (bfloat16, float8)."""
    if Path(path).suffix == ".npy" and dtype in _NOT_NPY:
        raise CommandError(f"{path}: a .npy file cannot record {dtype}", hint="write a .pt file instead")


__all__ = [
    "READABLE",
    "check_exists",
    "check_npy_dtype",
    "check_writable",
    "checkpoint_kind",
    "load_torch",
    "output_directory",
    "payload_total",
    "describe_skipped",
    "read_checkpoint",
    "read_checkpoint_skipping",
    "read_tensors",
    "refuse_existing",
    "save_tensor",
    "to_numpy",
]
