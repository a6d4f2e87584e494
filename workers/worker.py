"""The worker role (``qps worker``): TF 1.x's between-graph replicated training.

Worker ``I`` of ``W`` opens its own :class:`qps.Session` in the job's container and
loops: take a batch, read the parameters straight from Redis (the PS processes are not
involved), compute the loss and gradients, push one gradient message per PS shard.

* **Chief** (worker 0) initialises the variables (or restores the newest checkpoint of
  ``checkpoint_dir`` into an empty container) and marks the model ready; the others
  block until it has (:func:`workers.job.wait_ready`). While training it writes a
  checkpoint every ``checkpoint_every`` global steps, and at the end it evaluates the
  final parameters on the test split.
* **Input**: ``data="digits"`` or a ``.npz`` path: each worker holds the data and draws
  W4's minibatches (worker ``k``: a fresh permutation per epoch from
  ``default_rng(seed + k)``); ``data="queue:NAME"``: batches are dequeued from a shared
  queue (fed by ``qps feed``) until it is closed and empty.
* **Overlap**: while step ``t`` computes, the batch of step ``t + 1`` is fetched; the
  push of ``t`` and the pull for ``t + 1`` travel together, as the job's step strategy
  (:mod:`workers.steps`: synchronous, sparse, inline or overlapped) has them. The math
  runs on a thread (NumPy releases the GIL) for models above :data:`INLINE_PARAMS`
  parameters, so the event loop stays free; a tiny model computes inline, where a
  thread hop would cost more than the math.
* **Backend** (``backend``, ``$QPS_BACKEND``): ``auto`` computes with CuPy where a CUDA
  device exists and the model has more than :data:`INLINE_PARAMS` dense parameters,
  else with NumPy; ``cupy`` and ``numpy`` force one. On the device each pulled
  parameter is copied there, the math runs on a thread, and the gradients come back to
  the host for the wire; the first step's math runs once untimed, so CuPy compiles its
  kernels before the clock starts.
* **Modes**: asynchronous (TF's default: every gradient is applied on arrival), or
  bounded staleness (``max_staleness=k``, SSP: a worker more than ``k`` steps ahead of
  the slowest running worker waits, blocked in Redis). Staleness in asynchronous mode
  is bounded by the shards' gradient queues, whose capacity makes a push wait.
* **End**: after ``steps`` steps, when the global step reaches ``until_global_step``,
  when the input queue ends, or on a stop request (:class:`qps.stopping.Stopper`):
  SIGTERM/SIGINT, or ``qps job stop`` (:func:`workers.job.request_stop`, waited for in
  Redis beside the training: :func:`workers.job.wait_stop_request`). It stops after
  the step in hand; a wait (for the chief, a batch of the input queue, a synchronous
  update's token, slower workers) is cut short at once. The last worker to
  finish marks the PS job finished, so the shards drain their queues and exit 0.

Each worker publishes its status (step, loss, examples/s, state) in the container for
``qps job status``/``qps top`` and logs progress every ``log_every`` steps; with
``logdir`` it also writes its training curves there (:mod:`qps.curves`: loss,
examples/s, staleness, and the chief's test accuracy at each log point).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import qps
from qps import backend, checkpoint, curves, packing
from qps import metrics as _metrics
from qps.errors import (
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
)
from qps.ps import control
from qps.ps.messages import GRAD_DTYPES
from qps.stopping import Stopped, Stopper
from workers import job, lifecycle
from workers.batches import Input
from workers.data import BUILTIN, auc, builtin_split, load_xy
from workers.models import (
    Model,
    Packed,
    auto_packed,
    build_model,
    grads_to_host,
    narrowed,
    packed_inner,
    params_to,
)
from workers.steps import steps_for
from workers.workerconfig import WorkerConfig, WorkerResult

__all__ = ["GRAD_DTYPES", "INLINE_PARAMS", "WorkerConfig", "WorkerResult", "run_worker"]

log = logging.getLogger("qps.worker")

#: models with at most this many dense parameters compute on the event loop's thread,
#: and with NumPy under ``--backend auto`` even where a GPU exists
INLINE_PARAMS = 200_000


def claimant() -> str:
    """Who claims a worker index with ``--index auto``: ``<host>:<pid>``, ``$HOSTNAME``
    first (a container's id in Docker, where the worker is pid 1: a restarted replica
    claims the same name, so it gets its index back; two workers on one machine differ
    by pid)."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}:{os.getpid()}"


