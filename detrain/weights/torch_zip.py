"""The torch zip archive around a checkpoint's pickle, checked before any of it is read.

A torch ``.pt`` (torch >= 1.6) is a zip: ``<archive>/data.pkl`` pickles the saved object and each storage's
bytes sit in ``<archive>/data/<key>``. A zip's directory states every record's sizes, and the readers trust
it: Python's zipfile and torch's own reader both allocate what a record says it inflates to. So the whole
directory is checked first, against the file itself:

- only stored or deflated records (torch writes stored ones), none encrypted, no name twice, not even in another
  case (torch's reader finds records case-insensitively, so ``DATA.PKL`` beside ``data.pkl`` could give it a
  pickle this check never read);
- every record in the archive's one folder and of a kind torch writes (pickle, storage, small metadata), and
  after the pickle is read every record has been read by the check (:meth:`TorchZip.check_all_vetted`);
- a stored record is as long as it says; a deflated one claims no more than deflate can produce;
- every record's data lies inside the file and no two records overlap (one compressed stream cannot be
  counted twice, as "overlapping" zip bombs do);
- data.pkl, each record and all records together stay under :mod:`detrain.weights.limits`' caps, and all
  records together inflate to at most ``MAX_INFLATION`` times the file's size (plus some slack), so a small
  file cannot make the reader allocate gigabytes of zeros.

Storages are then read only at the size the pickle declares, which must equal the record's (see
:meth:`TorchZip.read_storage`), and a record that inflates to something else fails its length or CRC check.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

from detrain.errors import CheckpointError
from detrain.weights import limits
from detrain.weights.limits import Refused, shown, size_text

__all__ = ["TorchZip"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


# Small records torch writes beside the pickle and the storages; each is read (CRC checked) by the check.
_METADATA = (
    "byteorder",
    "version",
    ".format_version",
    ".storage_alignment",
    ".data/version",
    ".data/serialization_id",
)


def _is_key(key: str) -> bool:
    """A storage key as torch writes it: short, ASCII letters and digits."""
    return 0 < len(key) <= 32 and key.isascii() and key.isalnum()


def _quoted(name: str) -> str:
    """A record name for a refusal: quoted and clipped (a zip may name a record with 64 KB of anything)."""
    return shown(name, 80)


class TorchZip:
    """An opened torch zip checkpoint whose directory passed the checks above; use as a context manager.

    Raises CheckpointError when the file is missing or no zip at all, and :class:`Refused` when the zip
    asks for more than the limits allow or lies about its records.

    Example:
        >>> import torch
        >>> torch.save({"w": torch.ones(2)}, "w.pt")
        >>> with TorchZip(Path("w.pt")) as tz:
        ...     tz.prefix, tz.pickle_bytes()[-1:]  # the folder its records are in; the pickle's STOP
        ('w/', b'.')
    """

    def __init__(self, path: Path, data: bytes | None = None) -> None:
        """``data``: the file's bytes, read once by the caller (which then loads from the same bytes); ``path`` is
        then only its name in messages. Without it the file at ``path`` is opened."""
        self.path = path
        if data is None and not path.is_file():
            raise CheckpointError(f"weights file not found: {path}")
        self.vetted: set[str] = set()  # the records read (or, for an empty storage, measured) by the check
        try:
            self._zf = zipfile.ZipFile(path if data is None else io.BytesIO(data))
        except (MemoryError, RecursionError):
            raise
        except Exception as e:  # noqa: BLE001 - BadZipFile, or whatever else a mangled directory makes zipfile raise
            raise CheckpointError(
                f"cannot load weights file {path}: not a torch zip checkpoint (saved by torch >= 1.6): {e}"
            ) from None
        try:
            self._records = self._check_directory(path.stat().st_size if data is None else len(data))
            self.prefix = self._find_prefix()
            self._check_names()
            self.byteorder = self._read_byteorder()
            self._read_metadata()
        except BaseException:
            self._zf.close()
            raise

    def __enter__(self) -> TorchZip:
        return self

    def __exit__(self, *exc: object) -> None:
        self._zf.close()

    # ----------------------------------------------------------------------------------------------

    def _check_directory(self, archive_size: int) -> dict[str, zipfile.ZipInfo]:
        infos = self._zf.infolist()
        if len(infos) > limits.MAX_RECORDS:
            raise Refused(f"it holds {len(infos)} zip records, more than the {limits.MAX_RECORDS} allowed")
        records: dict[str, zipfile.ZipInfo] = {}
        folded: dict[str, str] = {}
        total = 0
        for info in infos:
            name = info.filename
            if name in records:
                raise Refused(f"zip record {_quoted(name)} appears twice (readers would disagree on which counts)")
            twin = folded.setdefault(name.casefold(), name)
            if twin != name:  # torch's reader finds a record by its name in any case: it could take either
                raise Refused(f"zip records {_quoted(twin)} and {_quoted(name)} differ only in case")
            records[name] = info
            if info.flag_bits & 0x1:
                raise Refused(f"zip record {_quoted(name)} is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise Refused(
                    f"zip record {_quoted(name)} uses compression method {info.compress_type} (only stored or deflated)"
                )
            size, packed = info.file_size, info.compress_size
            if info.compress_type == zipfile.ZIP_STORED and size != packed:
                raise Refused(f"stored zip record {_quoted(name)} claims {size} bytes but holds {packed}")
            if size > packed * limits.DEFLATE_MAX_RATIO + 64:
                raise Refused(
                    f"zip record {_quoted(name)} claims to inflate {size_text(packed)} to {size_text(size)}, "
                    "more than deflate can"
                )
            if size > limits.MAX_RECORD_BYTES:
                raise Refused(
                    f"zip record {_quoted(name)} is {size_text(size)}, more than the "
                    f"{size_text(limits.MAX_RECORD_BYTES)} allowed for one record"
                )
            total += size
        if total > limits.MAX_TOTAL_BYTES:
            raise Refused(
                f"its zip records add up to {size_text(total)}, more than the {size_text(limits.MAX_TOTAL_BYTES)} "
                "allowed"
            )
        if total > archive_size * limits.MAX_INFLATION + limits.INFLATION_SLACK:
            raise Refused(
                f"its zip records inflate to {size_text(total)} from a file of {size_text(archive_size)}, more than "
                f"{limits.MAX_INFLATION}x its size plus {size_text(limits.INFLATION_SLACK)} (a zip bomb?)"
            )
        self._check_layout(infos, archive_size)
        return records

    def _check_layout(self, infos: list[zipfile.ZipInfo], archive_size: int) -> None:
        """Every record's data inside the file, and no two records sharing bytes."""
        fp = self._zf.fp
        assert fp is not None
        end_of_previous, previous = 0, ""
        for info in sorted(infos, key=lambda i: i.header_offset):
            start = info.header_offset
            if start < 0:
                raise Refused(f"zip record {_quoted(info.filename)} starts before the beginning of the file")
            if start < end_of_previous:
                raise Refused(f"zip records {_quoted(previous)} and {_quoted(info.filename)} overlap")
            fp.seek(start)
            header = fp.read(_LOCAL_HEADER.size)
            if len(header) < _LOCAL_HEADER.size:
                raise Refused(f"zip record {_quoted(info.filename)} starts past the end of the file")
            signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
            if signature != _LOCAL_SIGNATURE:
                raise Refused(f"zip record {_quoted(info.filename)} has no local header where the directory points")
            end = start + _LOCAL_HEADER.size + name_len + extra_len + info.compress_size
            if end > archive_size:
                raise Refused(f"zip record {_quoted(info.filename)} runs past the end of the file")
            end_of_previous, previous = end, info.filename

    def _find_prefix(self) -> str:
        """The archive's top folder ('yolov8n/'): torch names it after the file it first saved to."""
        found = [n for n in self._records if (n == "data.pkl" or n.endswith("/data.pkl")) and n.count("/") <= 1]
        if not found:
            raise CheckpointError(f"cannot load weights file {self.path}: not a torch checkpoint (no data.pkl inside)")
        if len(found) > 1:
            some = ", ".join(_quoted(n) for n in sorted(found)[:3])
            raise Refused(f"it holds {len(found)} data.pkl records ({some})")
        info = self._records[found[0]]
        if info.file_size > limits.MAX_PICKLE_BYTES:
            raise Refused(
                f"its data.pkl is {size_text(info.file_size)}, more than the "
                f"{size_text(limits.MAX_PICKLE_BYTES)} allowed"
            )
        return found[0][: -len("data.pkl")]

    def _check_names(self) -> None:
        """Every record in the archive's one folder and of a kind torch writes: its pickle, a storage
        (``data/<key>``) or one of the small metadata records (torch names its archive after the first record's
        folder, so a record elsewhere could make it read another archive than the one checked)."""
        for name in self._records:
            rest = name[len(self.prefix) :] if name.startswith(self.prefix) else None
            storage = rest is not None and rest.startswith("data/") and _is_key(rest[5:])
            if rest is None or not (rest == "data.pkl" or storage or rest in _METADATA):
                raise Refused(f"zip record {_quoted(name)} is not one torch writes in {_quoted(self.prefix)}")

    def _read_metadata(self) -> None:
        """Read (CRC checked) the small records torch reads besides the pickle and the storages."""
        for rest in _METADATA:
            info = self._records.get(self.prefix + rest)
            if info is not None:
                if info.file_size > 64:
                    raise Refused(f"its {_quoted(rest)} record is {info.file_size} bytes long")
                self._read(info, info.file_size)

    def check_all_vetted(self) -> None:
        """After the pickle was read: every record was read by the check, so torch reads nothing unchecked (a
        storage the pickle never names is refused too)."""
        unread = sorted(set(self._records) - self.vetted)
        if unread:
            raise Refused(f"zip record {_quoted(unread[0])} is not named by its pickle (left unread by the check)")

    def _read_byteorder(self) -> str:
        info = self._records.get(f"{self.prefix}byteorder")
        if info is None:
            return "little"  # what torch assumes for files without a byteorder record
        if info.file_size > 16:
            raise Refused(f"its byteorder record is {info.file_size} bytes long")
        text = self._read(info, info.file_size).decode("ascii", "replace").strip()
        if text not in ("little", "big"):
            raise Refused(f"unknown byte order {text[:16]!r} (little or big)")
        return text

    def _read(self, info: zipfile.ZipInfo, nbytes: int) -> bytes:
        """``nbytes`` of a record whose directory entry says exactly that; its CRC is checked on the way."""
        self.vetted.add(info.filename)
        try:
            with self._zf.open(info) as f:
                raw = f.read(nbytes)
                if len(raw) == nbytes and nbytes == info.file_size:
                    f.read(1)  # reaching the end is what makes zipfile compare the CRC
        except (MemoryError, RecursionError):
            raise
        except Exception as e:  # noqa: BLE001 - BadZipFile (CRC, local header), zlib.error: a broken record
            why = f"{type(e).__name__}: {str(e)[:200]}"
            raise Refused(f"zip record {_quoted(info.filename)} is damaged ({why})") from None
        if len(raw) != nbytes:
            raise Refused(f"zip record {_quoted(info.filename)} holds {len(raw)} bytes, not the {nbytes} it claims")
        return raw

    # ----------------------------------------------------------------------------------------------

    def pickle_bytes(self) -> bytes:
        """The whole data.pkl (its size was checked against MAX_PICKLE_BYTES on opening)."""
        info = self._records[f"{self.prefix}data.pkl"]
        return self._read(info, info.file_size)

    def storage_nbytes(self, key: str) -> int | None:
        """The size of record ``data/<key>``, or None when there is no such record (an empty storage is then
        vetted: its size is all there is to check)."""
        info = self._records.get(f"{self.prefix}data/{key}")
        if info is not None and info.file_size == 0:
            self.vetted.add(info.filename)
        return None if info is None else info.file_size

    def read_storage(self, key: str, nbytes: int) -> bytes:
        """The bytes of ``data/<key>``, which must be exactly ``nbytes`` long (the size the pickle declared)."""
        info = self._records.get(f"{self.prefix}data/{key}")
        if info is None:
            raise Refused(f"its pickle names storage data/{key}, which the zip does not hold")
        if info.file_size != nbytes:
            raise Refused(f"storage data/{key} is declared as {nbytes} bytes but its zip record holds {info.file_size}")
        return self._read(info, nbytes)
