"""An image's declared width and height, read from its header before anything is decoded.

A 110 KB PNG may declare 30000 x 30000 pixels: OpenCV would allocate 2.7 GB to decode it (on every loader thread),
and one declaring 50000 x 50000 makes OpenCV raise instead. So every image is measured here first and refused
above ``max_pixels`` (:func:`pixel_problem`). OpenCV picks its decoder from the bytes, not the file name, so the
format is told by its magic bytes too. Read here: JPEG (and MPO), PNG, BMP, TIFF (and DNG, BigTIFF), WebP, PNM
(P1-P7) and PFM, i.e. every format of the image suffixes a dataset may use. Bytes of any other format (a GIF or a
JPEG 2000 renamed ``.jpg``) have no size detrain can check, so they are refused as unrecognised rather than decoded
blind. The size read is the one the decoder will use where a file could name two: the first JPEG frame header
(libjpeg refuses a second before the image data and ignores one after), the first PNG chunk (libpng refuses a second
IHDR), the WebP VP8X canvas (libwebp refuses a frame of another size), and PNM, PAM and PFM headers parsed as OpenCV
parses them; a TIFF IFD holding ImageWidth or ImageLength twice is refused (libtiff keeps the first, silently).

>>> png = np.frombuffer(b"\\x89PNG\\r\\n\\x1a\\n\\0\\0\\0\\rIHDR\\0\\0\\0\\x07\\0\\0\\0\\x05", np.uint8)
>>> declared_size(png)
(7, 5)
>>> pixel_problem(png, max_pixels=30)
'image too large: it declares 7x5 = 35 pixels, over max_pixels=30'
"""

from __future__ import annotations

import re
import struct

import numpy as np

from detrain.system.text import excerpt

# JPEG start-of-frame markers (they carry the size); C4, C8 and CC share the range but are not frames.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PNG = b"\x89PNG\r\n\x1a\n"
_TIFF = {b"II*\x00": ("<", False), b"MM\x00*": (">", False), b"II+\x00": ("<", True), b"MM\x00+": (">", True)}
_TIFF_SIZE_TAGS = {256: "ImageWidth", 257: "ImageLength"}
_PNM = frozenset(b"1234567Ff")
READ_FORMATS = "JPEG, PNG, BMP, TIFF, WebP, PNM or PFM"
_JPEG_STEPS = 10_000
# C's isspace: what OpenCV's PNM, PAM and PFM readers skip or stop at
_WS = rb"[ \t\n\r\v\f]"
# OpenCV's PxM ReadNumber: whitespace and comments (``#`` up to a CR or an LF) before the digits
_PXM_NUMBER = re.compile(rb"(?:" + _WS + rb"|#[^\r\n]*[\r\n])*([0-9]+)")
# OpenCV's PFM read_number: each number ends at the first whitespace byte, nothing skipped before it
_PFM_HEAD = re.compile(rb"P[Ff]\n([0-9]+)" + _WS + rb"([0-9]+)" + _WS)
# one field of OpenCV's ReadPAMHeaderLine: a comment, or a name of at most 8 bytes and its value (none when a line
# break follows the name; else the rest of the line after any whitespace, line breaks included)
_PAM_FIELD = re.compile(
    rb"[ \t\n\r\v\f]*(?:#[^\r\n]*[\r\n]|([^ \t\n\r\v\f]{1,8})"
    rb"(?:[\r\n]|[ \t\v\f][ \t\n\r\v\f]*([^ \t\n\r\v\f][^\r\n]{0,254})[\r\n]))"
)
_PAM_NAMES = frozenset((b"ENDHDR", b"HEIGHT", b"WIDTH", b"DEPTH", b"MAXVAL", b"TUPLTYPE"))


class _Ambiguous(Exception):
    """A header that states its size twice: refused with this reason, whichever the decoder would use."""


def image_byte_limit(max_pixels: int) -> int:
    """The largest image file read at all: 8 bytes a pixel (16-bit RGBA, uncompressed) plus 16 MiB of metadata,
    so a file that may hold ``max_pixels`` pixels is never cut off, and a 10 GB "image" is never read."""
    return 8 * max_pixels + (16 << 20)


