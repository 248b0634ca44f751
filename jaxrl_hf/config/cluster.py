"""verl's cluster keys ``trainer.nnodes`` / ``trainer.n_gpus_per_node`` and the actor pool's ``placement``.

One identity ties them: ``nnodes × n_gpus_per_node = placement.num_processes × placement.devices_per_process``
(the actor pool's devices), with the same number of processes on every node. On a GPU cluster a process owns
one GPU (``devices_per_process`` 1), so ``n_gpus_per_node`` is the number of processes per node; on CPU
(tests, development) a "GPU" of a node is one XLA host device. Whichever side is left null is derived from
the other; both given and disagreeing is an error naming the four keys. ``placement.train.dp`` left null
becomes the devices over ``pp·tp``, so ``trainer.nnodes=2 trainer.n_gpus_per_node=8`` sizes a run alone.

``nnodes`` set (also by ``n_gpus_per_node`` alone, as verl's default 1) pins the actor pool to exactly that
many Ray nodes (`jaxrl_hf.controller.ResourcePool` ``nnodes``); left null, the pool goes wherever it fits.
"""

from __future__ import annotations

import dataclasses

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.schema import RunConfig


def _check_positive(key: str, value: int | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"config key '{key}'={value!r}: must be > 0")


def resolve_cluster(config: RunConfig) -> RunConfig:
    """A copy of ``config`` with ``trainer.nnodes``/``n_gpus_per_node`` and ``placement.num_processes``/
    ``train.dp`` filled in and checked against each other (see the module docstring)."""
    t, p = config.trainer, config.placement
    for key, value in (("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node),
                       ("placement.num_processes", p.num_processes),
                       ("placement.devices_per_process", p.devices_per_process)):
        _check_positive(key, value)
    nnodes, per_node, processes, per_process = t.nnodes, t.n_gpus_per_node, p.num_processes, p.devices_per_process
    if nnodes is None and per_node is None:
        processes = processes or 1
    else:
        nnodes = nnodes or 1
        if per_node is None:
            processes = processes or nnodes
            if processes % nnodes:
                raise ConfigError(
                    f"config key 'placement.num_processes'={processes}: must be a multiple of trainer.nnodes={nnodes} "
                    "(every node runs the same number of the actor pool's processes)")
            per_node = processes // nnodes * per_process
        else:
            if per_node % per_process:
                raise ConfigError(
                    f"config key 'trainer.n_gpus_per_node'={per_node}: must be a multiple of "
                    f"placement.devices_per_process={per_process} (a process's devices are on one node)")
            derived = nnodes * per_node // per_process
            if processes is not None and processes != derived:
                raise ConfigError(
                    f"config keys 'trainer.nnodes' x 'trainer.n_gpus_per_node' = {nnodes} x {per_node} = "
                    f"{nnodes * per_node} devices, but 'placement.num_processes' x 'placement.devices_per_process'"
                    f" = {processes} x {per_process} = {processes * per_process}; set one side (the other is "
                    "derived) or make them agree")
            processes = derived
    train = p.train
    if train.dp is None and train.pp > 0 and train.tp > 0:
        devices = processes * per_process
        if devices % (train.pp * train.tp):
            raise ConfigError(
                f"config keys 'placement.train.{{pp,tp}}'=({train.pp},{train.tp}): pp*tp={train.pp * train.tp} must "
                f"divide the actor pool's {devices} devices (placement.num_processes*devices_per_process) to derive "
                "placement.train.dp; or set placement.train.dp")
        train = dataclasses.replace(train, dp=devices // (train.pp * train.tp))
    config = dataclasses.replace(config)
    config.trainer = dataclasses.replace(t, nnodes=nnodes, n_gpus_per_node=per_node)
    config.placement = dataclasses.replace(p, num_processes=processes, train=train)
    return config


__all__ = ["resolve_cluster"]
