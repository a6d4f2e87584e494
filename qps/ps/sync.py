"""Synchronous training on a PS shard (:class:`Sync`, the top layer of
:class:`~qps.ps.shard.Shard` below the loop): gradients are gathered per update (TF's
ConditionalAccumulators), stale ones dropped, and once ``replicas_to_aggregate`` are
held their mean is applied as one update and committed; then every worker gets a
token, the new global step, on its own list (:class:`~qps.ps.control.Tokens`).

**Tokens** are given one way, by the script ``qps/lua/ps/tokens.lua`` (arguments:
:class:`TokenGrant`): each shard holding variables counts the update done, and the last
one pushes the step onto every worker's list. On a single server the script rides in
the commit's round trip, guarded (:meth:`Sync._guarded`): it checks that every commit
of the round trip took, and may acknowledge the update's messages of the gradient list.
Otherwise it runs unguarded once the commit is done (:meth:`Sync._sync_tokens`); its
keys are all of the container's slot, so a cluster runs it too. (A Python version of
the count and the pushes existed beside the script; the script is kept because only it
can ride in the commit's round trip, and it counts and pushes in one round trip where
the Python took two.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from qps import keys
from qps import metrics as _metrics
from qps.ps import control
from qps.ps.commit import Commits
from qps.ps.core import ShardOptions
from qps.ps.gradlist import is_list_delivery
from qps.ps.groups import _Accum, _deliveries, _Group, _Inbox, _Pending
from qps.ps.messages import GradientMessage, SparseGradient
from qps.queues.base import QueueBase
from qps.transport import Client

#: How long the count of the shards that committed a synchronous update is kept (ms).
DONE_TTL_MS = 3_600_000


@dataclass
class TokenGrant:
    """The arguments of ``qps/lua/ps/tokens.lua`` (its header names each key and
    argument): update ``step``'s tokens, pushed onto the workers' ``lists`` by the last
    of ``shards`` shards to count it done in ``done``. Guarded (in a commit's round
    trip): given only if each of ``metas`` holds fencing token ``token`` and the
    version of ``versions``, and ``global_step`` (if set, the global step's applied
    ids) counted the update; ``ack`` (:meth:`~qps.ps.gradlist.GradientList.front_ack`'s
    keys and arguments) acknowledges the update's messages of the gradient list."""

    step: int
    done: str
    lists: list[str]
    shards: int
    metas: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token: int = 0
    global_step: str = ""
    ack: tuple[list[str], list[Any]] | None = None

    def keys(self) -> list[str]:
        out = [self.done, *self.lists, *self.metas]
        if self.global_step:
            out.append(self.global_step)
        return out + (self.ack[0] if self.ack else [])

    def args(self) -> list[Any]:
        lease_token, trim = self.ack[1] if self.ack else ("", 0)
        checks = [len(self.metas), self.token, int(bool(self.global_step))]
        head = [self.step, self.shards, DONE_TTL_MS, len(self.lists), *checks]
        return [*head, lease_token, trim, *self.versions]


