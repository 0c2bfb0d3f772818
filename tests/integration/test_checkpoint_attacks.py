"""Named attacks on the checkpoint reader: each ends in one CheckpointError line, never a crash or big allocation.

Files are forged opcode by opcode (tests/_pickle_forge.py) in tmp_path. Attacks that crashed the reader
before (SIGSEGV) are loaded in a child process, so a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import functools
import os
import pickle
import resource
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from _pickle_forge import (
    bool_,
    bytes_,
    checkpoint,
    dict_,
    global_,
    inert,
    int_,
    list_,
    none,
    np_array,
    np_dtype,
    np_dtype_state,
    proto,
    reduce_,
    storage_tensor,
    str_,
    tuple_,
    ultralytics_model,
    write_torch_zip,
)
from _ultralytics import load_ultralytics_checkpoint

from detrain.errors import CheckpointError
from detrain.weights import limits, safe_torch
from detrain.weights.checkpoint import load_checkpoint, save_checkpoint
from detrain.weights.inert import inert_class
from detrain.weights.ultralytics import ultralytics_info

REPO = Path(__file__).resolve().parents[2]
YOLOV8N = REPO.parent / "shared" / "weights" / "yolov8n.pt"


def _refused(path: Path, pattern: str) -> str:
    """Load ``path`` and return the CheckpointError text, which must be one line matching ``pattern``."""
    with pytest.raises(CheckpointError, match=pattern) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


_CHILD = """
import sys
from detrain.weights.checkpoint import load_checkpoint
from detrain.errors import CheckpointError
for p in sys.argv[1:]:
    print("loading", p, flush=True)
    try:
        load_checkpoint(p)
        print("LOADED", flush=True)
    except CheckpointError as e:
        print("REFUSED", e, flush=True)
