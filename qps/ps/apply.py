"""How a PS shard applies a batch of gradient messages to its in-memory copies
(:class:`Apply`, a layer of :class:`~qps.ps.shard.Shard`): each message is checked (a bad
one is dead-lettered, never applied), looked up in the variables' applied ids only if it
may have been committed already (module docstring of :mod:`qps.ps.shard`), and its
gradients applied in order by the optimizer's rule (large batches in a worker thread:
NumPy releases the GIL). What each variable must then commit is recorded in the group
(:class:`~qps.ps.groups._Group`); committing is :mod:`qps.ps.commit`'s."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from qps import keys
from qps.errors import (
    InvalidArgumentError,
)
from qps.ps.groups import (
    _Group,
    _Item,
    _Owned,
    _Pending,
    _Rejected,
)
from qps.ps.messages import (
    GradientMessage,
    SparseGradient,
    check_gradient,
    is_finite,
    widen,
)
from qps.ps.settle import Settle
from qps.queues.base import QueueBase


def _raw(value: Any) -> bytes:
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.tobytes()
    return b""


#: Gradient bytes of a batch from which the rule runs in a worker thread (NumPy releases
#: the GIL in large ufuncs, so the next messages are read meanwhile); below it, inline.
THREAD_MIN_BYTES = 1 << 20


class Apply(Settle):
    """The apply of gradient messages (module docstring)."""

    async def _absorb(self, q: QueueBase | None, g: _Group, batch: list[_Item]) -> None:
        """Add ``batch`` to the group: dead-letter what must not be applied (acked at
        once), skip what was applied before, and apply the rest in order."""
        valid = await self._valid(q, g, batch)
        if valid:
            await self._apply_batch(q, g, valid)

    async def _valid(
        self, q: QueueBase | None, g: _Group, batch: list[_Item], *, finite: bool = False
    ) -> list[_Item]:
        """The items of ``batch`` that may be applied, in order; the others are
        dead-lettered (see :meth:`_reject`). ``finite``: a gradient holding NaN or Inf
        is rejected here (else by the apply, see :meth:`_run_rules`)."""
        valid: list[_Item] = []
        for item in batch:
            reason, variable = item.error, None
            if item.msg is not None:
                try:
                    await self._check(item.msg)
                    if finite:
                        _check_finite(item.msg)
                except _Rejected as rej:
                    reason, variable = rej.reason, rej.variable
                else:
                    valid.append(item)
                    continue
            await self._reject(q, g, item, reason, variable)
        return valid

    async def _reject(
        self, q: QueueBase | None, g: _Group, item: _Item, reason: str, variable: str | None
    ) -> None:
        """Dead-letter ``item`` (nothing of it was applied) and ack it at once. An
        oversize message is kept without its bytes (its size is recorded)."""
        if item.oversize:
            await self._dead_letter(item.about, reason, size=item.nbytes)
        else:
            await self._dead_letter(item.msg, reason, variable=variable, raw=_raw(item.raw))
        if item.delivery is not None and q is not None and not item.shared:
            g.deliveries = [d for d in g.deliveries if d is not item.delivery]
            await self._settle(q, [item.delivery], ack=True)
        # a message taken with others is acked with its group's (should the group fail,
        # it comes again with them and is dead-lettered again)

    async def _check(self, msg: GradientMessage) -> None:
        """Raise _Rejected if ``msg`` must not be applied (NaN and Inf are checked with
        the apply, see _run_rules)."""
        if msg.shard != self.shard:
            raise _Rejected(f"message for shard {msg.shard} arrived at shard {self.shard}")
        for name, g in msg.grads.items():
            o = await self._resolve(name)
            try:
                check_gradient(name, o.var.spec, g)
            except InvalidArgumentError as exc:
                raise _Rejected(str(exc), name) from None
            msg.grads[name] = widen(g, o.var.spec)  # a compressed one: in the variable's dtype

    async def _applied_flags(
        self, msgs: list[GradientMessage]
    ) -> tuple[list[dict[str, bool]], list[bool]]:
        """Per message: which of its variables (and its global-step increment) recorded
        its id already."""
        gs_key = keys.counter_applied(self.container, keys.GLOBAL_STEP)
        reads: list[tuple[Any, ...]] = []
        for m in msgs:
            for name in m.grads:
                reads.append(("ZSCORE", keys.variable_applied(self.container, name), m.id))
            if m.global_step:
                reads.append(("ZSCORE", gs_key, m.id))
        replies = iter(await self.client.run_commands(reads) if reads else [])
        flags: list[dict[str, bool]] = []
        gs: list[bool] = []
        for m in msgs:
            flags.append({name: next(replies) is not None for name in m.grads})
            gs.append(bool(m.global_step and next(replies) is not None))
        return flags, gs

    async def _apply_batch(self, q: QueueBase | None, g: _Group, items: list[_Item]) -> None:
        """Apply the messages of ``items`` (checked, in order) to the in-memory state,
        recording in ``g`` what each variable must commit."""
        msgs = [it.msg for it in items if it.msg is not None]
        # only those that may have been committed are looked up (module docstring)
        asked = [m for m in msgs if m.id in self._suspect]
        found = await self._applied_flags(asked) if asked else ([], [])
        looked = {m.id: (f, gs) for m, f, gs in zip(asked, *found)}
        flags, gs_done = [], []
        for m in msgs:
            f, gs = looked.get(m.id, (dict.fromkeys(m.grads, False), False))
            flags.append(f)
            gs_done.append(gs)
        plan: list[tuple[_Item, GradientMessage, list[str], bool]] = []
        work: list[list[tuple[_Owned, Any]]] = []
        work_bytes = 0
        for item, m, f, gs in zip(items, msgs, flags, gs_done):
            if m.id in g.ids:  # the same message twice (a lease ran out): applied once
                g.skipped += 1
                continue
            fresh = [n for n, done in f.items() if not done]
            if fresh and len(fresh) < len(f):
                self.log.info(
                    "message %s was partly applied before (redelivery): skipping %s",
                    m.id,
                    ", ".join(n for n, done in f.items() if done),
                )
            plan.append((item, m, fresh, bool(m.global_step and not gs)))
            work.append([(self.owned[n], m.grads[n]) for n in fresh])
            work_bytes += sum(m.grads[n].nbytes for n in fresh)
            g.ids.add(m.id)
        for w in work:
            for o, _ in w:
                g.touched.add(o.var.name)
        counts = {name: len(v.ids) for name, v in g.vars.items()}
        if work_bytes >= THREAD_MIN_BYTES:
            # NumPy releases the GIL in large ufuncs: the next messages are read meanwhile
            poisoned = await asyncio.to_thread(self._run_rules, work, counts)
        else:
            poisoned = self._run_rules(work, counts)
        for k, (item, m, fresh, gs_needed) in enumerate(plan):
            if k in poisoned:
                g.ids.discard(m.id)
                await self._reject(q, g, item, poisoned[k][1], poisoned[k][0])
                continue
            g.applied.append((m.id, list(m.grads), m.global_step))
            staleness = -1
            for name in fresh:
                o = self.owned[name]
                v = g.vars.get(name)
                if v is None:
                    v = g.vars[name] = _Pending()
                read = m.versions.get(name)
                if read is not None:
                    staleness = max(staleness, max(0, o.version + len(v.ids) - read))
                v.ids.append(m.id)
                grad = m.grads[name]
                if isinstance(grad, SparseGradient):
                    v.rows.append(grad.indices)
                    g.rows += int(grad.indices.shape[0])
                else:
                    v.dense = True
                    g.rows += int(grad.shape[0]) if grad.ndim else 1
                g.bytes += grad.nbytes
            if gs_needed:
                g.gs_ids.append(m.id)
            if fresh or gs_needed:
                g.fresh += 1
                if staleness >= 0:
                    g.stale.append((m.worker, staleness))
            elif m.grads or m.global_step:
                g.skipped += 1
                self.log.info("message %s was applied before (redelivery): skipped", m.id)

    def _run_rules(
        self, work: list[list[tuple[_Owned, Any]]], counts: dict[str, int]
    ) -> dict[int, tuple[str, str]]:
        """Apply each message's gradients in order, ``t`` counting on from ``counts``
        (updates already applied in the group, per variable). A message with NaN or Inf
        in any gradient is not applied at all: returns {its index: (variable, reason)}."""
        opt = self.optimizer
        assert opt is not None
        poisoned: dict[int, tuple[str, str]] = {}
        for k, grads in enumerate(work):
            bad = next((o.var.name for o, grad in grads if not is_finite(grad)), None)
            if bad is not None:
                poisoned[k] = (bad, f"gradient of '{bad}' holds NaN or Inf")
                continue
            for o, grad in grads:
                n = counts[o.var.name] = counts.get(o.var.name, 0) + 1
                if isinstance(grad, SparseGradient):
                    opt.apply_sparse(o.value, grad.indices, grad.values, o.slots, o.t + n)
                else:
                    opt.apply_dense(o.value, grad, o.slots, o.t + n)
        return poisoned


def _check_finite(msg: GradientMessage) -> None:
    """Raise _Rejected if a gradient of ``msg`` holds NaN or Inf."""
    bad = next((n for n, g in msg.grads.items() if not is_finite(g)), None)
    if bad is not None:
        raise _Rejected(f"gradient of '{bad}' holds NaN or Inf", bad)
