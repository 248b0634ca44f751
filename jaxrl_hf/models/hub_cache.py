"""Hugging Face hub ids (``Qwen/Qwen2.5-0.5B-Instruct``) resolved offline from the local hub cache.

Nothing is downloaded here: a run reads the snapshot ``huggingface-cli download ID`` left in the cache
(``<cache>/models--org--name/snapshots/<commit>/``, the commit named by ``refs/main``). The cache directory is
read from the environment at call time, as ``huggingface_hub`` does: ``HF_HUB_CACHE``, else the legacy
``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""``org/name`` as the hub spells repository ids (one slash, no leading dot or slash)."""


class ModelNotCachedError(FileNotFoundError):
    """A hub id whose snapshot is not in the local cache (the message says where it looked and how to fetch it)."""


def is_hub_id(name: str) -> bool:
    """True for an ``org/name`` that is not an existing local path."""
    return bool(HUB_ID.match(name)) and not os.path.exists(name) and not name.endswith((".gguf", ".json"))


def hub_cache_dir() -> str:
    """The hub cache directory the environment selects (module docstring)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def resolve_hub_id(repo_id: str, cache_dir: str | None = None, revision: str | None = None) -> str:
    """The local snapshot directory of ``repo_id`` (``config.json`` checked), offline; raises
    `ModelNotCachedError` naming the id, the cache searched and the download command when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir or hub_cache_dir()
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    hint = (f"download it first with `huggingface-cli download {repo_id}` (or `hf download {repo_id}`), or set "
            "HF_HUB_CACHE / HF_HOME to the cache holding it, or pass a local HF directory")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelNotCachedError(
            f"model {repo_id!r} is not in the local Hugging Face cache (searched {repo_dir}); hub ids are "
            f"resolved offline: {hint}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotCachedError(f"model {repo_id!r}: the cached snapshot {path} has no config.json (an incomplete "
                                  f"or partial download); {hint}")
    return path
