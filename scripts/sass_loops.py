#!/usr/bin/env python3
"""Instructions per tensor-core step in the inner loops of a CUDA object's kernels.

The NVFP4 decode GEMM is bound by how many instructions its consumer warps issue per k16 step
(docs/gpu_nvfp4.md), so a change to its loop is first judged by its SASS: this script finds every
loop (a backward branch) whose body holds wgmma instructions (HGMMA / QGMMA in SASS), and prints,
per kernel and per wgmma width, the loop's length, its wgmma count, the instructions per wgmma
and the opcode histogram. Loops longer than --max-body instructions (the outer pass loops, which
hold the epilogue) are left out.

Usage:
  scripts/sass_loops.py build-gpu/CMakeFiles/moelora_ops.dir/src/ops/gemm/moe_gemm_nvfp4_stream_cuda.cu.o
  scripts/sass_loops.py --filter 'TilingILi1ELi32' --show kernel.cubin   # print the loop too

It runs `cuobjdump -sass` (CUDA toolkit; on a machine without the toolkit's binaries, the PyPI
wheel nvidia-cuda-cuobjdump has it under nvidia/cu13/bin) unless given a .sass text file.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*(?:/\* 0x[0-9a-f]+ \*/)?\s*$")
BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s+)?0x([0-9a-f]+)")
MMA = re.compile(r"^(?:@!?U?P\d\s+)?([HQ]GMMA)\.64x(\d+)x(\d+)")


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/cuobjdump"):
        return "/usr/local/cuda/bin/cuobjdump"
    try:
        import nvidia  # the PyPI wheel nvidia-cuda-cuobjdump
        for base in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_cuobjdump"):
                path = os.path.join(base, sub, "bin", "cuobjdump")
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    sys.exit("sass_loops.py: cuobjdump not found: install the CUDA toolkit's binaries or "
             "`pip install nvidia-cuda-cuobjdump`, or pass a file written by `cuobjdump -sass`")


def read_sass(path):
    if path.endswith(".sass") or path.endswith(".txt"):
        with open(path) as f:
            return f.read()
    result = subprocess.run([find_cuobjdump(), "-sass", path], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"sass_loops.py: cuobjdump -sass {path} failed: {result.stderr.strip()}")
    return result.stdout


def demangle(name):
    if shutil.which("c++filt"):
        result = subprocess.run(["c++filt", name], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.strip():
            name = result.stdout.strip()
    name = re.sub(r"\(anonymous namespace\)::|moelora::\w+::cuda::|\(.*\)$", "", name)
    return name[:100]


def opcode(instruction):
    return re.sub(r"^@!?U?P\d\s+", "", instruction).split()[0].split(".")[0]


def kernels(sass):
    """(name, [(address, instruction)]) per function of the listing."""
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        body = []
        for line in chunk.split("\n"):
            m = LINE.match(line)
            if m and m.group(2):
                body.append((int(m.group(1), 16), m.group(2)))
        yield name, body


def mma_loops(body, max_body):
    """(first, last) instruction index of every loop of at most max_body instructions whose body
    holds wgmma instructions, in the order of their closing branches."""
    index = {address: i for i, (address, _) in enumerate(body)}
    for i, (_, instruction) in enumerate(body):
        m = BRANCH.search(instruction)
        if not m:
            continue
        target = index.get(int(m.group(1), 16))
        if target is None or target >= i or i - target + 1 > max_body:
            continue
        if any(MMA.match(s) for _, s in body[target:i + 1]):
            yield target, i


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("object", help="an object file, cubin or executable, or a .sass listing")
    parser.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    parser.add_argument("--max-body", type=int, default=400,
                        help="longest loop body counted, in instructions (default 400)")
    parser.add_argument("--show", action="store_true", help="print each counted loop's SASS")
    args = parser.parse_args()

    found = False
    for name, body in kernels(read_sass(args.object)):
        if args.filter not in name:
            continue
        for first, last in mma_loops(body, args.max_body):
            loop = [s for _, s in body[first:last + 1]]
            mmas = [MMA.match(s) for s in loop if MMA.match(s)]
            kind, width, depth = mmas[0].group(1), mmas[0].group(2), mmas[0].group(3)
            waits = sum("gsb0" in s for s in loop if MMA.match(s))
            counts = collections.Counter(opcode(s) for s in loop)
            histogram = ", ".join(f"{op} {n}" for op, n in counts.most_common())
            print(f"{demangle(name)}\n  {kind} 64x{width}x{depth}: loop of {len(loop)} instructions, "
                  f"{len(mmas)} wgmma ({waits} waited on at issue), "
                  f"{len(loop) / len(mmas):.2f} per wgmma\n  {histogram}")
            if args.show:
                print("\n".join("    " + s for s in loop))
            found = True
    if not found:
        sys.exit("sass_loops.py: no loop with wgmma instructions in the kernels selected")


if __name__ == "__main__":
    main()
