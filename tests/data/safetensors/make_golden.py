#!/usr/bin/env python3
"""Writes the safetensors goldens read by tests/unit/safetensors_test.cpp.

  golden.safetensors         every dtype moelora knows, odd shapes, zero-sized tensors, a scalar,
                             non-ASCII and escaped names; metadata {"format": "pt"}
  golden_nometa.safetensors  three tensors, no metadata at all

Both are written by the reference writer (safetensors.torch.save_file). Element values follow
formulas that the C++ test recomputes (keep the two in sync): the reader must return exactly
these values, and SafetensorsWriter must reproduce the files byte for byte.

Run from anywhere:  python3 tests/data/safetensors/make_golden.py
Made with torch 2.15.0 and safetensors 0.8.0.
"""
import os

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
MASK64 = (1 << 64) - 1

# (name, safetensors dtype, shape in elements). The test uses the same list, in this order; the
# position t in the list enters the value formulas.
TENSORS = [
    ("a.f32", "F32", [3, 5]),
    ("b.bf16", "BF16", [7, 3]),
    ("c.f16", "F16", [2, 3, 5]),
    ("d.f64", "F64", [5]),
    ("e.f8_e4m3", "F8_E4M3", [3, 7]),
    ("f.f8_e5m2", "F8_E5M2", [11]),
    ("g.f8_e8m0", "F8_E8M0", [3, 3]),
    ("h.f4", "F4", [3, 10]),
    ("i.bool", "BOOL", [9]),
    ("j.u8", "U8", [13]),
    ("k.i8", "I8", [2, 7]),
    ("l.i16", "I16", [5, 3]),
    ("m.u16", "U16", [7]),
    ("n.i32", "I32", [3, 3]),
    ("o.u32", "U32", [5]),
    ("p.i64", "I64", [2, 3]),
    ("q.u64", "U64", [3]),
    ("r.empty", "F32", [0, 5]),
    ("s.scalar", "F32", []),
    ("Z.upper", "BF16", [3]),
    ("\u043c\u043e\u0434\u0435\u043b\u044c.\u0432\u0435\u0441", "F16", [2]),
    ('quote"back\\slash/name', "I32", [1]),
    ("t.empty_bf16", "BF16", [4, 0, 3]),
]

FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
         "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INTS = {"U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64}


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def float_value(t, i):
    # multiples of 0.25 in [-2, 2]: exact in every float dtype above, e4m3 and e5m2 included
    return ((i * 7 + t * 3) % 17 - 8) * 0.25


def int_bits(t, i):
    # 64 pseudo-random bits; narrower types keep the low bits
    return ((i + 1) * 0x9E3779B97F4A7C15 + t * 0x632BE59BD9B4E019) & MASK64


def make(t, dtype, shape):
    n = numel(shape)
    if dtype in FLOAT:
        return torch.tensor([float_value(t, i) for i in range(n)], dtype=torch.float64).to(FLOAT[dtype]).reshape(shape)
    if dtype == "F8_E8M0":
        codes = np.array([120 + (i * 5 + t) % 15 for i in range(n)], dtype=np.uint8)
        return torch.from_numpy(codes).view(torch.float8_e8m0fnu).reshape(shape)
    if dtype == "F4":
        # torch's float4_e2m1fn_x2 holds two elements per byte; its shape counts bytes, the
        # safetensors shape counts elements (last dimension doubled).
        packed = shape[:-1] + [shape[-1] // 2]
        codes = np.array([(i * 29 + t * 7) % 256 for i in range(numel(packed))], dtype=np.uint8)
        return torch.from_numpy(codes).view(torch.float4_e2m1fn_x2).reshape(packed)
    if dtype == "BOOL":
        return torch.tensor([(i * 5 + t) % 3 == 0 for i in range(n)], dtype=torch.bool).reshape(shape)
    bits = INTS[dtype]
    raw = np.array([int_bits(t, i) & ((1 << bits) - 1) for i in range(n)], dtype=np.dtype(f"<u{bits // 8}"))
    if dtype.startswith("I"):
        raw = raw.view(np.dtype(f"<i{bits // 8}"))
    return torch.from_numpy(raw.copy()).reshape(shape)


def main():
    tensors = {name: make(t, dtype, shape) for t, (name, dtype, shape) in enumerate(TENSORS)}
    save_file(tensors, os.path.join(HERE, "golden.safetensors"), metadata={"format": "pt"})
    subset = {name: tensors[name] for name in ("a.f32", "j.u8", "s.scalar")}
    save_file(subset, os.path.join(HERE, "golden_nometa.safetensors"))


if __name__ == "__main__":
    main()
