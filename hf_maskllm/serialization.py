"""Safe, atomic file I/O shared by every save and load path.

- Writes go to a temporary file in the target folder, are flushed and fsynced, then renamed
  over the target (``os.replace`` is atomic on POSIX), so a crash never leaves a half file.
- Reads accept only JSON and safetensors; a pickle is recognised and refused, never unpickled.
- ``resolve_folder`` turns a local folder or a Hub repo id into a local folder, honouring
  ``HF_HUB_OFFLINE`` and failing fast with a clear message.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import MaskLLMError

__all__ = [
    "atomic_write",
    "current_umask",
    "load_json",
    "load_safetensors",
    "resolve_folder",
    "save_json",
    "save_safetensors",
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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside ``path``; on success flush, fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


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


def load_safetensors(
    path: str | os.PathLike, error: type[MaskLLMError] = MaskLLMError, what: str = "safetensors file"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file into CPU tensors and its metadata; refuses pickles and corrupt files."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist; check the folder, or save it again.")
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(_PICKLE_MAGICS):
        raise error(
            f"{what} {path} is a pickle / torch.save file, which hf_maskllm never loads (it can run code). "
            "Convert it to safetensors with a tool you trust."
        )
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    except Exception as e:  # safetensors raises several types for corrupt headers / truncation
        raise error(
            f"{what} {path} is corrupt or truncated ({type(e).__name__}: {e}); save it again."
        ) from None
    return tensors, metadata


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) <= 2 and all(parts) and not name.startswith((".", "/", "~"))


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
    if not _looks_like_repo_id(name):
        raise error(f"{what} {name!r} is neither an existing folder nor a Hub repo id ('user/name').")
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
            f"{what} {name!r} is neither an existing folder nor a valid Hub repo id ('user/name')."
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
    except (HfHubHTTPError, OSError) as e:
        raise error(f"Could not download {name!r} from the Hub: {e}") from None
    local_path = Path(local)
    missing = [f for f in required if not (local_path / f).is_file()]
    if missing:
        raise error(f"Hub repo {name!r} lacks {missing}; it is not a {what} saved by hf_maskllm.")
    return local_path
