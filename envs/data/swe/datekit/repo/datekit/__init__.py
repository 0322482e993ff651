"""datekit: calendar arithmetic on (year, month, day) tuples."""

from datekit.dates import add_days, day_of_year, days_in_month, is_leap_year, validate

__all__ = ["add_days", "day_of_year", "days_in_month", "is_leap_year", "validate"]
