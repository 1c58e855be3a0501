#!/usr/bin/env python3
"""Tests of scripts/sass_loops.py on hand-written cuobjdump listings (no CUDA toolkit needed)."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass_loops.py")

# Two kernels in cuobjdump -sass form. `decode` has a 6-instruction loop (0x0020 .. 0x0070) with two
# HGMMAs, one of them waited on at issue (gsb0), and a longer outer loop around it; `plain` has a
# loop without wgmma.
LISTING = """
\tcode for sm_90a
\t\tFunction : _Z6decodev
\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                         /* 0x00000a00ff017b82 */
        /*0010*/                   LOP3.LUT R2, R0, 0x8e008e00, RZ, 0xc0, !PT ;   /* 0x8e008e0000027812 */
        /*0020*/                   IMAD.SHL.U32 R3, R0, 0x2, RZ ;                 /* 0x0000000200037824 */
        /*0030*/                   HMUL2 R4, R3, R5.H0_H0 ;                       /* 0x2000000503047232 */
        /*0040*/                   HGMMA.64x8x16.F32 R24, R28, gdesc[UR4], R24 ;  /* 0x000000041c187df0 */
        /*0050*/                   HGMMA.64x8x16.F32 R24, R32, gdesc[UR4], R24, gsb0 ; /* 0x0000000420187df0 */
        /*0060*/                   ISETP.GE.AND P1, PT, R94, UR4, PT ;            /* 0x000000045e007c0c */
        /*0070*/              @!P1 BRA 0x20 ;                                     /* 0xfffffffc00a89947 */
        /*0080*/                   STG.E [R2.64], R24 ;                           /* 0x0000001802007986 */
        /*0090*/                   BRA 0x10 ;                                     /* 0xfffffff000007947 */
        /*00a0*/                   EXIT ;                                         /* 0x000000000000794d */
\t\t..........

\t\tFunction : _Z5plainv
        /*0000*/                   IADD3 R1, R1, 0x1, RZ ;                        /* 0x0000000101017810 */
        /*0010*/                   ISETP.NE.AND P0, PT, R1, 0x10, PT ;            /* 0x000000100100780c */
        /*0020*/               @P0 BRA 0x0 ;                                      /* 0xfffffffc00a80947 */
        /*0030*/                   EXIT ;                                         /* 0x000000000000794d */
\t\t..........
"""


def run(*args):
    with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
        f.write(LISTING)
        path = f.name
    try:
        return subprocess.run([sys.executable, SCRIPT, path, *args], capture_output=True, text=True)
    finally:
        os.unlink(path)


class SassLoops(unittest.TestCase):
    def test_counts_the_innermost_and_the_outer_loop_with_wgmma(self):
        result = run()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("decode", result.stdout)
        self.assertIn("HGMMA 64x8x16: loop of 6 instructions, 2 wgmma (1 waited on at issue), "
                      "3.00 per wgmma", result.stdout)
        # the outer loop (0x0010 .. 0x0090) holds the same two wgmmas in 9 instructions
        self.assertIn("loop of 9 instructions, 2 wgmma", result.stdout)
        self.assertIn("HGMMA 2", result.stdout)
        self.assertNotIn("plain", result.stdout)

    def test_max_body_leaves_out_longer_loops(self):
        result = run("--max-body", "8")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("loop of 6 instructions", result.stdout)
        self.assertNotIn("loop of 9 instructions", result.stdout)

    def test_show_prints_the_loop(self):
        result = run("--show", "--max-body", "8")
        self.assertIn("    @!P1 BRA 0x20", result.stdout)

    def test_no_matching_kernel_is_an_error(self):
        result = run("--filter", "plain")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("no loop with wgmma", result.stderr)


if __name__ == "__main__":
    unittest.main()