"""


def _cpu_limit() -> None:
    # A regression to a hang dies of SIGXCPU (-24) instead of stalling the suite; loads take well under a second.
    resource.setrlimit(resource.RLIMIT_CPU, (60, 61))


def _load_in_child(*paths: Path) -> list[str]:
    """Load each file in a fresh interpreter; the child must exit 0 (a SIGSEGV is -11). One outcome line each."""
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_cpu_limit,
    )
    assert run.returncode == 0, f"child died with {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    return [line for line in run.stdout.splitlines() if line.startswith(("LOADED", "REFUSED"))]


def _one_weight() -> tuple[bytes, dict[str, bytes]]:
    """A model record with one 4-element half tensor, and its storage record: the smallest valid checkpoint."""
    return dict_({"w": storage_tensor("0", 4, (4,))}), {"0": bytes(8)}


def _model_file(tmp_path: Path, name: str, model_state: dict[str, bytes] | None = None, **extra: bytes) -> Path:
    """A valid one-class, one-weight Ultralytics-shaped file, with ``extra`` top-level entries (the payload)."""
    params, records = _one_weight()
    state = {"names": list_(str_("a")), "yaml": dict_({"scale": str_("n")}), **(model_state or {})}
    model = ultralytics_model(_parameters=params, **state)
    return write_torch_zip(tmp_path / name, checkpoint(model, **extra), records)


# --------------------------------------------------------------------------------------------------
# numpy: dtypes by name only, no BUILD reaching numpy
# --------------------------------------------------------------------------------------------------


def _object_array_with_cleared_flags() -> bytes:
    """The reported attack: an object dtype whose flags BUILD cleared, so raw bytes become PyObject pointers."""
    return np_array(np_dtype("O8", np_dtype_state("|", flags=0)), (1,), b"\x41" * 8)


def test_the_cleared_flags_payload_is_live(tmp_path: Path) -> None:
    """Control: numpy's own unpickling of the payload dereferences the file's address and dies."""
    payload = proto() + _object_array_with_cleared_flags() + pickle.STOP
    code = f"import pickle; a = pickle.loads({payload!r}); bool(a[0]); print('survived')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "survived" not in run.stdout


def test_object_dtype_with_cleared_flags_is_refused_not_a_segfault(tmp_path: Path) -> None:
    arr = _object_array_with_cleared_flags()
    # where the old reader touched it first: the model record's non-persistent buffer set (bool(array))
    path = write_torch_zip(tmp_path / "objdtype.pt", checkpoint(ultralytics_model(_non_persistent_buffers_set=arr)))
    assert path.stat().st_size < 4096
    (line,) = _load_in_child(path)
    assert line.startswith("REFUSED refusing to load") and "numpy dtype 'O8' is not a plain number type" in line


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (np_array(np_dtype("O8", np_dtype_state("|", flags=63)), (1,), b"\x41" * 8), "numpy dtype 'O8'"),
        (np_dtype("V8"), "numpy dtype 'V8'"),
        (np_dtype("U1"), "numpy dtype 'U1'"),
        (np_dtype("f8", np_dtype_state("<", flags=63)), r"sets flags/size/alignment \(63"),
        (
            np_dtype("f8", tuple_(int_(3), str_("<"), none(), tuple_(str_("a")), none(), int_(-1), int_(-1), int_(0))),
            "fields or a subarray",
        ),
        # BUILD a second time on a finished dtype / array (reached through the memo)
        (
            np_dtype("f8", np_dtype_state())
            + pickle.BINPUT
            + b"\x07"
            + pickle.POP
            + pickle.BINGET
            + b"\x07"
            + np_dtype_state()
            + pickle.BUILD,
            "applies BUILD to a numpy object",
        ),
        (
            np_array(np_dtype("f4", np_dtype_state()), (1,), bytes(4))
            + pickle.BINPUT
            + b"\x07"
            + pickle.POP
            + pickle.BINGET
            + b"\x07"
            + tuple_(int_(1), tuple_(int_(2)), np_dtype("f4"), bool_(False), bytes_(b"A" * 8))
            + pickle.BUILD,
            "applies BUILD to a numpy object",
        ),
        (np_array(np_dtype("f4", np_dtype_state()), (4,), bytes(4)), "shape .* with 4 bytes of data"),
        (np_array(np_dtype("f4", np_dtype_state()), (10**12, 10**12), bytes(4)), "numpy array size"),
        (
            reduce_(
                global_("numpy.core.multiarray", "_reconstruct"),
                global_("numpy.ma", "MaskedArray"),
                tuple_(int_(0)),
                bytes_(b"b"),
            ),
            "it asks to call numpy.ma.MaskedArray",
        ),
        (reduce_(global_("numpy.core.multiarray", "scalar"), np_dtype("O8"), str_("x")), "numpy dtype 'O8'"),
    ],
    ids=[
        "object-dtype",
        "void-dtype",
        "unicode-dtype",
        "dtype-flags",
        "dtype-fields",
        "build-dtype-twice",
        "build-array-twice",
        "array-short-data",
        "array-huge-shape",
        "masked-array",
        "object-scalar",
    ],
)
def test_numpy_beyond_plain_numbers_is_refused(tmp_path: Path, payload: bytes, reason: str) -> None:
    path = _model_file(tmp_path, "np.pt", train_args=dict_({"x": payload}))
    _refused(path, reason)


def test_plain_numpy_numbers_and_arrays_still_load(tmp_path: Path) -> None:
    import numpy as np

    values = {
        "f": np.float64(2.5),
        "i": np.int32(-7),
        "a": np.arange(6, dtype=">i4").reshape(2, 3),
        "fa": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "e": np.zeros((0, 3)),
    }
    params, records = _one_weight()
    data = checkpoint(ultralytics_model(_parameters=params), train_args=pickle.dumps(values, protocol=2)[2:-1])
    path = write_torch_zip(tmp_path / "np_ok.pt", data, records)
    from detrain.weights.ultralytics import read_torch_zip

    got = read_torch_zip(path)["train_args"]
    for key, want in values.items():
        assert type(got[key]) is type(want) and got[key].dtype == want.dtype and np.array_equal(got[key], want), key
    assert got["fa"].flags.f_contiguous and got["a"].flags.writeable


# --------------------------------------------------------------------------------------------------
# Globals that would run code
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        (os.system.__module__, "system"),
        ("subprocess", "Popen"),
        ("builtins", "eval"),
        ("functools", "partial"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("numpy", "load"),
        ("torch.serialization", "load"),
    ],
)
def test_a_global_that_runs_code_is_refused(tmp_path: Path, module: str, name: str) -> None:
    marker = tmp_path / "ran"
    call = reduce_(global_(module, name), str_(f"touch {marker}"))
    path = _model_file(tmp_path, "evil.pt", train_args=dict_({"x": call}))
    _refused(path, rf"^refusing to load .*: it asks to call {module}\.{name}$")
    assert not marker.exists()


def test_functools_partial_pickled_by_python_is_refused(tmp_path: Path) -> None:
    obj = {"model": functools.partial(os.system, "true")}
    path = write_torch_zip(tmp_path / "partial.pt", pickle.dumps(obj, protocol=2))
    _refused(path, r"it asks to call functools\.partial$")


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (pickle.INST + b"os\nsystem\n", "INST"),
        (pickle.OBJ, "OBJ"),
        (pickle.EXT1 + b"\x01", "EXT1"),
        (pickle.NEWOBJ_EX, "NEWOBJ_EX"),
        (pickle.BYTEARRAY8 + struct.pack("<Q", 1 << 40), "BYTEARRAY8"),
        (pickle.PERSID + b"0\n", "PERSID"),
        (b"\xff", "unknown pickle opcode 0xff"),
    ],
)
def test_opcodes_no_checkpoint_uses_are_refused(tmp_path: Path, op: bytes, name: str) -> None:
    path = write_torch_zip(tmp_path / "op.pt", proto(4) + pickle.MARK + op + pickle.STOP)
    _refused(path, name)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        # SETITEM into a tensor (index assignment runs torch indexing on the file's word)
        (storage_tensor("0", 4, (4,)) + int_(0) + int_(1) + pickle.SETITEM, "applies SETITEM to a Tensor"),
        (list_() + int_(1) + int_(2) + pickle.SETITEM, "applies SETITEM to a list"),
        (dict_({}) + int_(1) + pickle.APPEND, "applies APPEND to a dict"),
        (reduce_(global_("builtins", "object")), "it calls a type object"),
        (global_("torch", "float16") + pickle.EMPTY_TUPLE + pickle.REDUCE, "it calls a dtype object"),
        (
            global_("builtins", "set") + pickle.EMPTY_TUPLE + pickle.NEWOBJ,
            "creates an object of type function, which is not a data record",
        ),
        (global_("torch", "Size") + str_("a.b") + pickle.TUPLE1 + pickle.REDUCE, "torch.Size"),
        (storage_tensor("0", 4, (4,)) + dict_({}) + pickle.BUILD, "sets the state of a Tensor"),
        (global_("os ", "system"), "malformed global name"),
        (global_("ultralytics." + "x" * 300, "A"), "malformed global name"),
    ],
    ids=[
        "setitem-tensor",
        "setitem-list",
        "append-dict",
        "call-object",
        "call-dtype",
        "newobj-function",
        "size-of-text",
        "build-tensor",
        "spaced-global",
        "long-global",
    ],
)
def test_misused_opcodes_are_refused(tmp_path: Path, payload: bytes, reason: str) -> None:
    path = _model_file(tmp_path, "misuse.pt", train_args=list_(payload))
    _refused(path, reason)


# --------------------------------------------------------------------------------------------------
# Sizes: storages, records, zip bombs
# --------------------------------------------------------------------------------------------------


def test_a_huge_declared_storage_is_refused_before_any_allocation(tmp_path: Path, monkeypatch) -> None:
    reads: list[str] = []
    real_read = safe_torch.StorageReader._read
    monkeypatch.setattr(
        safe_torch.StorageReader,
        "_read",
        lambda self, key, nbytes, dtype: reads.append(key) or real_read(self, key, nbytes, dtype),
    )
    model = ultralytics_model(_parameters=dict_({"w": storage_tensor("0", 10**12, (10**6, 10**6))}))
    path = write_torch_zip(tmp_path / "huge.pt", checkpoint(model), {"0": bytes(8)})
    _refused(path, r"storage data/0 is declared as 2000000000000 bytes but its zip record holds 8$")
    assert reads == []


@pytest.mark.parametrize(
    ("tensors", "records", "reason"),
    [
        ({"w": storage_tensor("0", 4, (4,))}, {"0": bytes(6)}, "declared as 8 bytes but its zip record holds 6"),
        ({"w": storage_tensor("0", 4, (4,))}, {}, "names storage data/0, which the zip does not hold"),
        (
            {"w": storage_tensor("0", 4, (4,)), "v": storage_tensor("0", 2, (2,))},
            {"0": bytes(8)},
            "declared twice with different types or sizes",
        ),
        ({"w": storage_tensor("0", 4, (8,))}, {"0": bytes(8)}, "reaches past its storage"),
        (
            {
                "w": reduce_(
                    global_("torch._utils", "_rebuild_tensor_v2"),
                    tuple_(str_("storage"), global_("torch", "HalfStorage"), str_("0"), str_("cpu"), int_(4))
                    + pickle.BINPERSID,
                    int_(0),
                    tuple_(int_(10**9)),
                    tuple_(int_(0)),
                    bool_(False),
                    none(),
                )
            },
            {"0": bytes(8)},
            "reaches past its storage",
        ),  # a stride-0 view: 10^9 elements over 4
        ({"w": storage_tensor("../../x", 4, (4,))}, {"0": bytes(8)}, "short alphanumeric name"),
        ({"w": storage_tensor("0", -4, (4,))}, {"0": bytes(8)}, "declares -4 elements"),
    ],
    ids=[
        "record-too-short",
        "record-missing",
        "key-redeclared",
        "view-past-end",
        "stride-0-blowup",
        "key-path",
        "negative-numel",
    ],
)
def test_storages_must_match_their_records(tmp_path: Path, tensors: dict, records: dict, reason: str) -> None:
    path = write_torch_zip(tmp_path / "st.pt", checkpoint(ultralytics_model(_parameters=dict_(tensors))), records)
    _refused(path, reason)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        # an int too long for str() (Python refuses past 4300 digits) where a storage size belongs
        (
            reduce_(
                global_("torch._utils", "_rebuild_tensor_v2"),
                tuple_(str_("storage"), global_("torch", "HalfStorage"), str_("0"), str_("cpu"), int_(-(10**5000)))
                + pickle.BINPERSID,
                int_(0),
                tuple_(int_(4)),
                tuple_(int_(1)),
                bool_(False),
                none(),
            ),
            r"storage data/0 declares an int of 16610 bits elements$",
        ),
        # a megabyte of text, newlines included, where numpy writes a small number
        (
            np_dtype(
                "f8", tuple_(str_("x\n" * limits.MiB), str_("<"), none(), none(), none(), int_(-1), int_(-1), int_(0))
            ),
            r"a numpy dtype state of version 'x\\nx\\n.*'\.\.\. \(3 or 4",
        ),
        (np_array(np_dtype("f4", np_dtype_state()), (10**5000,), bytes(4)), "numpy array size an int of"),
    ],
    ids=["huge-int-numel", "megabyte-version", "huge-int-shape"],
)
def test_refusals_quote_the_file_briefly(tmp_path: Path, payload: bytes, reason: str) -> None:
    path = _model_file(tmp_path, "quote.pt", train_args=list_(payload))
    message = _refused(path, reason)
    assert len(message) < 300 + len(str(path))


def test_a_record_name_full_of_newlines_is_quoted_on_one_line(tmp_path: Path) -> None:
    path = _model_file(tmp_path, "names.pt")
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("names/x\n" * 1000, b"")
        with pytest.warns(UserWarning, match="Duplicate name"):
            zf.writestr("names/x\n" * 1000, b"")
    message = _refused(path, r"zip record 'names/x\\n.*'\.\.\. appears twice")
    assert len(message) < 300 + len(str(path))


def _patch_sizes(path: Path, name: str, *, file_size: int) -> None:
    """Rewrite the uncompressed size a record claims, in its central directory entry and its local header."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    struct.pack_into("<I", raw, info.header_offset + 22, file_size)
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + name_len] == name.encode():
            struct.pack_into("<I", raw, at + 24, file_size)
        at = raw.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(raw))


