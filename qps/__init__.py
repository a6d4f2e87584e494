"""qps: a parameter-server training runtime on Redis and asyncio.

The public API is re-exported here::

    import qps
    async with await qps.connect() as client:
        q = qps.FIFOQueue(100, [np.float32], shapes=[[4]], shared_name="batches", client=client)
        await q.enqueue(np.zeros(4, np.float32))
"""

from qps import errors
from qps._version import __version__
from qps.queues import (
    FIFOQueue,
    PaddingFIFOQueue,
    QueueSpec,
    QueueStats,
    RandomShuffleQueue,
)
from qps.transport import Client, connect

__all__ = [
    "Client",
    "FIFOQueue",
    "PaddingFIFOQueue",
    "QueueSpec",
    "QueueStats",
    "RandomShuffleQueue",
    "__version__",
    "connect",
    "errors",
]