def latest_checkpoint(directory: str | None) -> Path | None:
    """The newest checkpoint under ``directory`` (None: no directory, none yet)."""
    if not directory or not os.path.isdir(directory):
        return None
    return checkpoint.latest(directory)


async def evaluate_params(
    sess: qps.Session, model: Model, test: tuple[np.ndarray, ...]
) -> tuple[str, float]:
    """The test metric of the job's current parameters (whole tables pulled): the AUC
    for a model with one logit (CTR), else the accuracy."""
    got = await sess.pull([p.name for p in model.params_spec()])
    params = {n: v.value for n, v in got.items()}
    if getattr(model, "classes", 0) == 1 and hasattr(model, "logits"):
        scores = model.logits(params, test)
        return "auc", auc(np.asarray(scores)[:, 0], test[-1])
    return "accuracy", float(model.accuracy(params, test))


def _names(model: Model) -> set[str]:
    """The variables ``model`` trains."""
    return {p.name for p in model.params_spec()}


class Worker:
    """One worker process's training loop (use :func:`run_worker`)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        sess: qps.Session,
        metrics: _metrics.Metrics | None = None,
        stopper: Stopper | None = None,
    ) -> None:
        cfg.check()
        self.cfg = cfg
        self.sess = sess
        #: the model --model names, and the one trained: it packed where that pays
        #: (cfg.pack; the chief's choice is the job's, see prepare)
        self.base: Model = build_model(cfg.model)
        self._use(auto_packed(self.base, cfg.num_shards or 1) if cfg.pack else self.base)
        self.names = [f"worker{k}" for k in range(cfg.num_workers)]
        self.grad_dtype = np.dtype(cfg.grad_dtype) if cfg.grad_dtype else None
        #: SIGTERM, SIGINT, `qps job stop`: stop after the step in hand, cutting waits short
        self.stopper = stopper or Stopper()
        self.result = WorkerResult()
        self.metrics = (metrics or _metrics.default()).worker(cfg.container, cfg.name)
        self.curves: curves.ScalarWriter | None = None
        self._stale_seen: dict[int, int] = {}  # staleness histogram at the last curve point

    def _use(self, model: Model) -> None:
        """Train ``model`` (the one --model names, or it packed)."""
        self.model = model
        spec = model.params_spec()
        self.dense = [p.name for p in spec if not p.sparse]
        self.sparse = [p.name for p in spec if p.sparse]
        small = sum(p.size for p in spec if not p.sparse) <= INLINE_PARAMS
        self.xp = self.cfg.array_module()
        if small and self.cfg.backend_choice() == "auto":
            # a small model's step is faster on the host: W4's MLP took 0.08 ms in
            # NumPy and 0.68 ms in CuPy on an H200 (kernel launches and copies)
            self.xp = np
        #: a model small enough computes on the event loop's thread; on a GPU every
        #: step goes to a thread, which waits for the device while the loop runs on
        self.inline = self.xp is np and small

    # -- set-up ------------------------------------------------------------------------
    async def prepare(self) -> None:
        """The chief initialises or restores the model; every worker then waits for it.

        The job's model is the chief's: the others train it packed or not as the chief
        does (the model --model names either way; another model is an error)."""
        cfg, client, res = self.cfg, self.sess.client, self.result
        before = (await job.read_statuses(client, cfg.container)).get(cfg.name)
        if before and int(before.get("step") or 0) > 0:
            # an earlier run of this worker in this job (killed, then started again):
            # its steps count, and this run goes on after the last one it published
            res.steps, res.examples = int(before["step"]), int(before.get("examples") or 0)
            log.info(
                "%s: resuming after step %d, the last an earlier run of it published",
                cfg.name,
                res.steps,
            )
        if cfg.index == 0:
            how = await self._initialise()
            spec = self.model.spec
            ready = {"model": spec, "from": how}
            await job.mark_ready(client, cfg.container, cfg.num_workers, ready)
            log.info("%s: model %s ready (%s)", cfg.name, spec, how)
        else:  # seen waiting by `qps job status`, and stopped by `qps job stop`
            log.info("%s: waiting for the chief to make the model ready", cfg.name)
            await self._publish("waiting", 0.0)
        async with self.stopper.interruptible("waiting for the chief to make the model ready"):
            info = await job.wait_ready(client, cfg.container, cfg.index, cfg.ready_timeout)
        theirs = str(info.get("model"))
        if theirs == self.model.spec:
            return
        if (packed_inner(theirs) or theirs) != self.base.spec:
            raise InvalidArgumentError(
                f"the job's model is {theirs!r}, this worker was given {cfg.model!r}"
            )
        log.info("%s: the job trains %s (the chief's choice): so do I", cfg.name, theirs)
        self._use(build_model(theirs))

    async def _initialise(self) -> str:
        """Restore the newest checkpoint into an empty container, else create every
        variable that does not exist yet (first creator wins: a restarted chief keeps
        the trained values); then record the PS job's shard count if given."""
        cfg, client = self.cfg, self.sess.client
        how = ""
        if cfg.pack and cfg.num_shards is None and (parts := await self._stored_parts()):
            self._use(auto_packed(self.base, parts))
        existing = set(await self.sess.list_variables())
        wanted = _names(self.model)
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is not None and not wanted <= existing:
            if await checkpoint.container_is_empty(client, cfg.container):
                info = await checkpoint.restore(self.sess, path)
                how = f"restored {path} (global step {info.global_step})"
                existing = set(await self.sess.list_variables())
            else:
                log.warning(
                    "%s: container '%s' is not empty: checkpoint %s not restored",
                    cfg.name, cfg.container, path,
                )  # fmt: skip
        # the container (or the checkpoint) may hold the model stored the other way,
        # packed or not, or packed in as many parts as its PS job has shards (a chief
        # not told --num-shards): go on with what it holds
        others = [self.base, auto_packed(self.base, cfg.num_shards or 1)]
        if cfg.num_shards is None and (parts := await self._stored_parts()):
            others.insert(0, auto_packed(self.base, parts))  # {packed/0} <= 2 parts' names
        held = next((m for m in others if _names(m) <= existing), None)
        if not wanted <= existing and held is not None:
            log.info("%s: the stored variables are %s's: training that", cfg.name, held.spec)
            self._use(held)
            wanted = _names(held)
        if how and not wanted <= existing:
            raise FailedPreconditionError(
                f"checkpoint {path} does not hold the variables of {self.model.spec!r} "
                f"(missing: {', '.join(sorted(wanted - existing))})"
            )
        if not how:
            variables = self.model.variables(  # type: ignore[attr-defined]
                np.random.default_rng(0), container=cfg.container, client=client
            )
            for var in variables.values():
                await var.create()
            fresh = [n for n in variables if n not in existing]
            how = f"initialised {len(fresh)} variable(s)" if fresh else "kept the stored variables"
        if isinstance(self.model, Packed):  # `qps var get W1` reads it from the parts,
            # recorded once they exist (a chief that fails to create them leaves none)
            await packing.record_layout(client, cfg.container, self.model.layout())
        if cfg.num_shards is not None:
            await control.configure(client, cfg.container, cfg.num_shards)
        return how

    async def _stored_parts(self) -> int | None:
        """How many parts the container's packed model has (its recorded layout), else
        its PS job's shard count; None where it records neither."""
        client, container = self.sess.client, self.cfg.container
        stored = await packing.read_layout(client, container)
        if stored is not None:
            return len(stored.parts)
        ps_cfg = await control.read_config(client, container)
        return None if ps_cfg is None else ps_cfg.num_shards

    # -- the math of one step (how it travels: workers.steps) ---------------------------
    async def _compute(
        self, params: Mapping[str, Any], batch: tuple[np.ndarray, ...]
    ) -> tuple[float, dict[str, Any]]:
        if self.inline:
            loss, grads = self.model.loss_and_grads(params, batch)
            return float(loss), grads_to_host(narrowed(grads, self.grad_dtype))
        return await asyncio.to_thread(self._step_math, params, batch)

    def _step_math(
        self, params: Mapping[str, Any], batch: tuple[np.ndarray, ...]
    ) -> tuple[float, dict[str, Any]]:
        """The loss and host gradients of one step, on a thread: on a GPU the pulled
        parameters go to the device (the model moves the batch after them), and the
        gradients come back to the host for the wire."""
        if self.xp is not np:
            params = params_to(params, self.xp)
        loss, grads = self.model.loss_and_grads(params, batch)
        return float(loss), grads_to_host(narrowed(grads, self.grad_dtype))

    # -- the loop ------------------------------------------------------------------------
    async def train(self) -> WorkerResult:
        cfg, sess, res = self.cfg, self.sess, self.result
        source = Input(cfg, sess, self.model)
        async with self.stopper.interruptible("loading the data"):
            await source.open()
        why = ""
        if self.xp is np and cfg.backend_choice() == "auto" and backend.gpu_available():
            why = " (auto: a model this small is faster on the host; --backend cupy to override)"
        log.info("%s: computing with %s%s", cfg.name, backend.describe(self.xp), why)
        if cfg.logdir:
            self.curves = curves.ScalarWriter(curves.run_dir(cfg.logdir, cfg.index))
        res.global_step = await sess.global_step()
        start = time.monotonic()
        res.started_at = time.time()
        last_log, last_examples = start, 0
        next_ckpt = 0
        until_check = 0  # the step at which to read the global step for until_global_step
        if cfg.index == 0 and cfg.checkpoint_every:
            next_ckpt = (res.global_step // cfg.checkpoint_every + 1) * cfg.checkpoint_every
        batches = source.batches(self.stopper)
        toucher = asyncio.ensure_future(source.keep_alive()) if source.queue is not None else None
        res.stopped_by = "end of input"
        # on a GPU the first step's math runs once more, untimed: CuPy compiles its
        # kernels at their first call (seconds where its kernel cache is empty)
        warm = self.xp is np
        ps_cfg = await control.read_config(sess.client, cfg.container)
        steps = await steps_for(self, ps_cfg, res.global_step)
        step = res.steps  # after an earlier run's steps (see prepare)
        await self._publish("training", 0.0)  # seen by `qps top` / `qps job` at once
        self.metrics.start()
        try:
            async for batch in batches:
                if self.stopper.requested:
                    res.stopped_by = self.stopper.reason
                    break
                if cfg.steps is not None and step >= cfg.steps:
                    res.stopped_by = f"{cfg.steps} steps"
                    break
                if cfg.until_global_step is not None and res.global_step >= cfg.until_global_step:
                    res.stopped_by = f"global step {cfg.until_global_step}"
                    break
                if cfg.max_staleness is not None:
                    async with self.stopper.interruptible("waiting for slower workers"):
                        res.waited_ms += await job.ssp_wait(
                            sess.client, cfg.container, cfg.name, step, cfg.max_staleness,
                            self.names,
                        )  # fmt: skip
                params, versions = await steps.params(batch)
                if not warm:  # compile the device's kernels before the clock starts
                    await self._compute(params, batch)
                    warm = True
                    start, res.started_at = time.monotonic(), time.time()
                    last_log = start
                loss, stop = await steps.step(step, params, versions, batch)
                await source.used()
                step += 1
                n = int(batch[-1].shape[0])
                res.steps, res.examples, res.last_loss = step, res.examples + n, loss
                if stop:  # the step counts, but no more are made
                    res.stopped_by = stop
                    break
                res.losses.append(loss)
                self.metrics.step(n, loss)
                if cfg.max_staleness is not None:
                    await job.ssp_advance(sess.client, cfg.container, cfg.name, step, self.names)
                if cfg.until_global_step is not None and step >= until_check:
                    res.global_step = await sess.global_step()  # read more often near it
                    left = cfg.until_global_step - res.global_step
                    until_check = step + lifecycle.steps_before_check(
                        left, cfg.num_workers, cfg.log_every
                    )
                if step % cfg.log_every == 0:
                    res.global_step = await sess.global_step()
                    now = time.monotonic()
                    rate = (res.examples - last_examples) / max(now - last_log, 1e-9)
                    last_log, last_examples = now, res.examples
                    log.info(
                        "%s: step %d, global step %d, loss %.4f, %.0f examples/s",
                        cfg.name, step, res.global_step, loss, rate,
                    )  # fmt: skip
                    await self._publish("training", rate)
                    if self.curves is not None:
                        await self._curve_point(loss, rate, ps_cfg, source.test)
                    if next_ckpt and res.global_step >= next_ckpt:
                        await self._checkpoint()
                        next_ckpt = (
                            res.global_step // cfg.checkpoint_every + 1
                        ) * cfg.checkpoint_every
        except CancelledError as exc:  # the job was finished under us
            res.stopped_by = await self._stop_asked() or f"job finished ({exc})"
        except Stopped as exc:  # a wait cut short
            res.stopped_by = str(exc)
        finally:
            await steps.close()
            await batches.aclose()
            if toucher is not None:
                toucher.cancel()
                await asyncio.gather(toucher, return_exceptions=True)
                await source.give_back()
        res.seconds = time.monotonic() - start
        res.ended_at = time.time()
        res.global_step = await sess.global_step()
        await self._publish("done", res.examples_per_second)
        log.info(
            "%s: stopped after %d step(s) (global step %d): %s",
            cfg.name, res.steps, res.global_step, res.stopped_by,
        )  # fmt: skip
        return res

    async def _curve_point(
        self,
        loss: float,
        rate: float,
        ps_cfg: control.PSConfig | None,
        test: tuple[np.ndarray, ...] | None,
    ) -> None:
        """Write this log point's scalars (see :mod:`qps.curves`): the loss, the rate,
        the mean staleness of this worker's gradients the shards applied since the last
        point (from their histograms); the chief also evaluates the job's parameters
        on the test split."""
        assert self.curves is not None
        client, container = self.sess.client, self.cfg.container
        point = {curves.LOSS: loss, curves.THROUGHPUT: rate}
        if ps_cfg is not None:
            got = await asyncio.gather(
                *(control.shard_status(client, container, i) for i in range(ps_cfg.num_shards))
            )
            hist: dict[int, int] = {}
            for st in got:
                for b, n in st.staleness.get(self.cfg.name, {}).items():
                    hist[b] = hist.get(b, 0) + n
            new = {b: n - self._stale_seen.get(b, 0) for b, n in hist.items()}
            self._stale_seen = hist
            if (count := sum(new.values())) > 0:
                point[curves.STALENESS] = sum(b * n for b, n in new.items()) / count
        if self.cfg.index == 0 and self.cfg.evaluate and test is not None:
            metric, value = await evaluate_params(self.sess, self.model, test)
            point[f"test/{metric}"] = value
        self.curves.add(self.result.steps, point)

    async def _stop_asked(self) -> str:
        """Why this worker must stop (``qps job stop``: :func:`workers.job.request_stop`),
        or "" if nobody asked."""
        got = await job.stop_requested(self.sess.client, self.cfg.container)
        return "" if got is None else f"stop requested ({got.get('reason', 'no reason')})"

    async def _checkpoint(self) -> None:
        cfg, where = self.cfg, self.cfg.checkpoint_dir
        assert where
        info = await checkpoint.save(self.sess, f"{where}/model-{{step}}")
        log.info("%s: checkpoint %s at global step %d", cfg.name, info.path, info.global_step)
        keep = cfg.checkpoint_keep  # the oldest of ours beyond it go (never this one)
        gone = await asyncio.to_thread(
            lifecycle.prune_checkpoints, where, cfg.container, keep, info.path
        )
        for path in gone:
            log.info(
                "%s: deleted old checkpoint %s (keeping %d)", cfg.name, path, cfg.checkpoint_keep
            )

    async def _publish(self, state: str, rate: float) -> None:
        res = self.result
        await job.publish_status(
            self.sess.client,
            self.cfg.container,
            self.cfg.name,
            {
                "state": state,
                "step": res.steps,
                "examples": res.examples,
                "loss": None if math.isnan(res.last_loss) else res.last_loss,
                "examples_per_s": rate,
                "global_step": res.global_step,
                "started_at": res.started_at,
                "ended_at": res.ended_at,
            },
        )

    async def finish(self) -> None:
        """Record this worker done; the chief evaluates; the last one finishes the job."""
        cfg, sess, res = self.cfg, self.sess, self.result
        done = await job.finish_worker(sess.client, cfg.container, cfg.name)
        if cfg.max_staleness is not None:
            await job.ssp_advance(sess.client, cfg.container, cfg.name, res.steps, self.names)
        if cfg.index == 0 and cfg.evaluate and self.stopper.signum is None:
            # (not after a signal: the process must exit within the grace period)
            got = await self.evaluate()
            if got is not None:
                res.test_metric, res.test_value = got
                log.info("%s: test %s %.4f", cfg.name, *got)
                if self.curves is not None:
                    self.curves.add(res.steps, {f"test/{got[0]}": got[1]})
                await job.publish_status(sess.client, cfg.container, "eval", {got[0]: got[1]})
        if cfg.finish_job and done >= cfg.num_workers:
            try:
                await control.mark_finished(sess.client, cfg.container)
                log.info("%s: last worker done: job marked finished", cfg.name)
            except NotFoundError:
                pass

    async def evaluate(self) -> tuple[str, float] | None:
        """The test metric of the current parameters on ``eval_data`` (default: the test
        split of a built-in ``data``); None without held-out data."""
        name = self.cfg.eval_data or (self.cfg.data if self.cfg.data in BUILTIN else None)
        if name is None:
            return None
        if name in BUILTIN:
            _, test = await asyncio.to_thread(builtin_split, name, self.model)
        else:
            test = await asyncio.to_thread(load_xy, name)
        return await evaluate_params(self.sess, self.model, test)


async def run_worker(
    cfg: WorkerConfig, stop: Stopper | None = None, metrics: _metrics.Metrics | None = None
) -> WorkerResult:
    """Run one worker to its end (see the module docstring); a stop requested through
    ``stop`` (SIGTERM: :mod:`qps.stopping`), or with ``qps job stop``, ends it after the
    step in hand and cuts its waits short: it returns at once from the wait for the
    chief. ``cfg.index`` -1: claim an index (``--index auto``, see
    :func:`workers.job.claim_index`) under this host's name. Its metrics go to
    ``metrics`` (default: the process's, :func:`qps.metrics.default`).

    Raises:
        Stopped: the stop came while it connected to Redis.
    """
    stopper = stop or Stopper()
    if cfg.index < 0:
        async with stopper.interruptible("connecting to Redis"):
            client = await qps.connect(cfg.url)
        async with client:
            cfg.index = await job.claim_index(client, cfg.container, claimant(), cfg.num_workers)
        log.info("%s: claimed index %d of %d", cfg.name, cfg.index, cfg.num_workers)
    sess = qps.Session(cfg.url, container=cfg.container, worker=cfg.name)
    try:
        async with stopper.interruptible("connecting to Redis"):
            await sess.open()
        w = Worker(cfg, sess, metrics, stopper)
        watch = asyncio.ensure_future(_watch_stop_request(sess.client, cfg, stopper))
        try:
            await w.prepare()
            await w.train()
            await w.finish()
        except Stopped as exc:  # waiting for the chief, or loading the data: no step
            w.result.stopped_by = str(exc)
            log.info("%s: stopped (%s)", cfg.name, exc)
            await w._publish("done", 0.0)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            if w.curves is not None:
                w.curves.close()
        return w.result
    finally:
        await sess.close()


async def _watch_stop_request(client: qps.Client, cfg: WorkerConfig, stopper: Stopper) -> None:
    """Turn the job's stop request (``qps job stop``), when it comes, into a stop of
    this worker (blocked in Redis until then: :func:`workers.job.wait_stop_request`)."""
    try:
        got = await job.wait_stop_request(client, cfg.container, cfg.name)
    except QpsError as exc:  # the worker's own calls meet the same trouble
        log.debug("%s: no longer watching for a stop request: %s", cfg.name, exc)
        return
    stopper.request(f"stop requested ({got.get('reason', 'no reason')})")