def test_a_record_claiming_gigabytes_is_refused(tmp_path: Path) -> None:
    path = _model_file(tmp_path, "bomb.pt")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    path = tmp_path / "deflated.pt"
    _patch_sizes(path, "bomb/data/0", file_size=4 * limits.GiB - 1)
    _refused(path, r"zip record 'bomb/data/0' claims to inflate .* to 4\.0 GiB, more than deflate can")


def test_an_honest_zip_bomb_is_refused_by_the_caps(tmp_path: Path, monkeypatch) -> None:
    """64 MiB of zeros deflate to 64 KiB: within deflate's ratio, so the size caps must catch it."""
    monkeypatch.setattr(limits, "MAX_RECORD_BYTES", 16 * limits.MiB)
    path = _model_file(tmp_path, "zeros.pt")
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("zeros/data/1", bytes(64 * limits.MiB))
    assert path.stat().st_size < 1 * limits.MiB
    _refused(path, r"zip record 'zeros/data/1' is 64\.0 MiB, more than the 16\.0 MiB allowed for one record")


def test_a_zip_bomb_under_every_record_cap_is_refused_by_its_inflation(tmp_path: Path, monkeypatch) -> None:
    """16 MiB of zeros in a file of 40 KB: each record within its cap, but 400x the file's size."""
    monkeypatch.setattr(limits, "INFLATION_SLACK", 1 * limits.MiB)
    path = _model_file(tmp_path, "inflate.pt")
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("inflate/data/1", bytes(16 * limits.MiB))
    assert path.stat().st_size < 64 * 1024
    _refused(
        path,
        r"its zip records inflate to 16\.0 MiB from a file of .* KiB, more than 32x its size plus "
        r"1\.0 MiB \(a zip bomb\?\)$",
    )


