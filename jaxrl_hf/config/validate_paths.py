"""The config checks that look at the file system: data files, model and reward-model directories, user files.

Kept apart from `jaxrl_hf.config.validate` so that ``launch/train.py --dry-run`` can check a config written for
another machine: `path_problems` lists what is missing here (the dry run prints it), `check_paths` raises on the
first (a run).
"""

from __future__ import annotations

import os

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.schema import RunConfig

BUILTIN_DATASETS = ("arithmetic", "calculator", "gsm8k")


def path_problems(config: RunConfig) -> list[tuple[str, object, str]]:
    """``(dotted key, value, what is missing)`` for every path of ``config`` that does not exist here."""
    d, out = config.data, []
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files),
                       ("data.ptx_files", d.ptx_files)):
        out += [(key, name, f"not a built-in dataset {list(BUILTIN_DATASETS)} and no such file")
                for name in files if name not in BUILTIN_DATASETS and not os.path.isfile(name)]
    if ("gsm8k" in d.train_files + d.val_files + d.ptx_files) and not os.path.isdir(d.gsm8k_dir):
        out.append(("data.gsm8k_dir", d.gsm8k_dir, "no such directory (needed for the 'gsm8k' dataset)"))
    prm = config.reward_model.prm.path
    if config.reward_model.reward_manager == "prm" and prm and not os.path.isdir(prm):
        out.append(("reward_model.prm.path", prm, "no such PRM directory (launch/train_prm.py --out)"))
    crf = config.custom_reward_function.path
    if crf is not None and not os.path.isfile(crf):
        out.append(("custom_reward_function.path", crf, "no such file"))
    tools = config.rollout.multi_turn.tool_config_path
    if tools is not None and not os.path.isfile(tools):
        out.append(("rollout.multi_turn.tool_config_path", tools, "no such file"))
    from jaxrl_hf.models.hub_cache import ModelNotCachedError, is_hub_id, resolve_hub_id

    for key, model_cfg in (("model", config.model), ("critic.model", config.critic.model)):
        if model_cfg is None or model_cfg.path == "tiny-random" or model_cfg.path.lower() == "smollm2-135m-instruct":
            continue
        path = model_cfg.path
        if is_hub_id(path):
            try:
                path = resolve_hub_id(path)
            except ModelNotCachedError as err:
                out.append((f"{key}.path", model_cfg.path, str(err)))
                continue
        if not os.path.exists(path):
            out.append((f"{key}.path", path, "not 'smollm2-135m-instruct', 'tiny-random', an HF directory, a .gguf "
                                             "file or a hub id org/name cached locally"))
        elif os.path.isdir(path):
            problem = model_dir_problem(path, needs_tokenizer=key == "model")
            if problem is None and key == "model" and config.rollout.name == "vllm":
                problem = vllm_model_problem(path)
            if problem:
                out.append((f"{key}.path", model_cfg.path, problem))
    return out


def model_heads(model) -> tuple[int, int, str] | None:
    """(attention heads, key/value heads, where they were read) of ``model`` (a ``ModelConfig``) without loading
    any weight: ``model.tiny`` for ``tiny-random``; else the ``config.json`` of the model directory (a known name's
    converted copy, an HF directory, a cached hub id); None where there is none to read here."""
    import json

    if model.path == "tiny-random":
        return model.tiny.num_heads, model.tiny.num_kv_heads, "model.tiny"
    from jaxrl_hf.models.hub_cache import ModelNotCachedError, is_hub_id, resolve_hub_id
    from jaxrl_hf.models.pretrained import KNOWN_MODELS, cache_root

    path = model.path
    if path.lower() in KNOWN_MODELS:
        path = os.path.join(cache_root(), KNOWN_MODELS[path.lower()].cache_name)
    elif is_hub_id(path):
        try:
            path = resolve_hub_id(path)
        except ModelNotCachedError:
            return None
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as fh:
            hf = json.load(fh)
        heads = int(hf["num_attention_heads"])
        return heads, int(hf.get("num_key_value_heads") or heads), file
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no readable config.json: the model checks report it


def vllm_model_problem(path: str) -> str | None:
    """Why ``rollout.name=vllm`` cannot serve the HF model at ``path`` (`jaxrl_hf.models.vllm_support`), or None."""
    from jaxrl_hf.models.config import DecoderConfig
    from jaxrl_hf.models.vllm_support import vllm_support_problem

    try:
        problem = vllm_support_problem(DecoderConfig.from_pretrained_dir(path))
    except ValueError as err:
        return f"{os.path.join(path, 'config.json')}: {err}"
    return None if problem is None else f"config key 'rollout.name'='vllm' cannot serve this model: {problem}"


def model_dir_problem(path: str, *, needs_tokenizer: bool) -> str | None:
    """What an HF model directory lacks: ``config.json`` naming a supported ``model_type`` (and ``tokenizer.json``
    for the policy, whose tokenizer the run uses); None when it has them."""
    import json

    from jaxrl_hf.models.config import SUPPORTED_MODEL_TYPES, UNSUPPORTED_MODEL_TYPES

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return "an HF model directory needs a config.json (and model.safetensors, tokenizer.json); it has none"
    try:
        with open(config_file, encoding="utf-8") as fh:
            model_type = json.load(fh).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        return f"{config_file} is not a JSON object ({err})"
    if model_type in UNSUPPORTED_MODEL_TYPES:
        return f"{config_file}: model_type {model_type!r} is not supported: {UNSUPPORTED_MODEL_TYPES[model_type]}"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"{config_file}: model_type {model_type!r} is not a supported architecture; supported: "
                f"{list(SUPPORTED_MODEL_TYPES)}")
    if needs_tokenizer and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "no tokenizer.json in the model directory (save the tokenizer with the model: tokenizer.save_pretrained(dir))"
    return None


def check_paths(config: RunConfig) -> None:
    """Raise ``ConfigError`` naming the first missing path (`path_problems`)."""
    for key, value, rule in path_problems(config)[:1]:
        raise ConfigError(f"config key '{key}'={value!r}: {rule}")
