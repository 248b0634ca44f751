"""Controller overhead vs plain Ray actor calls, and worker->worker futures vs going via the driver.

Measured side by side in one Ray cluster:

* empty call: ``group.noop()`` (ONE_TO_ALL over the pool's ranks) vs ``ray.get([a.noop.remote()])``
  on the same number of plain Ray actors;
* a Batch of 1 / 16 / 64 MB through DP dispatch: ``group.consume(batch)`` (DP_COMPUTE_METRIC, split
  across ranks, small result) and ``group.echo(batch)`` (DP_COMPUTE round trip, concatenated) vs
  the same split / concat done by hand around plain Ray actor calls;
* passing a producer group's output to a consumer group on another pool: the future itself
  (worker->worker) vs fetching to the driver and sending it again.

Usage: ``python launch/bench/bench_controller.py [--json OUT] [--repeats N] [--processes P]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import ray

from jaxrl_hf.controller import Batch, Dispatch, ResourcePool, Worker, WorkerGroup, ensure_ray, register

MB = 1 << 20


def make_batch(megabytes: int, seed: int = 0) -> Batch:
    """A Batch of ``megabytes`` of float32 rows of 1024 values plus an int id column."""
    rows = megabytes * MB // (1024 * 4)
    data = np.random.default_rng(seed).standard_normal((rows, 1024), dtype=np.float32)
    return Batch.from_dict({"x": data, "id": np.arange(rows)})


class BenchWorker(Worker):
    """Methods whose bodies cost ~nothing, so the timings are transport + controller overhead."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def consume(self, batch: Batch) -> int:
        return int(batch.nbytes)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def produce(self, seeds: Batch, megabytes: int) -> Batch:
        """``megabytes`` of rows made in this process per seed row (a stand-in for rollouts; filled
        with a constant so that producing costs little next to moving the data)."""
        rows = megabytes * MB // (1024 * 4)
        return Batch.concat([
            Batch.from_dict({"x": np.full((rows, 1024), float(s), np.float32), "id": np.arange(rows)})
            for s in seeds["seed"]
        ])


class PlainActor:
    """The peer: a plain Ray actor with the same method bodies."""

    def noop(self) -> None:
        return None

    def consume(self, arrays: dict) -> int:
        return int(sum(a.nbytes for a in arrays.values() if a.dtype != object))

    def echo(self, arrays: dict) -> dict:
        return arrays


def paired(controller: Callable[[], object], peer: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall times (ms) of two functions timed alternately, so both see the same machine load
    (one warm-up call each first)."""
    controller(), peer()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((controller, samples[0]), (peer, samples[1])):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def plain_split(batch: Batch, parts: int) -> list[dict]:
    """What the DP dispatch does, by hand: equal row chunks of every column."""
    return [{k: v for k, v in chunk.to_dict().items()} for chunk in batch.chunk(parts)]


def run(repeats: int, processes: int) -> list[dict]:
    ensure_ray()
    pool_a = ResourcePool("bench_a", num_processes=processes, devices_per_process=1)
    pool_b = ResourcePool("bench_b", num_processes=processes, devices_per_process=1)
    group = WorkerGroup(pool_a, BenchWorker, role="bench")
    consumer = WorkerGroup(pool_b, BenchWorker, role="consumer")
    actors = [ray.remote(num_cpus=0.25)(PlainActor).remote() for _ in range(processes)]
    ray.get([a.noop.remote() for a in actors])
    rows = []

    def add(case: str, timings: tuple[float, float], peer: str) -> None:
        controller_ms, peer_ms = timings
        rows.append({"case": case, "controller_ms": controller_ms, "peer": peer, "peer_ms": peer_ms,
                     "ratio": controller_ms / peer_ms})
        print(f"{case:<34} {controller_ms:>10.2f} {peer:<26} {peer_ms:>10.2f} {controller_ms / peer_ms:>7.2f}")

    print(f"{'case':<34} {'ctrl ms':>10} {'peer':<26} {'peer ms':>10} {'ratio':>7}")
    add("empty call", paired(group.noop, lambda: ray.get([a.noop.remote() for a in actors]), repeats * 5),
        "plain ray actor calls")
    for megabytes in (1, 16, 64):
        batch = make_batch(megabytes)
        reps = repeats if megabytes < 64 else max(3, repeats // 2)

        def plain_in() -> list:
            return ray.get([a.consume.remote(c) for a, c in zip(actors, plain_split(batch, processes))])

        def plain_round_trip() -> dict:
            outs = ray.get([a.echo.remote(c) for a, c in zip(actors, plain_split(batch, processes))])
            return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}

        add(f"DP dispatch {megabytes} MB (in)", paired(lambda: group.consume(batch), plain_in, reps),
            "split + plain ray calls")
        add(f"DP round trip {megabytes} MB", paired(lambda: group.echo(batch), plain_round_trip, reps),
            "split + plain ray + concat")
    seeds = Batch.from_dict({"seed": np.arange(processes)})
    for megabytes in (16, 64):
        reps = max(3, repeats // 2)
        add(f"future {megabytes * processes} MB worker->worker",
            paired(lambda: consumer.consume(group.produce(seeds, megabytes)),
                   lambda: consumer.consume(group.produce(seeds, megabytes).get()), reps),
            "fetch to driver + resend")
    pool_a.shutdown()
    pool_b.shutdown()
    for actor in actors:
        ray.kill(actor)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per case (median)")
    parser.add_argument("--processes", type=int, default=2, help="processes per pool / plain actors")
    args = parser.parse_args()
    rows = run(args.repeats, args.processes)
    if args.json:
        meta = {"machine": platform.platform(), "processes": args.processes, "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