def test_a_data_pkl_bomb_is_refused(tmp_path: Path) -> None:
    body = proto() + list_(*[none()] * 16) + pickle.STOP
    pkl = body[:-1] + pickle.POP + pickle.NONE * (40 * limits.MiB) + pickle.STOP  # 40 MiB of NONE, deflated
    path = write_torch_zip(tmp_path / "pkl.pt", pkl, compression=zipfile.ZIP_DEFLATED)
    _refused(path, r"its data.pkl is 40\.0 MiB, more than the 32\.0 MiB allowed")


def test_a_record_inflating_past_its_claim_is_cut_off(tmp_path: Path) -> None:
    """A deflated record that says 8 bytes but inflates to 1 MiB: read to 8 bytes, then its CRC fails."""
    path = _model_file(tmp_path, "liar.pt")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "liar2.pt", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info.filename, bytes(limits.MiB) if info.filename.endswith("data/0") else data)
    path = tmp_path / "liar2.pt"
    _patch_sizes(path, "liar/data/0", file_size=8)
    _refused(path, r"zip record 'liar/data/0' is damaged \(BadZipFile: Bad CRC-32")


def test_duplicated_and_overlapping_records_are_refused(tmp_path: Path) -> None:
    path = _model_file(tmp_path, "dup.pt")
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(path, "a") as zf:
        zf.writestr("dup/data/0", bytes(8))
    _refused(path, r"zip record 'dup/data/0' appears twice")

    path = _model_file(tmp_path, "lap.pt")
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        first, second = sorted(zf.infolist(), key=lambda i: i.header_offset)[:2]
    at = raw.find(b"PK\x01\x02")  # point the second directory entry at the first record's bytes
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + name_len] == second.filename.encode():
            struct.pack_into("<I", raw, at + 42, first.header_offset)
        at = raw.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(raw))
    _refused(path, r"overlap|no local header|damaged")


