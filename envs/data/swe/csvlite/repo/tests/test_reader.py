import unittest

from csvlite import read_rows, split_line


class SplitLineTest(unittest.TestCase):
    def test_quoted_fields(self):
        self.assertEqual(split_line('a,"b, c",d'), ["a", "b, c", "d"])

    def test_escaped_quote(self):
        self.assertEqual(split_line('"say ""hi"""'), ['say "hi"'])


class ReadRowsTest(unittest.TestCase):
    def test_header(self):
        self.assertEqual(read_rows("a,b\n1,2\n"), [{"a": "1", "b": "2"}])

    def test_last_row_without_trailing_newline(self):
        self.assertEqual(
            read_rows("name,age\nann,31\nbob,42"),
            [{"name": "ann", "age": "31"}, {"name": "bob", "age": "42"}],
        )


if __name__ == "__main__":
    unittest.main()
