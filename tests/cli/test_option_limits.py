"""The sizes `lmoe` takes on its command line have upper bounds, and a value past one is refused
before anything runs, naming the flag, the limit and the value. Usage: test_option_limits.py
PATH_TO_LMOE"""

import unittest

import cli_support
from cli_support import lmoe


class OptionLimits(unittest.TestCase):
    def expect_refused(self, args, message):
        with self.subTest(args=args):
            result = lmoe(*args, "--backend", "cpu", check=False)
            self.assertNotEqual(result.returncode, 0, result.stdout)
            self.assertIn(message, result.stderr)

    def test_each_size_past_its_limit_is_refused_naming_it(self):
        cases = [
            (["bench", "-n", "1000"], "-n/--ranks: at most 64 ranks, got 1000"),
            (["tune", "-o", "/nonexistent/t.json", "-n", "65"],
             "-n/--ranks/--tp: at most 64 ranks, got 65"),
            (["bench", "-n", "2", "-t", "1,1048577"],
             "-t/--tokens: at most 1048576 tokens, got 1048577"),
            (["bench", "-n", "2", "--iters", "100001"],
             "--iters: at most 100000 iterations, got 100001"),
            (["bench", "-n", "2", "--warmup", "100001"],
             "--warmup: at most 100000 iterations, got 100001"),
            (["bench", "-n", "2", "--layers", "65"], "--layers: at most 64 tails, got 65"),
            (["bench", "-n", "2", "--d-model", "65537"], "--d-model: at most 65536, got 65537"),
            (["bench", "-n", "2", "--d-latent", "70000"], "--d-latent: at most 65536, got 70000"),
            (["bench", "-n", "2", "--check-max-tokens", "1048577"],
             "--check-max-tokens: at most 1048576 tokens, got 1048577"),
            (["run", "-n", "1000"], "-n/--ranks: at most 64 ranks, got 1000"),
            (["run", "-n", "2", "-t", "2000000"],
             "-t/--tokens: at most 1048576 tokens, got 2000000"),
            (["run", "-n", "2", "--repeats", "100001"],
             "--repeats: at most 100000 forwards, got 100001"),
            (["layer", "-n", "65"], "-n/--ranks: at most 64 ranks, got 65"),
            (["layer", "--scale", "1025"], "--scale: at most 1024, got 1025"),
            (["layer", "--experts", "4097"], "--experts: at most 4096 experts, got 4097"),
            (["layer", "-t", "1048577"], "-t/--tokens: at most 1048576 tokens, got 1048577"),
            (["layer", "--repeats", "100001"], "--repeats: at most 100000 forwards, got 100001"),
            (["explain", "-t", "1", "--tp", "65"], "--tp: at most 64 ranks, got 65"),
            (["explain", "-t", "1048577"], "-t/--tokens: at most 1048576 tokens, got 1048577"),
        ]
        for args, message in cases:
            self.expect_refused(args, message)

    def test_the_limits_themselves_are_accepted(self):
        # Cheap commands at the bound: the check is "at most", not "below".
        lmoe("explain", "--backend", "cpu", "--tp", "64", "-t", "1048576", "--preset", "small")


if __name__ == "__main__":
    cli_support.main()