def test_an_unusual_compression_method_is_refused(tmp_path: Path) -> None:
    path = _model_file(tmp_path, "bz.pt")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "bz2.pt", "w", zipfile.ZIP_BZIP2) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    _refused(tmp_path / "bz2.pt", r"uses compression method 12 \(only stored or deflated\)")


# --------------------------------------------------------------------------------------------------
# Counts: classes, memo entries, opcodes, copies
# --------------------------------------------------------------------------------------------------


def test_an_absurd_number_of_classes_is_refused(tmp_path: Path) -> None:
    many = list_(*[inert("ultralytics.fake", f"C{i}", {}) for i in range(limits.MAX_GLOBALS + 1)])
    path = _model_file(tmp_path, "classes.pt", train_args=many)
    _refused(path, rf"it names more than {limits.MAX_GLOBALS} distinct classes and functions$")


def test_an_absurd_number_of_memo_entries_is_refused(tmp_path: Path) -> None:
    puts = b"".join(pickle.LONG_BINPUT + struct.pack("<I", i) for i in range(limits.MAX_MEMO + 1))
    path = _model_file(tmp_path, "memo.pt", train_args=none() + puts)
    _refused(path, rf"its pickle keeps more than {limits.MAX_MEMO} memo entries$")


def test_an_endless_pickle_program_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_PICKLE_OPS", 10_000)
    path = _model_file(tmp_path, "ops.pt", train_args=none() + (pickle.DUP + pickle.POP) * 5_000)
    _refused(path, r"its pickle runs more than 10000 opcodes$")


def test_copy_amplification_is_refused(tmp_path: Path) -> None:
    """One 1 MiB string encoded to bytes 300 times: 300 MiB of copies from a 1 MiB file."""
    text = str_("x" * limits.MiB) + pickle.BINPUT + b"\x01" + pickle.POP
    encode = global_("_codecs", "encode") + pickle.BINPUT + b"\x02"
    calls = (
        pickle.BINGET + b"\x02" + pickle.BINGET + b"\x01" + str_("latin1") + pickle.TUPLE2 + pickle.REDUCE + pickle.POP
    ) * 300
    path = _model_file(tmp_path, "amp.pt", train_args=text + encode + pickle.POP + calls + none())
    _refused(path, r"its calls would copy more than 256\.0 MiB$")


# --------------------------------------------------------------------------------------------------
# Hashing: keys that cost without bound or collide
# --------------------------------------------------------------------------------------------------


def _put(i: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", i)


def _shared_tuple_key() -> bytes:
    """T0 = (None, None), Tk = (Tk-1, Tk-1): 45 levels in 1.5 KB, and hashing T45 visits 2**45 elements."""
    body = none() + none() + pickle.TUPLE2 + _put(0)
    for k in range(1, 46):
        body += pickle.POP + _get(k - 1) + _get(k - 1) + pickle.TUPLE2 + _put(k)
    return body + pickle.POP + dict_({}) + _get(45) + none() + pickle.SETITEM


def _colliding_int_keys() -> bytes:
    """60,000 ints that are all equal modulo 2**61 - 1, so all hash alike: 1.8e9 comparisons to fill the dict."""
    modulus = (1 << 61) - 1
    return dict_({}) + pickle.MARK + b"".join(int_(k * modulus) + none() for k in range(1, 60_001)) + pickle.SETITEMS


def _big_int_key_again_and_again() -> bytes:
    """A 4 MB int used as a key 200,000 times: an int's hash is not cached, each SETITEM reads every digit."""
    return int_(1 << (8 * 4_000_000)) + _put(0) + pickle.POP + dict_({}) + (_get(0) + none() + pickle.SETITEM) * 200_000


def test_keys_that_are_costly_to_hash_are_refused(tmp_path: Path) -> None:
    """Each of these files kept load_checkpoint busy for hours (found by reading the reader after the fuzzer
    came up clean: random mutations do not build them)."""
    payloads = {
        "shared": (_shared_tuple_key(), "a dict key or set item of type tuple (text, numbers and records only)"),
        "collide": (_colliding_int_keys(), "a dict key or set item that is an integer of 61 bits"),
        "bigint": (_big_int_key_again_and_again(), "a dict key or set item that is an integer of 32000001 bits"),
    }
    files = [_model_file(tmp_path, f"{name}.pt", train_args=payload) for name, (payload, _) in payloads.items()]
    assert files[0].stat().st_size < 2048
    lines = _load_in_child(*files)
    assert len(lines) == 3
    for line, (_, reason) in zip(lines, payloads.values()):
        assert line.startswith("REFUSED refusing to load") and line.endswith(reason), line


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (pickle.EMPTY_SET + pickle.MARK + tuple_(int_(1)) + pickle.ADDITEMS, "set item of type tuple"),
        (
            pickle.MARK + reduce_(global_("builtins", "complex"), int_(1), int_(2)) + pickle.FROZENSET,
            "set item of type complex",
        ),
        (
            pickle.MARK + reduce_(global_("torch", "Size"), tuple_(int_(1))) + int_(0) + pickle.DICT,
            "key or set item of type Size",
        ),
        (reduce_(global_("builtins", "set"), list_(int_(2**70))), "integer of 71 bits"),
        (
            reduce_(global_("collections", "OrderedDict"), list_(list_(tuple_(), none()))),
            "key or set item of type tuple",
        ),
        (
            reduce_(global_("collections", "OrderedDict"), list_(str_("ab"), str_("cd"))),
            r"other than \(key, value\) pairs$",
        ),
    ],
    ids=[
        "additems-tuple",
        "frozenset-complex",
        "dict-size",
        "set-of-big-int",
        "ordered-dict-tuple",
        "ordered-dict-str",
    ],
)
def test_every_way_to_hash_checks_its_keys(tmp_path: Path, payload: bytes, reason: str) -> None:
    path = _model_file(tmp_path, "keys.pt", train_args=list_(payload))
    _refused(path, reason)


