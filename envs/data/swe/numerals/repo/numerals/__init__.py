"""numerals: Roman numerals to and from integers."""

from numerals.roman import from_roman, to_roman

__all__ = ["from_roman", "to_roman"]
