"""Errors the controller raises on the driver, each naming the pool, role, rank and method involved."""

from __future__ import annotations


class ControllerError(RuntimeError):
    """Base class of the controller's errors."""


class WorkerMethodError(ControllerError):
    """A worker method (or a role's ``__init__``) raised on some rank; carries the remote traceback."""

    def __init__(self, role: str, rank: int, method: str, remote_type: str, remote_traceback: str):
        self.role, self.rank, self.method = role, rank, method
        self.remote_type, self.remote_traceback = remote_type, remote_traceback
        super().__init__(
            f"role {role!r} rank {rank} method {method!r} raised {remote_type}; remote traceback:\n"
            f"{remote_traceback.rstrip()}"
        )

    def __reduce__(self):  # keeps the fields when Ray pickles the exception
        return type(self), (self.role, self.rank, self.method, self.remote_type, self.remote_traceback)


class WorkerDiedError(ControllerError):
    """The process behind a rank died (killed, crashed, out of memory) while serving a call."""

    def __init__(self, pool: str, role: str, rank: int, method: str, reason: str):
        self.pool, self.role, self.rank, self.method, self.reason = pool, role, rank, method, reason
        super().__init__(
            f"process of pool {pool!r} rank {rank} died while role {role!r} ran {method!r}: {reason}"
        )

    def __reduce__(self):
        return type(self), (self.pool, self.role, self.rank, self.method, self.reason)


class PoolBrokenError(ControllerError):
    """A call was made on a pool whose multi-controller program lost a process earlier."""


class WorkerTimeoutError(ControllerError):
    """Some ranks did not answer a call within the timeout (a hung process, a deadlocked collective)."""

    def __init__(self, pool: str, role: str, method: str, ranks: list[int], timeout_s: float):
        self.pool, self.role, self.method, self.ranks, self.timeout_s = pool, role, method, list(ranks), timeout_s
        super().__init__(
            f"pool {pool!r} role {role!r} method {method!r}: ranks {self.ranks} did not answer within {timeout_s:g} s "
            f"(trainer.worker_timeout_s); a hung or stopped process, or a collective waiting for one"
        )

    def __reduce__(self):
        return type(self), (self.pool, self.role, self.method, self.ranks, self.timeout_s)