def test_plain_keys_still_load(tmp_path: Path) -> None:
    import numpy as np

    values = {
        "names": {0: "a", 2**61 - 2: "b", -5: "c"},
        "f": {0.5: 1, float("nan"): 2},
        "s": {"x", b"y", None, True},
        "fs": frozenset({1, 2}),
        "np": {np.int64(3): 1, np.float32(0.25): 2, np.bool_(True): 3},
    }
    params, records = _one_weight()
    data = checkpoint(ultralytics_model(_parameters=params), train_args=pickle.dumps(values, protocol=2)[2:-1])
    path = write_torch_zip(tmp_path / "keys_ok.pt", data, records)
    from detrain.weights.ultralytics import read_torch_zip

    got = read_torch_zip(path)["train_args"]
    assert got["names"] == values["names"] and got["s"] == values["s"] and got["fs"] == values["fs"]
    assert got["f"][0.5] == 1 and len(got["f"]) == 2 and got["np"] == values["np"]


# --------------------------------------------------------------------------------------------------
# Recursion
# --------------------------------------------------------------------------------------------------


def test_deep_nesting_is_refused_without_a_crash(tmp_path: Path) -> None:
    # a million nested tuples used as a dict key: hashing it recursed in C until the stack overflowed
    deep_key = dict_({}) + pickle.EMPTY_TUPLE + pickle.TUPLE1 * 1_000_000 + int_(1) + pickle.SETITEM
    deep_list = pickle.EMPTY_LIST * 100_000 + pickle.APPEND * 99_999  # each APPEND nests one list in the next
    records = (global_("ultralytics.m", "M") + pickle.EMPTY_TUPLE + pickle.NEWOBJ) * 5_000
    deep_records = records + pickle.BUILD * 4_999  # each record becomes the state of the one below it
    files = [
        _model_file(tmp_path, f"deep{i}.pt", train_args=payload)
        for i, payload in enumerate([deep_key, deep_list, deep_records])
    ]
    lines = _load_in_child(*files)
    assert len(lines) == 3
    for line in lines:
        assert line.startswith("REFUSED") and f"nests deeper than {limits.MAX_NESTING} levels" in line, line


def test_a_cycle_is_not_mistaken_for_depth(tmp_path: Path) -> None:
    cyclic = pickle.EMPTY_LIST + pickle.BINPUT + b"\x05" + pickle.BINGET + b"\x05" + pickle.APPEND
    path = _model_file(tmp_path, "cycle.pt", train_args=cyclic)
    assert load_checkpoint(path)["model"]["nc"] == 1


# --------------------------------------------------------------------------------------------------
# Ultralytics metadata of the wrong type
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"names": np_array(np_dtype("i8", np_dtype_state()), (2,), bytes(16))}, "class names are a ndarray"),
        ({"names": dict_({"0": list_(list_())})}, "class names hold a str -> list entry"),
        ({"names": list_(str_("a"), str_("b")), "yaml": dict_({"nc": int_(3)})}, "names 2 classes but .* nc=3"),
        ({"stride": storage_tensor("0", 4, (2, 2))}, "model stride is a Tensor"),
        ({"stride": str_("abc")}, "model stride is a str"),
        ({"_modules": list_()}, "_modules of '<root>' is a list"),
        ({"_buffers": dict_({}) + int_(3) + str_("x") + pickle.SETITEM}, "_buffers of '<root>' has an entry named"),
        ({"_non_persistent_buffers_set": list_(str_("a"))}, "_non_persistent_buffers_set of '<root>' is a list"),
    ],
    ids=[
        "names-array",
        "names-nested",
        "nc-mismatch",
        "stride-2d",
        "stride-text",
        "modules-list",
        "buffer-int-name",
        "non-persistent-list",
    ],
)
def test_metadata_of_the_wrong_type_is_refused(tmp_path: Path, state: dict, reason: str) -> None:
    path = _model_file(tmp_path, "meta.pt", model_state=state)
    _refused(path, reason)


