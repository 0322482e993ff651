"""Merge and query closed intervals ``(start, end)``."""

Interval = tuple[int, int]


def merge(intervals: list[Interval]) -> list[Interval]:
    """The same points as the union of ``intervals``, as sorted disjoint intervals that do not touch."""
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(intervals: list[Interval]) -> int:
    """How long the union is (``(1, 4)`` covers 3)."""
    return sum(end - start for start, end in merge(intervals))


def contains(intervals: list[Interval], point: int) -> bool:
    """Whether ``point`` lies in one of ``intervals`` (ends included)."""
    return any(start <= point <= end for start, end in merge(intervals))
