"""Where a worker step's time goes on a GPU: the W4 and W5 models' step split into the
parameters' trip to the device, the math and the gradients' trip back, with pageable
host memory (what the worker does now) and through pinned buffers, next to the same
step in NumPy (OPENBLAS_NUM_THREADS as set; bench/gpu_check.sh sets 1).

    python bench/gpu_step.py [--steps 50]

Prints milliseconds per step, the median of ``--steps`` timed steps after three
warm-up steps (CuPy compiles its kernels at their first call). Needs CuPy and a device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.data import builtin_split
from workers.models import build_model, grads_to_host, params_to

MODELS = {"w4": ("mlp:64,128,10", "digits", 64), "w5": ("mlp:784,1024,1024,10", "teacher", 128)}


def median_ms(fn: Callable[[], Any], steps: int, sync: Callable[[], None]) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def row(spec: str, data: str, batch_size: int, steps: int, cp: Any) -> list[float]:
    """One model's milliseconds: NumPy step, to the device, math, to the host, CuPy
    step, and to the device and to the host through pinned buffers."""
    sync = cp.cuda.get_current_stream().synchronize
    model = build_model(spec)
    params = model.init_params(np.random.default_rng(0))
    train, _ = builtin_split(data, model)
    batch = tuple(a[:batch_size] for a in train)
    host = median_ms(lambda: model.loss_and_grads(params, batch), steps, lambda: None)
    on_dev = params_to(params, cp)
    h2d = median_ms(lambda: params_to(params, cp), steps, sync)
    math = median_ms(lambda: model.loss_and_grads(on_dev, batch), steps, sync)
    _, grads = model.loss_and_grads(on_dev, batch)
    d2h = median_ms(lambda: grads_to_host(grads), steps, sync)

    def step() -> None:
        grads_to_host(model.loss_and_grads(params_to(params, cp), batch)[1])

    whole = median_ms(step, steps, sync)
    # through pinned buffers: one per parameter, kept across steps
    pinned = {
        k: np.frombuffer(cp.cuda.alloc_pinned_memory(v.nbytes), v.dtype, v.size).reshape(v.shape)
        for k, v in params.items()
    }
    dev_bufs = {k: cp.empty_like(v) for k, v in on_dev.items()}

    def h2d_pinned() -> None:
        for k, v in params.items():
            np.copyto(pinned[k], v)
            dev_bufs[k].set(pinned[k])

    def d2h_pinned() -> None:
        for k, g in grads.items():
            g.get(out=pinned[k])

    return [host, h2d, math, d2h, whole, median_ms(h2d_pinned, steps, sync),
            median_ms(d2h_pinned, steps, sync)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)["name"]
    print(f"device: {dev.decode() if isinstance(dev, bytes) else dev}; CuPy {cp.__version__}")
    print(
        "| model | NumPy step | to device | math | to host | CuPy step | pinned: to device | to host |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (spec, data, batch_size) in MODELS.items():
        ms = row(spec, data, batch_size, args.steps, cp)
        cells = " | ".join(f"{x:.3f}" for x in ms)
        print(f"| {name.upper()} {spec} batch {batch_size} | {cells} |")


if __name__ == "__main__":
    main()
