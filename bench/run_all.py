"""Run every queue benchmark (W1 a/b, W1 batched a/b, W2 a/b, W3, wake latency) against
its raw redis-py baseline, repetition-major, and print the table (``--out`` also writes
it as Markdown). ``--quick`` is a smoke test: 1 repetition, smaller counts.

    python bench/run_all.py --reps 3 --out /tmp/bench.md

See ``bench/README.md`` for what each row measures and how to read the ratios.
"""

from __future__ import annotations

import harness
import w1_queue_small
import w2_queue_batch
import w3_bulk
import wake_latency


def rows(quick: bool) -> list[harness.Row]:
    return [
        *w1_queue_small.rows(quick),
        *w2_queue_batch.rows(quick),
        *w3_bulk.rows(quick),
        *wake_latency.rows(quick),
    ]


if __name__ == "__main__":
    harness.bench_main(rows, __doc__ or "")
