"""A first-in first-out queue of fixed capacity, on a ring buffer (no shifting on pop)."""

from collections.abc import Iterator
from typing import Any


class RingQueue:
    """FIFO queue holding at most ``capacity`` items."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._items: list[Any] = [None] * capacity
        self._head = 0  # index of the front item
        self._size = 0

    @property
    def capacity(self) -> int:
        return len(self._items)

    def __len__(self) -> int:
        return self._size

    def push(self, item: Any) -> None:
        """Add ``item`` at the back; ``OverflowError`` when the queue is full."""
        if self._size == self.capacity:
            raise OverflowError("push to a full queue")
        self._items[(self._head + self._size) % self.capacity] = item
        self._size += 1

    def pop(self) -> Any:
        """Remove and return the front item; ``IndexError`` when the queue is empty."""
        item = self.peek()
        self._items[self._head] = None
        self._head += 1
        self._size -= 1
        return item

    def peek(self) -> Any:
        """The front item, left in the queue; ``IndexError`` when the queue is empty."""
        if not self._size:
            raise IndexError("the queue is empty")
        return self._items[self._head]

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._size):
            yield self._items[(self._head + i) % self.capacity]
