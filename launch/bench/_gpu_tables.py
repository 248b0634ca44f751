"""Markdown tables of ``bench_gpu.json``, one per section (printed by ``bench_gpu.py`` at the end)."""

from __future__ import annotations

from typing import Any

from _gpu_common import fmt

GIB = 2 ** 30


def _status_line(name: str, section: dict[str, Any]) -> str | None:
    status = section.get("status")
    if status == "ok":
        return None
    err = section.get("error", "")
    return f"**{name}: {status}** {err}".rstrip()


def table_env(s: dict[str, Any]) -> list[str]:
    v = s.get("versions", {})
    mem = s.get("memory_stats")
    limit = fmt(mem.get("bytes_limit"), GIB) + " GiB" if isinstance(mem, dict) else mem
    rows = [("backend", s.get("backend")), ("device kind", s.get("device_kind")),
            ("devices", ", ".join(s.get("devices", []))), ("jax / jaxlib", f"{v.get('jax')} / {v.get('jaxlib')}"),
            ("cuda plugin", v.get("jax-cuda13-plugin") or v.get("jax-cuda12-plugin")),
            ("flax / optax", f"{v.get('flax')} / {v.get('optax')}"),
            ("torch / transformers", f"{v.get('torch')} / {v.get('transformers')}"),
            ("JAX memory limit", limit), ("nvidia-smi", s.get("nvidia_smi"))]
    return ["| env | value |", "|---|---|", *(f"| {k} | {fmt(x)} |" for k, x in rows)]


def table_peak(s: dict[str, Any]) -> list[str]:
    sheet = s.get("datasheet_bf16_flops_per_s") or 989e12
    out = ["| matmul | TFLOP/s | of 989 TFLOP/s bf16 datasheet |", "|---|---|---|"]
    for label, key in (("ours bf16 (peak_flops.py)", "ours_bfloat16_flops_per_s"),
                       ("ours f32 (peak_flops.py)", "ours_float32_flops_per_s")):
        rate = s.get(key)
        out.append(f"| {label} | {fmt(rate, 1e12, 1)} | {fmt(rate / sheet if rate else None, 1, 3)} |")
    peer = s.get("torch_bf16")
    if isinstance(peer, dict) and "flops_per_s" in peer:
        out.append(f"| torch bf16 n={peer['n']} ({peer['device']}) | {fmt(peer['flops_per_s'], 1e12, 1)} | "
                   f"{fmt(peer['flops_per_s'] / sheet, 1, 3)} |")
    return out


def table_update(s: dict[str, Any]) -> list[str]:
    out = ["| variant | attention | compile s | step s | tok/s | MFU (meas. peak) | MFU (989T) | peak GiB | "
           "plan GiB | meas/plan | log-prob s (compile) | status |", "|" + "---|" * 12]
    for name, v in s.get("variants", {}).items():
        mem = v.get("memory_after_update")
        peak = mem.get("peak_bytes_in_use") if isinstance(mem, dict) else None
        plan = v.get("memory_plan", {})
        lp = v.get("log_prob")
        lp_cell = (f"{lp['s_median']:.3f} ({lp['compile_s']:.1f})" if isinstance(lp, dict) and "s_median" in lp
                   else "-")
        status = v.get("status", "-") if v.get("status") == "ok" else f"{v.get('status')} {v.get('error', '')}"
        out.append(f"| {name} | {fmt(v.get('attention_resolved'))} | {fmt(v.get('compile_s'), 1, 1)} | "
                   f"{fmt(v.get('step_s_median'), 1, 3)} | {fmt(v.get('tokens_per_s'), 1, 0)} | "
                   f"{fmt(v.get('mfu_vs_measured_peak'), 1, 3)} | {fmt(v.get('mfu_vs_datasheet_989'), 1, 3)} | "
                   f"{fmt(peak, GIB)} | {fmt(plan.get('peak_bytes_per_device'), GIB)} | "
                   f"{fmt(v.get('peak_bytes_measured_over_plan'), 1, 2)} | {lp_cell} | {status[:120]} |")
    return out


