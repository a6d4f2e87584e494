"""``qps queue ...``: list, inspect, peek into and close queues by name.

Every command reads the queue's state with the library's inspection helpers
(:func:`qps.queues.list_queues`, :func:`~qps.queues.queue_stats`,
:func:`~qps.queues.peek_blobs`) and changes nothing, except ``close``, which opens the
queue from its stored spec (:func:`queue_from_spec`) and closes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import click
import numpy as np

from qps import wire
from qps.cli import (
    EXIT_FAILURE,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    CliError,
    connected,
    container_option,
    echo_json,
    json_option,
    run_async,
    table,
    url_option,
    yes_option,
)
from qps.cli import interactive as _interactive  # tests answer for the terminal
from qps.errors import CancelledError, DataLossError, DeadlineExceededError
from qps.ps.gradlist import ListCounts, queue_list_counts
from qps.queues import (
    QueueStats,
    StoredElement,
    peek_blobs,
    queue_stats,
)
from qps.queues.inspect import BrokenQueue, scan_queues
from qps.queues.spec import dtype_name
from qps.session import queue_from_spec

#: ``peek --json`` lists at most this many values of a component.
JSON_MAX_VALUES = 100
#: ``peek`` text output: arrays with more elements than this are summarized.
PREVIEW_THRESHOLD = 20


# -- helpers --------------------------------------------------------------------------


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _confirm(question: str, no_terminal: str, declined: str) -> None:
    """Ask ``question``; refuse with ``no_terminal`` (exit 2) when stdin cannot answer,
    with ``declined`` (exit 1) when the answer is no."""
    if not _interactive():
        raise CliError(no_terminal, EXIT_USAGE)
    if not click.confirm(question, default=False):
        raise CliError(declined, EXIT_FAILURE)


# -- the group ---------------------------------------------------------------------------


@click.group(name="queue")
def queue() -> None:
    """Inspect and close queues (FIFOQueue, RandomShuffleQueue, PaddingFIFOQueue).

    A queue is named by its shared_name within a container. All commands but `close`
    only read; none of them needs the program that created the queue.
    """


# -- ls ---------------------------------------------------------------------------------


async def _ls(
    url: str | None, container: str
) -> tuple[list[QueueStats | BrokenQueue], dict[str, ListCounts]]:
    async with connected(url) as client:
        out = await scan_queues(client, container)
        names = [s.name for s in out if isinstance(s, QueueStats)]
        return out, await queue_list_counts(client, container, names)


def _with_list(d: dict[str, Any], lists: dict[str, ListCounts]) -> dict[str, Any]:
    """A queue's JSON record, with its shard's gradient list for a gradient queue."""
    return {**d, "gradient_list": lists[d["name"]].as_dict()} if d["name"] in lists else d


def list_note(name: str, lc: ListCounts) -> str:
    """What a gradient queue's counters leave out: its shard's gradient list."""
    return (
        f"{name}: shard {lc.shard}'s gradients go on its gradient list {lc.key} (a single "
        f"server), not this queue: {lc.pushed:,} pushed, {lc.taken:,} taken, "
        f"{lc.waiting:,} waiting"
    )


@queue.command(name="ls")
@url_option()
@container_option
@json_option
def ls_command(url: str | None, container: str, json: bool) -> None:
    """List the queues of a container with their size and counters.

    Columns: name, type, size/capacity, whether closed, pending (blocked) enqueue and
    dequeue calls, and the elements ever enqueued and dequeued. A PS gradient queue's
    counters are its own: on a single server the gradients go on the shard's gradient
    list, counted in a line under the table. With --json, a list of the full statistics
    of each queue (as `qps queue stat --json`).

    A queue whose stored state is corrupt is listed as BROKEN (its type column), with
    what is wrong on a line under the table ({"name", "container", "broken"} with
    --json); the other queues are listed as usual, and the command exits with 1.
    """
    stats, lists = run_async(_ls(url, container))
    broken = [s for s in stats if isinstance(s, BrokenQueue)]
    if json:
        echo_json([_with_list(s.as_dict(), lists) for s in stats])
    elif not stats:
        click.echo(f"no queues in container '{container}'")
    else:
        header = ["NAME", "TYPE", "SIZE/CAP", "CLOSED", "PEND_ENQ", "PEND_DEQ", "ENQUEUED"]
        header.append("DEQUEUED")
        rows = [_ls_row(s) for s in stats]
        for line in table(header, rows, right={2, 4, 5, 6, 7}):
            click.echo(line)
        for name, lc in lists.items():
            click.echo(list_note(name, lc))
        for b in broken:
            click.echo(f"{b.name}: BROKEN: {b.error}")
    if broken:
        raise click.exceptions.Exit(EXIT_FAILURE)


def _ls_row(s: QueueStats | BrokenQueue) -> list[str]:
    """A queue's row of ``qps queue ls`` (a broken one: BROKEN, the rest '-')."""
    if isinstance(s, BrokenQueue):
        return [s.name, "BROKEN", "-", "-", "-", "-", "-", "-"]
    return [
        s.name,
        s.spec.class_name,
        f"{s.size}/{'inf' if s.spec.capacity < 0 else s.spec.capacity}",
        _yes_no(s.closed),
        str(s.pending_enqueues),
        str(s.pending_dequeues),
        str(s.enqueued_total),
        str(s.dequeued_total),
    ]


