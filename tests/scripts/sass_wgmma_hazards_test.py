#!/usr/bin/env python3
"""Tests of scripts/sass_wgmma_hazards.py on hand-written cuobjdump listings (no toolkit needed)."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass_wgmma_hazards.py")


def function(name, body):
    lines = "\n".join(f"        /*{address:04x}*/                   {text} ;"
                      for address, text in zip(range(0, 16 * len(body), 16), body))
    return f"\t\tFunction : {name}\n{lines}\n\t\t..........\n"


def run(*functions, args=()):
    with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
        f.write("\tcode for sm_90a\n" + "".join(functions))
        path = f.name
    try:
        return subprocess.run([sys.executable, SCRIPT, path, *args], capture_output=True, text=True)
    finally:
        os.unlink(path)


# A pipelined loop as the W4A8 GEMM had it: the wgmmas at the end of the body read A from
# R88-R95; the next iteration's expansion writes R89 before the wait that retires them.
LOOP_WITH_HAZARD = function("_Z6hazardv", [
    "LDS.128 R8, [R4]",                                                 # 0x00
    "LOP3.LUT R89, R8, 0x9c9c9c9c, RZ, 0xc0, !PT",                      # 0x10: rewrites A
    "WARPGROUP.DEPBAR.LE gsb0, 0x0",                                    # 0x20
    "FFMA R20, R56, R2, R20",                                           # 0x30: reads retired acc
    "WARPGROUP.ARRIVE",                                                 # 0x40
    "QGMMA.64x8x32.F32.E4M3.E4M3 R56, R88, gdesc[UR4], RZ, !UPT",       # 0x50
    "QGMMA.64x8x32.F32.E4M3.E4M3 R60, R92, gdesc[UR8], RZ, !UPT, gsb0",  # 0x60
    "@!P1 BRA 0x0",                                                     # 0x70
    "EXIT",                                                             # 0x80
])
# The same loop with the expansion after the wait.
LOOP_CLEAN = function("_Z5cleanv", [
    "LDS.128 R8, [R4]",
    "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    "LOP3.LUT R89, R8, 0x9c9c9c9c, RZ, 0xc0, !PT",
    "FFMA R20, R56, R2, R20",
    "WARPGROUP.ARRIVE",
    "QGMMA.64x8x32.F32.E4M3.E4M3 R56, R88, gdesc[UR4], RZ, !UPT",
    "QGMMA.64x8x32.F32.E4M3.E4M3 R60, R92, gdesc[UR8], RZ, !UPT, gsb0",
    "@!P1 BRA 0x0",
    "EXIT",
])


class SassWgmmaHazards(unittest.TestCase):
    def test_a_register_rewritten_across_the_loop_edge_is_found(self):
        result = run(LOOP_WITH_HAZARD)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("hazard: 1 hazard(s)", result.stdout)
        self.assertIn("/*0010*/ LOP3.LUT R89", result.stdout)
        self.assertIn("writes A register(s) R[89]", result.stdout)

    def test_expansion_after_the_wait_is_clean(self):
        result = run(LOOP_CLEAN)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("clean: 0 hazard(s)", result.stdout)

    def test_accumulators_read_or_written_before_the_wait(self):
        body = function("_Z3accv", [
            "WARPGROUP.ARRIVE",
            "HGMMA.64x16x16.F32 R24, R88, gdesc[UR4], R24, gsb0",  # accumulators R24-R31
            "FADD R40, R27, R2",                                   # reads R27 in flight
            "MOV R31, RZ",                                         # writes R31 in flight
            "MOV R88, RZ",                                         # writes A in flight
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "FADD R41, R27, R2",                                   # fine: retired
            "EXIT",
        ])
        result = run(body)
        self.assertEqual(result.returncode, 1)
        self.assertIn("reads accumulator(s) R[27]", result.stdout)
        self.assertIn("writes accumulator(s) R[31]", result.stdout)
        self.assertIn("writes A register(s) R[88]", result.stdout)
        self.assertIn("acc: 3 hazard(s)", result.stdout)

    def test_a_wait_for_all_but_k_groups_retires_only_the_older_ones(self):
        body = function("_Z6groupsv", [
            "WARPGROUP.ARRIVE",
            "HGMMA.64x8x16.F32 R24, R88, gdesc[UR4], R24, gsb0",  # group 1: A R88-R91
            "WARPGROUP.ARRIVE",
            "HGMMA.64x8x16.F32 R24, R92, gdesc[UR4], R24, gsb0",  # group 2 chains into R24
            "WARPGROUP.DEPBAR.LE gsb0, 0x1",                      # group 1 retired
            "MOV R88, RZ",                                        # fine
            "MOV R92, RZ",                                        # group 2 still runs
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "EXIT",
        ])
        result = run(body)
        self.assertEqual(result.returncode, 1)
        self.assertIn("groups: 1 hazard(s)", result.stdout)
        self.assertIn("MOV R92, RZ: writes A register(s) R[92]", result.stdout)

    def test_shared_memory_operands_and_filter(self):
        body = function("_Z2ssv", [
            "WARPGROUP.ARRIVE",
            "HGMMA.64x8x16.F32 R24, gdesc[UR4], R24, gsb0",  # A from shared memory
            "MOV R88, RZ",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "EXIT",
        ])
        result = run(body, LOOP_WITH_HAZARD, args=("--filter", "ss"))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("ss: 0 hazard(s)", result.stdout)
        self.assertNotIn("hazard:", result.stdout)

    def test_no_wgmma_kernel_is_an_error(self):
        result = run(function("_Z5plainv", ["IADD3 R1, R1, 0x1, RZ", "EXIT"]))
        self.assertEqual(result.returncode, 1)
        self.assertIn("no kernel with wgmma", result.stderr)


if __name__ == "__main__":
    unittest.main()