def table_generate(s: dict[str, Any]) -> list[str]:
    out = [f"batch {s.get('batch')} x {s.get('prompt_len')} prompt tokens x {s.get('new_tokens')} new, bf16, greedy",
           "", "| engine | tok/s | seconds | compile / warm-up s |", "|---|---|---|---|"]
    hf, native = s.get("transformers"), s.get("native")
    if isinstance(native, dict):
        out.append(f"| native JAX | {fmt(native.get('tok_per_s'), 1, 0)} | {fmt(native.get('seconds'), 1, 2)} | "
                   f"{fmt(native.get('compile_s'), 1, 1)} |")
    if isinstance(hf, dict):
        out.append(f"| transformers ({hf.get('attn_implementation')}) | {fmt(hf.get('tok_per_s'), 1, 0)} | "
                   f"{fmt(hf.get('seconds'), 1, 2)} | {fmt(hf.get('warmup_s'), 1, 1)} |")
    agree = s.get("greedy_agreement") or {}
    out.append(f"\nnative / transformers: {fmt(s.get('native_over_transformers'), 1, 2)}x; equal greedy tokens: "
               f"{fmt(agree.get('equal_token_fraction'), 1, 3)} (mean first divergence at "
               f"{fmt(agree.get('first_divergence_mean'), 1, 1)}, {agree.get('rows_identical', '-')}/"
               f"{agree.get('rows', '-')} rows identical)")
    return out


def table_colocate(s: dict[str, Any]) -> list[str]:
    out = [f"budget env: {s.get('budget_env')}", "", "| part | result |", "|---|---|"]
    start = s.get("startup") or {}
    if start.get("status") == "ok":
        stages = [k for k in start if k.startswith("free_after_")]
        out.append("| free MiB after start-up | " + ", ".join(f"{k[11:-4]} {start[k]:.0f}" for k in stages)
                   + f" (of {start['total_mib']:.0f}) |")
    else:
        out.append(f"| start-up memory | {start.get('status', '-')} |")
    sync = s.get("dlpack_sync") or {}
    if sync.get("status") == "ok":
        out.append(f"| DLPack sync to {sync['target']} | {sync['path']}; zero-copy {sync['zero_copy_fraction']:.3f} "
                   f"of {sync['bytes'] / 2 ** 20:.1f} MiB; logits max diff vs transformers "
                   f"{sync['logits_max_abs_diff']:.2e} (scale {sync['logits_scale']:.2f}) |")
    else:
        out.append(f"| DLPack sync | {sync.get('status', '-')} |")
    race = s.get("stream_race") or {}
    if race.get("status") == "ok":
        for k in ("unsynchronised", "synchronised"):
            out.append(f"| stream race, {k} | {race[k]['donation']}; copy saw new values: "
                       f"{race[k]['copy_saw_new_values']} |")
    else:
        out.append(f"| stream race | {race.get('status', '-')} |")
    upd = s.get("update_beside_block") or {}
    mem = upd.get("memory_after_update")
    peak = mem.get("peak_bytes_in_use") if isinstance(mem, dict) else None
    out.append(f"| update_actor beside a {upd.get('torch_block_bytes', 0) / GIB:.1f} GiB torch block | "
               f"{upd.get('status', '-')}; step {fmt(upd.get('step_s_median'), 1, 3)} s; peak {fmt(peak, GIB)} GiB |")
    return out


TABLES = {"env": table_env, "peak": table_peak, "update": table_update, "generate": table_generate,
          "colocate": table_colocate}


def print_tables(doc: dict[str, Any]) -> None:
    for name, section in doc.get("sections", {}).items():
        print(f"\n### {name}", flush=True)
        line = _status_line(name, section)
        if line:
            print(line, flush=True)
        if set(section) - {"status", "variants"} or any(len(v) > 1 for v in section.get("variants", {}).values()):
            try:
                print("\n".join(TABLES[name](section)), flush=True)
            except Exception as err:  # a partial section must not stop the other tables
                print(f"(table unavailable: {type(err).__name__}: {err})", flush=True)
