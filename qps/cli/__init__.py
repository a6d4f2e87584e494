"""The ``qps`` command line: a thin layer that parses, calls the library and prints.

The entry point is :func:`qps.cli.main.main`. This module holds what the command
modules share: the exit codes, :class:`CliError` (a click exception that prints one
``qps: error: ...`` line and exits with our code), :func:`run_async` (runs a coroutine
and turns :class:`qps.errors.QpsError` into :class:`CliError`) and the common options.

Exit codes:

====  ============================================================================
0     success
1     failure: any other qps error (e.g. closing a queue that is already closed)
2     usage: a bad option or argument, or a confirmation that cannot be asked
3     not found: the named queue (or other resource) does not exist
4     timeout: a ``--timeout`` ran out
5     unavailable: Redis cannot be reached, or no embedded server can be started
====  ============================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import click

from qps import keys, transport
from qps.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    QpsError,
    UnavailableError,
)
from qps.transport import Client, connect, redact_url

__all__ = [
    "EXIT_FAILURE",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "LOG_LEVELS",
    "CliError",
    "check_url",
    "configure_logging",
    "connected",
    "container_option",
    "debug_enabled",
    "exit_code_for",
    "json_option",
    "metrics_options",
    "remember_url",
    "run_async",
    "scrub",
    "serve_metrics",
    "url_option",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_TIMEOUT = 4
EXIT_UNAVAILABLE = 5

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

log = logging.getLogger("qps.cli")

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# URLs this process was given: every message we print has them replaced by their
# redacted form, whatever library or server text they ended up in.
_urls: set[str] = set()


def remember_url(url: str | None) -> None:
    """Note a URL whose password must never be printed (see :func:`scrub`)."""
    if url and redact_url(url) != url:
        _urls.add(url)


def scrub(text: str) -> str:
    """``text`` with every remembered URL replaced by its redacted form."""
    for url in sorted(_urls, key=len, reverse=True):
        text = text.replace(url, redact_url(url))
    return text


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a qps error (see the module docstring)."""
    if isinstance(exc, NotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, DeadlineExceededError):
        return EXIT_TIMEOUT
    if isinstance(exc, UnavailableError):
        return EXIT_UNAVAILABLE
    return EXIT_FAILURE


class CliError(click.ClickException):
    """A failure reported as one ``qps: error: <message>`` line on stderr."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(scrub(message))
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it a ClassVar

    def show(self, file: Any = None) -> None:
        click.echo(f"qps: error: {self.format_message()}", err=True, file=file)


# -- logging ---------------------------------------------------------------------------


class _EchoHandler(logging.Handler):
    """Writes records to whatever ``sys.stderr`` is now (CliRunner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(scrub(self.format(record)), err=True)
        except Exception:
            self.handleError(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (Unix seconds), ``level``, ``logger``,
    ``message``, ``pid``, and ``exc`` with a traceback if there is one. Secrets are
    scrubbed from the message like every other output (URLs redacted)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
            "pid": record.process,
        }
        if record.exc_info:
            data["exc"] = scrub(self.formatException(record.exc_info))
        return json.dumps(data)


def configure_logging(level: str, as_json: bool = False) -> None:
    """Send the ``qps`` loggers' records at ``level`` and above to stderr, as text
    (``qps: LEVEL: logger: message``) or as JSON lines (:class:`JsonFormatter`)."""
    logger = logging.getLogger("qps")
    logger.setLevel(getattr(logging, level.upper()))
    handler = next((h for h in logger.handlers if isinstance(h, _EchoHandler)), None)
    if handler is None:
        handler = _EchoHandler()
        logger.addHandler(handler)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("qps: %(levelname)s: %(name)s: %(message)s"))


def role_logs(ctx: click.Context, logger: str) -> None:
    """A long-running role says what it does: its logger logs at INFO unless the user
    chose a level with ``qps --log-level``."""
    parent = ctx.parent
    if parent is not None and parent.get_parameter_source("log_level") in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        logging.getLogger(logger).setLevel(logging.INFO)


def debug_enabled() -> bool:
    """True when ``--log-level DEBUG`` is in effect (errors then show a traceback)."""
    return logging.getLogger("qps").isEnabledFor(logging.DEBUG)


# -- running library code -----------------------------------------------------------------


