"""HTTP/2 frames (RFC 9113) and the HPACK literals (RFC 7541) of a gRPC server's answers, as
bytes: what router/epp/h2grpc.py writes."""

from __future__ import annotations

import struct
from urllib.parse import quote

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0x0,
    0x1,
    0x3,
    0x4,
    0x6,
    0x7,
    0x8,
    0x9,
)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
INITIAL_WINDOW, MAX_FRAME = 0x4, 0x5  # SETTINGS ids
BIG_WINDOW = 2**31 - 1
NO_ERROR, PROTOCOL_ERROR = 0x0, 0x1
UINT32 = struct.Struct(">I")  # a frame head is 3 bytes of length, type, flags, stream id


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + UINT32.pack(stream) + payload


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541, 5.1) whose first byte carries `first`'s high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes((*out, value))


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal never added to the peer's HPACK table (RFC 7541, 6.2.2)."""
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # :status 200
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def trailers(status: int, message: str | None) -> bytes:
    if status == 0 and message is None:
        return _OK_TRAILERS
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        block += _literal(b"grpc-message", quote(message, safe=" ").encode())
    return block
