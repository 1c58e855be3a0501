#!/usr/bin/env python3
"""Registers touched while a wgmma may still read or write them, found in a kernel's SASS.

A wgmma (HGMMA / QGMMA in SASS) reads its A registers and writes its accumulators asynchronously,
until a `WARPGROUP.DEPBAR.LE gsb0, K` (PTX wgmma.wait_group K) retires its commit group; ptxas
does not guard them. An instruction that writes an in-flight wgmma's A register or accumulator,
or reads its accumulator, gives wrong products only when the tensor cores are busy enough to read
late, so tests on small problems pass. The NVFP4 W4A8 decode GEMM once expanded its next stage's
codes into the A registers of the stage in flight; this script is how that shows in the SASS.

It walks every path of each kernel's control flow from every wgmma to the wait that retires it
and prints each instruction that touches the wgmma's registers on the way. Exit status 1 when it
finds one.

Usage:
  scripts/sass_wgmma_hazards.py build-gpu/CMakeFiles/moelora_ops.dir/src/ops/gemm/moe_gemm_nvfp4_w4a8_cuda.cu.o
  scripts/sass_wgmma_hazards.py --filter w4a8 kernel.cubin

It runs `cuobjdump -sass` (see scripts/sass_loops.py) unless given a .sass text file.
"""
import argparse
import re
import sys

from sass_loops import BRANCH, demangle, kernels, read_sass

PREDICATE = re.compile(r"^@!?U?P[T\d]\s+")
WGMMA = re.compile(r"^[HQ]GMMA\.64x(\d+)x\d+\S*\s+R(\d+),\s*(R(\d+)|gdesc)")
DEPBAR = re.compile(r"^WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
REGISTER = re.compile(r"\bR(\d+)\b")
# Opcodes whose first operand is not a register they write.
NO_DESTINATION = ("ST", "STS", "STG", "STL", "RED", "BRA", "BAR", "EXIT", "RET", "CALL", "NOP",
                  "WARPGROUP", "SYNCS", "FENCE", "MEMBAR", "ERRBAR", "CCTL", "UTMALDG", "UBLKCP",
                  "UTMAPF", "UTMACCTL", "ACQBULK", "DEPBAR", "WARPSYNC", "BSSY", "BSYNC", "YIELD",
                  "ELECT", "PREEXIT", "ACQSHMINIT", "UCGABAR_ARV", "UCGABAR_WAIT", "BPT", "KILL")


def destination_width(op):
    if ".128" in op or re.search(r"LDSM\.\S*\.4\b", op):
        return 4
    if ".64" in op or "WIDE" in op or re.search(r"LDSM\.\S*\.2\b", op):
        return 2
    return 1


def decode(instruction):
    """(opcode with modifiers, registers written, registers read) of one SASS instruction."""
    text = PREDICATE.sub("", instruction)
    op, _, rest = text.partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest else []
    base = op.split(".")[0]
    written = set()
    if operands and base not in NO_DESTINATION and not base.startswith("U"):
        m = re.fullmatch(r"R(\d+)", operands[0])
        if m:
            first = int(m.group(1))
            written = set(range(first, first + destination_width(op)))
        operands = operands[1:]
    read = {int(r) for o in operands for r in REGISTER.findall(o)}
    return text, op, written, read


def successors(body, index, i):
    text = PREDICATE.sub("", body[i][1])
    conditional = PREDICATE.match(body[i][1]) is not None
    out = []
    m = BRANCH.search(body[i][1])
    if m and int(m.group(1), 16) in index:
        out.append(index[int(m.group(1), 16)])
    ends = text.startswith(("EXIT", "RET", "BRA")) and not conditional
    if not ends and i + 1 < len(body):
        out.append(i + 1)
    return out


def hazards(body):
    """(index of the wgmma, index of the instruction, what) for every hazard of one kernel."""
    index = {address: i for i, (address, _) in enumerate(body)}
    found = set()
    for start, (_, instruction) in enumerate(body):
        m = WGMMA.match(PREDICATE.sub("", instruction))
        if not m:
            continue
        width, acc = int(m.group(1)), int(m.group(2))
        accumulators = set(range(acc, acc + width // 2))
        a_registers = set(range(int(m.group(4)), int(m.group(4)) + 4)) if m.group(4) else set()
        # walk the paths from the wgmma; state: commit groups closed since it (its own included,
        # once a gsb0 instruction closed it)
        closed_at_start = 1 if "gsb0" in instruction else 0
        seen = set()
        work = [(i, closed_at_start) for i in successors(body, index, start)]
        while work:
            i, closed = work.pop()
            if (i, closed) in seen or i == start:
                continue
            seen.add((i, closed))
            text, op, written, read = decode(body[i][1])
            d = DEPBAR.match(text)
            if d and closed > int(d.group(1), 16):
                continue  # retired: at most K younger groups may still run
            if WGMMA.match(text):
                # a later wgmma may chain into the same accumulators; it may not rewrite A
                if "gsb0" in text:
                    closed = min(closed + 1, 8)
            else:
                if written & a_registers:
                    found.add((start, i, f"writes A register(s) R{sorted(written & a_registers)}"))
                if written & accumulators:
                    found.add((start, i, f"writes accumulator(s) R{sorted(written & accumulators)}"))
                if read & accumulators and not text.startswith("WARPGROUP"):
                    found.add((start, i, f"reads accumulator(s) R{sorted(read & accumulators)}"))
            work.extend((j, closed) for j in successors(body, index, i))
    return sorted(found)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("object", help="an object file, cubin or executable, or a .sass listing")
    parser.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    args = parser.parse_args()
    kernels_with_wgmma = 0
    bad = 0
    for name, body in kernels(read_sass(args.object)):
        if args.filter not in name or not any(WGMMA.match(PREDICATE.sub("", s)) for _, s in body):
            continue
        kernels_with_wgmma += 1
        found = hazards(body)
        print(f"{demangle(name)}: {len(found)} hazard(s)")
        for start, i, what in found:
            print(f"  wgmma /*{body[start][0]:04x}*/ {body[start][1]}\n"
                  f"    /*{body[i][0]:04x}*/ {body[i][1]}: {what}")
        bad += len(found)
    if kernels_with_wgmma == 0:
        sys.exit("sass_wgmma_hazards.py: no kernel with wgmma instructions selected")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
