"""A request body sent compressed (``Content-Encoding``), undone by the router within its limits.

The server hands the edge bodies as they were sent (``auto_decompress=False``, ``router.server``),
so every coding is the router's to decode or refuse, as JSON naming the header: aiohttp's own
decoding answers a body that is not what its header says with a 500 from the handler's
``read()``, and ``br`` or ``zstd`` (no decoder installed) with a plain-text 400 before any
handler runs.

* no header, or ``identity``: the body as sent;
* ``gzip`` (``x-gzip``; concatenated members too) and ``deflate`` (zlib, or raw deflate as some
  clients send it): inflated to at most ``max_bytes`` (more is a 413, however small it came);
  bytes that are not that coding, or end inside it, are a 400 with ``param`` ``Content-Encoding``;
* anything else (``br``, ``zstd``, ``compress``, two codings stacked) is a 415 naming the
  supported ones, with an ``Accept-Encoding`` header listing them (RFC 9110, 12.5.3).
"""

from __future__ import annotations

import zlib

from router.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType, echo

PARAM = "Content-Encoding"
SUPPORTED = ("gzip", "deflate")
"""The codings a body may be sent in (besides ``identity``, none)."""
_GZIP, _ZLIB, _RAW_DEFLATE = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS
_ALIASES = {"x-gzip": "gzip"}


def coding_of(header: str | None) -> str | None:
    """The one coding ``header`` names (``None`` for none or ``identity``); 415 for any other."""
    if header is None:  # most requests
        return None
    codings = [c.strip().lower() for c in (header or "").split(",")]
    codings = [_ALIASES.get(c, c) for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in SUPPORTED:
        return codings[0]
    raise UnsupportedMediaType(f"Content-Encoding {echo(header)!r} is not supported: send the body uncompressed, "
                               f"or as one of {', '.join(SUPPORTED)}", param=PARAM,
                               headers={"Accept-Encoding": ", ".join(SUPPORTED)})


def decode_body(raw: bytes, coding: str, max_bytes: int) -> bytes:
    """``raw`` inflated from ``coding`` (``gzip`` or ``deflate``), at most ``max_bytes`` long."""
    if coding == "gzip":
        wbits = _GZIP
    else:  # RFC 9110's deflate is zlib-wrapped; a raw stream has no zlib header (CM = 8 in the low bits)
        wbits = _ZLIB if raw[:1] and raw[0] & 0x0F == 8 else _RAW_DEFLATE
    out = bytearray()
    rest = raw
    while True:
        stream = zlib.decompressobj(wbits)
        try:
            out += stream.decompress(rest, max_bytes + 1 - len(out))
        except zlib.error:
            raise _not_coded(coding) from None
        if len(out) > max_bytes:
            raise PayloadTooLarge(f"request body is over {max_bytes} bytes once decompressed "
                                  "(router.max_body_bytes)", param="body")
        rest = stream.unused_data
        if not stream.eof or rest and coding != "gzip":  # cut short, or bytes after the stream's end
            raise _not_coded(coding)
        if not rest:  # a gzip body may hold several members, one after the other
            return bytes(out)


def _not_coded(coding: str) -> BadRequest:
    return BadRequest(f"request body is not valid {coding} data, as its Content-Encoding header says: "
                      "send it compressed whole, or without the header", param=PARAM)
