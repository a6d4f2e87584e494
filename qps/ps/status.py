"""The shards' published status, read by ``qps ps status``, ``qps job status`` and
``qps top``: each shard's stats hash (its counters and staleness histograms, see
docs/ps.md, "Staleness and counters"), its lease, its dead letters, and what waits for
it in its gradient queue and gradient list. Nothing here writes.

A shard whose stats hash, lease or dead-letter list is not what a shard writes is
reported ``broken``, with the reason naming the key (:attr:`ShardStatus.problem`), so
that a listing shows the others as they are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qps import keys, varcheck
from qps.errors import DataLossError, QpsError
from qps.ps.gradlist import PUSHED, TAKEN, gradient_list_key, list_bytes
from qps.queues.inspect import list_queue_bytes, queue_stats
from qps.registry import text_of
from qps.transport import Client, reply_text

__all__ = [
    "EXACT_STALENESS",
    "ShardStatus",
    "check_lease",
    "shard_status",
    "stale_bucket",
    "staleness_percentile",
]


#: Staleness values below this are counted exactly; larger ones by powers of two.
EXACT_STALENESS = 16


def stale_bucket(staleness: int) -> int:
    """The histogram bucket of a staleness: itself below :data:`EXACT_STALENESS`, else
    the largest power of two not above it."""
    s = max(0, int(staleness))
    return s if s < EXACT_STALENESS else 1 << (s.bit_length() - 1)


def staleness_percentile(hist: Mapping[int, int], q: float) -> int | None:
    """The ``q``-quantile (0..1) of a bucketed staleness histogram (a bucket's lower
    bound), or None if it is empty."""
    total = sum(hist.values())
    if total == 0:
        return None
    rank = max(1, int(np.ceil(q * total)))
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return b
    return max(hist)


@dataclass(frozen=True)
class ShardStatus:
    """What a shard publishes in its stats hash, plus its lease and queue.

    Attributes:
        shard: the index.
        state: ``running``, ``stopped``, ``finished``, ``never started``, ``gone`` (its
            lease ran out while running) or ``broken`` (its state is corrupt: see
            ``problem``).
        owner, token: the lease holder (None when no live lease) and its fencing token.
        applied: messages applied; ``skipped``: redeliveries found already applied;
            ``rows``: rows updated; ``bytes``: gradient bytes applied;
            ``dead_letters``: messages refused (see the shard's dead-letter list);
            ``dropped_stale``: stale gradients dropped (synchronous training: a gradient
            for an update the shard had already made).
        variables: variables the shard owns.
        queue_size: messages waiting in its gradient queue and gradient list.
        staleness: worker -> bucketed histogram {staleness: messages}.
        fields: the raw stats hash.
        queue_bytes: bytes of the messages waiting in its gradient queue and list (in Redis);
            ``pending_bytes``: bytes of the pushes blocked on the full queue (also in
            Redis, waiting to get in); None if the queue could not be read.
        held_bytes: bytes of the messages the shard process holds: read ahead and in
            the group it applies (as it last published them: with each group's counters
            and each lease renewal; 0 once it stopped).
        list_size: messages waiting in its gradient list (None on a cluster, which has
            none); ``list_pushed`` / ``list_taken``: messages ever pushed onto it / taken
            from it by the shard (qps.ps.gradlist: on a single server the workers push
            there, not onto the gradient queue).
        problem: why the shard is ``broken`` (names the corrupt key), else None; the
            counters of a broken shard are 0 and its ``fields`` are empty.
    """

    shard: int
    state: str
    owner: str | None
    token: int | None
    applied: int
    skipped: int
    rows: int
    bytes: int
    dead_letters: int
    variables: int
    queue_size: int | None
    staleness: dict[str, dict[int, int]] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    queue_bytes: int | None = None
    pending_bytes: int | None = None
    held_bytes: int = 0
    dropped_stale: int = 0
    list_size: int | None = None
    list_pushed: int = 0
    list_taken: int = 0
    problem: str | None = None

    def percentiles(self) -> dict[str, dict[str, int | None]]:
        """worker -> {"p50", "p99", "messages"} (and ``"*"`` for all workers)."""
        out: dict[str, dict[str, int | None]] = {}
        total: dict[int, int] = {}
        for w, h in sorted(self.staleness.items()):
            out[w] = {
                "messages": sum(h.values()),
                "p50": staleness_percentile(h, 0.5),
                "p99": staleness_percentile(h, 0.99),
            }
            for b, n in h.items():
                total[b] = total.get(b, 0) + n
        if total:
            out["*"] = {
                "messages": sum(total.values()),
                "p50": staleness_percentile(total, 0.5),
                "p99": staleness_percentile(total, 0.99),
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "state": self.state,
            "owner": self.owner,
            "token": self.token,
            "applied": self.applied,
            "skipped": self.skipped,
            "rows": self.rows,
            "bytes": self.bytes,
            "dead_letters": self.dead_letters,
            "dropped_stale": self.dropped_stale,
            "variables": self.variables,
            "queue_size": self.queue_size,
            "queue_bytes": self.queue_bytes,
            "pending_bytes": self.pending_bytes,
            "held_bytes": self.held_bytes,
            "list": None
            if self.list_size is None
            else {"size": self.list_size, "pushed": self.list_pushed, "taken": self.list_taken},
            "staleness": self.percentiles(),
            "pid": self.fields.get("pid"),
            "host": self.fields.get("host"),
            "heartbeat_ms": int(self.fields["heartbeat_ms"])
            if "heartbeat_ms" in self.fields
            else None,
            "problem": self.problem,
        }


def check_lease(raw: Any, key: str, pttl: int = 0) -> tuple[int, str]:
    """A shard's lease ``raw`` (``"<token> <owner>"``, the value of ``key``) as its
    fencing token and owner; ``pttl``: its time to live (ms; -1: none).

    Raises:
        DataLossError: a value no shard writes, or a lease without a time to live (a
            shard always sets one: such a lease would never run out).
    """
    tok, _, owner = text_of(raw).partition(" ")
    if not (tok.isdigit() and owner):
        raise DataLossError(f"corrupt state: {key} holds {raw!r}, not a lease '<token> <owner>'")
    if pttl == -1:
        raise DataLossError(f"corrupt state: {key} (lease {text_of(raw)!r}) has no time to live")
    return varcheck.count(tok, key, "token"), owner


#: the stats fields read as counts (the others are text: state, pid, host, takeover)
_COUNTS = ("applied", "skipped", "rows", "bytes", "variables", "held_bytes", "dropped_stale")


def _stats(raw: Mapping[Any, Any], key: str) -> tuple[dict[str, str], dict[str, dict[int, int]]]:
    """A stats hash's fields as text and its staleness histograms, checked.

    Raises:
        DataLossError: a count or a histogram entry that is not an integer.
    """
    f = {text_of(k): text_of(v) for k, v in raw.items()}
    for name in (*_COUNTS, PUSHED, TAKEN, "heartbeat_ms"):
        if name in f:
            varcheck.count(f[name], key, name)
    stale: dict[str, dict[int, int]] = {}
    for k, v in f.items():
        if k.startswith("stale|") and k.count("|") >= 2:
            worker, _, b = k[len("stale|") :].rpartition("|")
            stale.setdefault(worker, {})[varcheck.count(b, key, k)] = varcheck.count(v, key, k)
    return f, stale


async def shard_status(client: Client, container: str, shard: int) -> ShardStatus:
    """Read shard ``shard``'s published status; a shard whose stats hash, lease or
    dead-letter list is corrupt is returned ``broken`` (see :class:`ShardStatus`)."""
    prefix = keys.ps_prefix(container, shard)
    names = [prefix + "stats", prefix + "lease", prefix + "dlq"]
    batch = client.batch().hgetall(names[0]).get(names[1]).llen(names[2])
    replies = await batch.run(raise_on_error=False)
    try:
        for key, r in zip(names, replies):
            if isinstance(r, Exception):  # a key of another type
                raise DataLossError(
                    f"corrupt state: {key} holds the wrong type of value ({reply_text(r)})"
                )
        raw, lease, dlq = replies
        f, stale = _stats(raw, names[0])
        owner: str | None = None
        token: int | None = None
        if lease is not None:
            token, owner = check_lease(lease, names[1])
    except DataLossError as exc:
        return ShardStatus(shard, "broken", None, None, 0, 0, 0, 0, 0, 0, None, problem=str(exc))
    lsize: int | None = None
    if not client.cluster:  # a single server: its gradient list
        lsize = await client.llen(gradient_list_key(container, shard))
    try:
        qsize: int | None = (
            await queue_stats(client, keys.ps_gradient_queue(shard), container)
        ).size
        if qsize is not None and lsize is not None:  # and those in its gradient list
            qsize += lsize
    except Exception:
        qsize = None
    qbytes: int | None = None
    pbytes: int | None = None
    if qsize is not None:
        try:
            qbytes, pbytes = await list_queue_bytes(
                client, keys.ps_gradient_queue(shard), container
            )
            if not client.cluster:
                qbytes += await list_bytes(client, container, shard)
        except QpsError:
            qbytes = pbytes = None
    state = f.get("state", "never started")
    if state == "running" and owner is None:
        state = "gone"  # its lease expired: killed or stalled
    return ShardStatus(
        shard=shard,
        state=state,
        owner=owner,
        token=token,
        applied=int(f.get("applied", 0)),
        skipped=int(f.get("skipped", 0)),
        rows=int(f.get("rows", 0)),
        bytes=int(f.get("bytes", 0)),
        dead_letters=int(dlq),
        variables=int(f.get("variables", 0)),
        queue_size=qsize,
        staleness=stale,
        fields=f,
        queue_bytes=qbytes,
        pending_bytes=pbytes,
        held_bytes=int(f.get("held_bytes", 0)),
        dropped_stale=int(f.get("dropped_stale", 0)),
        list_size=lsize,
        list_pushed=int(f.get(PUSHED, 0)),
        list_taken=int(f.get(TAKEN, 0)),
    )
