"""Every Redis key qps uses is spelled here, and nowhere else.

Layout (docs/keys.md): all keys of one resource share one hash tag, so each Lua
script touches a single slot and the same code runs on Redis Cluster::

    qps:{<container>/q/<name>}:meta      hash: spec, closed flag, counters, RNG state
    qps:{<container>/q/<name>}:items     list (FIFO, padding) or hash slot->element (shuffle)
    qps:{<container>/q/<name>}:ew        list: pending enqueue attempts, oldest first
    qps:{<container>/q/<name>}:dw        list: pending dequeue attempts, oldest first
    qps:{<container>/q/<name>}:lease     zset: attempt id -> lease expiry (ms, server clock)
    qps:{<container>/q/<name>}:dlq       list: elements that failed to decode, with reasons
    qps:{<container>/q/<name>}:a:<id>:p  list: elements a pending enqueue still has to insert
    qps:{<container>/q/<name>}:a:<id>:h  list: elements a dequeue holds (partial or delivered)
    qps:{<container>/q/<name>}:a:<id>:s  string: the outcome of a finished attempt
    qps:{<container>/q/<name>}:a:<id>:w  list: wake token for the attempt's blocked caller
    qps:{<container>/q/<name>}:b:<id>:<k> string: chunk k of a large element
    qps:{<container>}:queues             set: names of the queues of a container
    qps:{<container>/c/<name>}:value     string: a Counter's int64 value
    qps:{<container>}:counters           set: names of the counters of a container
    qps:{<container>/v/<name>}:meta      hash: a variable's spec, generation, version, token
    qps:{<container>/v/<name>}:d:<g>:<i> string: segment i of generation g of its value
    qps:{<container>/v/<name>}:s:<id>    string: rows staged by a publish_rows in flight
    qps:{<container>/v/<name>}:o:<g>:<slot>:<i>  string: segment i of an optimizer slot
    qps:{<container>/v/<name>}:applied   zset: ids of gradient messages applied, not yet acked
    qps:{<container>/v/<name>}:ck:<id>:...  strings: a checkpoint's pinned copy of the value
                                         (d:<i>) and slots (o:<slot>:<i>), 10 min TTL
    qps:{<container>}:variables          set: names of the variables of a container
    qps:{<container>/a/<name>}:...       an accumulator's keys (reserved: accumulators)
    qps:{<container>}:accumulators       set: names of the accumulators of a container
    qps:{<container>/c/<name>}:applied   zset: ids of messages a counter commit counted
    qps:{<container>}:ps:config          hash: num_shards, optimizer spec (the PS job)
    qps:{<container>}:ps:placement       hash: variable name -> PS shard index
    qps:{<container>}:ps:finished        string: set when the job is marked finished
    qps:{<container>/ps/<i>}:lease       string: "<token> <owner>" of shard i's writer (TTL)
    qps:{<container>/ps/<i>}:wake        list: pushed when shard i's lease is released
    qps:{<container>/ps/<i>}:stats       hash: shard i's counters and staleness histogram
    qps:{<container>/ps/<i>}:dlq         list: gradient messages shard i refused, with why
    qps:{<container>}:registered         string: the container's registration (any value)
    qps:containers                       set: legacy registry of container names (read only)

**Container rule.** Every key of container ``C`` starts with ``qps:{C}:`` (keys of the
container itself, such as its registries) or ``qps:{C/`` (keys of one of its resources,
tagged ``C/<kind>/<name>``). Container names cannot hold ``{``, ``}`` or ``/``, so these
two prefixes never match a key of another container, even one whose name starts with
``C`` ("a" vs "ab"). :func:`container_key_patterns` gives them as SCAN patterns;
``qps.containers.reset`` deletes exactly the keys they match. A new kind of resource
must follow the rule (use :func:`resource_prefix`) or ``reset`` will not remove it.

Per-attempt keys are derived inside the Lua scripts from the queue's prefix; they share
its hash tag and therefore its slot.
"""

from __future__ import annotations

import re

ROOT = "qps"
#: The registry of containers of earlier qps versions (a set of names, written by every
#: process): still read as a source of names, never written (see :func:`registration`).
CONTAINERS = f"{ROOT}:containers"
DEFAULT_CONTAINER = "default"

# fullmatch, not match with "$": "$" also matches before a final newline ("a\n")
_CONTAINER_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_NAME_RE = re.compile(r"[A-Za-z0-9_.:/\-]{1,200}")