# -- stat --------------------------------------------------------------------------------


async def _stat(url: str | None, container: str, name: str) -> tuple[QueueStats, ListCounts | None]:
    async with connected(url) as client:
        s = await queue_stats(client, name, container)
        return s, (await queue_list_counts(client, container, [name])).get(name)


def stat_lines(s: QueueStats) -> list[str]:
    """The text of ``qps queue stat``."""
    spec = s.spec
    rows: list[tuple[str, str]] = [
        ("queue", f"{s.container}/{s.name}"),
        ("type", spec.class_name),
        ("dtypes", ", ".join(dtype_name(d) for d in spec.dtypes)),
        ("shapes", ", ".join(spec.describe()["shapes"]) if spec.shapes is not None else "unknown"),
        ("names", ", ".join(spec.names) if spec.names is not None else "-"),
        ("capacity", "unbounded" if spec.capacity < 0 else str(spec.capacity)),
    ]
    if spec.kind == "shuffle":
        rows.append(("min_after_dequeue", str(spec.min_after_dequeue)))
        rows.append(("seed", "random" if spec.seed is None else str(spec.seed)))
    rows += [
        ("size", f"{s.size} stored element(s)"),
        ("closed", _yes_no(s.closed)),
        ("enqueued (total)", str(s.enqueued_total)),
        ("dequeued (total)", str(s.dequeued_total)),
        ("pending enqueues", str(s.pending_enqueues)),
        ("pending dequeues", str(s.pending_dequeues)),
        ("held", f"{s.held} element(s) taken by pending dequeues"),
        ("pending close", _yes_no(s.pending_close)),
        ("dead letters", f"{s.dead_letters} undecodable element(s) set aside"),
    ]
    width = max(len(k) for k, _ in rows)
    return [f"{k.ljust(width)}  {v}" for k, v in rows]


@queue.command(name="stat")
@click.argument("name")
@url_option()
@container_option
@json_option
def stat_command(name: str, url: str | None, container: str, json: bool) -> None:
    """Show everything known about queue NAME, without changing it.

    Its spec (type, dtypes, shapes, names, capacity; min_after_dequeue and seed for a
    RandomShuffleQueue), its size, whether it is closed, the totals enqueued and
    dequeued, blocked callers (pending enqueues/dequeues, elements held by pending
    dequeues, a close waiting behind enqueues) and undecodable elements set aside; for
    a PS gradient queue on a single server, its shard's gradient list ("gradient_list"
    in --json). Exits with 3 if there is no such queue, and with 1 if its stored state
    is corrupt ("qps: error: corrupt queue state: <key>: <what is wrong>").
    """
    s, lc = run_async(_stat(url, container, name))
    if json:
        echo_json(_with_list(s.as_dict(), {} if lc is None else {name: lc}))
        return
    for line in stat_lines(s):
        click.echo(line)
    if lc is not None:
        click.echo(list_note(name, lc))


# -- peek --------------------------------------------------------------------------------


