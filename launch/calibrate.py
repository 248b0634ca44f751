"""Measure this machine's device constants and write a JSON device profile for the planner.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python launch/calibrate.py --out device_profile.json
    python launch/plan.py --device-profile device_profile.json --gpus 8 --model-size smollm2-135m ...

Measures matmul FLOP/s (f32; bf16 inputs with f32 accumulation) per device and for all devices at
once, memory bandwidth, all-reduce / all-gather α and β over all devices, and the fixed per-layer and
per-decode-step costs, and the backward pass's rate relative to the forward's.  On fake CPU
devices (which share the host's cores) the all-devices rates are
recorded as host caps, so the simulators do not assume that more fake devices mean more compute.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrl_hf.placement.calibration import calibrate_device  # noqa: E402
from jaxrl_hf.placement.cluster import device_to_dict  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="device_profile.json", help="where to write the JSON profile")
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats, f32 only (for tests)")
    args = ap.parse_args(argv)
    spec, raw = calibrate_device(quick=args.quick)
    profile = {"device": device_to_dict(spec), "measurements": raw}
    Path(args.out).write_text(json.dumps(profile, indent=2))
    g = 1e9
    print(f"| quantity | value |\n|---|---|\n"
          f"| devices | {raw['num_devices']} x {raw['platform']} ({raw['cpu_count']} host cores) |\n"
          f"| matmul f32, 1 device / all | {raw['matmul_f32_1dev'] / g:.1f} / {raw['matmul_f32_all'] / g:.1f} GFLOP/s |\n"
          f"| matmul bf16 (f32 acc), 1 device / all | {raw['matmul_bf16_1dev'] / g:.1f} / "
          f"{raw['matmul_bf16_all'] / g:.1f} GFLOP/s |\n"
          f"| memory bandwidth, 1 device / all | {raw['membw_1dev'] / g:.1f} / {raw['membw_all'] / g:.1f} GB/s |\n"
          f"| all-reduce α / β | {raw['all_reduce_alpha_s'] * 1e6:.1f} us / {raw['all_reduce_bw'] / g:.2f} GB/s |\n"
          f"| all-gather α / β | {raw['all_gather_alpha_s'] * 1e6:.1f} us / {raw['all_gather_bw'] / g:.2f} GB/s |\n"
          f"| per-layer / per-decode-step overhead | {raw['layer_overhead_s'] * 1e6:.1f} / "
          f"{raw['decode_step_overhead_s'] * 1e6:.1f} us |\n"
          f"| backward / forward rate | {raw['backward_efficiency']:.2f} |")
    print(f"profile written to {args.out}")
    return profile


if __name__ == "__main__":
    main()