def check_container(container: str) -> str:
    """Return ``container`` if it is a valid container name.

    Raises:
        InvalidArgumentError: empty, too long, or a character outside ``[A-Za-z0-9_.:-]``.
    """
    if not isinstance(container, str) or not _CONTAINER_RE.fullmatch(container):
        from qps.errors import InvalidArgumentError  # only on failure: a hot path

        raise InvalidArgumentError(
            f"invalid container name {container!r}: use 1-128 characters from [A-Za-z0-9_.:-]"
        )
    return container


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid resource name.

    Raises:
        InvalidArgumentError: empty, too long, or a character outside ``[A-Za-z0-9_.:/-]``.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        from qps.errors import InvalidArgumentError  # only on failure: a hot path

        raise InvalidArgumentError(
            f"invalid resource name {name!r}: use 1-200 characters from [A-Za-z0-9_.:/-]"
        )
    return name


def queue_prefix(container: str, name: str) -> str:
    """The prefix shared by every key of queue ``name`` in ``container`` (ends with ':')."""
    return f"{ROOT}:{{{container}/q/{name}}}:"


def container_queues(container: str) -> str:
    """The set holding the names of the queues of ``container``."""
    return f"{ROOT}:{{{container}}}:queues"


#: A resource's kind tag (the middle part of its hash tag ``<container>/<kind>/<name>``)
#: -> the plural name of its kind, which also names the container's registry set.
RESOURCE_KINDS: dict[str, str] = {
    "q": "queues",
    "c": "counters",
    "v": "variables",
    "a": "accumulators",
}


def container_prefix(container: str) -> str:
    """The prefix of the keys of ``container`` itself, e.g. its registries (ends with ':')."""
    return f"{ROOT}:{{{container}}}:"


def resource_prefix(container: str, kind: str, name: str) -> str:
    """The prefix shared by every key of resource ``name`` of ``kind`` (a key of
    :data:`RESOURCE_KINDS`, or a new short tag) in ``container`` (ends with ':')."""
    return f"{ROOT}:{{{container}/{kind}/{name}}}:"


def container_registry(container: str, kind: str) -> str:
    """The set holding the names of the resources of ``kind`` (a tag of
    :data:`RESOURCE_KINDS`) in ``container``."""
    return container_prefix(container) + RESOURCE_KINDS[kind]


def counter_key(container: str, name: str) -> str:
    """The string key holding counter ``name``'s int64 value."""
    return resource_prefix(container, "c", name) + "value"


def container_counters(container: str) -> str:
    """The set holding the names of the counters of ``container``."""
    return container_registry(container, "c")


def feed_prefix(container: str, queue: str) -> str:
    """The prefix of the keys of the feed into queue ``queue`` (``qps feed``): ``state``
    (a hash: the feed's dataset fingerprint, seed, epochs and where its count of inserted
    elements starts), ``owner`` (the lease of the feeder running it) and ``wake`` (pushed
    when that lease is released)."""
    return resource_prefix(container, "f", queue)


def variable_prefix(container: str, name: str) -> str:
    """The prefix of every key of variable ``name`` in ``container`` (ends with ':')."""
    return resource_prefix(container, "v", name)


def variable_meta(container: str, name: str) -> str:
    """The meta hash of variable ``name`` (spec and pointer: ``KEYS[1]`` of its scripts)."""
    return variable_prefix(container, name) + "meta"


def variable_applied(container: str, name: str) -> str:
    """The sorted set of gradient-message ids applied to variable ``name`` whose messages
    are not yet acknowledged (message id -> server time in ms)."""
    return variable_prefix(container, name) + "applied"


def variable_checkpoint_prefix(container: str, name: str, snapshot: str) -> str:
    """The prefix of the copies of variable ``name``'s segments (``d:<i>``) and slot
    segments (``o:<slot>:<i>``) that checkpoint snapshot ``snapshot`` pins while it
    saves them (same hash tag as the variable)."""
    return variable_prefix(container, name) + f"ck:{snapshot}:"


def container_variables(container: str) -> str:
    """The set holding the names of the variables of ``container``."""
    return container_registry(container, "v")


def accumulator_prefix(container: str, name: str) -> str:
    """The prefix of every key of accumulator ``name`` in ``container`` (ends with ':')."""
    return resource_prefix(container, "a", name)


