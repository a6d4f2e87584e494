"""``qps var ...``: list, inspect and print variables by name. Read-only.

``ls`` and ``stat`` read the variables' meta (:func:`qps.variables.variable_stats`);
``get`` reads values (:meth:`qps.Variable.read`, :meth:`~qps.Variable.read_rows`). A
NAME that is a partitioned variable (parts ``NAME/part_<i>``) is read as a whole, and
one that is a parameter of a packed model (:mod:`qps.packing`) from its parts.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import click
import numpy as np

from qps import packing
from qps.cli import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CliError,
    connected,
    container_option,
    json_option,
    run_async,
    url_option,
)
from qps.cli import (
    echo_json as _echo_json,
)
from qps.cli import (
    table as _table,
)
from qps.errors import DataLossError, NotFoundError
from qps.placement import PartitionedVariable, list_partitioned, open_partitioned_variable
from qps.variables import VariableStats, list_variables, open_variable, variable_stats
from qps.varspec import dtype_name, format_shape

#: ``get`` text output: arrays with more elements than this are summarized.
PREVIEW_THRESHOLD = 50


def _size_text(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _time_text(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def _part_text(s: VariableStats) -> str:
    p = s.spec.partition
    if p is None:
        return "-"
    return f"{p.index}/{p.count} of {p.full_name}"


@click.group(name="var")
def var() -> None:
    """List, inspect and print variables (read-only).

    A variable is a named, versioned tensor in a container, published by the PS shard
    that owns it and read by workers straight from Redis. A partitioned variable NAME
    is stored as variables NAME/part_0, NAME/part_1, ...
    """


# -- ls ------------------------------------------------------------------------------------


class Broken(NamedTuple):
    """A variable whose stored state is corrupt: ``problem`` names the key."""

    name: str
    problem: str


def report_broken(broken: list[tuple[str, str]], json: bool) -> None:
    """The end of a listing that met corrupt state: a ``NAME: BROKEN: why`` line under
    the table for each (``qps queue ls``'s convention; with --json, what is wrong is in
    the JSON), then exit status 1."""
    if broken:
        if not json:
            for name, problem in broken:
                click.echo(f"{name}: BROKEN: {problem}")
        raise click.exceptions.Exit(EXIT_FAILURE)


async def _ls(
    url: str | None, container: str
) -> tuple[list[VariableStats | Broken], packing.PackLayout | None]:
    async with connected(url) as client:
        out: list[VariableStats | Broken] = []
        for name in await list_variables(client, container):
            try:
                out.append(await variable_stats(client, name, container, memory=False))
            except NotFoundError:  # deleted between the listing and now
                continue
            except DataLossError as exc:  # listed as broken, with the others
                out.append(Broken(name, str(exc)))
        return out, await packing.read_layout(client, container)


@var.command(name="ls")
@url_option()
@container_option
@json_option
def ls_command(url: str | None, container: str, json: bool) -> None:
    """List the variables of a container.

    Columns: name, dtype, shape, size, published version, fencing token, trainable,
    and for a part of a partitioned variable its index/count and whole name. The
    parameters of a packed model (stored joined in packed/0, packed/1...: `qps worker
    --pack`) are named below the table; `qps var get` reads each. With --json, a list
    of the full statistics of each variable (as `qps var stat --json`).

    A variable whose stored state is corrupt is listed as BROKEN (its dtype column),
    with what is wrong, naming the key, on a line under the table ({"name",
    "container", "broken"} with --json); the others are listed as usual, and the
    command exits with 1.
    """
    stats, layout = run_async(_ls(url, container))
    broken = [(s.name, s.problem) for s in stats if isinstance(s, Broken)]
    if json:
        _echo_json(
            [
                {"name": s.name, "container": container, "broken": s.problem}
                if isinstance(s, Broken)
                else s.as_dict()
                for s in stats
            ]
        )
        report_broken(broken, json)
        return
    if not stats:
        click.echo(f"no variables in container '{container}'")
        return
    header = ["NAME", "DTYPE", "SHAPE", "BYTES", "VERSION", "TOKEN", "TRAINABLE", "PART"]
    rows = [
        [s.name, "BROKEN", "-", "-", "-", "-", "-", "-"]
        if isinstance(s, Broken)
        else [
            s.name,
            dtype_name(s.spec.dtype),
            format_shape(s.spec.shape),
            str(s.spec.nbytes),
            str(s.version),
            str(s.token),
            "yes" if s.spec.trainable else "no",
            _part_text(s),
        ]
        for s in stats
    ]
    for line in _table(header, rows, right={3, 4, 5}):
        click.echo(line)
    if layout is not None:
        parts = ", ".join(n for n, _ in layout.parts)
        click.echo(f"packed in {parts}: {', '.join(layout.names())} (qps var get NAME)")
    report_broken(broken, json)


# -- stat ----------------------------------------------------------------------------------


async def _stat(
    url: str | None, container: str, name: str, memory: bool
) -> VariableStats | list[VariableStats]:
    async with connected(url) as client:
        try:
            return await variable_stats(client, name, container, memory=memory)
        except NotFoundError:
            if name not in await list_partitioned(client, container):
                raise
        pv = await open_partitioned_variable(client, name, container)
        return [await variable_stats(client, p.name, container, memory=memory) for p in pv]


def stat_lines(s: VariableStats) -> list[str]:
    """The text of ``qps var stat`` for one variable."""
    spec = s.spec
    init = dict(spec.initializer or {})
    kind = init.pop("kind", "?")
    params = ", ".join(f"{k}={v}" for k, v in init.items())
    rows: list[tuple[str, str]] = [
        ("variable", f"{s.container}/{s.name}"),
        ("dtype", dtype_name(spec.dtype)),
        ("shape", format_shape(spec.shape)),
        ("size", f"{_size_text(spec.nbytes)} ({spec.nbytes} bytes) in {s.segments} segment(s)"),
        ("trainable", "yes" if spec.trainable else "no"),
        ("initializer", f"{kind}({params})"),
    ]
    p = spec.partition
    if p is not None:
        rows.append(
            (
                "partition",
                f"{p.index} of {p.count} of '{p.full_name}' {format_shape(p.full_shape)}, "
                f"axis {p.axis}, offset {list(p.offset)} "
                f"(save slice '{p.save_slice_info(spec.shape)}')",
            )
        )
    prev = "-"
    if s.previous:
        prev = f"{s.previous} (version {s.previous_version}, kept for readers)"
    rows += [
        ("version", str(s.version)),
        ("fencing token", str(s.token)),
        ("generation", s.generation),
        ("previous", prev),
        ("publishes", f"{s.publishes} full, {s.row_publishes} row update(s)"),
        ("created", _time_text(s.created_ms)),
        ("updated", _time_text(s.updated_ms)),
    ]
    if s.memory_bytes is not None:
        rows.append(("memory", f"{_size_text(s.memory_bytes)}, estimated by MEMORY USAGE"))
    width = max(len(k) for k, _ in rows)
    return [f"{k.ljust(width)}  {v}" for k, v in rows]


@var.command(name="stat")
@click.argument("name")
@click.option(
    "--no-memory",
    "no_memory",
    is_flag=True,
    default=False,
    help="Skip the memory estimate (MEMORY USAGE of each data key).",
)
@url_option()
@container_option
@json_option
def stat_command(name: str, no_memory: bool, url: str | None, container: str, json: bool) -> None:
    """Show everything stored about variable NAME, without changing it.

    Its spec (dtype, shape, size, trainable, initializer, its place in a partitioned
    variable), the published version and fencing token, the current and previous
    generations, the numbers of full and row publishes, creation and update times and
    (where the server supports it) its memory. For a partitioned variable, every part.
    Exits with 3 if there is no such variable.
    """
    got = run_async(_stat(url, container, name, not no_memory))
    if json:
        _echo_json([s.as_dict() for s in got] if isinstance(got, list) else got.as_dict())
        return
    for i, s in enumerate(got if isinstance(got, list) else [got]):
        if i:
            click.echo("")
        for line in stat_lines(s):
            click.echo(line)


# -- get -----------------------------------------------------------------------------------


def parse_rows(text: str, dim0: int) -> np.ndarray:
    """``--rows``: comma-separated row numbers and ``a:b`` ranges (``b`` excluded; ``:b``
    from 0, ``a:`` to the end), e.g. ``0:10,42``.

    Raises:
        CliError: a malformed spec or a row outside ``[0, dim0)`` (exit 2).
    """
    out: list[np.ndarray] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if ":" in part:
                a, b = part.split(":", 1)
                lo = int(a) if a.strip() else 0
                hi = int(b) if b.strip() else dim0
                if lo < 0 or hi < lo:
                    raise ValueError
                if hi > dim0:
                    raise CliError(f"--rows {part}: the variable has {dim0} rows", EXIT_USAGE)
                out.append(np.arange(lo, hi, dtype=np.int64))
            else:
                row = int(part)
                if not 0 <= row < dim0:
                    raise CliError(f"--rows {part}: row not in [0, {dim0})", EXIT_USAGE)
                out.append(np.array([row], np.int64))
        except ValueError:
            raise CliError(
                f"--rows {text!r}: expected row numbers and a:b ranges, e.g. 0:10,42",
                EXIT_USAGE,
            ) from None
    return np.concatenate(out) if out else np.zeros(0, np.int64)


async def _get(
    url: str | None, container: str, name: str, rows: str | None
) -> tuple[dict[str, Any], np.ndarray, np.ndarray | None]:
    async with connected(url) as client:
        target: Any
        try:
            target = await open_variable(client, name, container)
        except NotFoundError:
            if name not in await list_partitioned(client, container):
                view = await packing.read_view(client, container, name)
                if view is None:
                    raise
                return _view_info(name, container, view, rows)
            target = await open_partitioned_variable(client, name, container)
        info, idx = _head(name, container, target.dtype, tuple(target.shape), rows)
        if isinstance(target, PartitionedVariable):
            info["parts"] = len(target)
            if idx is None:
                value, versions = await target.read()
                info["versions"] = list(versions)
            else:
                value, vers = await target.read_rows(idx, "div")
                info["versions"] = list(vers)
        else:
            value, version = await (target.read() if idx is None else target.read_rows(idx))
            info["version"] = version
        return info, value, idx


def _view_info(
    name: str,
    container: str,
    view: tuple[np.ndarray, list[tuple[str, int]]],
    rows: str | None,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray | None]:
    """``_get``'s answer for a parameter of a packed model (read whole from its parts)."""
    value, read = view
    info, idx = _head(name, container, value.dtype, value.shape, rows)
    info["packed_in"] = [part for part, _ in read]
    info["versions"] = [version for _, version in read]
    return info, (value if idx is None else value[idx]), idx