def test_shared_module_records_cannot_explode_the_walk(tmp_path: Path) -> None:
    """Each level's record lists the next one twice: 2**50 paths in 50 levels, walked once per path by torch."""
    body = inert("torch.nn.modules.container", "Sequential", {}) + pickle.BINPUT + b"\x00" + pickle.POP
    for i in range(1, 51):  # record i: _modules = {"a": record i-1, "b": record i-1}
        below = pickle.BINGET + bytes([i - 1])
        body += (
            global_("torch.nn.modules.container", "Sequential")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + dict_({"_modules": dict_({"a": below, "b": below})})
            + pickle.BUILD
            + pickle.BINPUT
            + bytes([i])
            + (pickle.POP if i < 50 else b"")
        )
    params, records = _one_weight()
    model = ultralytics_model(_parameters=params, _modules=dict_({"0": body}))
    path = write_torch_zip(tmp_path / "shared.pt", checkpoint(model), records)
    _refused(path, r"module tree has more than 100000 module places")


def test_one_record_listed_under_many_names_cannot_explode_the_walk(tmp_path: Path) -> None:
    """A record with 2,000 weights appears as 1,000 children: 2 million entries to read from a 60 KB file."""
    params, records = _one_weight()
    tensor = storage_tensor("0", 4, (4,)) + _put(0) + pickle.POP
    wide = inert("torch.nn.modules.conv", "Conv2d", {"_parameters": dict_({f"w{i}": _get(0) for i in range(2_000)})})
    children = dict_({str(i): _get(1) for i in range(1_000)})
    model = ultralytics_model(_parameters=params, _modules=children)
    path = write_torch_zip(
        tmp_path / "wide.pt",
        proto() + tensor + wide + _put(1) + pickle.POP + dict_({"model": model}) + pickle.STOP,
        records,
    )
    assert path.stat().st_size < 100 * 1024
    _refused(path, r"module tree has more than 1000000 named entries \(shared records\?\)$")


def test_ultralytics_info_keeps_good_metadata() -> None:
    def record(name: str, state: dict) -> object:
        cls = inert_class("ultralytics.nn.modules", name)
        obj = cls.__new__(cls)
        obj.__setstate__(state)
        return obj

    # model.0.conv.weight has 16 output channels: the stem width of scale n
    conv = record("Conv2d", {"_parameters": {"weight": torch.zeros(16, 3, 3, 3)}})
    inner = record("Sequential", {"_modules": {"0": record("Conv", {"_modules": {"conv": conv}})}})
    model_cls = inert_class("ultralytics.nn.tasks", "DetectionModel")
    model = model_cls.__new__(model_cls)
    model.__setstate__(
        {
            "_parameters": {},
            "_modules": {"model": inner},
            "names": {"0": "a", 1: "b"},
            "stride": [8, 16.0],
            "yaml": {"nc": 2},
        }
    )
    info = ultralytics_info({"model": model, "train_args": {"imgsz": [480, 640]}}, Path("x.pt"))
    assert info["names"] == {0: "a", 1: "b"} and info["stride"] == [8.0, 16.0] and info["imgsz"] == 640
    assert info["scale"] == "n" and info["nc"] == 2


# --------------------------------------------------------------------------------------------------
# What must keep loading
# --------------------------------------------------------------------------------------------------


def test_a_full_detrain_checkpoint_still_loads_exactly_as_torch_gives_it(tmp_path: Path) -> None:
    """Optimizer, scheduler, RNG and metadata state pass the vetting read; the values are torch.load's own."""
    from detrain.engine.train.reproduce import rng_state
    from detrain.nn.model import DetectionModel

    model = DetectionModel(scale="n", nc=2, names={0: "a", 1: "b"})
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    state = {
        "model": {
            "yaml": None,
            "scale": "n",
            "nc": 2,
            "names": {0: "a", 1: "b"},
            "imgsz": 64,
            "state_dict": model.state_dict(),
        },
        "ema": {"state_dict": model.state_dict(), "updates": 3},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng_state(),
        "train_args": {"imgsz": 64, "name": "x"},
        "epoch": 0,
        "pending_grads": {"w": torch.ones(2)},
    }
    path = save_checkpoint(state, tmp_path / "last.pt")
    got = load_checkpoint(path)
    want = torch.load(path, map_location="cpu", weights_only=True)
    assert got.keys() == want.keys()
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert all(
        torch.equal(a, b) for a, b in zip(got["model"]["state_dict"].values(), want["model"]["state_dict"].values())
    )
    assert torch.equal(got["rng"]["torch"], want["rng"]["torch"]) and got["rng"]["python"] == want["rng"]["python"]
    assert got["scheduler"] == want["scheduler"] and got["train_args"] == want["train_args"]


