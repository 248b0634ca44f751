"""One child process of ``bench_gpu.py``: the ``env`` + ``peak`` sections, one actor-update variant, or one half
of ``generate`` (transformers, then the native engine).

    python launch/bench/_gpu_child.py --task env_peak|update|generate_hf|generate_native|colocate --json DIR/bench_gpu.json
        [--quick] [--variant bf16-auto-none] [--deadline UNIX_TIME] [--log-prob] [--work DIR]

Each section runs in its own try/except (the traceback goes to the JSON) and writes every sub-measurement as
soon as it has it (`_gpu_common.set_at`). A fresh process per variant gives each its own device allocator, so
``memory_stats()['peak_bytes_in_use']`` is that variant's peak.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _gpu_common import DATASHEET_BF16_PEAK, error_record, log, read_json, set_at  # noqa: E402

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "chex", "numpy", "torch", "transformers", "safetensors", "tokenizers")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_memory(device) -> dict | str:
    """``device.memory_stats()`` (bytes in use, peak, limit) or why there is none (``skipped: cpu``)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
        return f"skipped: {device.platform}"
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "largest_alloc_size")
    return {k: int(stats[k]) for k in keep if k in stats}


def section_env(path: str) -> None:
    import jax

    out = {"status": "running", "versions": {p: _version(p) for p in PACKAGES}, "python": platform.python_version(),
           "platform": platform.platform(), "cpus": os.cpu_count(),
           "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                   "XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}}
    set_at(path, ("sections", "env"), out)
    devices = jax.devices()
    d0 = devices[0]
    out.update({"backend": jax.default_backend(), "devices": [str(d) for d in devices],
                "device_kind": d0.device_kind,
                "platform_version": getattr(getattr(d0, "client", None), "platform_version", None),
                "memory_stats": device_memory(d0)})
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as err:
        out["nvidia_smi"] = f"skipped: {type(err).__name__}"
    out["status"] = "ok"
    set_at(path, ("sections", "env"), out)
    log(f"env: {jax.default_backend()} {d0.device_kind} x{len(devices)}, jax {jax.__version__}")


def torch_matmul_rate(n: int, repeats: int = 5) -> dict:
    """Best FLOP/s of ``[n,n] @ [n,n]`` in bf16 with torch (the peer number), on CUDA when there is one."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a = torch.ones((n, n), dtype=torch.bfloat16, device=device)
    b = torch.full((n, n), 0.5, dtype=torch.bfloat16, device=device)
    (a @ b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return {"flops_per_s": 2.0 * n ** 3 / best, "n": n, "device": device, "dtype": "bfloat16"}


def section_peak(path: str, quick: bool) -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl_hf.workers import peak_flops

    device = jax.devices()[0]
    out: dict = {"status": "running", "platform": device.platform, "datasheet_bf16_flops_per_s": DATASHEET_BF16_PEAK}
    set_at(path, ("sections", "peak"), out)
    for dtype in ("bfloat16", "float32"):
        t = time.perf_counter()
        if quick:  # the calibration's own timing function at a CPU-friendly size
            rate, how = peak_flops.matmul_rate(device, jnp.dtype(dtype), 256), "matmul_rate(n=256)"
        else:
            sizes = peak_flops.MATMUL_SIZES.get(device.platform, (8192,))
            rate, how = peak_flops.measure_device_peak(device, dtype), f"measure_device_peak(n={sizes})"
        out[f"ours_{dtype}_flops_per_s"] = rate
        out[f"ours_{dtype}_method"] = how
        out[f"ours_{dtype}_s"] = time.perf_counter() - t
        set_at(path, ("sections", "peak"), out)
        log(f"peak: ours {dtype} {rate / 1e12:.2f} TFLOP/s ({how})")
    out["ours_bf16_over_datasheet"] = out["ours_bfloat16_flops_per_s"] / DATASHEET_BF16_PEAK
    out["status"] = "ok"
    set_at(path, ("sections", "peak"), out)


def section_torch(path: str, quick: bool) -> None:
    """torch's CUDA facts (into ``env``) and the torch bf16 matmul peer (into ``peak``): last in the process,
    after every JAX measurement, so torch's CUDA libraries are loaded only once JAX's work is done."""
    import torch

    info = ({"available": True, "device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
             "cudnn": torch.backends.cudnn.version()} if torch.cuda.is_available() else "skipped: no CUDA for torch")
    set_at(path, ("sections", "env", "torch_cuda"), info, merge=False)
    try:
        peer = torch_matmul_rate(256 if quick else 8192)
        ours = read_json(path).get("sections", {}).get("peak", {}).get("ours_bfloat16_flops_per_s")
        set_at(path, ("sections", "peak"), {"torch_bf16": peer,
                                            "ours_over_torch_bf16": ours / peer["flops_per_s"] if ours else None})
        log(f"peak: torch bf16 {peer['flops_per_s'] / 1e12:.2f} TFLOP/s on {peer['device']}")
    except Exception as err:
        set_at(path, ("sections", "peak", "torch_bf16"), error_record(err), merge=False)


def run_section(path: str, keys: tuple[str, ...], fn, *args) -> None:
    try:
        fn(path, *args)
    except Exception as err:
        log(f"{'/'.join(keys)}: ERROR {type(err).__name__}: {err}")
        set_at(path, ("sections", *keys), error_record(err))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", required=True,
                        choices=("env", "peak", "env_peak", "update", "generate_hf", "generate_native", "colocate"))
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--variant", default="bf16-auto-none")
    parser.add_argument("--deadline", type=float, default=float("inf"))
    parser.add_argument("--log-prob", action="store_true", help="also time compute_log_prob (update)")
    parser.add_argument("--work", default=None, help="generate: the directory shared by its two children")
    args = parser.parse_args()
    if args.task in ("env", "env_peak"):
        run_section(args.json, ("env",), section_env)
    if args.task in ("peak", "env_peak"):
        run_section(args.json, ("peak",), section_peak, args.quick)
    if args.task in ("env", "peak", "env_peak"):
        try:
            section_torch(args.json, args.quick)
        except Exception as err:  # torch absent or broken: the JAX numbers stand
            log(f"torch: ERROR {type(err).__name__}: {err}")
            set_at(args.json, ("sections", "env", "torch_cuda"), f"error: {type(err).__name__}: {err}", merge=False)
    elif args.task == "update":
        from _gpu_update import run_variant
        run_section(args.json, ("update", "variants", args.variant), run_variant, args.variant, args.quick,
                    args.deadline, args.log_prob)
    elif args.task == "colocate":
        from _gpu_colocate import run_colocate
        run_section(args.json, ("colocate",), run_colocate, args.quick, args.deadline)
    else:
        import _gpu_generate
        fn = _gpu_generate.run_generate_hf if args.task == "generate_hf" else _gpu_generate.run_generate_native
        run_section(args.json, ("generate",), fn, args.quick, args.deadline, args.work)


if __name__ == "__main__":
    main()
