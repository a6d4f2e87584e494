""":class:`Counter`: a named int64 counter in a container (TF's global step builds on
it), and the reading of counter values for :func:`qps.containers.container_stats`.

Its value is the decimal string ``qps:{C/c/<name>}:value``; its name is registered in
``qps:{C}:counters``. A stored value that is not an int64 (another type of key, garbage
bytes, a number out of range) is never taken for one: the call raises
:class:`~qps.errors.DataLossError` naming the key and changes nothing.
"""

from __future__ import annotations

import operator
import re
from typing import Any

from qps import keys, registry
from qps.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    QpsError,
)
from qps.transport import Client, reply_text

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: What a stored int64 looks like (Redis's own INCRBY accepts no more than this).
_INT64_TEXT = re.compile(rb"-?[0-9]{1,19}")


def int64_arg(value: Any, what: str) -> int:
    """``value`` as an int64 argument.

    Raises:
        InvalidArgumentError: not an integer (``bool`` included), or out of int64.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}") from None
    if not INT64_MIN <= v <= INT64_MAX:
        raise InvalidArgumentError(f"{what} {v} does not fit in int64")
    return v


def stored_int64(raw: Any, key: str, what: str) -> int:
    """A stored counter value read back.

    Raises:
        DataLossError: ``raw`` is not the decimal text of an int64; names ``key``.
    """
    data = raw.encode() if isinstance(raw, str) else raw
    if isinstance(data, bytes) and _INT64_TEXT.fullmatch(data):
        v = int(data)
        if INT64_MIN <= v <= INT64_MAX:
            return v
    raise DataLossError(f"{what}: {key} holds {raw!r}, not an int64")


def _stored_error(exc: QpsError | str, key: str, what: str, *, reply: bool = False) -> QpsError:
    """The error for a Redis error met on a counter's value key: another type of key
    or a value that is no int64 is data loss (named by its key), else as translated.
    ``reply``: ``exc`` is an error reply left in place, quoted in the server's words."""
    text = reply_text(exc) if reply and isinstance(exc, QpsError) else str(exc)
    if "WRONGTYPE" in text:
        return DataLossError(f"{what}: {key} is not a string key ({text})")
    if "not an integer" in text:
        return DataLossError(f"{what}: {key} holds a value that is not an int64 ({text})")
    if reply and isinstance(exc, QpsError):
        return exc
    return InternalError(f"{what}: {text}")


async def counter_values(
    client: Client, container: str, names: list[str]
) -> tuple[dict[str, int], list[str]]:
    """Counter name -> value for ``names`` of ``container`` (missing ones left out),
    and the counters whose value key is corrupt, each naming its key."""
    if not names:
        return {}, []
    counter_keys = [keys.counter_key(container, n) for n in names]
    raw = await client.mget(counter_keys)  # each has a hash tag of its own: per slot
    values: dict[str, int] = {}
    problems: list[str] = []
    absent: list[str] = []
    for n, key, v in zip(names, counter_keys, raw, strict=True):
        if v is None:
            absent.append(key)  # missing, or another type of key (MGET says nil)
            continue
        try:
            values[n] = stored_int64(v, key, f"counter '{container}/{n}'")
        except DataLossError as exc:
            problems.append(str(exc))
    for key in absent:
        kind = await client.type(key)
        if kind != "none":
            problems.append(f"{key} is a {kind}, not a string: its counter is left out")
    return values, problems


async def list_counters(client: Client, container: str = keys.DEFAULT_CONTAINER) -> list[str]:
    """Names of the counters registered in ``container``, sorted (members of its
    counters set that are no valid names are left out).

    Raises:
        DataLossError: the counters set is another type of key.
    """
    keys.check_container(container)
    where = keys.container_counters(container)
    try:
        names = await client.smembers(where)
    except InternalError as exc:
        raise _stored_error(exc, where, f"container '{container}'") from exc
    out = []
    for raw in names:
        try:
            out.append(keys.check_name(registry.text_of(raw)))
        except InvalidArgumentError:
            continue
    return sorted(out)


class Counter:
    """A named int64 counter in a container, shared by every process that opens the
    same name (TF's global step builds on it).

    The counter is created with ``initial`` on first use if it does not exist yet; an
    existing one keeps its value (the first creator wins, as with TF's shared
    resources). Every change is one atomic server-side step.

    Args:
        name: the counter's name (``[A-Za-z0-9_.:/-]``, 1-200 characters).
        container: the resource container (default ``"default"``).
        client: a :class:`qps.Client`; defaults to the process-wide one.
        initial: the value a new counter starts from.

    Raises:
        InvalidArgumentError: an invalid name, container or initial value.
    """

    def __init__(
        self,
        name: str,
        *,
        container: str | None = None,
        client: Client | None = None,
        initial: int = 0,
    ) -> None:
        self._name = keys.check_name(name)
        self._container = keys.check_container(container or keys.DEFAULT_CONTAINER)
        self._client = client
        self._initial = int64_arg(initial, "initial value")
        self._key = keys.counter_key(self._container, self._name)
        self._opened = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def container(self) -> str:
        return self._container

    def __repr__(self) -> str:
        return f"<qps.Counter {self._container}/{self._name}>"

    @property
    def _what(self) -> str:
        return f"counter '{self._container}/{self._name}'"

    async def _c(self) -> Client:
        if self._client is None:
            from qps.queues.waiters import default_client

            self._client = await default_client()
        if not self._opened:
            where = keys.container_counters(self._container)
            batch = self._client.batch().set(self._key, self._initial, nx=True)
            batch.set(keys.registration(self._container), 1, nx=True).sadd(where, self._name)
            replies = await batch.run(raise_on_error=False)
            written = (self._key, keys.registration(self._container), where)
            for key, reply in zip(written, replies, strict=True):
                if isinstance(reply, QpsError):  # translated: its cause is Redis's
                    raise _stored_error(reply, key, self._what, reply=True) from reply.__cause__
            self._opened = True
        return self._client

    def _gone(self) -> NotFoundError:
        return NotFoundError(
            f"counter '{self._name}' no longer exists in container '{self._container}' "
            "(was it reset?)"
        )

    async def _run(self, op: str, arg: int) -> int:
        client = await self._c()
        reply = await client.run_script("counters/update", [self._key], [op, arg])
        status = registry.text_of(reply[0])
        if status == "gone":
            raise self._gone()
        if status == "err":
            text = registry.text_of(reply[1])
            if "overflow" in text:
                raise OutOfRangeError(f"{self._what}: adding {arg} would overflow int64")
            raise _stored_error(text, self._key, self._what)
        return stored_int64(reply[1], self._key, self._what)

    async def get(self) -> int:
        """The current value.

        Raises:
            NotFoundError: the counter was deleted (its container reset) since this
                object created or found it.
            DataLossError: its key holds no int64 (names the key).
        """
        client = await self._c()
        try:
            raw = await client.get(self._key)
        except InternalError as exc:
            raise _stored_error(exc, self._key, self._what) from exc
        if raw is None:
            raise self._gone()
        return stored_int64(raw, self._key, self._what)

    async def add(self, delta: int = 1) -> int:
        """Add ``delta`` (may be negative) atomically; return the new value.

        Raises:
            InvalidArgumentError: ``delta`` is not an int64.
            OutOfRangeError: the result would not fit in int64 (nothing changes).
            NotFoundError: the counter was deleted (its container reset).
            DataLossError: its key holds no int64 (nothing changes; names the key).
        """
        return await self._run("add", int64_arg(delta, "delta"))

    async def set(self, value: int) -> int:
        """Set the value atomically; return the previous one.

        Raises:
            InvalidArgumentError: ``value`` is not an int64.
            NotFoundError: the counter was deleted (its container reset).
            DataLossError: its key holds no int64 (nothing changes; names the key).
        """
        return await self._run("set", int64_arg(value, "value"))