@pytest.mark.parametrize(
    ("model", "ema", "reason"),
    [
        ({"state_dict": {"w": "text"}}, None, r"its 'model' has no state_dict of tensors$"),
        (
            {"state_dict": {"w": torch.zeros(2)}, "scale": "n", "nc": "80", "names": {}},
            None,
            r"its model description \(scale, nc, names, imgsz, yaml\) has the wrong types$",
        ),
        (
            {"state_dict": {"w": torch.zeros(2)}, "scale": "n", "nc": 1, "names": {0: "a"}},
            {"updates": 3},
            r"its 'ema' has no state_dict of tensors$",
        ),
    ],
    ids=["weights-text", "nc-text", "ema-without-weights"],
)
def test_a_detrain_file_with_the_wrong_entries_is_refused(
    tmp_path: Path, model: dict, ema: dict | None, reason: str
) -> None:
    """Users index ckpt["model"]["state_dict"] and friends at once: a file that only claims the format stops here."""
    path = save_checkpoint({"model": model, "ema": ema}, tmp_path / "claims.pt")
    _refused(path, r"says it is a detrain checkpoint but " + reason)


@pytest.mark.skipif(not YOLOV8N.is_file(), reason="shared/weights/yolov8n.pt is not present")
def test_the_yolov8n_release_file_stays_within_every_limit() -> None:
    ckpt = load_checkpoint(YOLOV8N)
    assert ckpt["source"] == "yolov8" and ckpt["model"]["nc"] == 80
    assert len(ckpt["model"]["state_dict"]) == len(load_ultralytics_checkpoint(YOLOV8N)["state_dict"])


# --------------------------------------------------------------------------------------------------
# issue 25, item 1: one vetted copy; no record torch could read that the check did not
# --------------------------------------------------------------------------------------------------


def _detrain_file(path: Path, epoch: int) -> Path:
    """A small valid detrain checkpoint (YOLOv8n at one class) whose ``epoch`` tells copies apart."""
    from detrain.nn.model import DetectionModel
    from detrain.weights.checkpoint import model_meta

    model = DetectionModel("n.yaml", nc=1)
    state = {"model": {**model_meta(model, 64), "state_dict": model.state_dict()}, "ema": None, "epoch": epoch}
    return save_checkpoint(state, path)


def _with_records(src: Path, dst: Path, extra: dict[str, bytes]) -> Path:
    """``src``'s zip with the ``extra`` records written first."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for name, raw in extra.items():
            new.writestr(name, raw)
        for info in old.infolist():
            new.writestr(info, old.read(info))
    return dst


def test_a_second_pickle_differing_only_in_case_is_refused(tmp_path: Path) -> None:
    """torch's zip reader finds ``archive/data.pkl`` case-insensitively: a ``DATA.PKL`` beside the vetted one
    could be the pickle torch unpickles."""
    good = _detrain_file(tmp_path / "good.pt", epoch=0)
    other = _detrain_file(tmp_path / "other.pt", epoch=99)
    with zipfile.ZipFile(other) as zf:
        second = zf.read("archive/data.pkl")  # save_checkpoint writes through a file object: "archive/"
    forged = _with_records(good, tmp_path / "case.pt", {"archive/DATA.PKL": second})
    message = _refused_any(forged)
    assert "'archive/DATA.PKL'" in message and "differ only in case" in message


def test_a_record_the_check_never_read_is_refused(tmp_path: Path) -> None:
    good = _detrain_file(tmp_path / "good.pt", epoch=0)
    unnamed = _with_records(good, tmp_path / "extra.pt", {"archive/data/999": b"\x00" * 64})
    assert "'archive/data/999' is not named by its pickle" in _refused_any(unnamed)
    elsewhere = _with_records(good, tmp_path / "elsewhere.pt", {"other/x": b"x"})
    assert "'other/x' is not one torch writes in 'archive/'" in _refused_any(elsewhere)


def _refused_any(path: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_the_file_is_read_once_and_a_swap_after_the_check_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check and torch.load read the same bytes: a file replaced right after the check is not what loads."""
    from detrain.weights import ultralytics

    path = _detrain_file(tmp_path / "w.pt", epoch=0)
    swapped = _detrain_file(tmp_path / "swap.pt", epoch=99)
    real = ultralytics.read_torch_zip

    def check_then_swap(p: object, *args: object) -> object:
        out = real(p, *args)  # type: ignore[arg-type]
        os.replace(swapped, path)  # an attacker's file takes the checked one's place
        return out

    monkeypatch.setattr(ultralytics, "read_torch_zip", check_then_swap)
    assert load_checkpoint(path)["epoch"] == 0
