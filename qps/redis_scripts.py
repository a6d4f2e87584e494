"""The Lua scripts of ``qps/lua``: their source, assembled once, and their SHA.

:class:`Script` is one entry of a client's registry (:meth:`qps.transport.Client.run_script`
and the combined operations run scripts by name); the one place that loads a script
after ``NOSCRIPT`` is :meth:`qps.redis_client.Client._loaded_again`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any


def lua_source(name: str) -> str:
    """A script's full source.

    A name with a folder (``"ps/commit"``: ``qps/lua/ps/commit.lua``) is a script of its
    own, sent as written. A bare name is a queue script: ``fast_common.lua`` (helpers
    the fast paths share with the library), the shared queue library, then the script
    body as a function whose reply is returned after ``commit()`` wrote back the meta
    fields.

    A script with a fast path (``<name>_fast.lua``) runs that first; the full script is
    then wrapped in a function called only when the fast path falls through, so the
    common case skips the library's set-up (about 7 µs of server time per call)."""
    lua = resources.files("qps") / "lua"
    if "/" in name:
        folder, file = name.split("/", 1)
        return (lua / folder / f"{file}.lua").read_text(encoding="utf-8")
    common = (lua / "queue_common.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    full = (
        f"{common}\nlocal function main()\n{body}\nend\n"
        "local reply = main()\ncommit()\nreturn reply\n"
    )
    shared = (lua / "fast_common.lua").read_text(encoding="utf-8")
    fast = lua / f"{name}_fast.lua"
    if not fast.is_file():
        return f"{shared}\n{full}"
    return (
        f"{shared}\n{fast.read_text(encoding='utf-8')}\n"
        f"local function full()\n{full}end\nreturn full()\n"
    )


class Script:
    """A Lua script run by SHA, loaded on first use and again after NOSCRIPT."""

    __slots__ = ("load", "loaded", "name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = lua_source(name)
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()
        #: the command that loads it
        self.load = (b"SCRIPT", b"LOAD", self.source)
        #: known to be on the server (set by the round trips that must not meet NOSCRIPT)
        self.loaded = False

    def call(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        """The ``EVALSHA`` command that runs it on ``keys`` and ``args``."""
        return (b"EVALSHA", self.sha, len(keys), *keys, *args)
