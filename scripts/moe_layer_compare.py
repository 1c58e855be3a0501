#!/usr/bin/env python3
"""Side by side of bench_moe_layer runs: per decode row, the µs and the LoRA ratio's share of its
ideal ratio, one column pair per run (A/B runs of two builds or two switches).

    scripts/moe_layer_compare.py --dir bench/results/h200/h100/quant_scatter fp8_rule_r1 fp8_scatter_r1

Each RUN is RUN.log in --dir: the stdout of `bench_moe_layer ... --out RUN`.
"""
import argparse
import collections
import pathlib
import re
import sys

# "<preset> decode <B> <lora> routed|full <us> us ... ratio <r> (ideal <i>, <share>)"
ROW = re.compile(r"(\S+)\s+decode\s+(\d+)\s+(none|\d+x r\d+)\s+(?:routed|full)\s+([\d.]+) us.*?"
                 r"ratio ([\d.]+) \(ideal ([\d.]+), ([\d.]+)\)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run names (RUN.log in --dir)")
    parser.add_argument("--dir", default=".", help="folder holding the RUN.log files (default: .)")
    args = parser.parse_args()
    rows = collections.OrderedDict()  # (preset, B, lora) -> {run: (us, share of ideal)}
    for run in args.runs:
        log = pathlib.Path(args.dir) / f"{run}.log"
        if not log.is_file():
            print(f"moe_layer_compare: {log} not found (give --dir the folder of the run logs)", file=sys.stderr)
            return 2
        for line in log.read_text().splitlines():
            m = ROW.match(line)
            if m:
                key = (m[1], int(m[2]), m[3])
                rows.setdefault(key, {})[run] = (float(m[4]), float(m[7]))
    width = max(18, max(len(r) for r in args.runs) + 2)
    print(f"{'preset':<16} {'B':>4} {'lora':<7}" + "".join(f"{r:>{width}}" for r in args.runs))
    for (preset, batch, lora), by_run in rows.items():
        cells = "".join((f"{by_run[r][0]:>{width - 7}.1f} {by_run[r][1]:6.3f}" if r in by_run else f"{'-':>{width}}")
                        for r in args.runs)
        print(f"{preset:<16} {batch:>4} {lora:<7}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
