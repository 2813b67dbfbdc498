"""Export to a `torch.save` file, streamed.

`torch.save` needs the whole object in memory; instead the object is saved once with
``torch.serialization.skip_data()`` and placeholder tensors whose memory is never touched,
which writes the pickle and every storage record's place in the zip archive (uncompressed,
64-byte aligned) but not their bytes. The bytes are then copied from the shard into those
places through a fixed buffer, and the CRC-32 of each record, which `skip_data` leaves at 0,
is written into its local and central zip headers, so the file is a valid zip archive.

Which record holds which tensor is read back from the file itself: loaded with
``mmap=True``, every tensor's storage is a slice of one mapping of the file, so its address
minus the mapping's base is its record's offset (checked against the zip directory).
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .skeleton import SkeletonBuilder, Slot, swap_chunk
from .view import KeyPath, Node, ShardReader, dotted

_RECORD = re.compile(r"(?:^|/)data/([0-9]+)$")


class LayoutError(RuntimeError):
    """torch.save laid the file out in a way this exporter does not recognise."""


def untouched(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A placeholder: `torch.empty` reserves address space; with `skip_data` its pages are
    never read or written, so they never become resident."""
    return torch.empty(shape, dtype=dtype)


def write(node: Node, base: KeyPath, tmp_path: str, reader: ShardReader) -> tuple[int, list[KeyPath]]:
    """Write the plain state of `node` as a torch.save file at `tmp_path`.

    Returns:
        (number of tensor storages written, key paths of numpy values turned into tensors)
    """
    builder = SkeletonBuilder(reader, untouched)
    obj = builder.build(node, base)
    with torch.serialization.skip_data():
        torch.save(obj, tmp_path)
    offsets = _record_offsets(tmp_path, obj, builder.slots)
    del obj
    crcs: dict[int, int] = {}
    fd = os.open(tmp_path, os.O_RDWR)
    try:
        for slot in sorted(builder.slots, key=lambda s: (s.entry.file, s.entry.offset)):
            if not slot.entry.length:
                continue
            start = offsets[id(slot.tensor)]
            crcs[start] = _copy_into(fd, start, slot, reader)
        _patch_crcs(fd, tmp_path, crcs)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(builder.slots), builder.converted


def _copy_into(fd: int, start: int, slot: Slot, reader: ShardReader) -> int:
    pos = start
    crc = 0

    def sink(chunk: memoryview) -> None:
        nonlocal pos, crc
        data = swap_chunk(slot, chunk)
        crc = zlib.crc32(data, crc)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], pos + done)
        pos += len(data)

    reader.copy(slot.entry, sink, dotted(slot.path))
    return crc


def _record_offsets(path: str, obj: object, slots: Sequence[Slot]) -> dict[int, int]:
    """id(placeholder) -> offset in the file of the bytes of its storage record."""
    with zipfile.ZipFile(path) as z:
        records = {}
        for info in z.infolist():
            if _RECORD.search(info.filename) and info.file_size:
                records[_data_offset(path, info)] = info.file_size
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    _pair(obj, loaded, pairs)
    wanted = {id(s.tensor) for s in slots if s.entry.length}
    ptrs = {id(mine): theirs.untyped_storage().data_ptr() for mine, theirs in pairs if id(mine) in wanted}
    if len(ptrs) != len(wanted) or len(records) != len(wanted):
        raise LayoutError(f"{len(wanted)} tensors to write, {len(ptrs)} found, {len(records)} storage records")
    base = min(ptrs.values()) - min(records) if ptrs else 0
    offsets = {k: p - base for k, p in ptrs.items()}
    lengths = {id(s.tensor): s.entry.length for s in slots}
    for k, off in offsets.items():
        if records.get(off) != lengths[k]:
            raise LayoutError(f"a storage of {lengths[k]} bytes maps to offset {off}, not a record of that size")
    del loaded
    return offsets


def _pair(mine: object, theirs: object, out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if isinstance(mine, torch.Tensor):
        assert isinstance(theirs, torch.Tensor)
        out.append((mine, theirs))
    elif isinstance(mine, Mapping):
        assert isinstance(theirs, Mapping)
        for k, v in mine.items():
            _pair(v, theirs[k], out)
    elif isinstance(mine, (list, tuple)):
        assert isinstance(theirs, (list, tuple)) and len(theirs) == len(mine)
        for a, b in zip(mine, theirs, strict=True):
            _pair(a, b, out)


def _data_offset(path: str, info: zipfile.ZipInfo) -> int:
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if head[:4] != b"PK\x03\x04":
        raise LayoutError(f"no local zip header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return int(info.header_offset + 30 + name_len + extra_len)


def _patch_crcs(fd: int, path: str, crcs: Mapping[int, int]) -> None:
    """Write each record's CRC-32 into its local header and its central directory entry."""
    by_header: dict[int, int] = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            start = _data_offset(path, info) if _RECORD.search(info.filename) and info.file_size else None
            if start is not None and start in crcs:
                by_header[info.header_offset] = crcs[start]
        central: Any = z.start_dir
        count = len(z.infolist())
    for header, crc in by_header.items():
        os.pwrite(fd, struct.pack("<I", crc), header + 14)
    pos = int(central)
    for _ in range(count):
        head = os.pread(fd, 46, pos)
        if head[:4] != b"PK\x01\x02":
            raise LayoutError(f"no central directory entry at {pos}")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        (local,) = struct.unpack("<I", head[42:46])
        if local == 0xFFFFFFFF:  # zip64: the local header offset is in the extra field
            local = _zip64_local_offset(os.pread(fd, extra_len, pos + 46 + name_len), head)
        if local in by_header:
            os.pwrite(fd, struct.pack("<I", by_header[local]), pos + 16)
        pos += 46 + name_len + extra_len + comment_len


def _zip64_local_offset(extra: bytes, head: bytes) -> int:
    sizes = struct.unpack("<II", head[20:28])
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[i : i + 4])
        if tag == 1:
            field = extra[i + 4 : i + 4 + size]
            skip = 8 * sum(1 for s in sizes if s == 0xFFFFFFFF)
            (offset,) = struct.unpack("<Q", field[skip : skip + 8])
            return int(offset)
        i += 4 + size
    raise LayoutError("zip64 central directory entry without its offset")
