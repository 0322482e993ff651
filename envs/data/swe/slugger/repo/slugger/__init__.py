"""slugger: URL slugs from titles."""

from slugger.text import slugify

__all__ = ["slugify"]
