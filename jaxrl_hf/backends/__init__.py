"""Optional hardware backends: code tuned to one kind of device, kept out of the hardware-neutral core.

`backends.cpu` is the one backend: XLA:CPU on x86-64 (C++ FFI kernels, the unrolled float32 decode, the fused
optimizer update, bf16 weight gradients). The core asks for a piece only where ``model.cpu_backend: auto`` and the
piece's capability probe agree, never under ``off``; a piece changes results only by float32/bf16 summation order
(docs/CPU_BACKEND.md lists each piece, its switch and its tests).
"""
