import unittest

from numerals import from_roman, to_roman


class ToRomanTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual([to_roman(n) for n in (1, 4, 9, 14, 40)], ["I", "IV", "IX", "XIV", "XL"])

    def test_ninety(self):
        self.assertEqual(to_roman(90), "XC")

    def test_out_of_range(self):
        with self.assertRaises(ValueError):
            to_roman(0)


class FromRomanTest(unittest.TestCase):
    def test_values(self):
        self.assertEqual(from_roman("MCMXCIV"), 1994)


if __name__ == "__main__":
    unittest.main()
