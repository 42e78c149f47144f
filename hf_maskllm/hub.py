"""When a string names a Hugging Face Hub repo: the one rule every loader, saver and model card applies."""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_hub_repo_id"]


def is_hub_repo_id(name: str) -> bool:
    """True if ``name`` is an ``owner/name`` Hub repo id and not an existing local path.

    The id must pass ``huggingface_hub``'s own check (letters, digits, ``-``, ``_``, ``.``; no ``--``
    or ``..``; at most 96 characters a part) and have an owner: every repo that hf_maskllm writes has
    one, and a bare word is more likely a mistyped folder or method name than a legacy model id. A
    local path always wins, as in ``from_pretrained``.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not Path(name).expanduser().exists()
