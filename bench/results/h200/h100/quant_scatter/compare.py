#!/usr/bin/env python3
"""Side by side of bench_moe_layer logs: µs and the LoRA ratio's share of its ideal per row.

usage: compare.py RUN [RUN ...]   (reads RUN.log in the current folder)
"""
import sys,re,collections
runs=sys.argv[1:]
rows=collections.OrderedDict()
for r in runs:
    for line in open(f"{r}.log"):
        m=re.match(r"(\S+)\s+decode\s+(\d+)\s+(none|\dx r16)\s+routed\s+([\d.]+) us.*?ratio ([\d.]+) \(ideal ([\d.]+), ([\d.]+)\)",line)
        if m:
            k=(m[1][:6],int(m[2]),m[3]); rows.setdefault(k,{})[r]=(float(m[4]),float(m[7]))
print("%-8s %4s %-7s"%("preset","B","lora")+"".join("%18s"%r[:18] for r in runs))
for k,v in rows.items():
    print("%-8s %4d %-7s"%k+"".join(("%10.1f %6.3f"%v[r]) if r in v else "%18s"%"-" for r in runs))
