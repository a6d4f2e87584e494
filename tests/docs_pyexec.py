"""The interpreter tests/docs_runner.py runs a page's ``python`` blocks in.

Reads one JSON request per line on stdin (``{"code", "name"}``), runs the code in one
namespace for the whole page and answers ``{"ok": true}`` or ``{"ok": false, "error":
traceback}`` on the file descriptor named by its argument. As in ``python -m asyncio``, an
event loop runs all the time in a thread of its own: a block that awaits at top level runs
on it, and the tasks it leaves (a call left waiting) go on running between blocks; any
other block runs in the main thread as a script would, so ``asyncio.run`` works. The
blocks' own output goes to stdout and stderr.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import sys
import threading
import traceback


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w")
    namespace: dict[str, object] = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="repl-loop", daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            code = compile(
                request["code"], request["name"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            )
            if code.co_flags & inspect.CO_COROUTINE:
                asyncio.run_coroutine_threadsafe(eval(code, namespace), loop).result()
            else:
                exec(code, namespace)
            reply: dict[str, object] = {"ok": True}
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
