"""Device and cluster descriptions for the placement simulators.

A `DeviceSpec` holds *effective* rates (what a well-written kernel reaches), either derived from the
published datasheet constants below times stated achievable fractions, or measured on the current
machine by `launch/calibrate.py` (then loaded with `load_device_profile`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Effective per-device constants used by the simulators.

    matmul_flops: dtype name ("bf16", "f32") → sustained matmul FLOP/s of one device.
    mem_bandwidth: sustained device-memory bytes/s.  intra_node_bw / inter_node_bw: per-device
    bytes/s of one direction of a ring collective inside a node (NVLink) and across nodes (NIC).
    collective_latency_s: α of one collective hop.  layer_overhead_s: fixed cost of launching one
    decoder layer's kernels in one forward pass (dominates small decode steps).
    decode_step_overhead_s: fixed cost per generated token step of the generation engine
    (scheduling, sampling, detokenisation), independent of the model size.
    backward_efficiency: rate of the backward pass (2× the forward FLOPs) relative to the forward
    matmul rate; 1.0 for GPU GEMMs, measured on hosts whose backward kernels are slower.
    host_flops_cap / host_bw_cap: when the "devices" share one host (fake XLA CPU devices), the
    aggregate rate of all of them together; None for real accelerators.
    """

    name: str
    memory_bytes: float
    matmul_flops: dict[str, float]
    mem_bandwidth: float
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int = 8
    collective_latency_s: float = 10e-6
    layer_overhead_s: float = 20e-6
    decode_step_overhead_s: float = 0.0
    backward_efficiency: float = 1.0
    usable_memory_fraction: float = 0.9
    host_flops_cap: dict[str, float] | None = None
    host_bw_cap: float | None = None
    source: str = "published"

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "mem_bandwidth", "intra_node_bw", "inter_node_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceSpec {self.name}: {field} must be > 0, got {getattr(self, field)}")
        if not self.matmul_flops or any(v <= 0 for v in self.matmul_flops.values()):
            raise ValueError(f"DeviceSpec {self.name}: matmul_flops needs positive rates, got {self.matmul_flops}")
        if not 0 < self.backward_efficiency <= 1.5:
            raise ValueError(f"DeviceSpec {self.name}: backward_efficiency must be in (0, 1.5], got "
                             f"{self.backward_efficiency}")
        if self.devices_per_node < 1:
            raise ValueError(f"DeviceSpec {self.name}: devices_per_node must be >= 1")

    def flops(self, dtype: str) -> float:
        """Sustained matmul FLOP/s of one device for `dtype`."""
        if dtype not in self.matmul_flops:
            raise ValueError(f"device {self.name} has no matmul rate for dtype {dtype!r}; has {sorted(self.matmul_flops)}")
        return self.matmul_flops[dtype]

    def group_flops(self, dtype: str, n: int) -> float:
        """Aggregate FLOP/s of n devices working together (capped for host-shared devices)."""
        rate = n * self.flops(dtype)
        if self.host_flops_cap is not None:
            rate = min(rate, self.host_flops_cap.get(dtype, rate))
        return rate

    def group_bandwidth(self, n: int) -> float:
        """Aggregate memory bytes/s of n devices (capped for host-shared devices)."""
        bw = n * self.mem_bandwidth
        return min(bw, self.host_bw_cap) if self.host_bw_cap is not None else bw

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction


# Datasheet constants (NVIDIA A100/H100/H200 SXM datasheets): dense tensor-core bf16 and plain fp32
# peak FLOP/s, HBM bytes/s, NVLink bytes/s per direction (total bidirectional / 2) and the per-GPU
# InfiniBand rate of the usual DGX/HGX node (A100: HDR 200 Gb/s, H100/H200: NDR 400 Gb/s).
PUBLISHED: dict[str, dict[str, float]] = {
    "a100-40gb": dict(memory=40 * GIB, bf16=312e12, f32=19.5e12, hbm=1.555e12, nvlink=300e9, ib=25e9),
    "a100-80gb": dict(memory=80 * GIB, bf16=312e12, f32=19.5e12, hbm=2.039e12, nvlink=300e9, ib=25e9),
    "h100-80gb": dict(memory=80 * GIB, bf16=989e12, f32=67e12, hbm=3.35e12, nvlink=450e9, ib=50e9),
    "h200-141gb": dict(memory=141e9, bf16=989e12, f32=67e12, hbm=4.8e12, nvlink=450e9, ib=50e9),
}
ALIASES = {"a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "h100": "h100-80gb",
           "h200": "h200-141gb"}

