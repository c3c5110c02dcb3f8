"""Hand-built hostile msgpack for decoding tests (hivemind's own encoder recurses in C and cannot build them)."""

from __future__ import annotations

import struct


def nested_tuples(depth: int, leaf: bytes = b"\x01") -> bytes:
    """`{"x": ((((1,),),),)}` with `depth` tuples, as hivemind encodes tuples (ext 0x40 around a 1-array).
    250 deep is ~1.2 KB and overflows the C stack of hivemind's decoder (SIGSEGV)."""
    body = leaf
    for _ in range(depth):
        payload = b"\x91" + body
        n = len(payload)
        if n < 256:
            header = b"\xc7" + bytes([n])
        elif n < 65536:
            header = b"\xc8" + struct.pack(">H", n)
        else:
            header = b"\xc9" + struct.pack(">I", n)
        body = header + b"\x40" + payload
    return b"\x81\xa1x" + body
