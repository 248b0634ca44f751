"""The device memory a rollout engine gives back when it sleeps and takes again when it wakes.

`SleepMeter.measure("sleep" | "wake", action)` reads the device's free memory (``torch.cuda.mem_get_info``)
around the action and adds the difference to the bytes freed / regained since the last `metrics` call, which
the actor logs with its update (``perf/rollout_sleep_freed_bytes``, ``perf/rollout_wake_regained_bytes``) and
the module logger reports at INFO. On CPU (vLLM's CPU backend cannot sleep) nothing is measured and no metric
is produced. The CUDA branch has not run on hardware here (no accelerator was available to this project).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def cuda_free_bytes(torch_device: str) -> int:
    """Free memory of a CUDA device as the driver reports it (after the device's queued work is done)."""
    import torch

    torch.cuda.synchronize(torch_device)
    return int(torch.cuda.mem_get_info(torch_device)[0])


class SleepMeter:
    """Bytes freed by sleeping and regained by waking, measured as the device's free memory changes.

    ``free_bytes``: a function returning the device's free bytes (default `cuda_free_bytes` on
    ``torch_device``); ``torch_device=None`` (the host) measures nothing."""

    def __init__(self, torch_device: str | None, free_bytes: Callable[[str], int] = cuda_free_bytes) -> None:
        self.torch_device = torch_device if torch_device and torch_device != "cpu" else None
        self._free_bytes = free_bytes
        self.freed = 0
        self.regained = 0
        self.events = 0

    def measure(self, kind: str, action: Callable[[], Any]) -> Any:
        """Run ``action`` (a sleep when ``kind == "sleep"``, else a wake-up) and account for the memory."""
        if self.torch_device is None:
            return action()
        before = self._free_bytes(self.torch_device)
        result = action()
        delta = self._free_bytes(self.torch_device) - before
        self.events += 1
        if kind == "sleep":
            self.freed += delta
            logger.info("rollout engine sleep on %s: freed %.1f MiB", self.torch_device, delta / 2**20)
        else:
            self.regained -= delta
            logger.info("rollout engine wake-up on %s: regained %.1f MiB", self.torch_device, -delta / 2**20)
        return result

    def metrics(self) -> dict[str, float]:
        """The bytes freed / regained since the previous call (nothing when no event was measured)."""
        if not self.events:
            return {}
        out = {"perf/rollout_sleep_freed_bytes": float(self.freed),
               "perf/rollout_wake_regained_bytes": float(self.regained)}
        self.freed = self.regained = self.events = 0
        return out


__all__ = ["SleepMeter", "cuda_free_bytes"]
