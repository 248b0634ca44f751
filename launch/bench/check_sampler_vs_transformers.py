"""Does the native engine sample from the model's distribution? A check against transformers on the same weights.

    PYTHONPATH=. python launch/bench/check_sampler_vs_transformers.py [--first-draws 8192] [--rows 512 --tokens 32]

Model: the embedded SmolLM2-135M-Instruct (its HF directory in the cache); temperature 1, no top-k / top-p;
chat-templated arithmetic prompts. Prints one JSON line per measurement:

* ``first_token``: the total-variation distance between the engine's first-token frequencies and transformers'
  float64 softmax, beside the same distance for exact multinomial draws of the same count (median, 99th
  percentile, and the share of exact draws further off than ours);
* ``responses``: over whole responses, the sampler's log-probs against transformers' teacher-forced ones on the
  drawn tokens, and ``E[log p(x_t)] + E[H_t]`` with its z-score (0 for an unbiased sampler; the z-score counts the
  tokens of one response as independent, which overstates it).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

PROMPTS = ("What is 37 + 48? Put the final answer after ####.", "Compute 12 * 7 - 5. Answer after ####.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--first-draws", type=int, default=8192, help="first-token draws (multiples of 512)")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxrl_hf.models.pretrained import load_pretrained
    from jaxrl_hf.rollout.base import SamplingParams
    from jaxrl_hf.rollout.jax_engine import JaxGenerationEngine

    lm = load_pretrained("smollm2-135m-instruct", dtype="float32")
    tok = AutoTokenizer.from_pretrained(lm.path)
    ref = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32).eval()
    engine = JaxGenerationEngine(lm.config, lm.params, pad_token_id=tok.pad_token_id or 0,
                                 eos_token_ids=[tok.eos_token_id])
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in PROMPTS]
    rng = np.random.default_rng(0)
    p = prompts[0]
    with torch.no_grad():
        exact = torch.softmax(ref(torch.tensor([p])).logits[0, -1].double(), -1).numpy()
    first = np.concatenate([engine.generate([p], SamplingParams(n=512, max_new_tokens=1, seed=s)).response_ids[:, 0]
                            for s in range(args.first_draws // 512)])
    tv = 0.5 * np.abs(np.bincount(first, minlength=exact.size) / first.size - exact).sum()
    null = np.array([0.5 * np.abs(rng.multinomial(first.size, exact) / first.size - exact).sum() for _ in range(300)])
    print(json.dumps({"first_token": {"draws": int(first.size), "tv": float(tv), "exact_draws_tv_p50": float(np.median(null)),
                                      "exact_draws_tv_p99": float(np.quantile(null, 0.99)),
                                      "share_of_exact_draws_further_off": float(np.mean(null >= tv))}}), flush=True)
    for i, p in enumerate(prompts):
        out = engine.generate([p], SamplingParams(n=args.rows, max_new_tokens=args.tokens, seed=100 + i))
        ids = np.concatenate([np.tile(np.asarray(p)[None], (args.rows, 1)), out.response_ids], 1)
        logp, ent = [], []
        with torch.no_grad():
            for s in range(0, args.rows, 64):
                lsm = torch.log_softmax(ref(torch.tensor(ids[s:s + 64])).logits[:, len(p) - 1:-1].double(), -1)
                logp.append(torch.gather(lsm, -1, torch.tensor(out.response_ids[s:s + 64])[..., None])[..., 0].numpy())
                ent.append(-(lsm.exp() * lsm).sum(-1).numpy())
        logp, ent, m = np.concatenate(logp), np.concatenate(ent), out.response_mask.astype(bool)
        d = (logp + ent)[m]
        diff = np.abs(out.log_probs[m] - logp[m])
        print(json.dumps({"responses": {"prompt": i, "tokens": int(m.sum()), "logprob_diff_max": float(diff.max()),
                                        "logprob_diff_mean": float(diff.mean()), "logp_plus_entropy": float(d.mean()),
                                        "z": float(d.mean() / (d.std() / np.sqrt(d.size)))}}), flush=True)


if __name__ == "__main__":
    main()
