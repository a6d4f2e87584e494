"""The interpreter tests/docs_runner.py runs a page's ``python`` blocks in.

Reads one JSON request per line on stdin (``{"code", "name"}``), runs the code in one
namespace for the whole page (top-level ``await`` allowed: such a block runs on one event
loop kept for the page; any other block runs as a script would, so ``asyncio.run`` works),
and answers ``{"ok": true}`` or ``{"ok": false, "error": traceback}`` on the file
descriptor named by its argument. The blocks' own output goes to stdout and stderr.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import sys
import traceback


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w")
    namespace: dict[str, object] = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            code = compile(
                request["code"], request["name"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            )
            if code.co_flags & inspect.CO_COROUTINE:
                loop.run_until_complete(eval(code, namespace))
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
