"""The ``colocate`` section: what one GPU can prove of the colocated vLLM path (issue: the cluster path) without vLLM.

One child process, started with the shipped memory settings of a colocated actor (`jaxrl_hf.config.memory_budget`
for the default config: vLLM's share, JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, preallocation off). Parts, each
recorded as soon as it is measured:

1. ``startup``: the device's free memory after each runtime starts, in this import order: torch's CUDA context,
   JAX's client, torch's cuBLAS handle, torch's cuDNN, JAX's first matmul (GPU only).
2. ``dlpack_sync``: the weight sync's on-device path (`jaxrl_hf.rollout.weight_sync.hf_weight_stream` onto
   ``cuda:0``; the host path on CPU): how many bytes arrive as zero-copy views (each torch tensor's data pointer
   inside a JAX buffer), and a transformers model loaded from that stream computing the same logits as our JAX
   forward on the same batch (float32).
3. ``stream_race`` (GPU only): torch reads a JAX buffer through DLPack on a side stream that is still busy while
   JAX donates the buffer to a jitted step. Without a stream synchronisation the copy may see the new values; with
   the synchronisation the vLLM engine does after every load (``current_stream().synchronize()``) it must not.
4. ``update_beside_block``: the real ``update_actor`` (the ``update`` section's first variant and shape) while a
   torch allocation of vLLM's share of the device stands in for a sleeping-less vLLM: the static split the
   shipped settings promise.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from _gpu_common import UPDATE_VARIANTS, error_record, log, set_at

KEYS = ("sections", "colocate")
MIB = 2 ** 20


def _free_mib(torch: Any) -> float:
    free, _total = torch.cuda.mem_get_info()
    return free / MIB


def startup_memory(path: str) -> dict[str, Any]:
    """Free device MiB after each runtime starts (module docstring, part 1)."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped: no CUDA"}
    out: dict[str, Any] = {"init_order": ["torch", "jax"], "total_mib": torch.cuda.mem_get_info()[1] / MIB}
    torch.zeros(1, device="cuda")
    out["free_after_torch_context_mib"] = _free_mib(torch)
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    out["free_after_jax_client_mib"] = _free_mib(torch)
    a = torch.ones((1024, 1024), device="cuda")
    (a @ a).sum().item()
    out["free_after_torch_cublas_mib"] = _free_mib(torch)
    conv = torch.nn.functional.conv2d(torch.ones((1, 4, 32, 32), device="cuda"), torch.ones((4, 4, 3, 3), device="cuda"))
    conv.sum().item()
    out["free_after_torch_cudnn_mib"] = _free_mib(torch)
    x = jnp.ones((1024, 1024))
    (x @ x).block_until_ready()
    out["free_after_jax_matmul_mib"] = _free_mib(torch)
    out["jax_memory_stats"] = {k: int(v) for k, v in (jax.devices()[0].memory_stats() or {}).items()
                               if k in ("bytes_in_use", "bytes_limit", "bytes_reserved")}
    out["status"] = "ok"
    return out


def _buffer_ranges(params: Any) -> list[tuple[int, int]]:
    import jax

    out = []
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            start = shard.data.unsafe_buffer_pointer()
            out.append((start, start + shard.data.nbytes))
    return out