#: ``asyncio`` runs the commands on the standard event loop instead of uvloop's
EVENT_LOOP_ENV = "QPS_EVENT_LOOP"


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` to its end on uvloop's event loop where it is installed (a dependency
    on Linux and macOS: its callbacks and transports cost a role about a tenth less CPU
    per update, W6), else, or with ``$QPS_EVENT_LOOP=asyncio``, on asyncio's own."""
    if os.environ.get(EVENT_LOOP_ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` with :func:`asyncio.run`, translating qps errors to :class:`CliError`."""
    try:
        return _run(coro)
    except QpsError as exc:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        raise CliError(str(exc), exit_code_for(exc)) from exc


# -- connecting ------------------------------------------------------------------------


def _invalid_url(url: str | None, why: object) -> CliError:
    shown = redact_url(url) if url else "(none)"
    return CliError(f"invalid Redis URL {shown}: {why}", EXIT_USAGE)


def check_url(url: str | None) -> str | None:
    """``url`` itself if redis-py can read it (None and "" too: the default server).

    Only its form is checked, as :func:`qps.connect` would read it, without connecting:
    the scheme, host and port, the ``cluster=`` parameter, and the query options
    (redis-py passes one it does not know to its connection as a keyword argument).
    Every ``--url`` (and ``$QPS_REDIS_URL``) goes through it as it is parsed, so a bad
    one stops a command before it prints, connects or starts anything.

    Raises:
        CliError: the URL is malformed (exit code 2).
    """
    if not url:
        return url
    remember_url(url)
    try:
        transport.check_form(url)
    except TypeError as exc:  # e.g. '?=' in an unquoted password: an option named ''
        raise _invalid_url(url, f"unknown query option ({exc})") from exc
    except InvalidArgumentError as exc:
        raise _invalid_url(url, exc) from exc
    return url


def _check_url_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return check_url(value)


@contextlib.asynccontextmanager
async def connected(url: str | None) -> AsyncIterator[Client]:
    """A :class:`qps.Client` for ``url`` (None: ``$QPS_REDIS_URL`` or the local embedded
    server), closed on exit.

    Raises:
        CliError: the URL is malformed (exit code 2; see :func:`check_url`).
        UnavailableError: the server cannot be reached.
    """
    check_url(url)
    try:
        client = await connect(url)
    except QpsError:
        raise
    except (ValueError, TypeError) as exc:  # what check_url could not see coming
        raise _invalid_url(url, exc) from exc
    remember_url(client.url)
    try:
        yield client
    finally:
        await client.close()


# -- common options ---------------------------------------------------------------------


def _check_container(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return keys.check_container(value)
    except QpsError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


URL_HELP = (
    "Redis URL: redis://[user:password@]host:port/db, rediss://... (TLS) or "
    "unix:///path/to/socket. Default: the local embedded server (reused if one is "
    "running, else started for this command and stopped after it)."
)


def _ask_cluster(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``--cluster``: ``$QPS_CLUSTER=yes`` while the command runs, for its connections
    and for the roles it starts (they inherit the environment)."""
    if not value:
        return
    before = os.environ.get(transport.CLUSTER_ENV)
    os.environ[transport.CLUSTER_ENV] = "yes"

    def restore() -> None:
        if before is None:
            os.environ.pop(transport.CLUSTER_ENV, None)
        else:
            os.environ[transport.CLUSTER_ENV] = before

    ctx.call_on_close(restore)


def url_option(help: str = URL_HELP) -> Callable[[F], F]:
    """``--url`` (env ``QPS_REDIS_URL``, checked by :func:`check_url` as it is parsed),
    with ``help`` as its help text, and ``--cluster``."""

    def decorate(f: F) -> F:
        f = click.option(
            "--cluster",
            is_flag=True,
            envvar=transport.CLUSTER_ENV,
            show_envvar=True,
            expose_value=False,
            callback=_ask_cluster,
            help="The URL names a Redis Cluster node: use the cluster (as ?cluster=yes "
            "in the URL or QPS_CLUSTER=yes; default: detected).",
        )(f)
        return click.option(
            "--url",
            envvar="QPS_REDIS_URL",
            show_envvar=True,
            default=None,
            metavar="URL",
            callback=_check_url_option,
            help=help,
        )(f)

    return decorate


def container_option(f: F) -> F:
    """``--container`` (env ``QPS_CONTAINER``)."""
    return click.option(
        "--container",
        envvar="QPS_CONTAINER",
        show_envvar=True,
        default=keys.DEFAULT_CONTAINER,
        show_default=True,
        callback=_check_container,
        help="The resource container to read (queues, variables and counters live in one).",
    )(f)


def metrics_options(f: F) -> F:
    """``--metrics-port`` (env ``QPS_METRICS_PORT``) and ``--metrics-addr`` (env
    ``QPS_METRICS_ADDR``): serve Prometheus metrics (see :func:`serve_metrics`)."""
    f = click.option(
        "--metrics-addr",
        envvar="QPS_METRICS_ADDR",
        show_envvar=True,
        default="127.0.0.1",
        show_default=True,
        metavar="ADDR",
        help="Address the metrics endpoint listens on (0.0.0.0: every interface).",
    )(f)
    return click.option(
        "--metrics-port",
        envvar="QPS_METRICS_PORT",
        show_envvar=True,
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics at http://ADDR:PORT/metrics (0: a free port, "
        "logged). Default: no endpoint.",
    )(f)


def serve_metrics(ctx: click.Context, port: int | None, addr: str) -> None:
    """Serve the process's metrics (:func:`qps.metrics.default`) if ``port`` is given,
    logging the bound address at INFO like the role's own log.

    Raises:
        CliError: the address cannot be bound.
    """
    if port is None:
        return
    from qps import metrics

    role_logs(ctx, "qps.metrics")
    try:
        metrics.default().serve(port, addr)
    except OSError as exc:
        raise CliError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc


def yes_option(f: F) -> F:
    """``-y/--yes``: do not ask for confirmation (required when stdin is not a terminal)."""
    return click.option(
        "--yes",
        "-y",
        is_flag=True,
        default=False,
        help="Do not ask for confirmation (required when stdin is not a terminal).",
    )(f)


def json_option(f: F) -> F:
    """``--json``: machine-readable output."""
    return click.option(
        "--json",
        "json",
        is_flag=True,
        default=False,
        help="Print JSON instead of text.",
    )(f)


# -- output and prompting helpers shared by the command groups ---------------------------


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON (the ``--json`` output of the commands)."""
    click.echo(json.dumps(data, indent=2))


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Text table lines: columns padded to their widest cell, those in ``right``
    right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        pairs = zip(row, widths, strict=True)
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(pairs)]
        lines.append("  ".join(cells).rstrip())
    return lines


def interactive() -> bool:
    """Whether a confirmation can be asked (stdin is a terminal)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False
