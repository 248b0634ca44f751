"""The ``generate`` section: the native JAX engine vs transformers ``generate`` on the same bf16 weights.

A random transformers ``Qwen2ForCausalLM`` (Qwen2-0.5B-like in the full run) is saved as bf16 safetensors with a
minimal word-level ``tokenizer.json`` (the engines only see token ids), then loaded by
``jaxrl_hf.models.load_pretrained(dir, dtype="bfloat16")``. Both generate greedily from the same random prompt
ids, every row exactly ``new`` tokens (no EOS for the native engine; ``min_new_tokens = max_new_tokens`` for
transformers). Each engine is timed on its second call (the first compiles / warms up, reported). Two child
processes: transformers first (it builds and saves the model), then the native engine (JAX only: torch's CUDA
libraries never share its process). The greedy tokens are compared position by position (bf16 on both sides:
reported, never a failure).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from _gpu_common import GENERATE_SHAPES, full_shapes, log, read_json, set_at

MODEL_DIR, PROMPTS_FILE, HF_IDS_FILE = "qwen2_random", "prompts.json", "hf_ids.json"


def write_model_dir(out_dir: str, dims: dict[str, Any], device: str) -> Any:
    """A random bf16 Qwen2 (tied embeddings) saved to ``out_dir`` with a minimal tokenizer; returns the model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.Qwen2Config(**dims, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir)  # safetensors
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return model


def hf_generate(model: Any, prompts: Any, new: int, device: str) -> dict[str, Any]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=2)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=min(new, 8), min_new_tokens=min(new, 8), **kwargs)
        sync()
        warm = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync()
        seconds = time.perf_counter() - t
    got = out.shape[1] - ids.shape[1]
    if got != new:
        raise RuntimeError(f"transformers generated {got} tokens per row, expected {new}")
    tokens = int(got * ids.shape[0])
    return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "warmup_s": warm, "device": device,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "ids": out[:, ids.shape[1]:].cpu().tolist()}


def jax_generate(model_dir: str, prompts: list[list[int]], new: int) -> dict[str, Any]:
    import jax

    from bench_generation import timed_greedy_generation
    from jaxrl_hf.models import load_pretrained

    t = time.perf_counter()
    lm = load_pretrained(model_dir, dtype="bfloat16")
    load_s = time.perf_counter() - t
    result = timed_greedy_generation(lm.config, lm.params, 0, prompts, new)
    ids = result.pop("response_ids")
    return {**result, "load_s": load_s, "backend": jax.default_backend(), "dtype": lm.config.dtype,
            "num_params": lm.config.num_params(), "ids": [list(map(int, row[:new])) for row in ids]}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Fraction of equal greedy tokens, and where each row first differs (its length when it never does)."""
    equal = total = 0
    first_diff = []
    for ra, rb in zip(a, b):
        n = min(len(ra), len(rb))
        same = [ra[i] == rb[i] for i in range(n)]
        equal, total = equal + sum(same), total + n
        first_diff.append(next((i for i, s in enumerate(same) if not s), n))
    return {"equal_token_fraction": equal / max(total, 1), "first_divergence_mean": sum(first_diff) / len(first_diff),
            "rows_identical": sum(d == len(r) for d, r in zip(first_diff, a)), "rows": len(first_diff)}


def run_generate_hf(path: str, quick: bool, deadline: float, work: str) -> None:
    """Child 1 of 2: build and save the model (``work/model``), time transformers, keep its tokens (``work``)."""
    import numpy as np
    import torch

    keys = ("sections", "generate")
    shape = GENERATE_SHAPES["quick"] if quick else full_shapes()[1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, Any] = {"status": "running", "batch": shape["batch"], "prompt_len": shape["prompt"],
                           "new_tokens": shape["new"], "model": shape["model"], "dtype": "bfloat16"}
    set_at(path, keys, out)
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, shape["model"]["vocab_size"], (shape["batch"], shape["prompt"])).tolist()
    with open(os.path.join(work, PROMPTS_FILE), "w") as f:
        json.dump(prompts, f)
    model_dir = os.path.join(work, MODEL_DIR)
    t = time.perf_counter()
    model = write_model_dir(model_dir, shape["model"], device)
    out["build_and_save_s"] = time.perf_counter() - t
    set_at(path, keys, out)
    log(f"generate: random Qwen2 saved in {out['build_and_save_s']:.1f}s ({device})")
    hf = hf_generate(model, prompts, shape["new"], device)
    with open(os.path.join(work, HF_IDS_FILE), "w") as f:
        json.dump(hf.pop("ids"), f)
    out["transformers"] = {"status": "ok", **hf}
    set_at(path, keys, out)
    log(f"generate: transformers {hf['tok_per_s']:.0f} tok/s ({hf['seconds']:.2f}s)")


def run_generate_native(path: str, quick: bool, deadline: float, work: str) -> None:
    """Child 2 of 2 (JAX only, so no CUDA library of torch's is loaded beside JAX's): the native engine on the
    saved model and prompts, its speed against transformers', and the greedy agreement."""
    keys = ("sections", "generate")
    shape = GENERATE_SHAPES["quick"] if quick else full_shapes()[1]
    with open(os.path.join(work, PROMPTS_FILE)) as f:
        prompts = json.load(f)
    native = jax_generate(os.path.join(work, MODEL_DIR), prompts, shape["new"])
    native_ids = native.pop("ids")
    out: dict[str, Any] = {"native": native}
    hf = read_json(path).get("sections", {}).get("generate", {}).get("transformers")
    if isinstance(hf, dict) and hf.get("tok_per_s") and os.path.exists(os.path.join(work, HF_IDS_FILE)):
        with open(os.path.join(work, HF_IDS_FILE)) as f:
            out["greedy_agreement"] = agreement(native_ids, json.load(f))
        out["native_over_transformers"] = native["tok_per_s"] / hf["tok_per_s"]
        out["status"] = "ok"
        log(f"generate: native {native['tok_per_s']:.0f} tok/s (compile {native['compile_s']:.1f}s), "
            f"{out['native_over_transformers']:.2f}x transformers, "
            f"{out['greedy_agreement']['equal_token_fraction']:.2f} tokens equal")
    else:
        out["status"] = "error"
        out["error"] = "the transformers part did not finish (see its child output); native measured alone"
        log(f"generate: native {native['tok_per_s']:.0f} tok/s (compile {native['compile_s']:.1f}s), no transformers")
    set_at(path, keys, out)
