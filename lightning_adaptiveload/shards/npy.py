"""``.npy`` members without numpy's reader: a bounded header parse, dtype rules, decoding, finiteness.

The header is parsed with :func:`~lightning_adaptiveload.shards.untrusted.parse_npy_header` (no
``ast.literal_eval``) from the header bytes alone; the data is viewed, never copied twice, and object
dtypes are refused, so a member can never unpickle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_adaptiveload.shards.untrusted import (
    Refused,
    parse_npy_header,
)

__all__ = [
    "Npy",
    "NpyError",
    "count_non_finite",
    "dtype_problem",
    "flat_array",
    "read_npy_header",
    "to_tensor",
]


class NpyError(Exception):
    """A malformed .npy member (never escapes this module)."""


@dataclass
class Npy:
    member: str
    dtype: np.dtype | None  # None: a descr that is no plain scalar type (structured, datetime, ...)
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # where the array data starts in the member
    data: bytearray | None = None  # the whole member, when read
    descr: Any = None  # the header's descr, for messages


# numpy refuses larger headers by default too (they are parsed with a literal evaluator).
_MAX_NPY_HEADER = 10000


def read_npy_header(read: Callable[[int], bytes], size: int, member: str) -> Npy:
    """Parse a .npy header with a strict literal parser, reading only the header bytes.

    Not numpy's reader: it evaluates the header with ``ast.literal_eval``, which recursion and
    tokenizer errors escape (``RecursionError``, ``tokenize.TokenError``).
    """
    magic = read(8)
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise NpyError(f"{member}: not a .npy file (bad magic bytes {bytes(magic[:6])!r})")
    major, minor = magic[6], magic[7]
    if major == 1:
        len_size = 2
    elif major in (2, 3):
        len_size = 4
    else:
        raise NpyError(f"{member}: unsupported .npy format version {major}.{minor}")
    raw_len = read(len_size)
    header_len = int.from_bytes(raw_len, "little")
    if len(raw_len) < len_size or header_len > _MAX_NPY_HEADER:
        raise NpyError(f"{member}: .npy header length {header_len} is invalid (at most {_MAX_NPY_HEADER})")
    header = read(header_len)
    if len(header) < header_len:
        raise NpyError(f"{member}: .npy header is cut short")
    try:
        dtype, descr, fortran, shape = parse_npy_header(bytes(header), major)
    except Refused as err:
        raise NpyError(f"{member}: malformed .npy header: {err}") from None
    offset = 8 + len_size + header_len
    if dtype is not None and not dtype.hasobject:
        need = offset + math.prod(shape) * dtype.itemsize
        if need != size:
            raise NpyError(
                f"{member}: .npy member is {size} bytes but its header (shape {list(shape)}, dtype {dtype}) "
                f"needs {need}"
            )
    return Npy(member=member, dtype=dtype, shape=shape, fortran=fortran, offset=offset, descr=descr)


def flat_array(npy: Npy) -> np.ndarray:
    """The member's data as a 1-d array viewing ``npy.data`` (no copy)."""
    count = math.prod(npy.shape)
    if count == 0:
        return np.empty(0, dtype=npy.dtype)
    return np.frombuffer(npy.data, dtype=npy.dtype, count=count, offset=npy.offset)


# Elements per block of the finiteness scan: small enough that the temporaries stay in cache.
_FINITE_BLOCK = 1 << 18


_F16 = np.dtype(np.float16)
# As NumPy scalars: a Python int operand costs NumPy a type resolution per call (~3 us on a small array).
_F16_EXP = np.uint16(0x7C00)


def _f16_non_finite(bits: np.ndarray) -> int:
    # Exponent bits all set <=> NaN or Inf; integer ops are ~5x faster than np.isfinite on float16.
    exp = np.bitwise_and(bits, _F16_EXP)
    return int(np.count_nonzero(exp == _F16_EXP)) if exp.max() == _F16_EXP else 0  # usual: no count


def _non_finite(block: np.ndarray) -> int:
    finite = np.isfinite(block)
    return 0 if finite.all() else int(block.size - np.count_nonzero(finite))


def count_non_finite(flat: np.ndarray) -> int:
    """Number of NaN/Inf values of a float16/float32 1-d array."""
    if not flat.size:
        return 0
    if flat.dtype == _F16 and flat.dtype.isnative:
        flat, count = flat.view(np.uint16), _f16_non_finite
    else:
        count = _non_finite
    if flat.size <= _FINITE_BLOCK:  # one block: most samples' members
        return count(flat)
    return sum(count(flat[start : start + _FINITE_BLOCK]) for start in range(0, flat.size, _FINITE_BLOCK))


def to_tensor(npy: Npy) -> torch.Tensor:
    """Decode a read member into a tensor sharing the member's buffer where the layout allows."""
    arr = flat_array(npy)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    arr = arr.reshape(npy.shape, order="F" if npy.fortran else "C")
    if npy.fortran:
        arr = np.ascontiguousarray(arr)
    return torch.from_numpy(arr)


def dtype_problem(npy: Npy) -> str | None:
    dt = npy.dtype
    if dt is None:
        kind = "structured dtype" if isinstance(npy.descr, list) else "dtype"
        return f"{npy.member}: {kind} {npy.descr!r} is not float16 or float32"
    if dt.hasobject:
        return f"{npy.member}: dtype object stores pickled Python objects; refused (pickles are never loaded)"
    if dt.kind != "f" or dt.itemsize not in (2, 4) or dt.fields is not None:
        return f"{npy.member}: dtype {dt} is not float16 or float32"
    return None
