"""Safe, atomic file I/O shared by every save and load path.

- Writes go to a temporary file in the target folder, are flushed and fsynced, then renamed
  over the target (``os.replace`` is atomic on POSIX), so a crash never leaves a half file.
- Multi-file saves (:func:`atomic_folder`) build the whole folder beside the target and swap it
  into place in one step, so a crash leaves either the previous save or the new one, never a mix.
- Temporaries carry this host's name and the writer's pid; the next save removes those whose
  process is gone (killed), so crashes do not leak disk space.
- Reads accept only JSON and safetensors; a pickle is recognised and refused, never unpickled.
- :func:`tensor_checksums` / :func:`verify_safetensors` give safetensors files per-tensor CRC-32s
  (over dtype, shape and bytes), so flipped bits, edited headers and swapped tensors are caught.
- ``resolve_folder`` turns a local folder or a Hub repo id into a local folder, honouring
  ``HF_HUB_OFFLINE`` and failing fast with a clear message.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import shutil
import socket
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .errors import MaskLLMError
from .hub import is_hub_repo_id

__all__ = [
    "atomic_folder",
    "atomic_write",
    "clean_stale_temporaries",
    "current_umask",
    "load_json",
    "load_safetensors",
    "refuse_pickle",
    "resolve_folder",
    "save_json",
    "save_safetensors",
    "stored_checksums",
    "tensor_checksums",
    "verify_safetensors",
]

_PICKLE_MAGICS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


def current_umask() -> int:
    """The process umask: from /proc (no race), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_TMP_TAG = ".tmp-"


def _tmp_prefix(name: str) -> str:
    """Prefix of temporaries for ``name``: ``.<name>.tmp-<host>-<pid>-``."""
    return f".{name}{_TMP_TAG}{socket.gethostname()}-{os.getpid()}-"


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and _TMP_TAG in name and name.endswith(".tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def clean_stale_temporaries(folder: str | os.PathLike, name: str) -> None:
    """Remove temporaries of ``name`` in ``folder`` left by writers on this host that no longer run.

    A save killed with SIGKILL (or by the OOM killer) cannot clean up; its temporary file or
    folder carries its pid, so the next save of the same target removes it.
    """
    prefix = f".{name}{_TMP_TAG}{socket.gethostname()}-"
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # make renames in ``path`` durable
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside ``path``; on success flush, fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(path.parent, path.name)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600 files; saved files follow the umask
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@cache
def _renameat2() -> Any:
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (or not Linux)
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return func


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``RENAME_EXCHANGE``); False if unsupported."""
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the file system cannot exchange
    raise OSError(err, os.strerror(err), str(b))


def _replace_files(tmp: Path, target: Path, last: str | None, stale: list[Path]) -> None:
    """Fallback publish: replace files one by one, ``last`` deleted first and put back last.

    Between the two steps the folder has no ``last`` file and fails to load loudly, so old and new
    files never pair silently after a crash.
    """
    if last is not None and (target / last).exists():
        os.unlink(target / last)
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == last):
        os.replace(path, target / path.name)  # tmp is beside target: same file system, atomic
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    _fsync_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)


def _publish_folder(tmp: Path, target: Path, drop: Callable[[str], bool], last: str | None) -> None:
    for path in tmp.iterdir():  # durable, and readable as the umask says, before they become visible
        os.chmod(path, 0o666 & ~current_umask())
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if not target.exists() and not target.is_symlink():
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        return
    if not target.is_dir():
        raise MaskLLMError(f"{target} exists and is not a folder; pick another save directory.")
    new = {p.name for p in tmp.iterdir()}
    old = [p for p in target.iterdir() if p.name not in new]
    stale = [p for p in old if drop(p.name) or _is_temporary(p.name)]
    keep = [p for p in old if p not in stale]
    if all(p.is_file() or p.is_symlink() for p in keep):
        # Carry the folder's other files over (hard links: no copy), then swap old and new in one step.
        for path in keep:
            try:
                os.link(path, tmp / path.name, follow_symlinks=False)
            except OSError:
                shutil.copy2(path, tmp / path.name, follow_symlinks=False)
        if _exchange(tmp, target):
            _fsync_dir(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now the previous folder
            return
        for path in keep:
            os.unlink(tmp / path.name)
    _replace_files(tmp, target, last, stale)  # sub-folders of the user's, or no atomic exchange


@contextlib.contextmanager
def atomic_folder(
    target: str | os.PathLike,
    drop: Callable[[str], bool] = lambda name: False,
    last: str | None = None,
) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target``; on success make it ``target`` in one step.

    The files are fsynced, then the folder is swapped with an existing ``target`` atomically (Linux
    ``renameat2(RENAME_EXCHANGE)``), so ``target`` is at every instant the complete previous save or
    the complete new one. Files of the old folder that the new one lacks are carried over, except
    those ``drop`` names (stale files of an earlier save). Where no atomic swap is possible (another
    OS, or ``target`` holds sub-folders) files are replaced one by one, ``last`` (the file a loader
    needs first, e.g. the config) removed first and written last, so a crash leaves a folder that
    fails to load loudly rather than a silent mix.
    """
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(target.parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target.name), suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 folders; follow the umask
    try:
        yield tmp
        _publish_folder(tmp, target, drop, last)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_json(obj: Any, path: str | os.PathLike) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def load_json(
    path: str | os.PathLike, error: type[MaskLLMError] = MaskLLMError, what: str = "JSON file"
) -> Any:
    """Read a JSON file, turning every failure into ``error`` with a message naming the file."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist; check the folder, or save it again.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{what} {path} is not valid JSON ({e}); the file is corrupt, save it again.") from None


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Atomically write ``tensors`` (made contiguous, on CPU) as a safetensors file."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    with atomic_write(path, "wb") as f:
        f.write(data)


def refuse_pickle(
    path: str | os.PathLike, error: type[MaskLLMError] = MaskLLMError, what: str = "safetensors file"
) -> None:
    """Raise ``error`` if ``path`` is missing or is a pickle / ``torch.save`` file (checked by its magic bytes)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist; check the folder, or save it again.")
    with open(path, "rb") as f:
        head = f.read(9)
    # A safetensors file starts with its header's length (8 bytes, little-endian) and the header's "{";
    # that length may begin with the same bytes as a pickle (0x80 0x02 for a 640-byte header).
    is_safetensors = head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size
    if not is_safetensors and head.startswith(_PICKLE_MAGICS):
        raise error(
            f"{what} {path} is a pickle / torch.save file, which hf_maskllm never loads (it can run code). "
            "Convert it to safetensors with a tool you trust."
        )


