"""The CPU backend (docs/CPU_BACKEND.md).

* `ffi`: builds the C++ sources in ``csrc/`` on first use and registers them as XLA FFI targets; `available` is the
  capability probe (x86-64 with AVX-512 F/BW/VL and g++), `bf16_pairs` the one for AVX512-BF16;
* `panel_matmul`: the float32 projection over weights held in panel order (generation);
* `layer_unrolled`: the decode with its layers unrolled over per-layer weights and caches (float32 caches);
* `pair_matmul`: bf16 weight gradients with float32 accumulation (training on one CPU device);
* `fused_adamw`: clip + AdamW in one in-place pass over float32 master weights on one CPU device.
"""