def opencv_reason(error: BaseException) -> str:
    """What an OpenCV exception says, in one short line (its message spans several lines with a source path)."""
    err = getattr(error, "err", None)
    text = str(err if err else error)
    return "OpenCV: " + excerpt(
        text.strip().splitlines()[-1] if text.strip() else type(error).__name__, 120, quote=False
    )


def pixel_problem(data: np.ndarray, max_pixels: int) -> str | None:
    """Why the encoded image ``data`` must not be decoded (its header is unreadable, or it declares more than
    ``max_pixels`` pixels), or None when it may be."""
    try:
        size = _header_size(data)
    except _Ambiguous as e:
        return f"not a readable image ({e})"
    if size is None:
        return f"not a readable image (no {READ_FORMATS} header)"
    w, h = size
    if w * h > max_pixels:
        return f"image too large: it declares {w}x{h} = {w * h} pixels, over max_pixels={max_pixels}"
    return None


def declared_size(data: np.ndarray) -> tuple[int, int] | None:
    """(width, height) as the header of the encoded image ``data`` (uint8) declares it, before any EXIF rotation;
    None for an unknown format, a header cut short or one stating its size twice."""
    try:
        return _header_size(data)
    except _Ambiguous:
        return None


def _header_size(data: np.ndarray) -> tuple[int, int] | None:
    """:func:`declared_size`, raising :class:`_Ambiguous` for a header that states its size twice."""
    head = data[:32].tobytes()
    try:
        if head[:2] == b"\xff\xd8":
            return _jpeg_size(data)
        if head[:8] == _PNG and head[12:16] == b"IHDR":
            w, h = struct.unpack(">II", head[16:24])
            return w, h
        if head[:2] == b"BM":
            return _bmp_size(head)
        if head[:4] in _TIFF:
            return _tiff_size(data[: 1 << 20].tobytes(), *_TIFF[head[:4]])
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head[:1] == b"P" and len(head) > 2 and head[1] in _PNM and head[2:3].isspace():
            return _pnm_size(data[:4096].tobytes())
    except (struct.error, ValueError, IndexError, KeyError):
        return None
    return None


def _jpeg_size(data: np.ndarray) -> tuple[int, int] | None:
    """The first frame header's size, skipping stray bytes between segments as libjpeg does (it warns and goes
    on), so a file OpenCV decodes is measured, not refused. At most :data:`_JPEG_STEPS` markers are read before
    the frame header (real files have a few dozen): a file of fill bytes is refused, not walked for seconds."""
    n, pos = int(data.size), 2
    marks: np.ndarray | None = None  # where the 0xFF bytes are, found once when stray bytes first appear
    for _ in range(_JPEG_STEPS):
        if pos + 4 > n:
            return None
        if data[pos] != 0xFF:
            marks = np.flatnonzero(data == 0xFF) if marks is None else marks
            at = int(np.searchsorted(marks, pos))
            if at == marks.size:
                return None
            pos = int(marks[at])
            continue
        marker = int(data[pos + 1])
        if marker in (0xFF, 0x00, 0x01) or 0xD0 <= marker <= 0xD8:  # fill, stuffed byte, markers without length
            pos += 1 if marker == 0xFF else 2
            continue
        if marker in _SOF_MARKERS and pos + 9 <= n:
            height = (int(data[pos + 5]) << 8) | int(data[pos + 6])
            width = (int(data[pos + 7]) << 8) | int(data[pos + 8])
            return width, height
        if marker in (0xDA, 0xD9):
            return None
        pos += 2 + ((int(data[pos + 2]) << 8) | int(data[pos + 3]))
    return None


