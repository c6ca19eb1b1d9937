"""Hostile media files for the ingest tests (issue 42): tiny files that declare huge or odd frames."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def gif_bomb(width: int, height: int, frames: int) -> bytes:
    """A GIF whose logical screen is ``width`` x ``height``, with ``frames`` one-pixel frames (~23 bytes each)."""
    out = bytearray(
        b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + bytes([0, 0, 0, 255, 255, 255])
    )
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    for _ in range(frames):
        out += b"\x21\xf9\x04\x00\x01\x00\x00\x00" + b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
        out += b"\x02\x02\x44\x01\x00"
    return bytes(out + b"\x3b")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` but holds almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def write_video(path, size, frames=8, codec="mpeg4", fmt=None):
    """A small clip of flat frames of ``size`` (height, width); any size the codec takes (1x1 too)."""
    import av

    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=8)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            img = np.full((size[0], size[1], 3), 20 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