def dlpack_sync(quick: bool) -> dict[str, Any]:
    """The sync stream's zero-copy share and a transformers model fed by it against our forward (part 2)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jaxrl_hf.models import DecoderConfig, forward, init_params
    from jaxrl_hf.models.weights_hf import save_hf_dir
    from jaxrl_hf.rollout.sync_plan import HOST, SyncTarget
    from jaxrl_hf.rollout.weight_sync import hf_weight_stream

    dims = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16) if quick else
            dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64))
    config = DecoderConfig(**dims, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
    params = jax.tree.map(jnp.asarray, init_params(config, 0))
    gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    target = SyncTarget("device", 0) if gpu else HOST
    ranges = _buffer_ranges(params)
    t = time.perf_counter()
    stream, stats = hf_weight_stream(params, config, target)
    state, inside, total = {}, 0, 0
    for name, tensor in stream:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        inside += nbytes * any(lo <= ptr < hi for lo, hi in ranges)
        total += nbytes
        state[name] = tensor
    stream_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(tmp, params, config)  # config.json (and weights, unused: the model is loaded from the stream)
        hf_config = AutoConfig.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32).to(target.torch_device).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 24)).astype(np.int32)
    ours = np.asarray(jax.jit(forward, static_argnums=1)(params, config, jnp.asarray(ids)))
    with torch.no_grad():
        theirs = model(torch.tensor(ids, dtype=torch.long, device=target.torch_device)).logits.float().cpu().numpy()
    return {"status": "ok", "target": target.torch_device, "path": stats.describe(), "stream_s": stream_s,
            "bytes": total, "bytes_inside_jax_buffers": inside, "zero_copy_fraction": inside / total if total else 0.0,
            "missing_keys": list(missing), "unexpected_keys": list(unexpected),
            "logits_max_abs_diff": float(np.abs(ours - theirs).max()), "logits_scale": float(np.abs(ours).max())}


def stream_race() -> dict[str, Any]:
    """A DLPack view copied on a busy torch stream while JAX donates its buffer, without and with a stream
    synchronisation before the donation (part 3)."""
    import jax
    import jax.numpy as jnp
    import torch

    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        return {"status": "skipped: no GPU"}
    step = jax.jit(lambda a: a * 0.0 + 2.0, donate_argnums=0)
    out: dict[str, Any] = {}
    for synced in (False, True):
        x = jnp.ones((64 * MIB // 4,), jnp.float32)
        x.block_until_ready()
        view = torch.from_dlpack(x)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e9))  # keep the stream busy (~1 s) so the copy is still queued
            copy = view.clone()
        if synced:
            side.synchronize()
        try:
            step(x).block_until_ready()
            donated = "donated"
        except Exception as err:  # JAX may refuse to donate a buffer torch still references
            donated = f"refused: {type(err).__name__}: {err}"[:300]
        torch.cuda.synchronize()
        out["synchronised" if synced else "unsynchronised"] = {
            "donation": donated, "copy_saw_new_values": bool((copy != 1.0).any().item())}
    out["status"] = "ok"
    return out


def update_beside_block(path: str, quick: bool, deadline: float) -> dict[str, Any]:
    """``update_actor`` under the shipped budget beside a torch block of vLLM's share (part 4)."""
    import torch

    from _gpu_update import run_variant
    from jaxrl_hf.config.memory_budget import DEFAULT_VLLM_GPU_SHARE

    block = None
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        block = torch.empty(int(DEFAULT_VLLM_GPU_SHARE * total), dtype=torch.uint8, device="cuda")
    keys = (*KEYS, "update_beside_block")
    run_variant(path, UPDATE_VARIANTS[0], quick, deadline, log_prob=False, keys=keys)
    set_at(path, keys, {"torch_block_bytes": int(block.numel()) if block is not None else 0,
                        "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                        "xla_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")})
    del block
    return {}


def shipped_budget_env() -> dict[str, str]:
    """The worker environment a colocated actor gets for the default config with ``rollout.name=vllm``
    (`jaxrl_hf.config.memory_budget`), applied before JAX's backend starts."""
    from jaxrl_hf.config import load_config
    from jaxrl_hf.config.memory_budget import memory_budget

    env = memory_budget(load_config("dapo", overrides=["rollout.name=vllm"]), {}).env()
    os.environ.update(env)
    return env


def run_colocate(path: str, quick: bool, deadline: float) -> None:
    """Every part in order, each in its own try (its error recorded, the next part still runs)."""
    set_at(path, KEYS, {"status": "running", "budget_env": shipped_budget_env()})
    failed = False
    for name, fn in (("startup", lambda: startup_memory(path)), ("dlpack_sync", lambda: dlpack_sync(quick)),
                     ("stream_race", stream_race), ("update_beside_block",
                                                   lambda: update_beside_block(path, quick, deadline))):
        t = time.perf_counter()
        try:
            result = fn()
            if result:
                set_at(path, (*KEYS, name), result)
            log(f"colocate {name}: done in {time.perf_counter() - t:.1f}s")
        except Exception as err:
            failed = True
            log(f"colocate {name}: ERROR {type(err).__name__}: {err}")
            set_at(path, (*KEYS, name), error_record(err))
    set_at(path, KEYS, {"status": "error" if failed else "ok"})
