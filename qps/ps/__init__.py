"""Parameter servers: PS shard processes that own and update variables, and the
worker's side of a PS job (see ``docs/ps.md``).

* :mod:`qps.ps.messages` — gradient messages as bytes (pure);
* :mod:`qps.ps.control` — what every role agrees on: config, placement, gradient
  queues, the global step, the "finished" mark, status and dead letters;
* :mod:`qps.ps.status` — the shards' published status (re-exported by control);
* :mod:`qps.ps.shard` — one shard: lease + fencing, apply loop, exactly-once commits;
* :mod:`qps.ps.client` — pull / push / global step for workers (used by
  :class:`qps.Session`).
"""

from qps.ps.client import PSClient
from qps.ps.control import (
    PSConfig,
    ShardStatus,
    configure,
    dead_letters,
    drop_dead_letters,
    is_finished,
    mark_finished,
    place_variables,
    read_config,
    read_placement,
    shard_status,
)
from qps.ps.messages import GradientMessage, SparseGradient, decode_message, encode_message
from qps.ps.shard import LeaseLostError, Shard, ShardOptions

__all__ = [
    "GradientMessage",
    "LeaseLostError",
    "PSClient",
    "PSConfig",
    "Shard",
    "ShardOptions",
    "ShardStatus",
    "SparseGradient",
    "configure",
    "dead_letters",
    "decode_message",
    "drop_dead_letters",
    "encode_message",
    "is_finished",
    "mark_finished",
    "place_variables",
    "read_config",
    "read_placement",
    "shard_status",
]