#: A stored element over 1 MiB is a reference ``QR|<bid>|<nchunks>|<bytes>`` to chunk
#: keys ``b:<bid>:<k>`` of its queue (qps/lua/queue_common.lua, qps/keys.py).
async def _peek(
    url: str | None, container: str, name: str, k: int
) -> tuple[QueueStats, list[StoredElement]]:
    async with connected(url) as client:
        s = await queue_stats(client, name, container)
        return s, await peek_blobs(client, name, container, k)


def _plain(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a dtype that numpy prints and lists as Python numbers (bfloat16 -> float32),
    or as bytes for a string component."""
    return arr if arr.dtype.kind in "biufS" else arr.astype(np.float32)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, bytes):  # a string component: UTF-8 text, other bytes escaped
        return v.decode("utf-8", errors="backslashreplace")
    return v


def _component_labels(n: int, names: Sequence[str] | None) -> list[str]:
    return list(names) if names is not None and len(names) == n else [str(i) for i in range(n)]


def _decode(p: StoredElement) -> wire.Message | str:
    """The element's message, or why it cannot be decoded."""
    if p.error is not None:
        return p.error
    try:
        return wire.decode(p.blob)
    except DataLossError as exc:
        return str(exc)


def describe_element(p: StoredElement, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``peek --json`` record of one stored element (never raises for bad bytes)."""
    msg = _decode(p)
    if isinstance(msg, str):
        return {"bytes": len(p.blob), "chunks": p.chunks, "error": f"undecodable: {msg}"}
    comps = []
    labels = _component_labels(len(msg.arrays), msg.names or names)
    for label, arr in zip(labels, msg.arrays, strict=True):
        flat = _plain(arr).ravel()
        comp: dict[str, Any] = {
            "name": label if (msg.names or names) else None,
            "dtype": dtype_name(arr.dtype),
            "shape": list(arr.shape),
            "values": [_json_value(v) for v in flat[:JSON_MAX_VALUES].tolist()],
            "truncated": bool(flat.size > JSON_MAX_VALUES),
        }
        comps.append(comp)
    return {"bytes": len(p.blob), "chunks": p.chunks, "components": comps}


def element_lines(index: int, p: StoredElement, names: Sequence[str] | None = None) -> list[str]:
    """The ``peek`` text of one stored element."""
    size = f"{len(p.blob)} bytes" + (f" in {p.chunks} chunks" if p.chunks else "")
    msg = _decode(p)
    if isinstance(msg, str):
        return [f"element {index}: {size}, UNDECODABLE: {msg}"]
    lines = [f"element {index}: {len(msg.arrays)} component(s), {size}"]
    labels = _component_labels(len(msg.arrays), msg.names or names)
    for label, arr in zip(labels, msg.arrays, strict=True):
        head = f"  [{label}] {dtype_name(arr.dtype)} {wire_shape(arr.shape)}"
        text = np.array2string(
            _plain(arr), threshold=PREVIEW_THRESHOLD, edgeitems=3, precision=4, max_line_width=88
        )
        body = text.splitlines()
        if len(body) == 1:
            lines.append(f"{head}  {body[0]}")
        else:
            lines.append(head)
            lines.extend("      " + b for b in body)
    return lines


def wire_shape(shape: Sequence[int]) -> str:
    """A shape as TensorFlow prints it: ``[28,28]``, ``[]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


@queue.command(name="peek")
@click.argument("name")
@click.option(
    "-n",
    "n",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="K",
    help="How many elements to show.",
)
@url_option()
@container_option
@json_option
def peek_command(name: str, n: int, url: str | None, container: str, json: bool) -> None:
    """Show the next K stored elements of queue NAME without removing them.

    Each element is decoded and each component printed with its dtype, shape and a
    preview of its values. For a RandomShuffleQueue these are K stored elements, not
    necessarily the next ones out. Bytes that do not decode are reported as such.
    With --json: a list of {"bytes", "components": [{"name", "dtype", "shape",
    "values", "truncated"}]} (at most 100 values per component; "truncated" tells if
    there were more), or {"bytes", "error"} for an undecodable element.
    Exits with 3 if there is no such queue.
    """
    s, elements = run_async(_peek(url, container, name, n))
    names = s.spec.names
    if json:
        echo_json([{"index": i, **describe_element(p, names)} for i, p in enumerate(elements)])
        return
    which = "stored" if s.spec.kind == "shuffle" else "next"
    click.echo(
        f"{s.container}/{s.name}: {s.spec.class_name}, size {s.size}; "
        f"showing {len(elements)} {which} element(s), nothing removed"
    )
    for i, p in enumerate(elements):
        for line in element_lines(i, p, names):
            click.echo(line)


# -- close -------------------------------------------------------------------------------


async def _close(
    url: str | None,
    container: str,
    name: str,
    cancel_pending: bool,
    yes: bool,
    timeout: float | None,
) -> dict[str, Any]:
    async with connected(url) as client:
        before = await queue_stats(client, name, container)
        where = f"{container}/{name}"
        if before.closed and not cancel_pending:
            raise CliError(f"queue '{where}' is already closed", EXIT_FAILURE)
        if not before.closed and not yes:
            _confirm(
                f"Close {before.spec.class_name} '{where}' ({before.size} stored element(s), "
                f"{before.pending_enqueues} pending enqueue(s))? This cannot be undone",
                f"closing queue '{where}' cannot be undone and stdin is not a terminal "
                "to confirm it: pass --yes to close it",
                f"not confirmed; queue '{where}' left open",
            )
        q = queue_from_spec(before.spec, name, container, client)
        if before.pending_enqueues and not cancel_pending and not before.closed:
            click.echo(
                f"waiting behind {before.pending_enqueues} pending enqueue(s) "
                "(use --cancel-pending to close at once, --timeout to bound the wait)",
                err=True,
            )
        try:
            await q.close(cancel_pending_enqueues=cancel_pending, timeout=timeout)
        except CancelledError as exc:  # closed by someone else meanwhile
            raise CliError(f"queue '{where}' is already closed", EXIT_FAILURE) from exc
        except DeadlineExceededError as exc:
            raise CliError(
                f"{exc}; the close was withdrawn and the queue is still open "
                "(--cancel-pending closes at once)",
                EXIT_TIMEOUT,
            ) from exc
        after = await queue_stats(client, name, container)
        return {
            "name": name,
            "container": container,
            "type": before.spec.class_name,
            "was_closed": before.closed,
            "closed": after.closed,
            "size": after.size,
            "cancelled_pending_enqueues": before.pending_enqueues if cancel_pending else 0,
        }


@queue.command(name="close")
@click.argument("name")
@click.option(
    "--cancel-pending",
    is_flag=True,
    default=False,
    help=(
        "Close at once and fail the pending (blocked) enqueues with CancelledError. "
        "Without it the close waits behind them, as in TensorFlow."
    ),
)
@yes_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Give up (exit 4, queue left open) if a plain close still waits after this long.",
)
@url_option()
@container_option
@json_option
def close_command(
    name: str,
    cancel_pending: bool,
    yes: bool,
    timeout: float | None,
    url: str | None,
    container: str,
    json: bool,
) -> None:
    """Close queue NAME: no more enqueues; dequeuers drain what is stored.

    Closing cannot be undone, so it asks for confirmation unless --yes is given; when
    stdin is not a terminal, --yes is required (exit 2 without it). Closing a queue that
    is already closed fails (exit 1) unless --cancel-pending is given. Exits with 3 if
    there is no such queue and 4 if --timeout runs out.
    """
    result = run_async(_close(url, container, name, cancel_pending, yes, timeout))
    if json:
        echo_json(result)
        return
    where = f"{container}/{name}"
    if result["was_closed"]:
        click.echo(f"queue '{where}' was already closed")
        return
    text = f"closed {result['type']} '{where}'; {result['size']} element(s) left to dequeue"
    if result["cancelled_pending_enqueues"]:
        text += f"; cancelled {result['cancelled_pending_enqueues']} pending enqueue(s)"
    click.echo(text)


# -- drain ------------------------------------------------------------------------------

#: ``drain`` takes at most this many elements per call.
DRAIN_BATCH = 500


def _components(element: Any) -> list[np.ndarray]:
    """An element (or a batch) as returned by a dequeue, as its list of components."""
    if isinstance(element, dict):
        return [np.asarray(v) for v in element.values()]
    if isinstance(element, (list, tuple)):
        return [np.asarray(v) for v in element]
    return [np.asarray(element)]


async def _drain(
    url: str | None,
    container: str,
    name: str,
    yes: bool,
    limit: int | None,
    out: str | None,
    json: bool,
) -> dict[str, Any]:
    from qps.cli.progress import Progress
    from qps.errors import OutOfRangeError, WouldBlockError

    async with connected(url) as client:
        before = await queue_stats(client, name, container)
        where = f"{container}/{name}"
        total = before.size if limit is None else min(limit, before.size)
        if total and not yes:
            _confirm(
                f"Take {total} element(s) out of {before.spec.class_name} '{where}'?",
                f"draining queue '{where}' removes its elements and stdin is not a "
                "terminal to confirm it: pass --yes",
                f"not confirmed; queue '{where}' left as it was",
            )
        q = queue_from_spec(before.spec, name, container, client)
        batched = before.spec.shapes is not None
        ncomp = len(before.spec.dtypes)
        parts: list[list[np.ndarray]] = [[] for _ in range(ncomp)]
        taken, stopped = 0, "empty"
        with Progress(f"qps queue drain {name}", total, unit="elements",
                      live=None if not json else False, plain_step=25) as bar:  # fmt: skip
            while limit is None or taken < limit:
                want = DRAIN_BATCH if limit is None else min(DRAIN_BATCH, limit - taken)
                try:
                    if batched:
                        got = _components(await q.dequeue_up_to_nowait(want))
                        count = len(got[0])
                    else:
                        got = [c[None] for c in _components(await q.dequeue_nowait())]
                        count = 1
                except WouldBlockError:
                    stopped = "would block" if await q.size() else "empty"
                    break
                except OutOfRangeError:
                    stopped = "closed and empty"
                    break
                taken += count
                if out is not None:
                    for part, c in zip(parts, got):
                        part.append(c)
                bar.update(taken, max(total, taken))
            else:
                stopped = "limit"
        saved = None
        if out is not None:
            labels = list(before.spec.names or [f"c{i}" for i in range(ncomp)])
            arrays: dict[str, np.ndarray] = {}
            for label, chunks in zip(labels, parts, strict=True):
                if batched and chunks:
                    arrays[label] = np.concatenate(chunks)
                elif not batched:  # shapes vary: one array per element
                    arrays.update({f"{label}_{j}": c[0] for j, c in enumerate(chunks)})
            save: Any = np.savez  # its stub types **arrays as allow_pickle's bool
            save(out, allow_pickle=False, **arrays)
            saved = out if out.endswith(".npz") else out + ".npz"
        left = await q.size()
    return {
        "queue": name,
        "container": container,
        "type": before.spec.class_name,
        "drained": taken,
        "left": left,
        "stopped": stopped,
        "saved": saved,
    }


@queue.command(name="drain")
@click.argument("name")
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE.npz",
    help="Save what was taken to FILE.npz (one array per component, named as the "
    "queue's components or c0, c1, ...; elements of varying shapes one array each).",
)
@click.option(
    "--max",
    "limit",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Take at most N elements.",
)
@yes_option
@url_option()
@container_option
@json_option
def drain_command(
    name: str,
    out: str | None,
    limit: int | None,
    yes: bool,
    url: str | None,
    container: str,
    json: bool,
) -> None:
    """Take every element stored in queue NAME out of it now (or --max N), without
    waiting for more, and print how many; --out saves them to an .npz file.

    It removes data, so it asks for confirmation unless --yes is given (required when
    stdin is not a terminal: exit 2 without it). A progress bar shows on a terminal,
    plain lines elsewhere. A RandomShuffleQueue that is still open keeps its
    min_after_dequeue elements (drain stops there: close it first to take them all).
    Pending (blocked) enqueues are not taken. Exits with 3 if there is no such queue.
    """
    result = run_async(_drain(url, container, name, yes, limit, out, json))
    if json:
        echo_json(result)
        return
    where = f"{container}/{name}"
    text = f"drained {result['drained']} element(s) from {result['type']} '{where}'"
    if result["saved"]:
        text += f" into {result['saved']}"
    text += f"; {result['left']} left"
    if result["stopped"] == "would block":
        text += " (an open RandomShuffleQueue keeps min_after_dequeue; close it to take all)"
    click.echo(text)
