"""The commit plan of a PS shard (:class:`Commits`, a layer of
:class:`~qps.ps.shard.Shard`): every variable a group (or a synchronous update) changed
is committed once, value, slots, ``t`` and the ids of its messages in one script
(:meth:`~qps.variables.Variable.publish` or ``publish_rows``), and the global step is
advanced by shard 0 (``qps/lua/ps/count_steps.lua``, one per message, deduplicated by
id). On a single server, small dense commits go in one round trip
(:meth:`Commits._commit_at_once`), with a synchronous update's guarded token script
(:class:`~qps.ps.sync.TokenGrant`) last."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from qps import keys, variables
from qps import metrics as _metrics
from qps.errors import (
    InternalError,
    QpsError,
)
from qps.optimizers import Adam
from qps.ps import control
from qps.ps.apply import Apply
from qps.ps.core import ShardOptions
from qps.ps.groups import (
    _Group,
    _Item,
    _Owned,
    _Pending,
)
from qps.ps.messages import (
    GradientMessage,
)
from qps.ps.settle import _coalesced
from qps.transport import Client, is_noscript
from qps.variables import APPLIED_KEEP_MS, AlreadyAppliedError

if TYPE_CHECKING:
    from qps.ps.sync import TokenGrant

#: At most this many bytes of variables and slots are committed in one round trip
#: (:meth:`Commits._commit_at_once`); larger groups commit variable by variable, each
#: in pipelines of at most WRITE_BATCH_BYTES.
AT_ONCE_BYTES = 16 << 20


class _Fallback(Exception):
    """A commit sent at once whose script was not loaded (it did not run)."""


#: A synchronous shard's acknowledgements go with its tokens: the releases and stats
#: kept meanwhile ride with a commit (after its tokens) once this many commands wait.
RIDE_COMMANDS = 64


def _sha(client: Client, name: str) -> str:
    """The SHA of script ``name`` of the client's registry, to run it by ``EVALSHA``
    among plain commands (:meth:`Commits._commit_at_once`)."""
    return client._script(name).sha


async def _load(client: Client, *names: str) -> None:
    """Load scripts ``names`` of the client's registry into the server."""
    for name in names:
        await client.script_load(client._script(name).source)


