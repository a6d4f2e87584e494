"""Training curves: scalars written to TensorBoard event files, and read back.

A worker started with ``--logdir DIR`` writes its scalars under ``DIR/worker-<index>/``
with :class:`ScalarWriter` (tensorboardX's writer: no TensorFlow needed), so
``tensorboard --logdir DIR`` shows one run per worker. :func:`read_scalars` reads such
a directory back, for ``qps plot`` and for tests.

The tags (:data:`TAGS`) are the four series ``qps plot`` draws:

* ``train/loss``: the loss of the logged step's batch;
* ``train/examples_per_s``: this worker's throughput since the previous log point;
* ``train/staleness``: the mean staleness of this worker's gradients that the PS
  shards applied since the previous log point, as the shards measure it (updates
  applied to a variable between the worker's read of it and the gradient's apply;
  read from their histograms, which bucket values from 16 up by powers of two);
* ``test/accuracy`` (or ``test/auc`` for a one-logit model): the chief's evaluation of
  the job's parameters on the test split.

An event file is a sequence of TFRecord-framed records (length, masked CRC-32C of the
length, the bytes, masked CRC-32C of the bytes), each one serialized ``Event``
protocol buffer; the reader decodes them with tensorboardX's generated messages and
checks both checksums. A record cut short at the end of a file (a writer still
writing) ends that file quietly; a checksum that does not match raises
:class:`~qps.errors.DataLossError`.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qps.errors import DataLossError, NotFoundError

__all__ = [
    "ACCURACY_TAGS",
    "TAGS",
    "ScalarWriter",
    "read_event_file",
    "read_scalars",
    "run_dir",
]

LOSS = "train/loss"
THROUGHPUT = "train/examples_per_s"
STALENESS = "train/staleness"
ACCURACY = "test/accuracy"
AUC = "test/auc"
#: the series a worker writes, in the order ``qps plot`` draws them
TAGS = (LOSS, ACCURACY, THROUGHPUT, STALENESS)
#: tags the accuracy panel takes (a CTR model's chief reports the AUC)
ACCURACY_TAGS = (ACCURACY, AUC)

#: marks an event file (TensorFlow's naming, which tensorboardX keeps)
EVENT_FILE_MARK = "tfevents"

#: Scalars: run -> tag -> [(step, value)], steps ascending
Scalars = dict[str, dict[str, list[tuple[int, float]]]]


def run_dir(logdir: str | os.PathLike[str], index: int) -> Path:
    """Where worker ``index`` writes its event files under ``logdir``."""
    return Path(logdir) / f"worker-{index}"


class ScalarWriter:
    """Appends scalars to a new event file under ``directory`` (created if missing).

    tensorboardX queues the events and writes them on its own thread, flushing every
    ``flush_secs`` seconds and on :meth:`close`; a call to :meth:`add` does no I/O.
    """

    def __init__(self, directory: str | os.PathLike[str], *, flush_secs: int = 10) -> None:
        from tensorboardX import SummaryWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # tensorboardX names a file by the second and the host: the pid and a random
        # suffix keep a worker restarted within the same second from reusing the name
        self._writer: Any = SummaryWriter(
            logdir=str(self.directory),
            flush_secs=flush_secs,
            filename_suffix=f".{os.getpid()}.{secrets.token_hex(3)}",
        )

    def add(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record each ``tag: value`` of ``scalars`` at ``step``."""
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Write what is queued and close the file (idempotent)."""
        self._writer.close()

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _masked_crc(data: bytes) -> int:
    from tensorboardX.record_writer import masked_crc32c

    return int(masked_crc32c(data))


def _records(path: Path) -> list[bytes]:
    """The records of one TFRecord file (a cut-short last record is left out)."""
    raw = path.read_bytes()
    out: list[bytes] = []
    at = 0
    while at + 12 <= len(raw):
        header = raw[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", raw[at + 8 : at + 12])
        if header_crc != _masked_crc(header):
            raise DataLossError(f"{path}: the length of the record at byte {at} is corrupt")
        end = at + 12 + length
        if end + 4 > len(raw):
            break  # cut short: a writer was still writing
        data = raw[at + 12 : end]
        (data_crc,) = struct.unpack("<I", raw[end : end + 4])
        if data_crc != _masked_crc(data):
            raise DataLossError(f"{path}: the record at byte {at} is corrupt")
        out.append(data)
        at = end + 4
    return out


def read_event_file(path: str | os.PathLike[str]) -> list[tuple[float, int, str, float]]:
    """The scalar values of one event file, as ``(wall_time, step, tag, value)`` in file
    order (other summaries, e.g. images, are skipped).

    Raises:
        DataLossError: a record's checksum does not match, or it is no ``Event``.
    """
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event

    path = Path(path)
    out: list[tuple[float, int, str, float]] = []
    for data in _records(path):
        event = Event()
        try:
            event.ParseFromString(data)
        except DecodeError as exc:
            raise DataLossError(f"{path}: a record is not an Event: {exc}") from exc
        if not event.HasField("summary"):
            continue
        for v in event.summary.value:
            if v.HasField("simple_value"):
                value = float(v.simple_value)
            elif v.HasField("tensor") and len(v.tensor.float_val) == 1:
                value = float(v.tensor.float_val[0])
            elif v.HasField("tensor") and len(v.tensor.double_val) == 1:
                value = float(v.tensor.double_val[0])
            else:
                continue
            out.append((event.wall_time, int(event.step), v.tag, value))
    return out


def read_scalars(logdir: str | os.PathLike[str]) -> Scalars:
    """Every scalar series under ``logdir``: run (the directory of the event files,
    relative to ``logdir``; "." for files directly in it) -> tag -> ``[(step, value)]``
    sorted by step. Files of one run are read oldest first, so where a restarted
    worker wrote a step again the later value wins.

    Raises:
        NotFoundError: ``logdir`` is not a directory, or holds no event file.
        DataLossError: an event file is corrupt (see :func:`read_event_file`).
    """
    root = Path(logdir)
    if not root.is_dir():
        raise NotFoundError(f"log directory {root} does not exist")
    files = sorted(p for p in root.rglob(f"*{EVENT_FILE_MARK}*") if p.is_file())
    if not files:
        raise NotFoundError(
            f"no TensorBoard event files under {root} (train with --logdir {root} first)"
        )
    by_run: dict[str, list[tuple[float, int, str, float]]] = {}
    for path in files:
        run = path.parent.relative_to(root).as_posix()
        by_run.setdefault(run, []).extend(read_event_file(path))
    out: Scalars = {}
    for run in sorted(by_run):
        latest: dict[str, dict[int, tuple[float, float]]] = {}
        for wall, step, tag, value in by_run[run]:
            seen = latest.setdefault(tag, {})
            if step not in seen or seen[step][0] <= wall:
                seen[step] = (wall, value)
        out[run] = {
            tag: [(step, v) for step, (_, v) in sorted(points.items())]
            for tag, points in sorted(latest.items())
        }
    return out