def _head(
    name: str, container: str, dtype: Any, shape: tuple[int, ...], rows: str | None
) -> tuple[dict[str, Any], np.ndarray | None]:
    """``_get``'s answer's first fields, and the rows of ``--rows`` (None: all).

    Raises:
        CliError: --rows of a scalar, or bad --rows (exit 2).
    """
    if not shape and rows is not None:
        raise CliError(f"variable '{name}' is a scalar: --rows does not apply", EXIT_USAGE)
    idx = None if rows is None else parse_rows(rows, shape[0])
    info = {"name": name, "container": container, "dtype": dtype_name(dtype), "shape": list(shape)}
    return info, idx


def _plain(arr: np.ndarray) -> np.ndarray:
    """``arr`` in a dtype NumPy prints and lists as Python numbers (bfloat16 -> float32)."""
    return arr if arr.dtype.kind in "biufS" else arr.astype(np.float32)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="backslashreplace")
    return v


@var.command(name="get")
@click.argument("name")
@click.option(
    "--rows",
    default=None,
    metavar="SPEC",
    help="Only these rows (axis 0): numbers and a:b ranges, e.g. 0:10,42 (b excluded).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="--json lists at most this many values (0: all).",
)
@url_option()
@container_option
@json_option
def get_command(
    name: str, rows: str | None, limit: int, url: str | None, container: str, json: bool
) -> None:
    """Print the value of variable NAME (or some rows) with its version.

    The value is an exact snapshot at the version printed. A partitioned variable is
    read part by part (one version per part, "-" for a part none of the rows is in);
    its --rows are rows of the whole variable. A parameter of a packed model (`qps
    worker --pack`: stored joined in packed/0, packed/1...) is read from the parts
    that hold it ("packed_in", with their versions). With --json: {"name",
    "container", "dtype", "shape", "version" (or "versions"), "rows", "value_shape",
    "values" (flattened, C order, at most --limit), "truncated"}. Exits with 3 if
    there is no such variable, 2 for bad --rows.
    """
    info, value, idx = run_async(_get(url, container, name, rows))
    if json:
        flat = _plain(value).reshape(-1)
        shown = flat if limit == 0 else flat[:limit]
        info["rows"] = None if idx is None else idx.tolist()
        info["value_shape"] = list(value.shape)
        info["values"] = [_json_value(v) for v in shown.tolist()]
        info["truncated"] = bool(shown.size < flat.size)
        _echo_json(info)
        return
    version = (
        f"version {info['version']}"
        if "version" in info
        else "versions " + ", ".join("-" if v is None else str(v) for v in info["versions"])
    )
    what = "" if idx is None else f", rows {rows} ({idx.size})"
    if "packed_in" in info:
        what += f", packed in {', '.join(info['packed_in'])}"
    click.echo(
        f"{container}/{name}: {info['dtype']} {format_shape(info['shape'])}, {version}{what}"
    )
    click.echo(
        np.array2string(
            _plain(value), threshold=PREVIEW_THRESHOLD, edgeitems=3, precision=6, max_line_width=96
        )
    )
