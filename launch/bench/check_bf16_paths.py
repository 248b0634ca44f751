"""How far each bf16 policy forward of the actor lies from the float32 one, on SmolLM2-135M-Instruct's weights.

    python launch/bench/check_bf16_paths.py [--seeds 3] [--json OUT]

The actor's update can take three forms over the same rows (`jaxrl_hf.workers.losses` padded rows,
`jaxrl_hf.workers.shared_prompt` group rows, `jaxrl_hf.workers.group_packing` packed group rows). In float32 they
agree to float summation order (the tests). In bfloat16 each rounds differently, so a run's trajectory moves; this
checks that no form is further from the float32 padded forward than the others: per form, over ``--seeds`` groups
of 4 samples (prompts 48-58 of 64 tokens, responses 4-28 of 32, as the default DAPO run's), the mean absolute and
mean signed error of the response log-probs and, for a random-weighted log-likelihood, the gradient's cosine,
relative error and norm ratio against the float32 gradient. Exit 1 if a form's gradient cosine is below 0.99.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch", "bench"))

FORMS = ("bf16_padded", "bf16_group_rows", "bf16_packed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_shared_prompt import grouped_rows
    from jaxrl_hf.models import pair_matmul
    from jaxrl_hf.models.pretrained import load_pretrained
    from jaxrl_hf.workers import group_packing
    from jaxrl_hf.workers.losses import response_log_probs
    from jaxrl_hf.workers.shared_prompt import packed_group_log_probs, shared_prompt_log_probs

    lm = load_pretrained("smollm2-135m-instruct")
    f32 = lm.config.replace(scan_layers=False, dtype="float32")
    bf16 = pair_matmul.training_config(f32.replace(dtype="bfloat16"), None)  # as the actor's update runs it
    n, prompt, response = 4, 64, 32
    errors: dict[str, list[list[float]]] = {k: [] for k in FORMS}
    for seed in range(args.seeds):
        ids, mask, positions, valid = grouped_rows(1, n, prompt, response, f32.vocab_size, seed=seed,
                                                   prompt_real=(48, 58), response_real=(4, 28))
        rows = tuple(jnp.asarray(x) for x in (ids, mask, positions))
        arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, prompt:]}
        packed = {k: jnp.asarray(v) for k, v in group_packing.pack_group_rows(
            arrays, response, n, group_packing.group_row_length(mask, response, n)).items()}
        weights = jnp.asarray(valid * np.random.default_rng(seed).normal(size=valid.shape))
        forwards = {"f32_padded": lambda p: response_log_probs(p, f32, *rows, response),
                    "bf16_padded": lambda p: response_log_probs(p, bf16, *rows, response),
                    "bf16_group_rows": lambda p: shared_prompt_log_probs(p, bf16, *rows, response, n),
                    "bf16_packed": lambda p: packed_group_log_probs(p, bf16, packed, n)}
        out = {}
        for name, fn in forwards.items():
            logp = np.asarray(jax.jit(lambda p, fn=fn: fn(p)[0])(lm.params))
            grads = jax.jit(jax.grad(lambda p, fn=fn: jnp.sum(fn(p)[0] * weights)))(lm.params)
            out[name] = logp, np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])
        ref_logp, ref_grad = out["f32_padded"]
        for name in FORMS:
            logp, grad = out[name]
            delta = (logp - ref_logp)[valid > 0]
            errors[name].append([float(np.abs(delta).mean()), float(delta.mean()),
                                 float(grad @ ref_grad / np.linalg.norm(grad) / np.linalg.norm(ref_grad)),
                                 float(np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad)),
                                 float(np.linalg.norm(grad) / np.linalg.norm(ref_grad))])
    columns = ("mean_abs_dlogp", "mean_dlogp", "grad_cosine", "grad_rel_error", "grad_norm_ratio")
    summary = {k: dict(zip(columns, np.mean(v, axis=0).tolist())) for k, v in errors.items()}
    print(f"bf16 forms against the float32 padded forward, SmolLM2-135M-Instruct, {args.seeds} groups of {n}")
    print("| form | mean abs Δ log p | mean Δ log p | gradient cosine | gradient rel. error | norm ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['mean_abs_dlogp']:.4f} | {s['mean_dlogp']:+.5f} | {s['grad_cosine']:.5f} | "
              f"{s['grad_rel_error']:.4f} | {s['grad_norm_ratio']:.4f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seeds": args.seeds, "summary": summary, "per_seed": errors}, fh, indent=1)
    return 0 if all(s["grad_cosine"] >= 0.99 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