class Commits(Apply):
    """The shard's commit plan (module docstring)."""

    def __init__(
        self, client: Client, options: ShardOptions, metrics: _metrics.Metrics | None = None
    ) -> None:
        super().__init__(client, options, metrics)
        self._gs_opened = False  # the global-step counter created and registered
        self._scripts_loaded = False  # the commit scripts loaded (run by SHA at once)

    async def _commit_group(self, g: _Group) -> None:
        """Commit every variable the group changed (value, slots, ``t`` and all its
        message ids in one script each, the variables concurrently: each commit is atomic
        on its own) and advance the global step alongside (it records the ids too)."""
        failure: BaseException | None = None
        failed, _, _ = await self._commit_all(g.vars, g.touched, gs_ids=g.gs_ids)
        for name, r in failed:
            if isinstance(r, AlreadyAppliedError) and r.message_id in self._suspect:
                # it was looked up in the applied ids before the apply and not found
                # there: delivering the group again would be refused again, forever
                raise InternalError(
                    f"ps shard {self.shard}: '{name}' refused message {r.message_id} as "
                    "applied before, but the look-up of its applied ids did not find it; "
                    "stopping rather than apply it twice or retry it forever"
                ) from r
        for name, r in failed:
            if isinstance(r, AlreadyAppliedError):
                # a message not looked up had been committed (an earlier owner's, not
                # acked): our copy applied it again, reload it, and have the group
                # delivered again (looked up then: what this variable lacks is applied)
                self.log.info("'%s' had applied a message of the group: reloading it", name)
                g.touched.discard(name)
                del self.owned[name]
                await self._own(name)
                g.redo = True
            elif failure is None:
                failure = r
        if failure is not None:
            raise failure

    async def _commit_all(
        self,
        pending: dict[str, _Pending],
        touched: set[str],
        updates: int | None = None,
        gs_ids: Sequence[str] = (),
        grant: TokenGrant | None = None,
    ) -> tuple[list[tuple[str, BaseException]], bool, bool | None]:
        """Commit the variables of ``pending``, then advance the global step by ``gs_ids``
        (each commit is atomic on its own, and records the ids with its state, so each
        is exactly-once on its own: the variables' run concurrently); those committed
        leave ``touched``. Returns the variables' failures, whether a synchronous
        update's guarded token script (``grant``, if given) handled its tokens here,
        and, if the grant acknowledges the update's messages, whether they were
        acknowledged with its tokens (True), refused for the lease (False), or not
        (None: acknowledge them the usual way); the global step's failure raises.

        On a single server, small dense commits go all at once: every variable's writes
        and commit script, the global step's script, and the update's tokens (given
        only if all of it committed), in one round trip."""
        names = list(pending)
        batch = await self._commit_at_once(names, pending, updates, gs_ids, grant)
        results: list[BaseException | None]
        handed, acked = False, None
        if batch is None:
            results, rest = [None] * len(names), list(range(len(names)))
        else:  # what remains: commits that did not run (script not loaded, or held)
            results, gs_ids, handed, acked = batch
            rest = [k for k, r in enumerate(results) if isinstance(r, _Fallback)]
        got = await asyncio.gather(
            *(self._commit(self.owned[names[k]], pending[names[k]], updates) for k in rest),
            return_exceptions=True,
        )
        if gs_ids:  # after the commits: a snapshot never counts a push ahead of them
            await self._advance_global_step(list(gs_ids))
        for k, r in zip(rest, got):
            results[k] = r
        failed = []
        for name, r in zip(names, results):
            if r is None:
                touched.discard(name)
            else:
                failed.append((name, r))
        return failed, handed, acked

    def _whole(self, v: _Pending) -> bool:
        """Whether a commit writes the whole variable: a dense gradient's, or any under
        TF1's Adam, whose sparse apply moves every row (else only the rows touched)."""
        opt = self.optimizer
        return v.dense or (isinstance(opt, Adam) and not opt.lazy)

    def _next(self, o: _Owned, v: _Pending, updates: int | None) -> tuple[int, int]:
        """``(t, version)`` of ``o`` once ``v`` is committed (``updates`` updates, else one
        per message)."""
        n = len(v.ids) if updates is None else updates
        return o.t + n, o.version + n

    async def _commit_at_once(
        self,
        names: list[str],
        pending: dict[str, _Pending],
        updates: int | None,
        gs_ids: Sequence[str],
        grant: TokenGrant | None = None,
    ) -> tuple[list[BaseException | None], Sequence[str], bool, bool | None] | None:
        """The commits of :meth:`_commit_all` in one round trip, if they are all small
        dense ones on a single server; None otherwise. Returns each variable's outcome
        (None: committed; :class:`_Fallback`: its script was not loaded, or a
        checkpoint held the variable, and it did not run: commit it again the usual
        way), the global-step ids still to count (``gs_ids`` unless its script ran
        here), whether the tokens of ``grant`` were handled (given, or counted for the
        shard that gives them) by a last script that runs only if every commit of the
        round trip took, and what became of its acknowledgement (see
        :meth:`_commit_all`). The releases and stats that wait
        (``_release_later``) ride along after it once enough of them are kept."""
        if self.client.cluster or not names:
            return None
        plans = []
        total = 0
        for name in names:
            o, v = self.owned[name], pending[name]
            if not self._whole(v):
                return None
            total += o.var.nbytes * (1 + len(o.slots))
            if total > AT_ONCE_BYTES:  # one write of it all would be a fresh large buffer
                return None
            t, version = self._next(o, v, updates)
            plan = o.var.publish_plan(
                o.value, version, self.token, slots=o.slots, applied=v.ids, t=t
            )
            if plan is None:
                return None
            plans.append(plan)
        if not self._scripts_loaded:
            await variables.load_publish_script(self.client)
            await _load(self.client, "ps/count_steps", "ps/tokens")
            self._scripts_loaded = True
        sent = [c for cmds, _ in plans for c in cmds]
        if gs_ids:
            await self._open_global_step()
            gk = self._step_keys()
            sha = _sha(self.client, "ps/count_steps")
            sent.append(("EVALSHA", sha, len(gk), *gk, APPLIED_KEEP_MS, *gs_ids))
        riding = 0
        if grant is not None:
            ks = grant.keys()
            sha = _sha(self.client, "ps/tokens")
            sent.append(("EVALSHA", sha, len(ks), *ks, *grant.args()))
            if len(self._release_later) >= RIDE_COMMANDS:  # after the tokens: not before
                later, self._release_later = _coalesced(self._release_later), []
                sent += later
                riding = len(later)
        replies = await self.client.run_commands_replies(sent)
        handed, acked = False, None
        if riding:
            self._release_replies(replies[-riding:])
            del replies[-riding:]
        if grant is not None:
            reply = replies.pop()
            if isinstance(reply, BaseException):
                if is_noscript(reply):
                    self._scripts_loaded = False
            else:
                handed = int(reply[0]) != 0
                acked = None if int(reply[1]) < 0 else bool(int(reply[1]))
        results: list[BaseException | None] = []
        at = 0
        for name, (cmds, check) in zip(names, plans):
            at += len(cmds)
            reply = replies[at - 1]
            for r in replies[at - len(cmds) : at - 1]:  # the writes: a failure is the server's
                if isinstance(r, BaseException):
                    raise r
            if isinstance(reply, BaseException):
                missing = is_noscript(reply)  # then it did not run: load it again
                self._scripts_loaded = self._scripts_loaded and not missing
                results.append(_Fallback() if missing else reply)
                continue
            try:
                check(reply)
            except variables.CheckpointHold:  # it wrote nothing: the usual way waits
                results.append(_Fallback())
                continue
            except QpsError as exc:
                results.append(exc)
                continue
            o, v = self.owned[name], pending[name]
            o.t, o.version = self._next(o, v, updates)
            results.append(None)
        if gs_ids:
            reply = replies[-1]
            if not isinstance(reply, BaseException):
                gs_ids = ()
            elif is_noscript(reply):
                self._scripts_loaded = False
            else:
                raise reply
        return results, gs_ids, handed, acked

    async def _commit(self, o: _Owned, v: _Pending, updates: int | None = None) -> None:
        """Commit ``o``'s in-memory state with the ``len(v.ids)`` messages applied to it
        (as ``updates`` updates if given: one aggregated update of several messages)."""
        t, version = self._next(o, v, updates)
        if self._whole(v):
            await o.var.publish(o.value, version, self.token, slots=o.slots, applied=v.ids, t=t)
        else:
            rows = np.unique(np.concatenate(v.rows))
            await o.var.publish_rows(
                rows,
                o.value[rows],
                version,
                self.token,
                slot_rows={name: s[rows] for name, s in o.slots.items()},
                applied=v.ids,
                t=t,
            )
        o.version, o.t = version, t

    def _forget(self, g: _Group) -> None:
        """Drop the in-memory copies the group changed but did not commit (they are
        loaded again from their last commit when next needed)."""
        for name in g.touched:
            self.owned.pop(name, None)
        g.touched.clear()

    async def _apply(self, msg: GradientMessage) -> _Group:
        """Apply and commit one message now, without a delivery (tests: a shard that
        is then "killed" before the ack)."""
        g = _Group()
        try:
            await self._apply_batch(None, g, [_Item(None, msg)])
            await self._commit_group(g)
        except BaseException:
            self._forget(g)
            raise
        return g

    async def _advance_global_step(self, ids: list[str]) -> None:
        await self._open_global_step()
        await self.client.run_script("ps/count_steps", self._step_keys(), [APPLIED_KEEP_MS, *ids])

    async def _open_global_step(self) -> None:
        if not self._gs_opened:
            counter = control.global_step_counter(self.client, self.container)
            await counter.get()  # creates and registers it
            self._gs_opened = True

    def _step_keys(self) -> list[str]:
        """The global-step script's keys (its arguments: APPLIED_KEEP_MS, the ids)."""
        return [
            keys.counter_key(self.container, keys.GLOBAL_STEP),
            keys.counter_applied(self.container, keys.GLOBAL_STEP),
        ]
