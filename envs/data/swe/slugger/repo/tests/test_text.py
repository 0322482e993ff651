import unittest

from slugger import slugify


class SlugifyTest(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_accents(self):
        self.assertEqual(slugify("Crème brûlée"), "creme-brulee")

    def test_punctuation_and_spaces(self):
        self.assertEqual(slugify("  Hello,   World!  "), "hello-world")


if __name__ == "__main__":
    unittest.main()