def _bmp_size(head: bytes) -> tuple[int, int]:
    """BITMAPCOREHEADER (12 bytes: 16-bit sizes) or any later header (32-bit; a negative height is top-down)."""
    (dib,) = struct.unpack_from("<I", head, 14)
    if dib == 12:
        w, h = struct.unpack_from("<HH", head, 18)
        return w, h
    w, h = struct.unpack_from("<ii", head, 18)
    return abs(w), abs(h)


def _tiff_size(head: bytes, order: str, big: bool) -> tuple[int, int] | None:
    """ImageWidth (256) and ImageLength (257) of the first IFD (the page OpenCV decodes); classic or BigTIFF. An
    IFD holding either twice is refused: libtiff keeps the first and ignores the rest, so reading any other would
    let a file declare 8 x 8 here and decode at 20000 x 20000."""
    if big:
        (ifd,) = struct.unpack_from(order + "Q", head, 8)
        (count,) = struct.unpack_from(order + "Q", head, ifd)
        entry, start, value_at = 20, ifd + 8, 12
    else:
        (ifd,) = struct.unpack_from(order + "I", head, 4)
        (count,) = struct.unpack_from(order + "H", head, ifd)
        entry, start, value_at = 12, ifd + 2, 8
    found: dict[int, int] = {}
    for k in range(min(count, 4096)):
        at = start + entry * k
        tag, kind = struct.unpack_from(order + "HH", head, at)
        if tag in _TIFF_SIZE_TAGS:
            if tag in found:
                raise _Ambiguous(f"TIFF IFD repeats tag {tag}, {_TIFF_SIZE_TAGS[tag]}")
            fmt = {3: "H", 4: "I", 16: "Q"}.get(kind)
            if fmt is None:
                return None
            (found[tag],) = struct.unpack_from(order + fmt, head, at + value_at)
    if 256 not in found or 257 not in found:
        return None
    return found[256], found[257]


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """The canvas of an extended WebP (VP8X), or the frame of a simple lossy (VP8) or lossless (VP8L) one."""
    chunk = head[12:16]
    if chunk == b"VP8X":
        w = int.from_bytes(head[24:27], "little") + 1
        h = int.from_bytes(head[27:30], "little") + 1
        return w, h
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", head, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", head, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _pnm_size(head: bytes) -> tuple[int, int] | None:
    """The width and height of a PNM (P1-P6), a PAM (P7) or a PFM (PF / Pf), read as OpenCV reads them, so that no
    file measures smaller here than it decodes (a comment ended by a CR, a field after ENDHDR, a ``#`` inside a
    PFM number)."""
    if head[1:2] == b"7":
        return _pam_size(head)
    if head[1:2] in (b"F", b"f"):
        match = _PFM_HEAD.match(head)
        return (int(match[1]), int(match[2])) if match else None
    width = _PXM_NUMBER.match(head, 2)
    if width is None or width.end() >= len(head):  # the byte after the digits is consumed: it must be there
        return None
    height = _PXM_NUMBER.match(head, width.end() + 1)
    if height is None or height.end() >= len(head):
        return None
    return int(width[1]), int(height[1])


def _pam_size(head: bytes) -> tuple[int, int] | None:
    """WIDTH and HEIGHT of a PAM header, field by field up to ENDHDR as OpenCV's PAM reader takes them: a field it
    would not read ends the header unread (None), and one it refuses to see twice is refused."""
    if head[2:3] not in (b"\n", b"\r"):
        return None
    fields: dict[bytes, bytes] = {}
    pos = 3
    while True:
        match = _PAM_FIELD.match(head, pos)
        if match is None:
            return None
        pos = match.end()
        name, value = match[1], (match[2] or b"").rstrip(b" \t\n\r\v\f")
        if name is None:  # a comment
            continue
        if name not in _PAM_NAMES:
            return None
        if name == b"ENDHDR":
            break
        if name in (b"WIDTH", b"HEIGHT") and name in fields:
            raise _Ambiguous(f"PAM header repeats {name.decode()}")
        fields[name] = value
    width, height = fields.get(b"WIDTH", b""), fields.get(b"HEIGHT", b"")
    return (int(width), int(height)) if width.isdigit() and height.isdigit() else None
