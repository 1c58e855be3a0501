#!/usr/bin/env python3
"""The fewest integer ops that expand packed NVFP4 codes into the f16 A registers of the decode GEMM.

  scripts/nvfp4_code_layouts.py [--words 1|2]

An e2m1 code becomes an f16 A value (e2m1 * 2^-14, exact) when its sign lands on bit 15 (31) and
its three magnitude bits on bits 9-11 (25-27) of a register holding two values; the other bits
must be zero. moe_gemm_nvfp4_stream_cuda.cu packs eight codes per 32-bit word and builds the
four registers with left shifts and masks (12 ops). This searches every placement of the codes'
sign and magnitude bits in one word (--words 1: shifts left or right) or in two words read as one
64-bit value (--words 2: funnel shifts across the pair; about ten minutes) that covers the bits
exactly, costing each register 1 op (a mask) when its sign and magnitude come from the same
shifted value and 2 otherwise (mask, then merge), plus one op per distinct shift, and prints the
cheapest per word. docs/gpu_nvfp4.md ("Not there yet") quotes the result: 11.
"""
import argparse

SIGN = (15, 31)
MAGNITUDE = (9, 10, 11, 25, 26, 27)


def options(bits, sign_shifts, magnitude_shifts):
    """(sign shift, magnitude shift, mask of source bits) of every placement of one register."""
    out = []
    for s in sign_shifts:
        sign = [p + s for p in SIGN]
        if min(sign) < 0 or max(sign) >= bits:
            continue
        for m in magnitude_shifts:
            mag = [p + m for p in MAGNITUDE]
            if min(mag) < 0 or max(mag) >= bits:
                continue
            used = set(sign) | set(mag)
            if len(used) == 8:
                out.append((s, m, sum(1 << b for b in used)))
    return out


def cost(chosen, free_shifts):
    shifts = {o for s, m, _ in chosen for o in {s, m} if o not in free_shifts}
    return len(shifts) + sum(1 if s == m else 2 for s, m, _ in chosen)


def search(bits, registers, opts, free_shifts):
    full = (1 << bits) - 1
    by_low = {}
    for o in opts:
        by_low.setdefault((o[2] & -o[2]).bit_length() - 1, []).append(o)
    best = [10**9, None]

    def walk(covered, chosen):
        if covered == full:
            c = cost(chosen, free_shifts)
            if c < best[0]:
                best[0], best[1] = c, list(chosen)
            return
        if len(chosen) == registers or cost(chosen, free_shifts) + registers - len(chosen) >= best[0]:
            return
        low = (~covered & (covered + 1)).bit_length() - 1
        for o in by_low.get(low, []):
            if not o[2] & covered:
                chosen.append(o)
                walk(covered | o[2], chosen)
                chosen.pop()

    walk(0, [])
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, choices=(1, 2), default=1)
    args = ap.parse_args()
    if args.words == 1:
        # a shift of the word left by -offset (right by offset): 0 is the word itself
        opts = options(32, range(-15, 1), range(-9, 5))
        best = search(32, 4, opts, free_shifts={0})
    else:
        # a 32-bit window at offset o of the 64-bit pair: o = 0 and 32 are the words themselves
        opts = options(64, range(-15, 33), range(-9, 37))
        best = search(64, 8, opts, free_shifts={0, 32})
    per_word = best[0] / args.words
    print("fewest ops: %d for %d word(s), %.1f per word" % (best[0], args.words, per_word))
    print("placements (sign shift, magnitude shift): %s" % [(s, m) for s, m, _ in best[1]])


if __name__ == "__main__":
    main()
