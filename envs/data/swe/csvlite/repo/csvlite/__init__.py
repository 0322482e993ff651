"""csvlite: read small CSV documents into rows."""

from csvlite.reader import read_rows, split_line

__all__ = ["read_rows", "split_line"]
