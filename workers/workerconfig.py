"""What a worker is told (:class:`WorkerConfig`, ``qps worker``'s options) and what it
reports when it ends (:class:`WorkerResult`)."""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass, field
from typing import Any

from qps import backend
from qps.errors import InvalidArgumentError
from qps.ps.messages import GRAD_DTYPES

__all__ = ["LOSS_WINDOW", "WorkerConfig", "WorkerResult"]


@dataclass
class WorkerConfig:
    """What ``qps worker`` takes (see its ``--help``)."""

    index: int  # -1: claim one (--index auto)
    num_workers: int
    num_shards: int | None = None
    model: str = "mlp:64,128,10"
    data: str = "digits"
    #: held-out data the chief evaluates on: a built-in name or an .npz file (None: the
    #: test split of ``data`` when it is built in)
    eval_data: str | None = None
    batch_size: int = 64
    steps: int | None = 1500
    until_global_step: int | None = None
    seed: int = 1
    url: str | None = None
    container: str = "default"
    max_staleness: int | None = None
    log_every: int = 100
    ready_timeout: float = 600.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 5  # the chief keeps its newest N checkpoints (0: all)
    evaluate: bool = True
    finish_job: bool = True
    logdir: str | None = None  # TensorBoard scalars under logdir/worker-<index>/
    #: where the math runs: auto (CuPy for a model over INLINE_PARAMS dense parameters
    #: where a CUDA device exists), numpy or cupy; "" takes $QPS_BACKEND, else auto
    backend: str = ""
    #: the dtype gradients travel in ("" : the variables' own); "float16" halves the
    #: bytes of float32 gradients, the shard widens them before the apply
    grad_dtype: str = ""
    #: store a small dense model's parameters packed into one flat variable per PS shard
    #: (workers.models.auto_packed); the chief decides for the job, the others follow
    pack: bool = True

    def check(self) -> None:
        """Raises InvalidArgumentError for settings that cannot work."""
        self.array_module()
        if self.grad_dtype not in ("", *GRAD_DTYPES):
            raise InvalidArgumentError(
                f"grad dtype {self.grad_dtype!r} is not one of {', '.join(GRAD_DTYPES)}"
            )
        if self.num_workers < 1 or not -1 <= self.index < self.num_workers:
            raise InvalidArgumentError(
                f"worker index {self.index} is not in [0, {self.num_workers}) workers"
            )
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch size must be >= 1, got {self.batch_size}")
        if self.steps is not None and self.steps < 0:
            raise InvalidArgumentError(f"steps must be >= 0, got {self.steps}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgumentError(f"max staleness must be >= 0, got {self.max_staleness}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidArgumentError("checkpoint_every needs a checkpoint directory")
        if self.checkpoint_keep < 0:
            raise InvalidArgumentError(f"checkpoint keep must be >= 0, got {self.checkpoint_keep}")

    def backend_choice(self) -> str:
        """``auto``, ``numpy`` or ``cupy``: ``backend``, else ``$QPS_BACKEND``, else auto."""
        return (self.backend or os.environ.get(backend.ENV_VAR) or "auto").strip().lower()

    def array_module(self) -> Any:
        """NumPy or CuPy, as ``backend`` (or ``$QPS_BACKEND``) asks.

        Raises:
            InvalidArgumentError: cupy asked for where CuPy or a CUDA device is missing.
        """
        what = "backend" if self.backend else backend.ENV_VAR
        try:
            return backend.choose(self.backend or os.environ.get(backend.ENV_VAR), what)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(str(exc)) from None

    @property
    def name(self) -> str:
        return f"worker{self.index}"


#: losses a WorkerResult keeps (the most recent)
LOSS_WINDOW = 1000


@dataclass
class WorkerResult:
    """What one worker did."""

    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    last_loss: float = math.nan
    global_step: int = 0
    test_metric: str = ""  # "accuracy" or "auc" (see evaluate_params)
    test_value: float | None = None
    stopped_by: str = ""
    waited_ms: int = 0  # time spent waiting on slower workers (SSP)
    started_at: float = 0.0  # wall clock (time.time()) of the first step
    ended_at: float = 0.0  # and of the end of the last one
    #: the last LOSS_WINDOW losses (bounded: a long run must not grow the worker)
    losses: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LOSS_WINDOW)
    )

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0
