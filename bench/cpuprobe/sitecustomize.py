"""CPU probe for ``bench/cpu_per_update.py`` (not part of qps).

Put on ``PYTHONPATH`` with ``QPS_BENCH_CPU_DIR`` set, every Python process started
then writes, when it exits, one file ``<pid>.json`` there: its CPU seconds (user +
system, all threads) and its command line. Without the variable it does nothing.
"""

import os

_DIR = os.environ.get("QPS_BENCH_CPU_DIR")

if _DIR:
    import atexit
    import json
    import resource
    import sys

    def _write() -> None:
        use = resource.getrusage(resource.RUSAGE_SELF)
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"cpu": use.ru_utime + use.ru_stime, "argv": sys.argv}, f)
        except OSError:
            pass

    atexit.register(_write)
