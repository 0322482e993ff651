"""ringq: a fixed-capacity FIFO queue."""

from ringq.queue import RingQueue

__all__ = ["RingQueue"]
