"""Calendar arithmetic on ``(year, month, day)`` tuples of the proleptic Gregorian calendar."""

DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_leap_year(year: int) -> bool:
    """Whether ``year`` has a 29 February."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year: int, month: int) -> int:
    """The number of days of ``month`` (1-12) in ``year``."""
    if not 1 <= month <= 12:
        raise ValueError(f"month out of range: {month}")
    if month == 2 and is_leap_year(year):
        return 29
    return DAYS_IN_MONTH[month - 1]


def validate(date: tuple[int, int, int]) -> tuple[int, int, int]:
    """Return ``date`` if it exists, else raise ``ValueError``."""
    year, month, day = date
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"day out of range: {date}")
    return (year, month, day)


def day_of_year(year: int, month: int, day: int) -> int:
    """1 for 1 January, up to 365 or 366 for 31 December."""
    validate((year, month, day))
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def add_days(date: tuple[int, int, int], n: int) -> tuple[int, int, int]:
    """The date ``n`` days after ``date`` (before it when ``n`` is negative)."""
    year, month, day = validate(date)
    day += n
    while day > days_in_month(year, month):
        day -= days_in_month(year, month)
        month += 1
        if month > 12:
            month, year = 1, year + 1
    while day < 1:
        month -= 1
        if month < 1:
            month, year = 12, year - 1
        day += days_in_month(year, month)
    return (year, month, day)