class Sync(Commits):
    """The shard's synchronous training (module docstring)."""

    def __init__(
        self, client: Client, options: ShardOptions, metrics: _metrics.Metrics | None = None
    ) -> None:
        super().__init__(client, options, metrics)
        self._sync_shards: int | None = None  # shards that hold variables (tokens)
        self._tokens: list[control.Tokens] | None = None  # the workers' token lists
        self.sync_step = 0  # aggregated updates this shard has committed
        self.dropped = 0  # stale gradients dropped (synchronous training)
        #: synchronous training: gradients for updates up to this one are looked up in
        #: the applied ids before they count (see _sync_round)
        self._checked_through = 0
        self._acc = _Accum()
        #: synchronous training: the last update's tokens and ack, while under way
        self._settling: asyncio.Future[Any] | None = None

    async def _drop_unfinished_update(self, q: QueueBase) -> None:
        """Synchronous training, the job finished: the gradients gathered for an update
        that fewer than ``replicas_to_aggregate`` workers sent (a backup worker's last
        step) are dropped as TF's accumulators drop them, acknowledged and counted
        (``dropped_stale``), rather than given back to the list for no one."""
        items, self._acc = self._acc.items, _Accum()
        assert self.sync is not None
        self.log.info(
            "dropping %d gradient(s) of update %d: the job finished before %d arrived",
            len(items), self.sync_step + 1, self.sync[0],
        )  # fmt: skip
        await self._settle(q, _deliveries(items), ack=True)
        self.dropped += len(items)
        self.metrics.dropped_stale.inc(len(items))
        await self._stats({}, {"dropped_stale": len(items)})

    async def _sync_round(self, q: QueueBase, inbox: _Inbox) -> None:
        """Take what the inbox holds into the accumulator: dead-letter bad messages, ack
        redeliveries of committed ones and stale gradients (computed from an older
        update than the shard's next one: dropped and counted, as TF does), keep the
        rest unacknowledged; once ``replicas_to_aggregate`` are held, apply their mean
        as one update and commit it."""
        assert self.sync is not None
        batch = []
        while inbox.items:
            batch.append(inbox.take())
        acc = self._acc
        kept = await self._valid(q, _Group(), batch, finite=True)
        valid = [(item, item.msg) for item in kept if item.msg is not None]

        # A gradient for the update being gathered (its step s is the shard's update
        # count) cannot have been applied, and is not looked up: one of step s goes
        # into update s + 1, and the shard counts s + 1 once that update is committed.
        # Looked up (one round trip): the others (stale ones, redeliveries of applied
        # ones), those of steps up to the count this run started from (what the last
        # run delivered comes again first), and, once one from an update ahead of the
        # shard (a worker started meanwhile) was taken, those up to its step.
        def unsure(m: GradientMessage) -> bool:
            return m.step != self.sync_step or m.step <= self._checked_through

        asked = [m for _, m in valid if unsure(m)]
        found = iter((await self._applied_flags(asked))[0] if asked else [])
        for item, m in valid:
            done = next(found) if unsure(m) else None
            if done is not None and m.grads and all(done.values()):
                await self._settle(q, [item.delivery] if item.delivery else [], ack=True)
                self.skipped += 1
                continue
            if m.step < self.sync_step:
                await self._settle(q, [item.delivery] if item.delivery else [], ack=True)
                self.dropped += 1
                self.metrics.dropped_stale.inc()
                await self._stats({}, {"dropped_stale": 1, f"dropped|{m.worker}": 1})
                continue
            if m.step > self.sync_step:  # from an update ahead: look those up
                self._checked_through = m.step
            acc.items.append(item)
            acc.add(m)
        if len(acc.items) >= self.sync[0]:
            await self._sync_update(q)

    async def _sync_update(self, q: QueueBase) -> None:
        await self._settled()  # the previous update's tokens and ack (done by now)
        acc, self._acc = self._acc, _Accum()
        opt = self.optimizer
        assert opt is not None
        msgs = [it.msg for it in acc.items if it.msg is not None]
        deliveries = [it.delivery for it in acc.items if it.delivery is not None]
        applied = [(m.id, list(m.grads), m.global_step) for m in msgs]
        g = _Group(deliveries=deliveries, applied=applied, fresh=len(msgs))
        try:
            ids: dict[str, list[str]] = {}
            for m in msgs:
                for name in m.grads:
                    ids.setdefault(name, []).append(m.id)
            pending: dict[str, _Pending] = {}
            for name in ids:
                o = self.owned[name]
                grad = acc.mean(name)
                g.touched.add(name)
                if isinstance(grad, SparseGradient):
                    opt.apply_sparse(o.value, grad.indices, grad.values, o.slots, o.t + 1)
                    pending[name] = _Pending(ids=ids[name], rows=[grad.indices])
                else:
                    opt.apply_dense(o.value, grad, o.slots, o.t + 1)
                    pending[name] = _Pending(ids=ids[name], dense=True)
            gs_ids = (
                [f"sync.{self.sync_step + 1}"] if self.shard == control.GLOBAL_STEP_SHARD else []
            )
            # on a single server, the messages of the gradient list are acknowledged by
            # the token script, once it found the update committed (no round trip of
            # their own)
            gl = self._list
            front = None
            listed = bool(deliveries) and all(is_list_delivery(d) for d in deliveries)
            if gl is not None and listed:  # (no list on a cluster)
                front = gl.front_ack(deliveries)
            grant = await self._guarded(self.sync_step + 1, pending, gs_ids, front)
            failed, handed, acked = await self._commit_all(pending, g.touched, 1, gs_ids, grant)
            if acked is not None:
                assert gl is not None
                gl.acked_front(len(deliveries))
            for _, failure in failed:
                raise failure
        except BaseException:
            self._forget(g)
            self._give_back += deliveries  # the loop ends: given back with the rest
            raise
        self.sync_step += 1
        if acked is not None:  # acknowledged with the tokens
            self._unhold(deliveries)
            if acked:  # its stats and its ids' release wait to ride with a later commit
                self._release_later += self._stats_commands(g)
                await self._released(g)
            else:  # the lease is another owner's: it gives them back (found applied)
                self.log.warning("the gradient list's pop was refused: the lease was lost")
            return

        async def settle() -> None:  # the ids are released once the ack is done
            if await self._settle(q, deliveries, ack=True, count=g):
                await self._released(g)
            # else a lease ran out: the ids stay recorded, the messages come again and
            # are found applied

        # The tokens go out first (their writes ahead of the ack's), then the deliveries
        # are acknowledged: a worker may pull and push again at once. Should this
        # process die before the ack, the messages come again and are acked as applied
        # (their ids were committed with the update). Both run while the shard gathers
        # the next update's gradients; the next update (or the loop's end) awaits them.
        tokens = [] if handed else await self._sync_tokens(self.sync_step)
        self._settling = asyncio.ensure_future(asyncio.gather(*tokens, settle()))

    async def _settled(self) -> None:
        """Wait for the last update's tokens and acknowledgement if they are still
        under way; raise their failure."""
        pending, self._settling = self._settling, None
        if pending is not None:
            await pending

    async def _sync_tokens(self, step: int) -> list[Awaitable[Any]]:
        """The token script (``ps/tokens``) for update ``step``, which this shard has
        committed (not guarded: the commits' outcome is known here): it counts the
        update done, and the last shard holding variables to count it gives each
        worker a token (the new global step); each is blocked on its own token list.
        Returns the call to run: one round trip, of the container's slot."""
        grant = await self._grant(step)
        return [self.client.run_script("ps/tokens", grant.keys(), grant.args())]

    async def _grant(self, step: int) -> TokenGrant:
        """The arguments of the token script for update ``step``, unguarded."""
        lists, needed = await self._token_lists()
        return TokenGrant(step, self._done_key(step), [t.key for t in lists], needed)

    async def _guarded(
        self,
        step: int,
        pending: dict[str, _Pending],
        gs_ids: list[str],
        ack: tuple[list[str], list[Any]] | None,
    ) -> TokenGrant:
        """The arguments of the token script for update ``step``, guarded: it gives the
        tokens only if the commit's round trip committed each variable of ``pending``
        (and the global step, if ``gs_ids``); with ``ack``, it acknowledges the update's
        messages of the gradient list too."""
        grant = await self._grant(step)
        grant.metas = [keys.variable_meta(self.container, n) for n in pending]
        grant.versions = [self._next(self.owned[n], v, 1)[1] for n, v in pending.items()]
        grant.token = self.token
        if gs_ids:
            grant.global_step = keys.counter_applied(self.container, keys.GLOBAL_STEP)
        grant.ack = ack
        return grant

    async def _token_lists(self) -> tuple[list[control.Tokens], int]:
        """The workers' token lists, and how many shards hold variables (each counts an
        update done; the last one gives the tokens)."""
        assert self.sync is not None
        if self._sync_shards is None:  # placed once, at the first push of the job
            placed = await control.read_placement(
                self.client, self.container, self.options.num_shards
            )
            self._sync_shards = len(set(placed.values()) | {control.GLOBAL_STEP_SHARD})
        if self._tokens is None:
            self._tokens = [
                control.tokens(self.client, self.container, k) for k in range(self.sync[1])
            ]
        return self._tokens, self._sync_shards

    def _done_key(self, step: int) -> str:
        """The counter of the shards that committed synchronous update ``step``."""
        return keys.container_prefix(self.container) + f"ps:sync:done:{step}"