def load_safetensors(
    path: str | os.PathLike, error: type[MaskLLMError] = MaskLLMError, what: str = "safetensors file"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file into CPU tensors and its metadata; refuses pickles and corrupt files."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    refuse_pickle(path, error, what)
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    except SafetensorError as e:  # its parse errors: a bad header, a length that does not match the file
        raise error(f"{what} {path} is corrupt or truncated ({e}); save it again.") from e
    return tensors, metadata


# ---------------------------------------------------------------------------------------------- checksums
_DTYPE_NAMES = {  # torch dtype -> the name safetensors writes in its header
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _st


def _crc(dtype: str, shape: list[int], data: Any) -> int:
    """CRC-32 of a tensor's safetensors dtype name, shape and raw bytes."""
    return zlib.crc32(data, zlib.crc32(f"{dtype}{list(shape)}".encode()))


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Per-tensor CRC-32 over dtype, shape and bytes, as :func:`verify_safetensors` recomputes it from a file."""
    out = {}
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise MaskLLMError(f"Tensor {name} has dtype {t.dtype}, which hf_maskllm cannot checksum.")
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = _crc(_DTYPE_NAMES[t.dtype], list(t.shape), data)
    return out


def stored_checksums(
    metadata: dict[str, str],
    checksum_key: str,
    path: str | os.PathLike,
    error: type[MaskLLMError] = MaskLLMError,
    what: str = "safetensors file",
) -> dict[str, Any]:
    """The ``{tensor name: CRC-32}`` JSON a writer stored in safetensors metadata under ``checksum_key``;
    ``error`` if it is missing or not a JSON object."""
    try:
        expected = json.loads(metadata[checksum_key])
        if not isinstance(expected, dict):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise error(
            f"{what} {path} has no valid `{checksum_key}` checksums in its metadata: it is corrupt or was not "
            "written by hf_maskllm. Save it again with hf_maskllm."
        ) from None
    return expected


# What reading a safetensors header by hand raises when the header is malformed: a short length field,
# text that is not JSON, an entry without `data_offsets`, `dtype` or `shape`, or of the wrong kind.
_CORRUPT_HEADER = (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError)


def verify_safetensors(
    path: str | os.PathLike,
    checksum_key: str,
    error: type[MaskLLMError] = MaskLLMError,
    what: str = "safetensors file",
) -> tuple[dict[str, tuple[str, list[int], int]], dict[str, str]]:
    """Check a safetensors file against the per-tensor CRC-32s stored in its metadata under ``checksum_key``.

    Refuses pickles, unreadable headers, truncation, and any tensor whose name, dtype, shape or bytes
    differ from what was saved. Reads the file once (memory-mapped, no tensor is built). Returns
    ``{name: (dtype, shape, crc32)}`` and the metadata.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    refuse_pickle(path, error, what)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:  # validates the header and the size
            metadata = dict(f.metadata() or {})
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            (header_len,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + header_len])
            header.pop("__metadata__", None)
            start = 8 + header_len
            entries, actual = {}, {}
            view = memoryview(mm)
            try:
                for name, info in header.items():
                    begin, end = info["data_offsets"]
                    actual[name] = _crc(info["dtype"], info["shape"], view[start + begin : start + end])
                    entries[name] = (str(info["dtype"]), [int(d) for d in info["shape"]], actual[name])
            finally:
                view.release()
    except _CORRUPT_HEADER + (SafetensorError,) as e:
        raise error(
            f"{what} {path} is corrupt or truncated ({type(e).__name__}: {e}); save or download it again."
        ) from e
    expected = stored_checksums(metadata, checksum_key, path, error, what)
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        raise error(
            f"{what} {path} does not hold the tensors it was saved with: missing {missing[:3]}, unexpected "
            f"{extra[:3]}; the file is corrupt or was edited. Save or download it again."
        )
    bad = sorted(name for name in actual if expected[name] != actual[name])
    if bad:
        raise error(
            f"{what} {path}: tensor(s) {bad[:3]}{' ...' if len(bad) > 3 else ''} fail their checksum (bytes, dtype "
            "or shape changed); the file is corrupt. Save or download it again."
        )
    return entries, metadata


def resolve_folder(
    name_or_path: str | os.PathLike,
    required: list[str],
    optional: list[str] | None = None,
    error: type[MaskLLMError] = MaskLLMError,
    what: str = "folder",
    revision: str | None = None,
) -> Path:
    """Return a local folder holding ``required`` files: ``name_or_path`` itself, or a Hub snapshot.

    A Hub download fetches only the named files. Offline (``HF_HUB_OFFLINE=1``) a repo id that is
    not in the local cache fails at once.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        missing = [f for f in required if not (path / f).is_file()]
        if missing:
            raise error(
                f"{what} {path} lacks {missing}; is it the right folder? Save it again with save_pretrained."
            )
        return path
    name = str(name_or_path)
    if not is_hub_repo_id(name):
        raise error(
            f"{what} {name!r} is neither an existing folder nor a Hub repo id ('user/name'); check the path."
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        local = snapshot_download(
            name, revision=revision, allow_patterns=list(required) + list(optional or [])
        )
    except HFValidationError:
        raise error(
            f"{what} {name!r} is neither an existing folder nor a valid Hub repo id ('user/name'); check the path "
            "or id."
        ) from None
    except RepositoryNotFoundError:
        raise error(
            f"{what} {name!r} is not a local folder, and no Hub repo of that id exists (or it is private); "
            "check the path or id, and your HF_TOKEN."
        ) from None
    except LocalEntryNotFoundError:
        raise error(
            f"{what} {name!r} is not a local folder and is not in the Hub cache, and the Hub cannot be reached "
            "(HF_HUB_OFFLINE is set or there is no network). Pass a local folder or go online."
        ) from None
    # Only the Hub's and the network's errors: a full disk or an unwritable cache raises as itself.
    except (HfHubHTTPError, ConnectionError, TimeoutError) as e:
        raise error(
            f"Could not download {name!r} from the Hub ({type(e).__name__}: {e}); check the network and the repo "
            "id, or pass a local folder."
        ) from e
    local_path = Path(local)
    missing = [f for f in required if not (local_path / f).is_file()]
    if missing:
        raise error(
            f"Hub repo {name!r} lacks {missing}; it is not a {what} saved by hf_maskllm, or an upload was "
            "interrupted. Check the repo id, or push the mask again (push_to_hub)."
        )
    return local_path