def container_accumulators(container: str) -> str:
    """The set holding the names of the accumulators of ``container``."""
    return container_registry(container, "a")


def registration(container: str) -> str:
    """The key that registers ``container`` (a string; its value does not matter).

    It lies in the container's own key space, so a Redis ACL user limited to one
    container (``~qps:{C}:* ~qps:{C/*``) can register it and no other, and
    ``qps.containers.reset`` deletes it with the rest. Containers are listed by
    scanning for these keys (:data:`ALL_REGISTRATIONS`)."""
    return container_prefix(container) + "registered"


def glob_escape(text: str) -> str:
    """``text`` with the characters special to Redis glob patterns escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def container_key_patterns(container: str) -> tuple[str, str]:
    """The two SCAN ``MATCH`` patterns that match every key of ``container`` and no key
    of any other container (see the container rule in this module's docstring)."""
    return (
        glob_escape(container_prefix(container)) + "*",
        glob_escape(f"{ROOT}:{{{container}/") + "*",
    )


#: SCAN pattern matching the keys of every container (``qps:{...``).
ALL_CONTAINER_KEYS = glob_escape(f"{ROOT}:{{") + "*"
#: SCAN pattern matching every container's :func:`registration` key (and possibly
#: other keys: a match is one only if it equals ``registration(container_of(key))``).
ALL_REGISTRATIONS = glob_escape(f"{ROOT}:{{") + "*" + glob_escape("}:registered")


def is_registration(key: str | bytes) -> str | None:
    """The container that ``key`` registers, or None if it is no :func:`registration`."""
    c = container_of(key)
    if c is None:
        return None
    text = key.decode("utf-8", errors="replace") if isinstance(key, bytes) else key
    return c if text == registration(c) else None


def container_of(key: str | bytes) -> str | None:
    """The container a key belongs to, or None for a key outside every container
    (the legacy ``qps:containers``, or not a qps key)."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", errors="replace")
    head = f"{ROOT}:{{"
    if not key.startswith(head):
        return None
    end = key.find("}", len(head))
    if end < 0:
        return None
    tag = key[len(head) : end]
    container = tag.split("/", 1)[0]
    return container if _CONTAINER_RE.fullmatch(container) else None


def kind_of(key: str | bytes) -> str | None:
    """The kind tag of a container key (``"q"``, ``"c"``, ...), or None for a key of
    the container itself (or outside every container)."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", errors="replace")
    head = f"{ROOT}:{{"
    end = key.find("}", len(head))
    if not key.startswith(head) or end < 0:
        return None
    parts = key[len(head) : end].split("/", 2)
    return parts[1] if len(parts) == 3 else None


# -- parameter servers ----------------------------------------------------------------------

#: The counter whose INCR hands out PS fencing tokens (one per lease taken).
PS_TOKEN_COUNTER = "ps/token"
#: TF's global step: a counter advanced by PS shard 0, once per applied worker step.
GLOBAL_STEP = "global_step"


def counter_applied(container: str, name: str) -> str:
    """The sorted set of message ids a counter commit has counted and not yet released
    (same hash tag as the counter's value)."""
    return resource_prefix(container, "c", name) + "applied"


def ps_config(container: str) -> str:
    """The hash describing the PS job of ``container``: ``num_shards``, ``optimizer``."""
    return container_prefix(container) + "ps:config"


def ps_config_wake(container: str) -> str:
    """The list a shard started without an optimizer blocks on until one is recorded."""
    return container_prefix(container) + "ps:config:wake"


def ps_placement(container: str) -> str:
    """The hash variable name -> PS shard index that every role reads."""
    return container_prefix(container) + "ps:placement"


def packed_layout(container: str) -> str:
    """The string (JSON) naming the parameters a packed model stores in its flat
    variables, and where each lies (qps.packing)."""
    return container_prefix(container) + "packed"


def ps_finished(container: str) -> str:
    """The string set when the job of ``container`` is marked finished."""
    return container_prefix(container) + "ps:finished"


def ps_prefix(container: str, shard: int) -> str:
    """The prefix of the keys of PS shard ``shard`` of ``container`` (ends with ':')."""
    return resource_prefix(container, "ps", str(int(shard)))


def ps_gradient_queue(shard: int) -> str:
    """The shared name of the gradient queue of PS shard ``shard``."""
    return f"ps/{int(shard)}/grads"
