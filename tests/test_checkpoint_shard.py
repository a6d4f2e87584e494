"""A PS shard resumes from a restored checkpoint exactly as if never interrupted
(qps/checkpoint.py with qps/ps/shard.py in-process, both backends): Adam's slots and
``t`` come back, so with pushes applied one at a time the result is the same to the
last bit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

import qps
from qps import checkpoint
from qps.optimizers import Adam
from qps.ps import control
from qps.ps.shard import Shard, ShardOptions
from tests.conftest import ClientFactory, until

GRADS = [np.linspace(-1, 1, 6).reshape(2, 3).astype(np.float32) * (k + 1) for k in range(12)]


async def _run(
    make_client: ClientFactory, tmp_path: Path, container: str, interrupt: bool
) -> np.ndarray:
    client = await make_client()
    await control.configure(client, container, 1, Adam(learning_rate=0.1))
    tasks: list[asyncio.Task[str]] = []
    shards: list[Shard] = []

    async def shard() -> asyncio.Task[str]:
        opts = ShardOptions(0, 1, container=container, lease_ms=900)
        shards.append(Shard(await make_client(), opts))
        t = asyncio.create_task(shards[-1].run())
        tasks.append(t)
        return t

    async with qps.Session(client=client, container=container, worker="w0") as sess:
        await sess.variable("w", (2, 3), np.float32, qps.initializers.ones()).create()

        async def push(sess: qps.Session, ks: range) -> None:
            for k in ks:
                await sess.pull("w")
                await sess.push({"w": GRADS[k]}, step=k)

                async def applied(n: int = k + 1) -> bool:
                    return await sess.global_step() >= n

                await until(applied, timeout=30)

        try:
            task = await shard()
            await push(sess, range(6))
            if interrupt:
                info = await checkpoint.save(sess, tmp_path / container)
                shards[-1].request_stop()  # SIGTERM: after the message in hand
                assert await asyncio.wait_for(task, 30) == "stopped"
                await qps.reset(client=client, containers=[container])
                await checkpoint.restore(sess, info.path)
                task = await shard()
                # the workers' sessions start again too (their queue handles are gone)
                async with qps.Session(client=client, container=container, worker="w0") as s2:
                    await push(s2, range(6, 12))
            else:
                await push(sess, range(6, 12))
            await control.mark_finished(client, container)
            assert await asyncio.wait_for(task, 30) == "finished"
            return (await sess.pull("w")).value
        finally:
            for sh in shards:
                sh.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_shard_resumes_adam_exactly(make_client: ClientFactory, tmp_path: Path) -> None:
    resumed = await _run(make_client, tmp_path, "resumed", True)
    straight = await _run(make_client, tmp_path, "straight", False)
    np.testing.assert_array_equal(resumed, straight)
