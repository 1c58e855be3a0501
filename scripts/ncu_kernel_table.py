#!/usr/bin/env python3
"""Per-kernel table of an Nsight Compute report of the engine's decode steps.

Reads the text that `scripts/gpu-run --ncu-steps "ARGS"` writes (ncu over
`bench_decode_step --no-timeline ARGS`: each decode step's kernels in launch order, every step
starting with the embedding gather) and prints one Markdown table per recorded step: per kernel
name its calls per layer, duration, DRAM bytes read, DRAM throughput, achieved occupancy,
registers, cycles per issued instruction and ncu's top stall reason. ncu serializes the kernels,
so the durations carry no overlap.

    scripts/ncu_kernel_table.py ncu-steps.txt --layers 4 --titles "no adapter" "one r16 adapter"

--by-grid keeps launches of one kernel with different grids apart (a row per kernel and grid x
block), as for the LoRA segment kernels, whose grid is the segment capacity of the launch.
"""
import argparse
import collections
import lzma
import re

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("report", help="ncu text output (.txt, or .txt.xz)")
ap.add_argument("--layers", type=int, default=4, help="decoder layers the steps ran (--layers of the bench)")
ap.add_argument("--titles", nargs="*", default=[], help="a heading per recorded step, in order")
ap.add_argument("--by-grid", action="store_true", help="a row per kernel name and launch grid x block")
args = ap.parse_args()
opener = lzma.open if args.report.endswith(".xz") else open
with opener(args.report, "rt") as f:
    text = f.read()
# split the run at the 1-adapter engine's prefill message
# the report sections follow the launches in order; each step starts with the embedding gather
starts = [m.start() for m in re.finditer(r'\n  (?:void )?(?:ops|model)::<unnamed>::embedding_gather_kernel', text)]
parts = [text[a:b] for a, b in zip([0] + starts[1:], starts[1:] + [len(text)])]
def parse(part):
    blocks = re.split(r'\n  (?=(?:void |nvjet|ops::|model::|cublas)[^\n]*\(\d+, \d+, \d+\)x)', part)
    rows = collections.OrderedDict()
    for b in blocks[1:]:
        name = b.split('(')[0].strip()
        name = re.sub(r'^void ', '', name)
        name = re.sub(r'(ops|model)::<unnamed>::', '', name)
        name = re.sub(r'flashinfer::', 'fi::', name)
        name = re.sub(r'<1, fi::KernelTraits.*', '<decode>', name)
        name = re.sub(r'cublasLt::splitKreduce_kernel<.*', 'splitKreduce_kernel', name)
        name = re.sub(r'PersistentVariableLengthMergeStatesKernel<.*', 'MergeStates', name)
        launch = re.search(r'\((\d+), \d+, \d+\)x\((\d+), \d+, \d+\)', b)
        if args.by_grid and launch:
            name = f"{name} [{launch.group(1)} x {launch.group(2)}]"
        def num(pat):
            m = re.search(pat, b)
            return float(m.group(1).replace(',', '')) if m else None
        us = num(r'gpu__time_duration.sum\s+(?:us|usecond)\s+([\d.,]+)')
        if us is None:
            ms = num(r'gpu__time_duration.sum\s+ms\s+([\d.,]+)'); us = ms*1000 if ms else None
        mb = num(r'dram__bytes_read.sum\s+Mbyte\s+([\d.,]+)')
        if mb is None:
            kb = num(r'dram__bytes_read.sum\s+Kbyte\s+([\d.,]+)'); mb = kb/1000 if kb is not None else None
        if mb is None:
            gb = num(r'dram__bytes_read.sum\s+Gbyte\s+([\d.,]+)'); mb = gb*1000 if gb is not None else 0
        dram = num(r'DRAM Throughput\s+%\s+([\d.,]+)')
        occ = num(r'Achieved Occupancy\s+%\s+([\d.,]+)')
        regs = num(r'Registers Per Thread\s+register/thread\s+([\d.,]+)')
        cpi = num(r'Warp Cycles Per Issued Instruction\s+cycle\s+([\d.,]+)')
        m = re.search(r'spends ([\d.]+) cycles being stalled ([^.]*?)(?:\s{2,}|\n)', b)
        stall = ''
        m = re.search(r'each warp of this workload spends ([\d.]+) cycles being stalled\s+(.*?)\. ', b, re.S)
        if m:
            why = re.sub(r'\s+', ' ', m.group(2))
            why = why.replace('waiting for a scoreboard dependency on a L1TEX (local, global, surface, texture) operation', 'L1TEX scoreboard')
            why = why.replace('waiting on a fixed latency execution dependency', 'fixed-latency dependency')
            why = why.replace('waiting for sibling warps at a CTA barrier', 'CTA barrier')
            stall = f"{m.group(1)} {why}"[:60]
        r = rows.setdefault(name, dict(n=0, us=0, mb=0, dram=[], occ=[], regs=regs, cpi=[], stall=stall))
        r['n'] += 1; r['us'] += us or 0; r['mb'] += mb or 0
        if dram is not None: r['dram'].append(dram)
        if occ is not None: r['occ'].append(occ)
        if cpi is not None: r['cpi'].append(cpi)
    return rows
def table(rows, layers):
    out = ['| kernel | calls / layer | µs per call | MB read per call | DRAM throughput % | achieved occupancy % | registers | cycles per issued instruction | top stall (cycles of them) |', '|---|---|---|---|---|---|---|---|---|']
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]['us']):
        n = r['n']; avg = lambda v: sum(v)/len(v) if v else float('nan')
        out.append(f"| {name[:64] if args.by_grid else name[:48]} | {n/layers:.2g} | {r['us']/n:.1f} | {r['mb']/n:.1f} | {avg(r['dram']):.0f} | {avg(r['occ']):.0f} | {r['regs']:.0f} | {avg(r['cpi']):.1f} | {r['stall']} |")
    return '\n'.join(out)
for i, part in enumerate(parts):
    title = args.titles[i] if i < len(args.titles) else f"step {i + 1}"
    print(f"### {title}\n")
    print(table(parse(part), args.layers))
    print()
