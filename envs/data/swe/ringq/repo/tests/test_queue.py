import unittest

from ringq import RingQueue


class RingQueueTest(unittest.TestCase):
    def test_fifo(self):
        q = RingQueue(3)
        for i in range(3):
            q.push(i)
        self.assertEqual([q.pop(), q.pop(), q.pop()], [0, 1, 2])

    def test_full(self):
        q = RingQueue(1)
        q.push("a")
        with self.assertRaises(OverflowError):
            q.push("b")

    def test_wrap_around(self):
        q = RingQueue(2)
        out = []
        for i in range(3):
            q.push(i)
            out.append(q.pop())
        self.assertEqual(out, [0, 1, 2])


if __name__ == "__main__":
    unittest.main()
