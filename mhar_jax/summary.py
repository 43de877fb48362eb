"""TensorBoard event files written with the ``tensorboard`` package alone (no TensorFlow)."""

from __future__ import annotations

import os
import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class SummaryWriter:
  """Scalars and PNG images into ``<logdir>/events.out.tfevents.*``.

  ``enabled=False`` (every process but the first) makes every call a no-op.
  """

  def __init__(self, logdir: str, *, enabled: bool = True):
    self.enabled = enabled
    self._writer = None
    if enabled:
      os.makedirs(logdir, exist_ok=True)
      self._writer = EventFileWriter(logdir)

  def _add(self, value: summary_pb2.Summary.Value, step: int):
    event = event_pb2.Event(wall_time=time.time(), step=int(step),
                            summary=summary_pb2.Summary(value=[value]))
    self._writer.add_event(event)

  def scalars(self, values: dict[str, float], step: int):
    if not self.enabled:
      return
    for tag, v in values.items():
      self._add(summary_pb2.Summary.Value(tag=tag, simple_value=float(v)), step)

  def image(self, tag: str, png: bytes, *, height: int, width: int, step: int):
    if not self.enabled:
      return
    img = summary_pb2.Summary.Image(height=height, width=width, colorspace=4,
                                    encoded_image_string=png)
    self._add(summary_pb2.Summary.Value(tag=tag, image=img), step)

  def flush(self):
    if self.enabled:
      self._writer.flush()

  def close(self):
    if self.enabled:
      self._writer.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """All scalars in ``logdir``'s event files: ``{tag: [(step, value), ...]}``."""
  from tensorboard.backend.event_processing import event_file_loader
  out: dict[str, list[tuple[int, float]]] = {}
  for name in sorted(os.listdir(logdir)):
    if "tfevents" not in name:
      continue
    for ev in event_file_loader.EventFileLoader(os.path.join(logdir, name)).Load():
      for v in ev.summary.value:
        if v.HasField("simple_value"):
          out.setdefault(v.tag, []).append((ev.step, v.simple_value))
        elif v.HasField("tensor") and v.tensor.float_val:   # loader's form
          out.setdefault(v.tag, []).append((ev.step, v.tensor.float_val[0]))
  return out
