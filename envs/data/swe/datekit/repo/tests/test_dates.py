import unittest

from datekit import add_days, day_of_year, is_leap_year


class LeapYearTest(unittest.TestCase):
    def test_common_years(self):
        self.assertTrue(is_leap_year(2024))
        self.assertFalse(is_leap_year(2023))
        self.assertFalse(is_leap_year(1900))

    def test_year_2000(self):
        self.assertTrue(is_leap_year(2000))


class ArithmeticTest(unittest.TestCase):
    def test_add_days_across_a_year(self):
        self.assertEqual(add_days((2023, 12, 31), 1), (2024, 1, 1))

    def test_day_of_year(self):
        self.assertEqual(day_of_year(2023, 3, 1), 60)


if __name__ == "__main__":
    unittest.main()
