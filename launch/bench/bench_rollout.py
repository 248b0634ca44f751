"""Rollout through vLLM fed by in-place weight syncs vs the native JAX engine, same model, prompts and run.

    python launch/bench/bench_rollout.py --json OUT [--model smollm2-135m-instruct] [--prompts 8] [--n 2] [--max-new 32]

Both engines run in this one process on the same params (the vLLM engine is colocated as in the actor
worker: ``jaxrl_hf.rollout.make_rollout_engine``). Measured:
  * weight sync: ``VllmRolloutEngine.set_params`` wall time (flax tree -> HF names -> vLLM ``reload_weights``,
    median of ``--syncs`` syncs alternating perturbed / original params), bytes and GB/s, and its share of an
    RL step's (update + sync) time, with the update being one real actor optimizer step (``actor_loss`` +
    ``make_train_step``, micro-batches of 4 rows) on this rollout's batch, timed after its compilation;
  * correctness after a sync: greedy continuations of both engines (``greedy_match``: all identical), and
    the sampler log-probs of a sampled rollout (T = ``--temperature``, no top-k/p) against an independent
    teacher-forced JAX forward on the same tokens (``mean_abs_logprob_diff``, k3 KL; the native engine's
    own numbers as the peer);
  * throughput: generated tokens (mask sum) / wall time of the sampled ``generate`` call (``n`` samples per
    prompt, EOS stops rows), each engine after a warm-up call with the same shapes.
Prints a table and writes JSON with keys ``weight_sync_s``, ``greedy_match``, ``mean_abs_logprob_diff``,
``vllm_tokens_per_s``, ``jax_tokens_per_s`` (+ details).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

QUESTIONS = ["What is 12 + 7?", "Name a prime number larger than 10.", "Write one word that rhymes with cat.",
             "What is the capital of France?", "Count from 1 to 5.", "What colour is the sky on a clear day?",
             "Give me a synonym for happy.", "How many legs does a spider have?", "What is 9 times 6?",
             "Name a fruit that is yellow.", "What is the opposite of cold?", "Spell the word 'seven'."]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _perturbed(params, scale: float = 1e-3, seed: int = 1):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _rescore(params, config, out, temperature):
    from jaxrl_hf.models import token_log_probs_and_entropy

    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1, static_argnames=("with_entropy",))
    logp, _ = fn(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask), temperature=temperature,
                 with_entropy=False)
    return np.asarray(logp)[:, out.prompt_ids.shape[1] - 1:-1]


def _mismatch(engine_logp, ref_logp, mask) -> dict:
    from jaxrl_hf import algos

    m = algos.compute_mismatch_metrics(jnp.asarray(ref_logp), jnp.asarray(engine_logp), jnp.asarray(mask))
    return {k: float(v) for k, v in m.items()}


def _timed_generate(engine, prompts, sampling):
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    return out, seconds, int(out.response_mask.sum())


def _actor_update_seconds(params, config, out, temperature: float, micro_rows: int = 4) -> dict:
    """One actor optimizer step (PPO clip loss, token-mean, AdamW) on this rollout batch; compile excluded."""
    from jaxrl_hf.config.schema import ActorConfig
    from jaxrl_hf.workers.losses import (ACTOR_SUMMED_METRICS, actor_loss, actor_loss_config, lm_log_prob_fn,
                                         response_denominator)
    from jaxrl_hf.workers.optim import make_optimizer
    from jaxrl_hf.workers.train_step import init_train_state, make_train_step

    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    rows = ids.shape[0] - ids.shape[0] % micro_rows
    rng = np.random.default_rng(0)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": np.maximum(np.cumsum(mask, 1) - 1, 0),
             "responses": out.response_ids, "response_mask": out.response_mask, "old_log_probs": out.log_probs,
             "advantages": rng.normal(size=out.response_ids.shape).astype(np.float32)}
    micro = {k: jnp.asarray(np.asarray(v)[:rows].reshape(rows // micro_rows, micro_rows, *np.shape(v)[1:]))
             for k, v in batch.items()}
    actor = ActorConfig()  # the default actor section
    cfg = actor_loss_config(actor, temperature)
    optim = actor.optim
    optimizer = make_optimizer(optim, actor.grad_clip)
    loss_fn = functools.partial(actor_loss, log_prob_fn=lm_log_prob_fn(config), cfg=cfg)
    step = make_train_step(loss_fn, optim, optimizer=optimizer, denominator_fn=response_denominator(cfg.loss_agg_mode),
                           summed_aux=ACTOR_SUMMED_METRICS)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    t0 = time.perf_counter()
    state, metrics = step(state, micro)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = step(state, micro)
    jax.block_until_ready((state, metrics))
    return {"seconds": time.perf_counter() - t0, "first_call_s": first, "rows": rows, "micro_rows": micro_rows,
            "seq_len": int(ids.shape[1])}


def run(args: argparse.Namespace) -> dict:
    from jaxrl_hf.models import load_pretrained
    from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams, make_rollout_engine

    load_start = _load()
    lm = load_pretrained(args.model)
    config, params = lm.config, lm.params
    eos = tuple(config.eos_token_ids)
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
    texts = (QUESTIONS * (args.prompts // len(QUESTIONS) + 1))[:args.prompts]
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True) for t in texts]
    greedy = SamplingParams(greedy=True, max_new_tokens=args.max_new)
    sampled = SamplingParams(temperature=args.temperature, n=args.n, max_new_tokens=args.max_new, seed=args.seed)

    # ---- native JAX engine
    native = JaxGenerationEngine(config, params, pad_token_id=pad, eos_token_ids=eos)
    t0 = time.perf_counter()
    native.generate(prompts, greedy)
    native.generate(prompts, sampled)
    jax_warmup_s = time.perf_counter() - t0
    jax_greedy, jax_greedy_s, jax_greedy_tok = _timed_generate(native, prompts, greedy)
    jax_sampled, jax_s, jax_tok = _timed_generate(native, prompts, sampled)

    # ---- vLLM engine: construction does the first (dummy -> real) sync
    t0 = time.perf_counter()
    engine = make_rollout_engine("vllm", config=config, params=params, pad_token_id=pad, eos_token_ids=eos,
                                 model_dir=lm.path, options={"max_model_len": 1024, "max_num_seqs": 64})
    vllm_construct_s = time.perf_counter() - t0
    try:
        perturbed = _perturbed(params)
        jax.block_until_ready(perturbed)
        syncs = []
        for i in range(args.syncs):
            engine.set_params(perturbed if i % 2 == 0 else params)
            syncs.append(engine.last_sync_s)
        if args.syncs % 2:
            engine.set_params(params)
        sync_bytes = engine.last_sync_bytes
        stats = engine.last_sync_stats
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4))
        engine.generate(prompts, SamplingParams(temperature=args.temperature, n=args.n, max_new_tokens=4, seed=1))
        vllm_warmup_s = time.perf_counter() - t0
        v_greedy, v_greedy_s, v_greedy_tok = _timed_generate(engine, prompts, greedy)
        v_sampled, v_s, v_tok = _timed_generate(engine, prompts, sampled)
    finally:
        engine.close()

    greedy_match = bool(np.array_equal(v_greedy.response_ids, jax_greedy.response_ids)
                        and np.array_equal(v_greedy.response_mask, jax_greedy.response_mask))
    rows_equal = int(sum(np.array_equal(a, b) for a, b in zip(v_greedy.response_ids, jax_greedy.response_ids)))
    v_mis = _mismatch(v_sampled.log_probs, _rescore(params, config, v_sampled, args.temperature),
                      v_sampled.response_mask)
    j_mis = _mismatch(jax_sampled.log_probs, _rescore(params, config, jax_sampled, args.temperature),
                      jax_sampled.response_mask)
    v_greedy_mis = _mismatch(v_greedy.log_probs, _rescore(params, config, v_greedy, 1.0), v_greedy.response_mask)
    update = _actor_update_seconds(params, config, v_sampled, args.temperature)
    sync_s = statistics.median(syncs)
    result = {
        "model": args.model, "num_params": config.num_params(), "prompts": len(prompts), "n": args.n,
        "max_new_tokens": args.max_new, "temperature": args.temperature,
        "weight_sync_s": sync_s, "weight_sync_all_s": syncs, "weight_sync_bytes": sync_bytes,
        "weight_sync_gb_per_s": sync_bytes / sync_s / 1e9, "weight_sync_zero_copy_bytes": stats.bytes_zero_copy,
        "weight_sync_gathered_bytes": stats.bytes_gathered,
        "actor_update_s": update["seconds"], "actor_update_first_call_s": update["first_call_s"],
        "actor_update_batch": {k: update[k] for k in ("rows", "micro_rows", "seq_len")},
        "sync_share_of_update_plus_sync": sync_s / (sync_s + update["seconds"]),
        "greedy_match": greedy_match, "greedy_rows_equal": rows_equal, "greedy_rows": len(prompts),
        "mean_abs_logprob_diff": v_mis["mismatch_abs_logprob_diff"], "k3_kl": v_mis["mismatch_k3"],
        "vllm_mismatch": v_mis, "jax_mismatch": j_mis, "vllm_greedy_mismatch": v_greedy_mis,
        "vllm_tokens_per_s": v_tok / v_s, "jax_tokens_per_s": jax_tok / jax_s,
        "vllm_sampled": {"tokens": v_tok, "seconds": v_s}, "jax_sampled": {"tokens": jax_tok, "seconds": jax_s},
        "vllm_greedy_tokens_per_s": v_greedy_tok / v_greedy_s, "jax_greedy_tokens_per_s": jax_greedy_tok / jax_greedy_s,
        "vllm_construct_s": vllm_construct_s, "vllm_warmup_s": vllm_warmup_s, "jax_warmup_s": jax_warmup_s,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.devices()[0].platform}",
        "load_average_start": load_start, "load_average_end": _load(),
    }
    result["vllm_over_jax_tokens_per_s"] = result["vllm_tokens_per_s"] / result["jax_tokens_per_s"]
    return result


def print_table(r: dict) -> None:
    rows = [
        ("tokens/s (sampled, n=%d)" % r["n"], f"{r['vllm_tokens_per_s']:.1f}", f"{r['jax_tokens_per_s']:.1f}",
         f"{r['vllm_over_jax_tokens_per_s']:.2f}x"),
        ("tokens/s (greedy)", f"{r['vllm_greedy_tokens_per_s']:.1f}", f"{r['jax_greedy_tokens_per_s']:.1f}",
         f"{r['vllm_greedy_tokens_per_s'] / r['jax_greedy_tokens_per_s']:.2f}x"),
        ("warm-up (s)", f"{r['vllm_warmup_s']:.1f}", f"{r['jax_warmup_s']:.1f}", ""),
        ("mean |dlogp| vs JAX forward", f"{r['vllm_mismatch']['mismatch_abs_logprob_diff']:.2e}",
         f"{r['jax_mismatch']['mismatch_abs_logprob_diff']:.2e}", ""),
        ("k3 KL vs JAX forward", f"{r['vllm_mismatch']['mismatch_k3']:.2e}", f"{r['jax_mismatch']['mismatch_k3']:.2e}", ""),
    ]
    print(f"\n{'':32s} {'vLLM':>12s} {'JAX':>12s} {'vLLM/JAX':>9s}")
    for name, a, b, c in rows:
        print(f"{name:32s} {a:>12s} {b:>12s} {c:>9s}")
    print(f"\ngreedy continuations identical: {r['greedy_match']} ({r['greedy_rows_equal']}/{r['greedy_rows']} rows)")
    print(f"weight sync: {r['weight_sync_s'] * 1e3:.0f} ms median of {len(r['weight_sync_all_s'])} "
          f"({r['weight_sync_bytes'] / 1e6:.0f} MB, {r['weight_sync_gb_per_s']:.2f} GB/s, "
          f"{r['weight_sync_zero_copy_bytes'] / 1e6:.0f} MB via DLPack, {r['weight_sync_gathered_bytes'] / 1e6:.0f} MB gathered)")
    print(f"actor update (1 optimizer step, {r['actor_update_batch']}): {r['actor_update_s']:.2f} s; "
          f"sync share of update+sync: {100 * r['sync_share_of_update_plus_sync']:.1f}%")
    print(f"vLLM engine construct (+first sync): {r['vllm_construct_s']:.1f} s; machine {r['machine']}; "
          f"load average start {r['load_average_start']}, end {r['load_average_end']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
