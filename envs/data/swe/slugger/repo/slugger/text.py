"""Make URL slugs from arbitrary text."""

import re
import unicodedata


def to_ascii(text: str) -> str:
    """``text`` without accents; characters with no ASCII form are dropped."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def slugify(text: str, sep: str = "-", max_length: int | None = None) -> str:
    """Lowercase ASCII letters and digits of ``text`` joined by ``sep`` (see the README)."""
    slug = re.sub(r"[^a-z0-9]", sep, to_ascii(text).lower())
    slug = slug.replace(sep + sep, sep)
    if max_length is not None:
        slug = slug[:max_length]
    return slug
