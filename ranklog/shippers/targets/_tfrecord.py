"""TFRecord framing, as TensorBoard's event files use it, and the CRC-32C it needs, fast.

A record is ``u64 length``, the masked CRC-32C of those 8 bytes, the data, the masked
CRC-32C of the data. :func:`records` frames a batch (every CRC computed at once, with
numpy when there is enough data to pay for it), :func:`spans` finds the records of a
file up to the first torn or damaged one. tensorboard's own CRC is bytewise Python.
"""

from __future__ import annotations

import functools
import importlib
import struct
import threading
from typing import Any, Final

__all__ = ["U32", "U64", "crc32c", "masked", "records", "spans", "varint"]

U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
_NP_MIN: Final = 1024  # CRCs of less data are quicker in Python than numpy's fixed cost
_NP_PASS: Final = 1 << 18  # bytes per numpy pass (its work arrays: 8 bytes a byte)
_NP_MAX: Final = 1 << 20  # a longer record gets its CRC in Python (numpy would need 8x it)
_ROWS_MAX: Final = 1 << 12  # numpy's position table: 4 MiB at most; longer parts go in pieces


@functools.cache
def _crc_tables() -> tuple[list[int], ...]:
    """CRC-32C tables: four that take 16 bits of an 8-byte word each, and the bytewise one."""
    t8 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        t8.append(c)
    s = [t8]  # s[k][b]: byte b followed by k zero bytes
    for _ in range(7):
        s.append([(x >> 8) ^ t8[x & 0xFF] for x in s[-1]])
    return (*([a ^ b for b in s[6 - k] for a in s[7 - k]] for k in (0, 2, 4, 6)), t8)


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, eight bytes a round (tensorboard's own is bytewise)."""
    t0, t1, t2, t3, t8 = _crc_tables()
    c = 0xFFFFFFFF
    n = len(data) & ~7
    for q in struct.unpack_from(f"<{n >> 3}Q", data):
        x = c ^ q
        c = t0[x & 0xFFFF] ^ t1[(x >> 16) & 0xFFFF] ^ t2[(x >> 32) & 0xFFFF] ^ t3[x >> 48]
    for b in data[n:]:
        c = t8[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@functools.cache
def _numpy() -> Any:
    """numpy (a dependency of tensorboard, imported by it already), or None: CRCs in Python."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


_rows: list[tuple[int, Any, list[list[int]]]] = []  # the one position table, grown on demand


def _crc_rows(need: int) -> tuple[int, Any, list[list[int]]]:
    """``n`` >= ``need`` (at most ``_ROWS_MAX``), ``rows``, ``shift``: numpy's CRC-32C tables.

    ``rows[d * 256 + b]``: the CRC register (from 0) after byte ``b`` and ``d`` zero bytes,
    ``d < n``. ``shift[j][x]``: a register's byte ``j`` being ``x``, its part of that register
    after ``n`` zero bytes. (Reflected CRCs: a register's four bytes act as four message bytes.)
    """
    if _rows and _rows[0][0] >= min(need, _ROWS_MAX):
        return _rows[0]
    np, n = _numpy(), min(_ROWS_MAX, 1 << max(6, (need - 1).bit_length()))
    t8 = np.array(_crc_tables()[-1], np.uint32)
    rows = np.empty((n, 256), np.uint32)
    rows[0] = t8
    for d in (1, 2, 3):
        rows[d] = (rows[d - 1] >> 8) ^ t8[rows[d - 1] & 0xFF]
    m = 4
    while m < n:  # rows m..2m-1: rows 0..m-1 shifted through m zero bytes
        src = rows[: min(m, n - m)]
        acc = rows[m - 1][src & 0xFF]
        for j in (1, 2, 3):
            acc ^= rows[m - 1 - j][(src >> (8 * j)) & 0xFF]
        rows[m : m + len(src)] = acc
        m += len(src)
    _rows[:] = [(n, rows.ravel(), [rows[n - 1 - j].tolist() for j in range(4)])]
    return _rows[0]


_scratch = threading.local()  # numpy's work arrays, kept: fresh ones cost page faults


def _crcs_numpy(np: Any, parts: list[bytes]) -> list[int]:
    """CRC-32C of each part (4 bytes or more), all at once: a table look-up per byte, xored."""
    lens = np.fromiter(map(len, parts), np.int32, len(parts))
    longest = int(lens.max())
    n, rows, shift = _crc_rows(longest)
    starts = np.cumsum(lens, dtype=np.int32)
    starts -= lens
    joined = b"".join(parts)
    work = getattr(_scratch, "work", None)
    if work is None or work.shape[1] < len(joined):
        work = np.empty((2, len(joined)), np.int32)
        if len(joined) <= 2 * _NP_PASS:
            _scratch.work = work
    idx, looked_up = work[0, : len(joined)], work[1, : len(joined)].view(np.uint32)
    idx.fill(-1)
    idx[starts] = lens - 1
    np.cumsum(idx, dtype=np.int32, out=idx)  # each byte: how many follow it in its part
    segs = starts
    if longest > n:  # parts longer than the table: n-byte pieces from the end, a short one first
        idx &= n - 1
        first = idx == n - 1
        first[starts] = True
        segs = np.flatnonzero(first)
    idx <<= 8
    idx += np.frombuffer(joined, np.uint8)
    idx[(starts[:, None] + np.arange(4, dtype=np.int32)).ravel()] ^= 0xFF  # the register's
    rows.take(idx, out=looked_up)  # initial ones: as if xored into a part's first four bytes
    raw = np.bitwise_xor.reduceat(looked_up, segs).tolist()
    if len(raw) == len(parts):
        return [c ^ 0xFFFFFFFF for c in raw]
    out, end, s0, s1, s2, s3 = [], 0, *shift
    for size in lens.tolist():
        at, end = end, end + (size + n - 1) // n
        c = raw[at]
        for k in range(at + 1, end):  # the register through n zero bytes, and the next piece
            c = s0[c & 0xFF] ^ s1[(c >> 8) & 0xFF] ^ s2[(c >> 16) & 0xFF] ^ s3[c >> 24] ^ raw[k]
        out.append(c ^ 0xFFFFFFFF)
    return out


def _crcs(datas: list[bytes]) -> list[int]:
    """CRC-32C of each of ``datas``: with numpy in passes of ~256 KiB, else (or when cheaper:
    little data, a part shorter than 4 bytes or over 1 MiB) with :func:`crc32c`."""
    np = _numpy()
    if np is None or sum(map(len, datas)) < _NP_MIN:
        return [crc32c(d) for d in datas]
    out, todo, size = [0] * len(datas), list[int](), 0
    for i, d in enumerate(datas):
        if 4 <= len(d) <= _NP_MAX:
            todo.append(i)
            size += len(d)
        else:
            out[i] = crc32c(d)
        if todo and (size >= _NP_PASS or i == len(datas) - 1):
            for k, c in zip(todo, _crcs_numpy(np, [datas[k] for k in todo]), strict=True):
                out[k] = c
            todo, size = [], 0
    return out


def _mask(c: int) -> int:
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def masked(data: bytes) -> int:
    return _mask(_crcs([data])[0])


@functools.lru_cache(maxsize=1024)
def _head(size: int) -> bytes:
    """A record's length and the masked CRC-32C of that length (12 bytes)."""
    head = U64.pack(size)
    return head + U32.pack(_mask(crc32c(head)))


def records(datas: list[bytes]) -> bytes:
    """TFRecord frames of ``datas``, one after another (all the CRCs computed at once)."""
    out = [b""] * (3 * len(datas))
    out[0::3] = map(_head, map(len, datas))
    out[1::3] = datas
    out[2::3] = map(U32.pack, map(_mask, _crcs(datas)))
    return b"".join(out)


def spans(buf: Any, size: int) -> list[tuple[int, int]]:
    """(start, end) of each record's data in ``buf``, up to the first torn or bad record."""
    spans, pos = [], 0
    while pos + 12 <= size:
        length = U64.unpack_from(buf, pos)[0]
        end = pos + 16 + length
        if end > size or buf[pos : pos + 12] != _head(length):
            break
        spans.append((pos + 12, end - 4))
        pos = end
    while spans and U32.unpack_from(buf, spans[-1][1])[0] != masked(buf[slice(*spans[-1])]):
        spans.pop()  # written in part: a crash or power loss mid-record
    return spans


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
