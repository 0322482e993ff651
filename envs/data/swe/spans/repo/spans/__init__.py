"""spans: sets of closed integer intervals."""

from spans.intervals import contains, covered, merge

__all__ = ["contains", "covered", "merge"]
