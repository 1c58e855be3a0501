#!/usr/bin/env python3
"""Checks the packed-code layout of a W4A8 NVFP4 decode GEMM (docs/gpu_nvfp4.md, "Not there yet").

  scripts/nvfp4_e4m3_layout.py

An e2m1 code (sign, two exponent bits, one mantissa bit) placed in e4m3 bit positions - sign at
bit 7, exponent and mantissa bits at 4-2 - reads as e2m1 * 2^-6, the subnormal 0.5 included. A
thread's A fragment of an m64nNk32 e4m3 wgmma holds, per k16 group, four codes of row r and four of
row r + 8, one e4m3 byte each. With eight codes packed in a 32-bit word q as below, two registers of
four bytes come out of five integer ops:

  R0 = q & 0x9C9C9C9C                                         row r: bits 7 / 4-2 of byte j
  R1 = (rotl(q, 6) & 0x98989898) | ((q << 2) & 0x04040404)    row r + 8: sign in bit 1, mantissa
                                                              bit in bit 0, exponent bits in bits
                                                              6-5 of byte j - 1 (cyclically)

This script packs every code of every byte position, checks that R0 and R1 hold the e4m3 bytes of
the codes and that those read as e2m1 * 2^-6, and checks why R1 needs two shifts: every shift of
the byte pattern {7, 4, 3, 2} by 1-7 bits overlaps the pattern itself, so no word holds two
registers' codes where one shift and one mask each would expand them. Exit status 1 on a failure.
"""
import sys

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PATTERN = (7, 4, 3, 2)  # an e4m3 byte's sign and the code's exponent / mantissa bits


def e2m1_value(code):
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def e4m3_byte(code):
    return ((code >> 3) << 7) | ((code & 7) << 2)


def e4m3_value(byte):
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def pack(row_r, row_r8):
    """The word of four row-r codes and four row-(r + 8) codes (byte j holds code j of each)."""
    q = 0
    for j in range(4):
        q |= (row_r[j] >> 3) << (8 * j + 7) | (row_r[j] & 7) << (8 * j + 2)
        c = row_r8[j]
        before = (j - 1) % 4
        q |= (c >> 3) << (8 * j + 1) | (c & 1) << (8 * j)
        q |= ((c >> 2) & 1) << (8 * before + 6) | ((c >> 1) & 1) << (8 * before + 5)
    return q


def expand(q):
    rotl6 = ((q << 6) | (q >> 26)) & 0xFFFFFFFF
    r0 = q & 0x9C9C9C9C
    r1 = (rotl6 & 0x98989898) | ((q << 2) & 0x04040404)
    return r0, r1 & 0xFFFFFFFF


def main():
    failures = 0
    for code in range(16):
        if e4m3_value(e4m3_byte(code)) != e2m1_value(code) * 2.0 ** -6:
            print(f"code {code:#x}: e4m3 byte {e4m3_byte(code):#04x} does not read as e2m1 * 2^-6")
            failures += 1
    # every code at every byte position of both rows, the other bytes holding every other code
    checked = 0
    for j in range(4):
        for code in range(16):
            for other in range(16):
                for row in (0, 1):
                    codes = [[other] * 4, [other ^ 0xF] * 4]
                    codes[row][j] = code
                    r0, r1 = expand(pack(*codes))
                    for k in range(4):
                        if (r0 >> 8 * k) & 0xFF != e4m3_byte(codes[0][k]) or \
                           (r1 >> 8 * k) & 0xFF != e4m3_byte(codes[1][k]):
                            print(f"byte {k} wrong for codes {codes}")
                            failures += 1
                    checked += 1
    overlapping = [s for s in range(1, 8) if {(p - s) % 8 for p in PATTERN} & set(PATTERN)]
    if overlapping != list(range(1, 8)):
        print(f"a shift by {sorted(set(range(1, 8)) - set(overlapping))} leaves the pattern disjoint")
        failures += 1
    if failures:
        print(f"{failures} failure(s)")
        return 1
    print(f"layout holds: {checked} packed words expand to their e4m3 bytes (value e2m1 * 2^-6); "
          "every 1-7 bit shift of the byte pattern overlaps it, so R1 takes two shifts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
