"""TensorBoard event files, written with the ``tensorboard`` package alone.

One writer for every Keras backend: the protos of ``tensorboard.compat.proto``
(``Event``, ``Summary``, ``TensorProto``), the plugin metadata of TensorBoard's
own text, scalar and image plugins, and TensorBoard's ``RecordWriter`` (the
TFRecord framing with masked CRC-32C checksums) over a plain local file. The
events are the ones ``tf.summary.text``, ``tf.summary.scalar`` and
``tf.summary.image`` write: a string scalar, a float32 scalar, and a string
vector ``[width, height, png]``.

TensorFlow is never imported: ``tensorboard``'s ``EventFileWriter`` opens its
file through ``tensorboard.compat.tf``, which imports TensorFlow whenever it
is installed, so this module uses the record layer under it.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
import zlib

import numpy as np

__all__ = ["EventWriter", "require_tensorboard", "encode_png"]

_uid = itertools.count()


def require_tensorboard(who: str) -> None:
    """Raise one ImportError naming ``pip install tensorboard`` when the package is missing."""
    try:
        import tensorboard  # noqa: F401
        from tensorboard.compat.proto import event_pb2  # noqa: F401
        from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{who} writes TensorBoard event files with the tensorboard package, which is not installed "
            f"({e}); install it: pip install tensorboard"
        ) from None


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of a uint8 ``(height, width, 3)`` image (8-bit RGB, no filter, zlib level 6)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(f"encode_png takes a non-empty (height, width, 3) image, got shape {rgb.shape}")
    h, w, _ = rgb.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)  # filter byte 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, truecolor, deflate, no filter, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


class EventWriter:
    """An event file in ``log_dir``, named as TensorBoard's writers name theirs."""

    def __init__(self, log_dir: str):
        require_tensorboard("FreezeBoard")
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_uid)}"
        self.path = os.path.join(log_dir, name)
        self._records = RecordWriter(open(self.path, "wb"))
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def _value(self, tag: str, tensor, metadata, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(wall_time=time.time(), step=int(step))
        event.summary.value.add(tag=tag, tensor=tensor, metadata=metadata)
        self._write(event)

    def text(self, tag: str, text: str, step: int) -> None:
        """What ``tf.summary.text`` writes: a string scalar for the text plugin."""
        from tensorboard.plugins.text import metadata
        from tensorboard.util.tensor_util import make_tensor_proto

        self._value(tag, make_tensor_proto(text.encode("utf-8")), metadata.create_summary_metadata(None, None), step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """What ``tf.summary.scalar`` writes: a float32 scalar for the scalars plugin."""
        from tensorboard.plugins.scalar import metadata
        from tensorboard.util.tensor_util import make_tensor_proto

        self._value(tag, make_tensor_proto(np.float32(value)), metadata.create_summary_metadata(None, None), step)

    def image(self, tag: str, rgb: np.ndarray, step: int) -> None:
        """What ``tf.summary.image`` writes for one image: strings ``[width, height, png]``."""
        from tensorboard.plugins.image import metadata
        from tensorboard.util.tensor_util import make_tensor_proto

        h, w = rgb.shape[:2]
        data = np.array([str(w).encode(), str(h).encode(), encode_png(rgb)], dtype=object)
        self._value(tag, make_tensor_proto(data), metadata.create_summary_metadata(None, None), step)

    def flush(self) -> None:
        """Write what is buffered to the file."""
        self._records.flush()

    def close(self) -> None:
        """Flush and close the file (a second close does nothing)."""
        if not self._records.closed:
            self._records.flush()
            self._records.close()
