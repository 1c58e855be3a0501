#!/usr/bin/env python3
"""Tests of scripts/nvfp4_e4m3_layout.py: the layout passes, and a wrong expansion is caught."""
import contextlib
import importlib.util
import io
import os
import unittest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "nvfp4_e4m3_layout.py")
spec = importlib.util.spec_from_file_location("nvfp4_e4m3_layout", PATH)
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)


def run_main():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = layout.main()
    return status, out.getvalue()


class E4m3Layout(unittest.TestCase):
    def test_the_documented_layout_holds(self):
        status, out = run_main()
        self.assertEqual(status, 0, out)
        self.assertIn("layout holds: 2048 packed words", out)

    def test_every_code_reads_as_e2m1_times_2_to_the_minus_6(self):
        for code in range(16):
            self.assertEqual(layout.e4m3_value(layout.e4m3_byte(code)),
                             layout.e2m1_value(code) / 64)

    def test_a_wrong_mask_is_caught(self):
        original = layout.expand
        try:
            # row r + 8's mantissa bit dropped
            layout.expand = lambda q: (original(q)[0], original(q)[1] & ~0x04040404)
            status, out = run_main()
        finally:
            layout.expand = original
        self.assertEqual(status, 1)
        self.assertIn("wrong for codes", out)


if __name__ == "__main__":
    unittest.main()
