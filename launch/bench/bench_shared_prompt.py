"""The actor's policy forward + backward with each prompt computed once for its samples
(``actor.share_prompt_forward``, `jaxrl_hf.workers.shared_prompt`: one row per group, ``[prompt | n responses]``,
and the same without its padding, ``model.use_remove_padding``: `jaxrl_hf.workers.group_packing`) against the
padded forward and against the earlier two-pass form (a prompt pass, then a response pass over its KV cache: every
weight read twice and the two passes' weight gradients summed), on the same rows.

    python launch/bench/bench_shared_prompt.py [--shapes 1x4x64x32,4x4x64x32,2x8x64x128] [--dtypes float32,bfloat16]
                                             [--repeats 3] [--prompt-real 48-58] [--response-real 4-28] [--json OUT]

A shape ``GxNxPxR`` is ``G`` prompts x ``N`` samples, prompts left-padded to ``P`` columns, responses right-padded to
``R`` (lengths drawn per group / per sample, as a rollout lays them out). The model has SmolLM2-135M's dimensions
(random weights, layers unrolled as ``configs/grpo.yaml`` and ``configs/dapo.yaml`` train them, the actor's
training config: `backends.cpu.pair_matmul.training_config`). Per shape and dtype: the jitted gradient of the token
log-likelihood (the loss the actor's update differentiates), best of ``--repeats`` calls after a compile call, the
four forms in one process, alternating, two rounds; the ratios padded / group rows, two-pass / group rows and
group rows / packed group rows (> 1: the latter is faster), the decoder token positions each computes, and the
largest difference of the log-probs from the padded forward's (checked: exit 1 beyond 2e-4 in float32, 5e-2 in
bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                    tie_word_embeddings=True)
TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2}


def grouped_rows(groups: int, n: int, prompt: int, response: int, vocab: int, seed: int = 0,
                 prompt_real: tuple[int, int] | None = None, response_real: tuple[int, int] | None = None):
    """Rows as a rollout lays them out: each group's prompt (``prompt_real`` = (lo, hi) tokens, default P/2..P) in
    ``n`` adjacent rows, left-padded; each sample's response (``response_real``, default R/4..R tokens)
    right-padded; rollout position ids."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows, width = groups * n, prompt + response
    p_lo, p_hi = prompt_real or (prompt // 2, prompt)
    r_lo, r_hi = response_real or (max(response // 4, 1), response)
    ids, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
    for g in range(groups):
        plen = int(rng.integers(p_lo, p_hi + 1))
        tokens = rng.integers(3, vocab, plen)
        for s in range(n):
            r = g * n + s
            ids[r, prompt - plen:prompt], mask[r, prompt - plen:prompt] = tokens, 1
            rlen = int(rng.integers(r_lo, r_hi + 1))
            ids[r, prompt:prompt + rlen], mask[r, prompt:prompt + rlen] = rng.integers(3, vocab, rlen), 1
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    return ids, mask, positions, mask[:, prompt:].astype(np.float32)


def best_of(fn, params, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(params))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(params))
        best = min(best, time.perf_counter() - start)
    return best


def two_pass_log_probs(params, config, input_ids, attention_mask, position_ids, response_length: int, group: int):
    """The earlier shared-prompt form (the baseline): the decoder over each group's prompt, then over the responses
    with the prompt's keys/values as a KV cache of ``P`` slots; log-probs only."""
    import jax.numpy as jnp

    from jaxrl_hf.models.forward import lm_head_log_probs, make_module
    from jaxrl_hf.models.llama import CausalLM, init_kv_cache
    from jaxrl_hf.models.shared_prompt_attention import repeat_per_sample

    rows, width = input_ids.shape
    prompt_len = width - response_length
    module, variables = make_module(config), {"params": params}
    first = lambda x: x[::group, :prompt_len]  # noqa: E731
    hidden_p, kv = module.apply(variables, first(input_ids), first(position_ids), first(attention_mask),
                                init_kv_cache(config, rows // group, prompt_len), 0,
                                method=CausalLM.hidden_states_and_new_kv)
    cache = {name: jnp.swapaxes(jnp.stack([repeat_per_sample(layer, group) for layer in x]), 2, 3)
             for name, x in kv.items()}
    hidden_r, _ = module.apply(variables, input_ids[:, prompt_len:], position_ids[:, prompt_len:], attention_mask,
                               cache, prompt_len, method=CausalLM.hidden_states_and_new_kv)
    h = jnp.concatenate([repeat_per_sample(hidden_p[:, -1:], group), hidden_r[:, :-1]], axis=1)
    return lm_head_log_probs(params, config, h, input_ids[:, prompt_len:])


FORMS = ("padded", "two_pass", "group_rows", "packed_rows")


def run_shape(shape: str, dtype: str, repeats: int, prompt_real: tuple[int, int] | None = None,
              response_real: tuple[int, int] | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_hf.backends.cpu import pair_matmul
    from jaxrl_hf.models import DecoderConfig, init_params
    from jaxrl_hf.workers.losses import response_log_probs
    from jaxrl_hf.workers import group_packing
    from jaxrl_hf.workers.shared_prompt import packed_group_log_probs, shared_prompt_log_probs

    groups, n, prompt, response = (int(x) for x in shape.split("x"))
    config = DecoderConfig(**SMOLLM2_135M, dtype=dtype, scan_layers=False)
    params = init_params(config.replace(dtype="float32"), 0)
    config = pair_matmul.training_config(config, None)  # as the actor's update runs it
    ids, mask, positions, valid = grouped_rows(groups, n, prompt, response, config.vocab_size,
                                               prompt_real=prompt_real, response_real=response_real)
    args, weights = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions)), jnp.asarray(valid)
    length = group_packing.group_row_length(mask, response, n)
    micro = {k: jnp.asarray(v) for k, v in group_packing.pack_group_rows(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, prompt:]},
        response, n, length).items()}
    forwards = {"padded": lambda p: response_log_probs(p, config, *args, response),
                "two_pass": lambda p: two_pass_log_probs(p, config, *args, response, n),
                "group_rows": lambda p: shared_prompt_log_probs(p, config, *args, response, n),
                "packed_rows": lambda p: packed_group_log_probs(p, config, micro, n)}
    grads = {k: jax.jit(jax.grad(lambda p, f=f: jnp.sum(f(p)[0] * weights))) for k, f in forwards.items()}
    logps = {k: np.asarray(jax.jit(lambda p, f=f: f(p)[0])(params)) for k, f in forwards.items()}
    seconds: dict[str, list[float]] = {k: [] for k in FORMS}
    for _ in range(2):
        for name in FORMS:
            seconds[name].append(best_of(grads[name], params, repeats))
    best = {k: min(v) for k, v in seconds.items()}
    diff = max(float(np.abs((logps["padded"] - logps[k]) * valid).max()) for k in FORMS[1:])
    return {"shape": shape, "dtype": dtype, "rows": groups * n, "seconds": best, "all_s": seconds,
            "padded_over_group_rows": best["padded"] / best["group_rows"],
            "two_pass_over_group_rows": best["two_pass"] / best["group_rows"],
            "group_rows_over_packed": best["group_rows"] / best["packed_rows"],
            "positions_padded": groups * n * (prompt + response),
            "positions_shared": groups * prompt + groups * n * response, "positions_packed": groups * length,
            "real_tokens": int(mask[::n, :prompt].sum() + mask[:, prompt:].sum()), "max_logp_diff": diff,
            "within_tolerance": diff <= TOLERANCE[dtype]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x4x64x32,4x4x64x32,2x8x64x128")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-real", default=None, help="LO-HI real prompt tokens (default P/2-P)")
    parser.add_argument("--response-real", default=None, help="LO-HI real response tokens (default R/4-R)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    span = lambda text: tuple(int(x) for x in text.split("-")) if text else None  # noqa: E731
    rows = [run_shape(s, d, args.repeats, span(args.prompt_real), span(args.response_real))
            for d in args.dtypes.split(",") for s in args.shapes.split(",")]
    print(f"policy forward + backward, SmolLM2-135M dimensions (random weights), {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}; best of {args.repeats}, two alternating rounds")
    print("| G x n x P x R | dtype | positions padded / shared / packed (real) | padded s | two-pass s | group rows s "
          "| packed s | padded / group rows | two-pass / group rows | group rows / packed | max |Δ log p| |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["seconds"]
        print(f"| {r['shape']} | {r['dtype']} | {r['positions_padded']} / {r['positions_shared']} / "
              f"{r['positions_packed']} ({r['real_tokens']}) | {t['padded']:.3f} | {t['two_pass']:.3f} | "
              f"{t['group_rows']:.3f} | {t['packed_rows']:.3f} | {r['padded_over_group_rows']:.2f}x | "
              f"{r['two_pass_over_group_rows']:.2f}x | {r['group_rows_over_packed']:.2f}x | {r['max_logp_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "jax": jax.__version__,
                       "repeats": args.repeats, "rows": rows}, fh, indent=1)
    return 0 if all(r["within_tolerance"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
