"""Convert integers 1-3999 to Roman numerals and back."""

NUMERALS = (
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (50, "L"),
    (90, "XC"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
)
VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def to_roman(n: int) -> str:
    """``n`` (1-3999) as a Roman numeral in the standard form, e.g. ``to_roman(14) == "XIV"``."""
    if not isinstance(n, int) or not 1 <= n <= 3999:
        raise ValueError(f"only integers 1-3999 have Roman numerals, got {n!r}")
    out = []
    for value, letters in NUMERALS:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)


def from_roman(text: str) -> int:
    """The value of a Roman numeral (a letter before a larger one is subtracted)."""
    if not text or any(ch not in VALUES for ch in text.upper()):
        raise ValueError(f"not a Roman numeral: {text!r}")
    values = [VALUES[ch] for ch in text.upper()]
    total = 0
    for i, value in enumerate(values):
        if i + 1 < len(values) and value < values[i + 1]:
            total -= value
        else:
            total += value
    return total
