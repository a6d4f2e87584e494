"""The worker's side of a PS job: pull parameters straight from Redis, push gradient
messages to the shards' queues, read the global step. :class:`qps.Session` uses one
:class:`PSClient` (``sess.pull``, ``sess.push``, ...).

Reads never involve a PS process (docs/ps.md): a pull reads the published variable
and notes its version; the next push of a gradient for that variable carries that
version, so the shard can record the staleness of the update (TF's asynchronous
training: the shard applies it on arrival whatever its staleness).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from qps import keys
from qps.errors import (
    AbortedError,
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.ps import control
from qps.ps.gradlist import LIST_MAX_BYTES, GradientList, credit_key
from qps.ps.messages import Gradient, GradientMessage, check_gradient, encode_message
from qps.queues import FIFOQueue
from qps.transport import Client
from qps.variables import (
    ReadPlan,
    Variable,
    VariableValue,
    open_variable,
    read_many,
    read_plan,
)

__all__ = ["PSClient", "default_worker"]

log = logging.getLogger("qps.ps")

#: how often a push sends a message whose enqueue was undone (see PSClient._send)
PUSH_TRIES = 3
#: how long a push blocked for a credit waits in Redis before it checks that the job
#: is not finished (then waits again)
CREDIT_WAIT_SECONDS = 1.0


def default_worker() -> str:
    """``<host>-<pid>``: the worker name when none is given."""
    host = "".join(c if c.isalnum() or c in "_.-" else "_" for c in socket.gethostname())
    return f"{host or 'host'}-{os.getpid()}"


def _name_of(v: Any) -> str:
    if isinstance(v, Variable):
        return v.name
    if isinstance(v, str):
        return keys.check_name(v)
    raise InvalidArgumentError(f"expected a variable or its name, got {v!r}")


class PSClient:
    """A worker's handle on the PS job of a container.

    Args:
        client: an open :class:`qps.Client`.
        container: the job's container.
        worker: this worker's name in message ids and staleness statistics (TF: its
            task index); default ``<host>-<pid>``. ``[A-Za-z0-9_.:-]``, at most 64.

    Raises:
        InvalidArgumentError: an invalid worker name or container.
    """

    def __init__(self, client: Client, container: str, worker: str | None = None) -> None:
        self.client = client
        self.container = keys.check_container(container)
        w = worker if worker is not None else default_worker()
        if not isinstance(w, str) or not 1 <= len(w) <= 64 or "/" in w:
            raise InvalidArgumentError(f"invalid worker name {w!r}: 1-64 of [A-Za-z0-9_.:-]")
        keys.check_container(w)  # the same alphabet as containers
        self.worker = w
        self._incarnation = secrets.token_hex(4)
        self._seq = 0
        self._steps = 0
        self._vars: dict[str, Variable] = {}
        self._seen: dict[str, int] = {}
        self._placement: dict[str, int] = {}
        self._num_shards: int | None = None
        self._capacity = control.GRADIENT_QUEUE_CAPACITY
        self._max_bytes = control.DEFAULT_MAX_MESSAGE_BYTES
        self._queues: dict[int, FIFOQueue] = {}
        self._sync = False  # the job trains synchronously
        self._lists: dict[int, GradientList] = {}
        #: asynchronous training on the gradient lists: per shard, the messages sent and
        #: not yet settled by the shard as far as this client knows (credits not back)
        self._unsettled: dict[int, int] = {}

    # -- variables -------------------------------------------------------------------------
    async def variable(self, v: Any) -> Variable:
        """The variable ``v`` (a :class:`~qps.Variable` or a name), opened from its
        stored spec.

        Raises:
            NotFoundError: no such variable in the container.
        """
        name = _name_of(v)
        var = self._vars.get(name)
        if var is None:
            if isinstance(v, Variable) and v.container == self.container:
                var = await v.create()
            else:
                var = await open_variable(self.client, name, self.container)
            self._vars[name] = var
        return var

    async def pull(self, variables: Any) -> Any:
        """Read variables straight from Redis (no PS involved): for one variable (or
        name) its :class:`~qps.VariableValue` ``(value, version)``; for a list, a dict
        name -> VariableValue. Each is an exact snapshot; the versions are remembered
        for the next :meth:`push`.

        Raises:
            NotFoundError: an unknown variable.
        """
        single = isinstance(variables, (str, Variable))
        items = [variables] if single else list(variables)
        vars_ = [await self.variable(v) for v in items]
        values = await read_many(vars_)
        out = self._remember(vars_, values)
        return values[0] if single else out

    async def pull_plan(self, variables: Any) -> ReadPlan | None:
        """A :meth:`pull` of ``variables`` (a list) as plain commands that the caller sends
        in a round trip of its own (:meth:`qps.queues.FIFOQueue.dequeue_then`); read the
        replies with :meth:`pulled`. None where the variables cannot be read that way
        (large ones, a Redis Cluster): use :meth:`pull`.

        Raises:
            NotFoundError: an unknown variable.
        """
        return read_plan([await self.variable(v) for v in variables])

    def pulled(self, plan: ReadPlan, replies: list[Any]) -> dict[str, VariableValue] | None:
        """The values of a :meth:`pull_plan`'s replies, as :meth:`pull` returns them for
        a list (the versions are remembered for :meth:`push`); None if they cannot be
        used (see :meth:`qps.variables.ReadPlan.values`): :meth:`pull` then."""
        values = plan.values(replies)
        return None if values is None else self._remember(plan.variables, values)

    def _remember(
        self, vars_: Sequence[Variable], values: Sequence[VariableValue]
    ) -> dict[str, VariableValue]:
        """name -> value of a read, with the versions remembered for :meth:`push`."""
        out = {}
        for var, val in zip(vars_, values):
            self._seen[var.name] = val.version
            out[var.name] = val
        return out

    async def pull_rows(self, variable: Any, ids: Any) -> VariableValue:
        """Rows ``ids`` of a variable and the version they were read at (see
        :meth:`qps.Variable.read_rows`); the version is remembered for :meth:`push`.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: ids out of range.
        """
        var = await self.variable(variable)
        val = await var.read_rows(ids)
        self._seen[var.name] = val.version
        return val

    # -- placement -------------------------------------------------------------------------
    async def _config(self) -> int:
        if self._num_shards is None:
            cfg = await control.read_config(self.client, self.container)
            if cfg is None:
                raise FailedPreconditionError(
                    f"no PS job in container '{self.container}': start the shards "
                    "(qps ps --shard I --num-shards N) or call qps.ps.configure() first"
                )
            self._num_shards = cfg.num_shards
            self._capacity = cfg.queue_capacity
            self._max_bytes = cfg.max_message_bytes
            self._sync = cfg.sync is not None
        return self._num_shards

    async def shards_of(self, names: Iterable[str]) -> dict[str, int]:
        """The shard of each variable; one not placed yet is placed now (round robin)."""
        names = list(names)
        await self._config()
        missing = [n for n in names if n not in self._placement]
        if missing:
            self._placement = await control.read_placement(
                self.client, self.container, self._num_shards
            )
            missing = [n for n in names if n not in self._placement]
        if missing:
            self._placement = await control.place_variables(
                self.client, self.container, missing, "round_robin"
            )
        return {n: self._placement[n] for n in names}

    def _queue(self, shard: int) -> FIFOQueue:
        q = self._queues.get(shard)
        if q is None:
            q = self._queues[shard] = control.gradient_queue(
                self.client, self.container, shard, self._capacity
            )
        return q

    # -- push ------------------------------------------------------------------------------
    def check(self, var: Variable, grad: Any) -> Gradient:
        """``grad`` validated for ``var`` (see :func:`qps.ps.messages.check_gradient`)."""
        return check_gradient(var.name, var.spec, grad)

    async def push(
        self,
        grads: Mapping[Any, Any],
        *,
        step: int | None = None,
        versions: Mapping[str, int] | None = None,
    ) -> dict[int, str]:
        """Send one step's gradients: ``grads`` maps variables (or names) to a dense
        array of the variable's shape and dtype, or sparse rows ``(indices, values)``.
        They are split per shard into one message each (shard 0 always gets one: it
        advances the global step once the message is applied). Returns shard -> message
        id.

        Everything is validated before anything is sent, so a bad gradient changes
        nothing on any shard.

        Args:
            step: the worker's step, for the message ids (default: this client's count
                of pushes).
            versions: name -> the version each gradient was computed from (default:
                the versions the last :meth:`pull` / :meth:`pull_rows` returned).

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: a gradient of the wrong shape, dtype or kind, indices
                out of range, a variable that is not floating point, or a message over
                the job's maximum message size (``max_message_bytes``; nothing is sent).
            FailedPreconditionError: no PS job is configured in the container.
            CancelledError: the job is finished (the shards' queues are closed).
        """
        ids, _ = await self._push(grads, step, versions, ())
        return ids

    async def push_then(
        self,
        grads: Mapping[Any, Any],
        commands: Sequence[Sequence[Any]],
        *,
        step: int | None = None,
        versions: Mapping[str, int] | None = None,
        blocking: bool = False,
    ) -> tuple[dict[int, str], list[Any]]:
        """:meth:`push`, then plain Redis ``commands`` run right after shard 0's message
        is in its queue, in the same round trip (see
        :meth:`qps.queues.FIFOQueue.enqueue_then`): an asynchronous worker sends the
        pull of its next step's parameters (:meth:`pull_plan`) with its gradients; a
        synchronous one, with ``blocking``, its wait for the token (a ``BLPOP``) and
        the pull after it.

        Returns shard -> message id, and the commands' replies, or an empty list when
        they did not run with the enqueue (then run them yourself).

        Raises:
            as :meth:`push`.
        """
        return await self._push(grads, step, versions, commands, blocking)

    async def _push(
        self,
        grads: Mapping[Any, Any],
        step: int | None,
        versions: Mapping[str, int] | None,
        then: Sequence[Sequence[Any]],
        blocking: bool = False,
    ) -> tuple[dict[int, str], list[Any]]:
        if not isinstance(grads, Mapping):
            raise InvalidArgumentError("push takes a mapping variable -> gradient")
        checked: dict[str, Gradient] = {}
        for v, g in grads.items():
            var = await self.variable(v)
            if var.name in checked:
                raise InvalidArgumentError(f"variable '{var.name}' is given twice")
            checked[var.name] = self.check(var, g)
        if step is None:
            step = self._steps
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        self._steps = step + 1
        where = await self.shards_of(checked)
        seen = dict(self._seen)
        if versions is not None:
            seen.update(versions)
        by_shard: dict[int, GradientMessage] = {}
        now = time.time()
        for shard in sorted({*where.values(), control.GLOBAL_STEP_SHARD}):
            self._seq += 1
            by_shard[shard] = GradientMessage(
                worker=self.worker,
                step=step,
                shard=shard,
                nonce=f"{self._incarnation}.{self._seq}",
                global_step=shard == control.GLOBAL_STEP_SHARD,
                time=now,
            )
        for name, g in checked.items():
            m = by_shard[where[name]]
            m.grads[name] = g
            if name in seen:
                m.versions[name] = int(seen[name])
        for s, m in by_shard.items():  # the gradients alone over the limit: do not encode
            self._check_size(s, sum(g.nbytes for g in m.grads.values()))
        payloads = {s: encode_message(m) for s, m in by_shard.items()}
        for s, p in payloads.items():
            self._check_size(s, len(p))
        out: list[Any] = []
        sends = [
            self._send(s, p, then if s == control.GLOBAL_STEP_SHARD else (), out, blocking)
            for s, p in payloads.items()
        ]
        try:
            if len(sends) == 1:  # one shard: no task (and no event loop turns) for it
                await sends[0]
            else:
                await asyncio.gather(*sends)
        except CancelledError as exc:
            if await control.is_finished(self.client, self.container):
                raise CancelledError(
                    f"the PS job of container '{self.container}' is finished: {exc}"
                ) from exc
            raise
        return {s: m.id for s, m in by_shard.items()}, out

    def _check_size(self, shard: int, nbytes: int) -> None:
        if nbytes > self._max_bytes:
            raise InvalidArgumentError(
                f"the gradient message for shard {shard} is {nbytes} bytes, over the "
                f"maximum message size of the PS job of container '{self.container}', "
                f"{self._max_bytes} bytes (max_message_bytes; nothing was sent): place "
                "large variables on several shards or partition them"
            )

    async def _send(
        self,
        shard: int,
        payload: bytes,
        then: Sequence[Sequence[Any]] = (),
        then_out: list[Any] | None = None,
        blocking: bool = False,
    ) -> None:
        """Enqueue one message on ``shard``'s gradient queue. A push that waited on a
        full queue while this process could not reach Redis for longer than the queue's
        lease (a network partition) finds its attempt taken for dead and undone: nothing
        was enqueued, so the same message is sent again (up to :data:`PUSH_TRIES` times
        in all). ``then``: read commands run right after it (their replies go to
        ``then_out``); ``blocking`` ones only with the first try.

        On a single server a message of up to :data:`~qps.ps.gradlist.LIST_MAX_BYTES`
        goes onto the shard's :class:`~qps.ps.gradlist.GradientList` instead: one
        ``RPUSH`` in the round trip of ``then`` (the next pull; synchronous training:
        the token's wait and the next pull). A larger one goes through the queue, in
        chunks (docs/queues.md, "Large elements"); the shard reads both."""
        if not self.client.cluster and len(payload) <= LIST_MAX_BYTES:
            return await self._send_list(shard, payload, then, then_out, blocking)
        for attempt in range(1, PUSH_TRIES + 1):
            try:
                element = np.frombuffer(payload, np.uint8)
                if not then:
                    return await self._queue(shard).enqueue(element)
                got = await self._queue(shard).enqueue_then(element, then, blocking=blocking)
                if then_out is not None:
                    then_out[:] = got
                return None
            except AbortedError as exc:
                if attempt == PUSH_TRIES:
                    raise
                log.warning("push to shard %d: %s; sending the message again", shard, exc)
                if blocking:  # what they took in that try is gone: the caller waits itself
                    then = ()

    async def _send_list(
        self,
        shard: int,
        payload: bytes,
        then: Sequence[Sequence[Any]],
        then_out: list[Any] | None,
        blocking: bool,
    ) -> None:
        """:meth:`_send` onto ``shard``'s gradient list, with the job's finished mark
        read in the same round trip: a push after the end raises CancelledError, as a
        push onto the closed queue does, and takes its message back, unless the shard
        took it first (then it is applied, and the push returns as sent).

        Asynchronous training: a push that would leave more than the job's
        ``queue_capacity`` messages of this client unsettled on the shard first waits,
        blocked in Redis, for the shard to give a credit back; each push picks up the
        credits that came back meanwhile (qps.ps.gradlist)."""
        gl = self._lists.get(shard)
        if gl is None:
            gl = self._lists[shard] = GradientList(self.client, self.container, shard)
        # the finished mark is read after the push: a push that finds the job not
        # finished came before the mark, so the shard, which drains its list once the
        # job is finished, takes it (read before the push, a mark and the shard's last
        # look at the list could fall between the two, leaving the message for no one)
        lead = [gl.push_command(payload), ("EXISTS", keys.ps_finished(self.container))]
        credits = None
        if not self._sync:
            credits = credit_key(self.container, shard, self.worker)
            if self._unsettled.get(shard, 0) >= self._capacity:
                await self._wait_credit(shard, credits)
            lead.append(("LPOP", credits, self._capacity))
        lead.append(gl.count_command())  # for the status commands: no reply looked at
        replies = None
        if blocking and then:  # on a connection of its own: the token's wait blocks
            replies = await self.client.write_commands([*lead, *then])
        ran = replies is not None or not blocking
        if replies is None:  # no blocking commands, or no lean connection (fakeredis)
            replies = await self.client.run_commands_replies([*lead, *(() if blocking else then)])
        for r in replies[: len(lead) - 1]:  # the count's failure (corrupt stats) is not the push's
            if isinstance(r, BaseException):
                raise r
        if credits is not None:
            back = replies[2]
            self._unsettled[shard] = max(0, self._unsettled.get(shard, 0) + 1 - len(back or ()))
        if then and ran and then_out is not None:  # (another shard's send may fill it)
            then_out[:] = replies[len(lead) :]
        if int(replies[1]) and await self._withdrawn(gl, payload):
            raise CancelledError(f"the PS job of container '{self.container}' is finished")

    async def _withdrawn(self, gl: GradientList, payload: bytes) -> bool:
        """Take back a message pushed after the job was marked finished: True if it was
        still waiting (nothing was sent); False if the shard took it already (it is
        applied as it drains its list: the push counts as sent)."""
        if not await self.client.lrem(gl.key, 1, payload):
            return False
        await self.client.run_commands([gl.count_command(-1)])  # it was counted pushed
        return True

    async def _wait_credit(self, shard: int, key: str) -> None:
        """Block until shard ``shard`` gives this client a credit back (it settled one
        of its messages); take the others that came with it.

        Raises:
            CancelledError: the job is finished (no credit will come).
        """
        finished = keys.ps_finished(self.container)
        while True:
            wait = [("BLPOP", key, CREDIT_WAIT_SECONDS), ("LPOP", key, self._capacity)]
            replies = await self.client.write_commands(wait)
            if replies is None:  # no lean connection (fakeredis)
                one = await self.client.blpop([key], CREDIT_WAIT_SECONDS)
                replies = [one, await self.client.lpop(key, self._capacity)]
            for r in replies:
                if isinstance(r, BaseException):
                    raise r
            got = int(replies[0] is not None) + len(replies[1] or ())
            if got:
                self._unsettled[shard] = max(0, self._unsettled.get(shard, 0) - got)
                return
            if await self.client.exists(finished):
                raise CancelledError(f"the PS job of container '{self.container}' is finished")

    async def global_step(self) -> int:
        """TF's ``global_step``: worker steps applied so far (advanced by shard 0 once
        per applied push)."""
        try:
            return await control.global_step_counter(self.client, self.container).get()
        except NotFoundError:
            return 0
