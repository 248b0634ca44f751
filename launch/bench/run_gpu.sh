#!/usr/bin/env bash
# The one command for the borrowed GPU (run from the repo root; $OUT is the folder whose files come back):
# env, peak, update (bf16 auto/none first), generate, colocate, then the other update variants, within 480 s.
# Files in $OUT: bench_gpu.json (rewritten after every measurement) and log.txt.
PYTHONUNBUFFERED=1 PYTHONPATH=. timeout -k 10 510 python3 launch/bench/bench_gpu.py --out "$OUT" --budget-s 480 2>&1 | tee "$OUT/log.txt"
