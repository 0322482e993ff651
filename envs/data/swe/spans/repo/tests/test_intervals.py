import unittest

from spans import contains, covered, merge


class MergeTest(unittest.TestCase):
    def test_overlapping(self):
        self.assertEqual(merge([(5, 8), (1, 3), (2, 6)]), [(1, 8)])

    def test_touching(self):
        self.assertEqual(merge([(1, 2), (2, 5)]), [(1, 5)])

    def test_contained(self):
        self.assertEqual(merge([(1, 10), (2, 3)]), [(1, 10)])


class QueryTest(unittest.TestCase):
    def test_covered(self):
        self.assertEqual(covered([(0, 2), (5, 6)]), 3)

    def test_contains(self):
        self.assertTrue(contains([(0, 2), (5, 6)], 5))


if __name__ == "__main__":
    unittest.main()
