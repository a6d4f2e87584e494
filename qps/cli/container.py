"""``qps container ...``: list, inspect and reset resource containers.

``ls`` and ``stat`` only read (:func:`qps.containers.container_summaries`,
:func:`~qps.containers.container_stats`); ``reset`` deletes every key of the named
containers, or of all of them (:func:`qps.containers.reset`), after a confirmation.
Corrupt state they meet is reported on stderr (``note: ...``), never a traceback, and
does not hide the other containers.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from qps import keys, registry
from qps.cli import (
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CliError,
    connected,
    json_option,
    run_async,
    url_option,
    yes_option,
)
from qps.cli import (
    echo_json as _echo_json,
)
from qps.cli import (
    interactive as _interactive,
)
from qps.cli import (
    table as _table,
)
from qps.containers import (
    KINDS,
    ContainerStats,
    ContainerSummary,
    ResetResult,
    container_stats,
    reset,
)
from qps.errors import NotFoundError, QpsError

#: ``stat`` text output lists at most this many names of one kind.
MAX_NAMES_SHOWN = 20


# -- helpers ------------------------------------------------------------------------------


def _check_names(ctx: click.Context, param: click.Parameter, value: Sequence[str]) -> list[str]:
    out = []
    for v in value:
        try:
            keys.check_container(v)
        except QpsError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc
        if v not in out:
            out.append(v)
    return out


def _check_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return _check_names(ctx, param, [value])[0]


def _count(n: int, kind: str) -> str:
    word = kind[:-1] if n == 1 else kind  # "queues" -> "queue"
    return f"{n} {word}"


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(_count(counts.get(k, 0), k) for k in KINDS)


def _size_text(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit} ({n} bytes)"
        size /= 1024
    raise AssertionError("unreachable")


# -- the group -------------------------------------------------------------------------------


@click.group(name="container")
def container() -> None:
    """List, inspect and reset resource containers.

    A container is a named namespace in Redis that holds a job's queues, counters,
    variables and accumulators (TF 1.x: tf.container). Every process of a job opens
    qps.Session(container=NAME); two jobs in two containers never see each other's
    keys. `ls` and `stat` only read; `reset` deletes.
    """


# -- ls --------------------------------------------------------------------------------------


async def _ls(url: str | None, scan: bool) -> tuple[list[ContainerSummary], list[str]]:
    async with connected(url) as client:
        found = await registry.listing(client, discover=scan)
        rows = await registry.summaries(client, found)
    return rows, [*found.problems, *(p for r in rows for p in r.problems)]


def _notes(problems: Sequence[str]) -> None:
    for p in problems:
        click.echo(f"note: {p}", err=True)


@container.command(name="ls")
@click.option(
    "--scan",
    is_flag=True,
    default=False,
    help=(
        "Also scan the whole database for containers that own keys but are not "
        "registered (e.g. left by an interrupted reset). Costs a full SCAN."
    ),
)
@url_option()
@json_option
def ls_command(scan: bool, url: str | None, json: bool) -> None:
    """List the containers and how many resources of each kind they hold.

    Containers are found by their registration keys (one SCAN of the database);
    counts come from each container's registries. With --scan, containers found only
    by their keys are listed too, marked "(unregistered)". A count that cannot be read
    shows as "?", and what is wrong is noted on stderr. With --json, a list of
    {"name", "registered", "queues", "counters", "variables", "accumulators"} (plus
    "problems" for a container that has some).
    """
    rows, problems = run_async(_ls(url, scan))
    _notes(problems)
    if json:
        _echo_json([r.as_dict() for r in rows])
        return
    if not rows:
        click.echo("no containers")
        return
    header = ["NAME", *(k.upper() for k in KINDS)]
    table = [
        [
            r.name + ("" if r.registered else " (unregistered)"),
            *("?" if r.resources.get(k) is None else str(r.resources[k]) for k in KINDS),
        ]
        for r in rows
    ]
    for line in _table(header, table, right=set(range(1, len(header)))):
        click.echo(line)


# -- stat ------------------------------------------------------------------------------------


async def _stat(url: str | None, name: str, memory: bool) -> ContainerStats:
    async with connected(url) as client:
        return await container_stats(client, name, memory=memory)


def _names_text(names: Sequence[str], values: dict[str, int] | None = None) -> str:
    shown = [f"{n}={values[n]}" if values and n in values else n for n in names]
    text = f"{len(names)}"
    if shown:
        text += ": " + ", ".join(shown[:MAX_NAMES_SHOWN])
        if len(shown) > MAX_NAMES_SHOWN:
            text += f", ... ({len(shown) - MAX_NAMES_SHOWN} more)"
    return text


def stat_lines(s: ContainerStats) -> list[str]:
    """The text of ``qps container stat``."""
    rows: list[tuple[str, str]] = [
        ("container", s.name),
        ("registered", "yes" if s.registered else "no (owns keys but is not listed)"),
    ]
    for kind in KINDS:
        values = s.counters if kind == "counters" else None
        rows.append((kind, _names_text(s.resources.get(kind, []), values)))
    by_kind = ", ".join(f"{k} {v}" for k, v in s.keys_by_kind.items())
    rows.append(("keys", f"{s.keys}" + (f" ({by_kind})" if by_kind else "")))
    if s.memory_bytes is None:
        rows.append(("memory", s.memory_note or "unknown"))
    else:
        rows.append(("memory", f"{_size_text(s.memory_bytes)}, estimated by MEMORY USAGE"))
    rows += [("problem", p) for p in s.problems]
    width = max(len(k) for k, _ in rows)
    return [f"{k.ljust(width)}  {v}" for k, v in rows]


@container.command(name="stat")
@click.argument("name", callback=_check_name)
@click.option(
    "--no-memory",
    "no_memory",
    is_flag=True,
    default=False,
    help="Skip the memory estimate (one MEMORY USAGE call per key).",
)
@url_option()
@json_option
def stat_command(name: str, no_memory: bool, url: str | None, json: bool) -> None:
    """Show what container NAME holds, without changing it.

    The names of its queues, counters (with their values), variables and
    accumulators; how many keys it owns, by kind of resource (found by a SCAN of the
    database); and an estimate of their memory by MEMORY USAGE where the server
    supports it (otherwise the memory line says why it is missing). Corrupt state
    (a registry of the wrong type, an invalid name in one, a counter that holds no
    int64) is left out and shown on "problem" lines, each naming its key. Exits with 3
    if there is no such container.
    """
    s = run_async(_stat(url, name, not no_memory))
    if json:
        _echo_json(s.as_dict())
        return
    for line in stat_lines(s):
        click.echo(line)


# -- reset -----------------------------------------------------------------------------------


def _confirm(listed: str, what: str, details: Sequence[str]) -> None:
    """Ask before resetting ``listed`` (exit 2 when stdin is no terminal; 1 on no)."""
    if not _interactive():
        raise CliError(
            f"resetting {listed} deletes all of its state for good and stdin is "
            "not a terminal to confirm it: pass --yes to reset",
            EXIT_USAGE,
        )
    for line in details:
        click.echo(line, err=True)
    question = (
        f"Reset {listed}, deleting every queue, counter, variable and accumulator "
        f"in {what}? This cannot be undone"
    )
    if not click.confirm(question, default=False, err=True):
        raise CliError(f"not confirmed; {listed} left as it was", EXIT_FAILURE)


async def _reset_all(url: str | None, yes: bool) -> list[ResetResult]:
    async with connected(url) as client:
        found = await registry.listing(client, discover=True)
        _notes(found.problems)
        if not found.names and not found.invalid:
            return []
        if not yes:
            n = len(found.names)
            listed = f"all {n} container{'' if n == 1 else 's'}"
            _confirm(listed, "them", [f"container '{c}'" for c in found.names])
        return await reset(client, None)


async def _reset(
    url: str | None, names: list[str], yes: bool, missing_ok: bool
) -> tuple[list[ResetResult], list[str]]:
    async with connected(url) as client:
        found: list[ContainerStats] = []
        missing: list[str] = []
        for name in names:
            try:
                found.append(await container_stats(client, name, memory=False))
            except NotFoundError:
                missing.append(name)
        if missing and not missing_ok:
            listed = ", ".join(f"'{m}'" for m in missing)
            word = "container" if len(missing) == 1 else "containers"
            raise CliError(
                f"no {word} {listed}; nothing was reset (--missing-ok ignores missing ones)",
                EXIT_NOT_FOUND,
            )
        if found and not yes:
            details = [
                f"container '{s.name}': {_counts_text(s.resource_counts)}; {s.keys} key(s)"
                for s in found
            ]
            _confirm(", ".join(f"'{s.name}'" for s in found), "it", details)
        results = await reset(client, [s.name for s in found])
        return results, missing


@container.command(name="reset")
@click.argument("names", metavar="[NAME]...", nargs=-1, callback=_check_names)
@click.option(
    "--all",
    "all_",
    is_flag=True,
    default=False,
    help="Reset every container on the server (instead of NAME...).",
)
@yes_option
@click.option(
    "--missing-ok",
    is_flag=True,
    default=False,
    help="Skip containers that do not exist instead of failing (exit 3).",
)
@url_option()
@json_option
def reset_command(
    names: list[str], all_: bool, yes: bool, missing_ok: bool, url: str | None, json: bool
) -> None:
    """Delete every key of the containers NAME... (TF: tf.Session.reset).

    All of their queues (with stored elements), counters, variables and accumulators
    go; keys of other containers are never touched, even "ab" when "a" is reset.
    Processes still using them get NotFoundError. It cannot be undone, so it asks for
    confirmation unless --yes is given; when stdin is not a terminal, --yes is required
    (exit 2 without it). If a NAME does not exist, nothing is reset and it exits with 3,
    unless --missing-ok is given. With --json, a list of {"container", "existed",
    "keys_deleted", "resources", "passes", "clean"}.

    --all resets every container on the server, registered or owning keys (TF:
    tf.Session.reset with no containers). An entry of the legacy registry
    qps:containers that is no valid container name is skipped and reported
    ("skipped" in --json), and dropped from that set.
    """
    if all_ == bool(names):
        both = "not both" if all_ else "one of them"
        raise CliError(f"give the containers to reset (NAME...) or --all, {both}", EXIT_USAGE)
    missing: list[str] = []
    if all_:
        results = run_async(_reset_all(url, yes))
        if not results and not json:
            click.echo("no containers; nothing to reset")
    else:
        results, missing = run_async(_reset(url, names, yes, missing_ok))
    if json:
        out = [r.as_dict() for r in results]
        out += [
            {"container": m, "existed": False, "keys_deleted": 0, "resources": {}} for m in missing
        ]
        _echo_json(out)
        return
    for r in results:
        if r.skipped is not None:
            click.echo(f"skipped: {r.skipped}")
            continue
        counts = {k: len(v) for k, v in r.resources.items()}
        text = (
            f"reset container '{r.container}': deleted {r.keys_deleted} key(s) "
            f"({_counts_text(counts)})"
        )
        if not r.clean:
            text += "; keys kept appearing: a process is still writing into it"
        click.echo(text)
    for m in missing:
        click.echo(f"container '{m}' does not exist; nothing to reset")
