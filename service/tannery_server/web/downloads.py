"""Downloads from the web page: one entry as a ``.npy`` file and a whole archive's tensors as one
``.safetensors`` file, streamed a few MiB at a time from the one checked reader (never a whole
entry in memory), their blobs held while they stream. Bool tensors, stored a bit an element,
leave as a byte an element (what both formats hold). The files kept with an archive are no
tensors: the safetensors file leaves them out (each is on its /file page; ``tannery pull -o DIR/``
writes them)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import struct
from typing import Iterator

import numpy as np
from aiohttp import web

from tannery_protocol.codec import DTYPES
from tannery_protocol.v1 import archives_pb2

from ..dataplane.blocks import VerifiedBlob
from ..fetching import Plan, digests, resolve
from ..storage import Damaged
from .inputs import PageProblem, query, required
from .kept_files import tensors_only
from .pages import SITE, Site, find_archive

log = logging.getLogger("tannery_server.web")

#: Bytes of stored tensor data read and sent at a time.
STEP = 4 << 20
#: safetensors' names of the dtypes it holds (complex ones it does not).
SAFETENSORS = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
               "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
               "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
#: Dtypes a .npy file records (numpy's own; bfloat16 and float8 are ml_dtypes', which .npy cannot name).
NPY = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
       "float64", "complex64", "complex128"}


def out_bytes(dtype: str, shape: tuple[int, ...], nbytes: int) -> int:
    """Bytes of an entry's tensor data as downloaded (a bool: a byte an element)."""
    return math.prod(shape) if dtype == "bool" else nbytes


def data_pieces(storage, plan: Plan, step: int = STEP) -> Iterator[bytes]:
    """The entry's tensor data in pieces of about ``step`` bytes, read in checked blocks (blocking:
    call ``next`` from a worker thread); a bool tensor's bits as bytes."""
    entry = plan.entry
    elements = math.prod(entry.shape)
    done = 0
    with VerifiedBlob(storage, plan) as blob:
        for start in range(entry.data_offset, entry.payload_bytes, step):
            data = b"".join(bytes(p) for p in blob.blocks(start, min(entry.payload_bytes, start + step)))
            if entry.dtype == "bool":
                bits = np.unpackbits(np.frombuffer(data, np.uint8), count=min(len(data) * 8, elements - done),
                                     bitorder="little")
                done += bits.size
                data = bits.tobytes()
            yield data


def safetensors_header(entries, metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file of ``entries`` in order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        size = out_bytes(entry.dtype, entry.shape, entry.nbytes)
        header[entry.name] = {"dtype": SAFETENSORS[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The header of a .npy file of ``dtype`` and ``shape`` (little-endian, C order)."""
    out = io.BytesIO()
    numpy_dtype = np.dtype(np.bool_) if dtype == "bool" else DTYPES[dtype].numpy.newbyteorder("<")
    descr = np.lib.format.dtype_to_descr(numpy_dtype)
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": tuple(shape)})
    return out.getvalue()


def file_name(name: str, suffix: str) -> str:
    """A name fit for Content-Disposition: the archive's or entry's, other characters as ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120] + suffix


async def entry_download(request: web.Request) -> web.StreamResponse:
    """GET /download/entry?archive=A&name=E: entry E of archive A as a .npy file, streamed."""
    site: Site = request.app[SITE]
    values = query(request.query, {"archive": site.config.max_name_bytes, "name": site.config.max_name_bytes},
                   "download")
    archive = required(values, "archive", "download", "/download/entry?archive=resnet50&name=fc.weight")
    name = required(values, "name", "download", "/download/entry?archive=resnet50&name=fc.weight")
    record = await find_archive(site, archive)
    entry = (await site.run(site.storage.catalog.entries, record.name, [name])).get(name)
    if entry is None:
        raise PageProblem(404, "Not Found", f"archive {record.name!r} has no entry {name!r}",
                          f"see its entries on /archive?name={record.name}")
    if entry.dtype not in NPY:
        raise PageProblem(400, "Bad Request", f"entry {name!r} is {entry.dtype}, which a .npy file cannot record",
                          f"tannery get {record.name} {name} -o {file_name(name, '.pt')} writes it (torch.save)")
    plans = await _pinned(site, record.name, [name])
    head = npy_header(entry.dtype, entry.shape)
    return await _stream(request, site, plans, head, len(head) + out_bytes(entry.dtype, entry.shape, entry.nbytes),
                         file_name(name, ".npy"))


async def archive_download(request: web.Request) -> web.StreamResponse:
    """GET /download/archive?name=A: archive A's tensors as one .safetensors file (its metadata as
    __metadata__), streamed entry by entry."""
    site: Site = request.app[SITE]
    values = query(request.query, {"name": site.config.max_name_bytes}, "download")
    name = required(values, "name", "download", "/download/archive?name=resnet50")
    record = await find_archive(site, name)
    entries = tensors_only(await site.run(site.storage.catalog.entries_under, record.name, ""))
    for entry in entries:
        if entry.dtype not in SAFETENSORS:
            raise PageProblem(400, "Bad Request", f"entry {entry.name!r} is {entry.dtype}, which safetensors cannot "
                              "record", f"tannery pull {record.name} -o {file_name(record.name, '.tannic')} keeps "
                              "every dtype")
    plans = await _pinned(site, record.name, [e.name for e in entries])
    head = safetensors_header([p.entry for p in plans], dict(record.metadata))
    total = len(head) + sum(out_bytes(p.entry.dtype, p.entry.shape, p.entry.nbytes) for p in plans)
    return await _stream(request, site, plans, head, total, file_name(record.name, ".safetensors"))


async def _pinned(site: Site, archive: str, names: list[str]) -> list[Plan]:
    """The plans of these entries of ``archive``, their blobs held (release them after)."""
    request = archives_pb2.FetchRequest(archive=archive, entries=[archives_pb2.EntryAsk(name=n) for n in names])
    if not names:
        return []
    return await site.run(resolve, site.storage, request)


async def _stream(request: web.Request, site: Site, plans: list[Plan], head: bytes, total: int,
                  name: str) -> web.StreamResponse:
    """``head``, then each plan's tensor data, as an attachment ``name`` of ``total`` bytes; the
    blobs released at the end. A block that fails its check cuts the download short (the browser
    says so: fewer bytes than announced) and is logged."""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Content-Length": str(total),
                                           "Content-Disposition": f'attachment; filename="{name}"'})
    try:
        await response.prepare(request)
        await response.write(head)
        for plan in plans:
            pieces = data_pieces(site.storage, plan)
            try:
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    await response.write(piece)
            finally:
                await asyncio.to_thread(pieces.close)
    except Damaged as exc:  # the status is sent: the download ends short of its announced length
        log.error("download %s cut short: %s", name, exc)
        if request.transport is not None:
            request.transport.close()
        return response
    finally:
        await site.run(site.storage.release, digests(plans))
    await response.write_eof()
    return response


__all__ = ["archive_download", "entry_download", "npy_header", "safetensors_header"]
