"""vLLM side of ``launch/bench/bench_generation.py``: run in its own interpreter (the vLLM venv).

Reads a JSON spec ``{"model_dir", "max_new", "dtype", "seed", "batches": {"<B>": [[token ids], ...]}}``,
creates one offline ``vllm.LLM`` on the HF-format model directory, and for each batch size times one
``llm.generate`` call on exactly those token-id prompts: greedy (temperature 0), ``ignore_eos=True`` and
``min_tokens = max_tokens = max_new`` so every sequence generates exactly ``max_new`` tokens, no
detokenisation, prefix caching off (the timed call re-does its prefill like the other engines).
Each timed call follows a warm-up call on the same prompts (fewer tokens). Writes
``{"vllm_version", "init_s", "thread_env", "rows": {"<B>": {"tokens", "seconds", "tok_per_s", "warmup_s",
"first_tokens"}}}`` to ``--out``.

  .venv-vllm/bin/python launch/bench/_bench_vllm_worker.py --spec spec.json --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

# The engine runs in this process (no engine-core subprocess), so one process is timed.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Threads: vLLM's default CPU set-up ("auto") reserves one of the 2 cores for its scheduler and pins
# one OpenMP thread to the other; on this shared 2-core machine that pinned thread made every decode
# step ~2 s (7 tok/s at batch 16, measured), vs ~100 tok/s unpinned. So, unless the caller's
# environment says otherwise: no pinning, all cores (as the JAX and torch engines get), passive wait.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
THREAD_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def _check_spec(spec: dict, path: str) -> None:
    missing = [k for k in ("model_dir", "max_new", "batches") if k not in spec]
    if missing:
        raise ValueError(f"{path}: spec is missing keys {missing}; needs model_dir, max_new, batches")
    for b, prompts in spec["batches"].items():
        if len(prompts) != int(b):
            raise ValueError(f"{path}: batch {b} has {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError(f"{path}: batch {b} has an empty prompt")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes(model_dir: str, dtype: str, sequences: int, tokens: int, headroom: float = 1.5) -> int:
    """KV cache this workload needs: K and V for ``sequences × tokens`` positions of every layer (from the
    model's ``config.json``), with ``headroom`` for vLLM's block rounding; at least 64 MiB.

    vLLM's CPU default (``gpu_memory_utilization`` × the memory of one NUMA node) refuses to start on a machine
    whose free memory is below that fraction; sizing from the workload, as the trainer's ``kv_cache_gib`` does,
    needs no ``VLLM_CPU_KVCACHE_SPACE`` set by hand."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return max(int(per_token * DTYPE_BYTES[dtype] * sequences * tokens * headroom), 64 << 20)


def run(spec: dict) -> dict:
    """Time greedy generation of exactly ``max_new`` tokens per prompt for each batch in ``spec``."""
    import vllm
    from vllm import LLM, SamplingParams

    max_new = int(spec["max_new"])
    longest = max(len(p) for prompts in spec["batches"].values() for p in prompts)
    largest = max(int(b) for b in spec["batches"])
    dtype = spec.get("dtype", "float32")
    kv_bytes = kv_cache_bytes(spec["model_dir"], dtype, max(largest, 1), longest + max_new + 8)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=dtype, seed=int(spec.get("seed", 0)),
              max_model_len=longest + max_new + 8, max_num_seqs=max(largest, 1),
              kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False)
    init_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    rows = {}
    for b, prompts in spec["batches"].items():
        inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        t = time.perf_counter()
        llm.generate(inputs, params(min(max_new, 8)), use_tqdm=False)
        warmup_s = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate(inputs, params(max_new), use_tqdm=False)
        seconds = time.perf_counter() - t
        counts = [len(o.outputs[0].token_ids) for o in outs]
        if any(c != max_new for c in counts):
            raise RuntimeError(f"vLLM generated {sorted(set(counts))} tokens per sequence, expected {max_new}")
        tokens = sum(counts)
        rows[b] = {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "warmup_s": warmup_s,
                   "first_tokens": [list(o.outputs[0].token_ids[:16]) for o in outs[:2]]}
    return {"vllm_version": vllm.__version__, "init_s": init_s, "dtype": dtype, "kv_cache_bytes": kv_bytes,
            "thread_env": {k: os.environ.get(k) for k in THREAD_ENV}, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="JSON spec written by bench_generation.py")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    _check_spec(spec, args.spec)
    result = run(spec)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