# Achievable fractions of the datasheet peaks (assumptions, stated so they can be changed):
# large-GEMM efficiency, STREAM-like HBM efficiency, NCCL ring bus-bandwidth efficiency.
ACHIEVABLE = dict(matmul=0.6, hbm=0.8, link=0.8)
# Per-token-step engine overhead of a GPU generation engine (vLLM-style scheduler + sampler), an
# assumption of the order reported for vLLM before multi-step scheduling.
ENGINE_STEP_OVERHEAD_S = 2e-3


def published_device(name: str) -> DeviceSpec:
    """A DeviceSpec from the datasheet table times the ACHIEVABLE fractions ("a100" = A100-80GB)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PUBLISHED:
        raise ValueError(f"unknown GPU {name!r}; valid: {sorted(PUBLISHED) + sorted(ALIASES)}")
    c = PUBLISHED[key]
    return DeviceSpec(
        name=key, memory_bytes=c["memory"],
        matmul_flops={"bf16": c["bf16"] * ACHIEVABLE["matmul"], "f32": c["f32"] * ACHIEVABLE["matmul"]},
        mem_bandwidth=c["hbm"] * ACHIEVABLE["hbm"], intra_node_bw=c["nvlink"] * ACHIEVABLE["link"],
        inter_node_bw=c["ib"] * ACHIEVABLE["link"], devices_per_node=8,
        decode_step_overhead_s=ENGINE_STEP_OVERHEAD_S, source="published",
    )


PROFILE_KEYS = ("name", "memory_bytes", "matmul_flops", "mem_bandwidth", "intra_node_bw", "inter_node_bw",
                "devices_per_node", "collective_latency_s", "layer_overhead_s", "decode_step_overhead_s",
                "backward_efficiency", "host_flops_cap", "host_bw_cap")


def device_to_dict(device: DeviceSpec) -> dict:
    return dataclasses.asdict(device)


def load_device_profile(path: str | Path) -> DeviceSpec:
    """Load a JSON device profile written by `launch/calibrate.py` (key "device")."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read device profile {path}: {e}") from e
    data = raw.get("device", raw)
    missing = [k for k in PROFILE_KEYS if k not in data]
    if missing:
        raise ValueError(f"device profile {path} lacks keys {missing}; expected {list(PROFILE_KEYS)}")
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"device profile {path} has unknown keys {unknown}; valid: {sorted(known)}")
    return DeviceSpec(**{**data, "source": data.get("source", f"measured:{path.name}")})


@dataclasses.dataclass(frozen=True)
class Cluster:
    """N homogeneous devices, `device.devices_per_node` per node."""

    device: DeviceSpec
    num_devices: int

    def __post_init__(self) -> None:
        n, per = self.num_devices, self.device.devices_per_node
        if n < 1:
            raise ValueError(f"Cluster.num_devices must be >= 1, got {n}")
        if n > per and n % per:
            raise ValueError(f"Cluster.num_devices={n} must be a multiple of devices_per_node={per} beyond one node")

    def allocation_sizes(self) -> tuple[int, ...]:
        """Device counts a colocated set may receive: powers of two up to one node, then whole
        nodes (HybridFlow allocates in units of a node's devices beyond one node)."""
        per = self.device.devices_per_node
        sizes = []
        s = 1
        while s < per and s <= self.num_devices:
            sizes.append(s)
            s *= 2
        sizes += list(range(per, self.num_devices + 1, per))
        return tuple(sorted(set(sizes)))

    def link_bandwidth(self, group_span: int) -> float:
        """Per-device bandwidth of a collective whose group spans `group_span` consecutive ranks:
        NVLink-class inside one node, the NIC across nodes."""
        return self.device.intra_node_bw if group_span <= self.device.devices_per_node else self.device.inter_node_bw
