"""Native generation on CPU: the decoder layers scanned over stacked weights and a stacked KV cache, against the
layers unrolled over per-layer weights and caches (`jaxrl_hf.models.layer_unrolled`, the CPU default), in the same
process.

    python launch/bench/bench_decode_layers.py [--dtypes float32,bfloat16] [--batches 64] [--max-new 128]
                                               [--repeats 3] [--json OUT]

SmolLM2-135M-Instruct (float32 master weights, the compute dtype per row), greedy decoding of exactly ``--max-new``
tokens from B chat prompts, no stop ids. Per dtype and batch both engines are compiled by a first call, then their
timed ``generate`` calls alternate (``--repeats`` each) so load drifts hit both alike; the table gives best and
median tokens/s. The first calls' tokens are compared: float32 must agree on every token (the run fails otherwise;
log-probs may differ in float32 summation order); in bf16 the two programs round differently, so the table gives
how many leading tokens of each row agree.

Why: inside a decode loop XLA:CPU copies every layer's weights and cache slots out of the stacked arrays at each
step (a ``dynamic-slice`` is a copy there). Unrolled, each layer reads its own arrays, and writes its new
keys/values into its cache before reading it, so the loop-carried cache is updated in place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from jaxrl_hf.models import load_pretrained  # noqa: E402
from bench_kv_cache_dtype import alternate_engines, machine_line, speed_cells, write_rows  # noqa: E402

VARIANTS = {"scanned": {"unroll_layers": False}, "unrolled": {"unroll_layers": True}}


def agreed_prefix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, how many leading tokens of ``a`` and ``b`` are equal."""
    differs = a != b
    return np.where(differs.any(1), differs.argmax(1), a.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_start, rows = os.getloadavg(), []
    for dtype in args.dtypes.split(","):
        lm = load_pretrained(args.model, dtype=dtype)
        for batch in (int(b) for b in args.batches.split(",")):
            first, row = alternate_engines(lm, batch, args.max_new, args.repeats, VARIANTS)
            agree = agreed_prefix(first["scanned"].response_ids, first["unrolled"].response_ids)
            if dtype == "float32" and int(agree.min()) != args.max_new:
                raise RuntimeError(f"float32, batch {batch}: the unrolled engine's tokens differ from the scanned "
                                   f"engine's (first difference at token {int(agree.min())})")
            row.update(dtype=dtype, agreed_tokens_min=int(agree.min()), agreed_tokens_median=float(np.median(agree)),
                       speedup_median=statistics.median(row["seconds"]["scanned"])
                       / statistics.median(row["seconds"]["unrolled"]))
            rows.append(row)
    print(machine_line(load_start, os.getloadavg(), f"{args.model}, greedy, no stop ids"))
    print("| dtype | batch | prompt | new | scanned tok/s (best / median) | unrolled tok/s (best / median) | "
          "unrolled / scanned (median) | tokens agreed (min / median of rows) |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['prompt_len']} | {r['max_new']} | "
              + " | ".join(speed_cells(r, VARIANTS))
              + f" | {r['speedup_median']:.2f} | {r['agreed_tokens_min']} / {r['agreed_tokens_median']:.0f} |")
    write_rows(args.json, load_start, os.getloadavg(), rows)


if __name__ == "__main__":
    main()
