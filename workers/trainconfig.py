"""What ``qps train`` runs (:class:`TrainConfig`), and the checks that refuse, before
anything starts, the settings a role would refuse (:func:`check_model`,
:func:`check_data`, :meth:`TrainConfig.check`). :mod:`workers.launcher` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qps import keys
from qps.errors import InvalidArgumentError
from qps.optimizers import make_optimizer
from workers.data import BUILTIN
from workers.models import build_model
from workers.models.base import Model
from workers.workerconfig import WorkerConfig

__all__ = ["BUILTIN_TRAIN_SIZES", "TrainConfig", "check_data", "check_model"]

#: the training examples of each built-in data set (workers.data.builtin_split): a
#: batch must not be larger
BUILTIN_TRAIN_SIZES = {"digits": 1437, "teacher": 60_000, "ctr": 50_000}


def check_model(spec: str) -> Model:
    """The model ``spec`` names (:func:`workers.models.build_model`), built as a worker
    builds it.

    Raises:
        InvalidArgumentError: it names none, or building it fails (a ``py:`` model's
            own error, whatever its type, is reported as this too).
    """
    try:
        return build_model(spec)
    except InvalidArgumentError:
        raise
    except Exception as exc:
        raise InvalidArgumentError(
            f"model {spec!r} cannot be built: {type(exc).__name__}: {exc}"
        ) from exc


def check_data(data: str, model: Model, batch_size: int | None = None) -> None:
    """Refuse a ``--data`` a worker would refuse, without reading the data: a built-in
    name (``ctr`` with an embedding-bag model; a batch no larger than its training
    split), ``queue:NAME`` with a valid name, or an ``.npz`` file that holds ``x`` and
    ``y`` (or exactly two arrays).

    Raises:
        InvalidArgumentError: what is wrong.
    """
    if data.startswith("queue:"):
        try:
            keys.check_name(data[len("queue:") :])
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--data {data}: {exc}") from None
        return
    if data in BUILTIN:
        if data == "ctr" and not getattr(model, "vocab", None):
            raise InvalidArgumentError("--data ctr needs an embedding-bag model (embbag:...)")
        size = BUILTIN_TRAIN_SIZES[data]
        if batch_size is not None and batch_size > size:
            raise InvalidArgumentError(
                f"--batch-size {batch_size} is larger than the {size:,} training examples "
                f"of --data {data}"
            )
        return
    if not data.endswith(".npz"):
        raise InvalidArgumentError(
            f"--data {data!r} is not one of {', '.join(BUILTIN)}, queue:NAME or an .npz file"
        )
    try:
        with np.load(data, allow_pickle=False) as z:
            names = list(z.files)
    except OSError as exc:
        raise InvalidArgumentError(f"--data {data}: {exc.strerror or exc}") from None
    except Exception as exc:  # not a zip, a damaged one
        raise InvalidArgumentError(f"--data {data} is not an .npz file: {exc}") from None
    if len(names) != 2 and not ({"x", "X"} & set(names) and {"y", "Y"} & set(names)):
        raise InvalidArgumentError(
            f"--data {data}: expected arrays 'x' and 'y' (or exactly two), got {names}"
        )


@dataclass
class TrainConfig:
    """What ``qps train`` takes (see its ``--help``)."""

    num_shards: int = 2
    num_workers: int = 3
    model: str = "mlp:64,128,10"
    data: str = "digits"
    batch_size: int = 64
    steps: int = 1500
    optimizer: str = "sgd"
    learning_rate: float = 0.05
    max_staleness: int | None = None
    #: synchronous training: updates average this many workers' gradients (TF's
    #: replicas_to_aggregate; the rest of num_workers are backups); None: asynchronous
    sync_replicas: int | None = None
    #: messages a shard takes ahead and applies in one group (``qps ps --max-group``):
    #: bigger groups apply faster, but every message read ahead is one more update a
    #: gradient can be stale by
    max_group: int = 8
    #: the job's largest gradient message in MiB (``qps ps --max-message-mib``; None:
    #: qps.ps.control.DEFAULT_MAX_MESSAGE_BYTES); 2048 means the wire's limit
    max_message_mib: int | None = None
    seed: int = 1
    url: str | None = None
    container: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    #: the chief keeps this many of its newest checkpoints (0: all)
    checkpoint_keep: int = 5
    #: the workers stop once the job's global step reaches this (None: their steps)
    until_global_step: int | None = None
    log_every: int = 100
    #: serve each role's Prometheus metrics on metrics_port + k (see metrics_ports)
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: each worker writes TensorBoard scalars under logdir/worker-<index>/
    logdir: str | None = None
    #: how often a role that dies (a non-zero exit, a signal) is started again, as a
    #: process manager would, before its failure counts: a killed shard comes back and
    #: takes over its lease at once; a killed worker resumes after its last published
    #: step. 0: never.
    restarts: int = 3
    #: where the workers' math runs (``qps worker --backend``); "": each worker's
    #: default ($QPS_BACKEND, else auto)
    backend: str = ""
    #: the dtype the workers send gradients in (``qps worker --grad-dtype``); "": the
    #: variables' own
    grad_dtype: str = ""
    #: store a small dense model packed (``qps worker --pack``)
    pack: bool = True
    extra_worker_args: list[str] = field(default_factory=list)
    #: set in every role's environment (QPS_LOG_LEVEL, QPS_LOG_JSON: `qps --log-level`)
    role_env: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Refuse what a role would refuse as a usage error, before any starts: the
        model spec, the optimizer and its learning rate, the data, the container and
        every other worker setting (:meth:`workers.worker.WorkerConfig.check`).

        Raises:
            InvalidArgumentError: the first setting that cannot work.
        """
        if self.container is not None:
            keys.check_container(self.container)
        WorkerConfig(
            index=0,
            num_workers=self.num_workers,
            num_shards=self.num_shards,
            model=self.model,
            data=self.data,
            batch_size=self.batch_size,
            steps=self.steps,
            until_global_step=self.until_global_step,
            max_staleness=self.max_staleness,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            checkpoint_keep=self.checkpoint_keep,
            backend=self.backend,
            grad_dtype=self.grad_dtype,
        ).check()
        make_optimizer(self.optimizer, learning_rate=self.learning_rate)
        check_data(self.data, check_model(self.model), self.batch_size)

    def metrics_ports(self) -> dict[str, int]:
        """Role name -> its metrics port: ``ps0``.. then ``worker0``.. from
        ``metrics_port`` up (all 0 with a base of 0); empty without one."""
        if self.metrics_port is None:
            return {}
        names = [f"ps{i}" for i in range(self.num_shards)]
        names += [f"worker{k}" for k in range(self.num_workers)]
        base = self.metrics_port
        return {name: base + k if base else 0 for k, name in enumerate(names)}

    def _metrics_args(self, role: str) -> list[str]:
        port = self.metrics_ports().get(role)
        if port is None:
            return []
        return ["--metrics-port", str(port), "--metrics-addr", self.metrics_addr]

    def worker_args(self, index: int, url: str, container: str) -> list[str]:
        args = [
            "worker", "--index", str(index), "--num-workers", str(self.num_workers),
            "--num-shards", str(self.num_shards), "--model", self.model, "--data", self.data,
            "--batch-size", str(self.batch_size), "--steps", str(self.steps),
            "--seed", str(self.seed), "--log-every", str(self.log_every),
            "--url", url, "--container", container, "--no-finish-job",
        ]  # fmt: skip
        if self.max_staleness is not None:
            args += ["--max-staleness", str(self.max_staleness)]
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir]
            if self.checkpoint_every:
                args += ["--checkpoint-every", str(self.checkpoint_every)]
            args += ["--checkpoint-keep", str(self.checkpoint_keep)]
        if self.until_global_step is not None:
            args += ["--until-global-step", str(self.until_global_step)]
        if self.logdir:
            args += ["--logdir", self.logdir]
        if self.backend:
            args += ["--backend", self.backend]
        if self.grad_dtype:
            args += ["--grad-dtype", self.grad_dtype]
        if not self.pack:
            args.append("--no-pack")
        return args + self._metrics_args(f"worker{index}") + self.extra_worker_args

    def shard_args(self, index: int, url: str, container: str) -> list[str]:
        return [
            "ps", "--shard", str(index), "--num-shards", str(self.num_shards),
            "--optimizer", self.optimizer, "--lr", str(self.learning_rate),
            "--max-group", str(self.max_group), "--url", url, "--container", container,
            *self._metrics_args(f"ps{index}"),
        ]  # fmt: skip
