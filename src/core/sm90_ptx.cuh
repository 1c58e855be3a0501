// PTX wrappers for Hopper-only features (sm_90 / sm_90a): mbarriers, the tensor memory accelerator
// (cp.async.bulk.tensor, cp.async.bulk), warpgroup MMA (wgmma) on FP8 operands in shared memory and
// on f16 with A in registers, and programmatic
// dependent launch (griddepcontrol). Used by the weight-streaming expert GEMM
// (ops/gemm/moe_gemm_stream_cuda.cu); every kernel that includes this is built for sm_90a.
#pragma once

#include <cstdint>

namespace moelora::cuda::sm90 {

// ---- mbarrier (shared::cta) ----
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival that also announces `bytes` of transactions (TMA copies) the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting for parity 1 returns at once (the producer's first pass over an empty ring).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- TMA ----
// L2 policy for data read exactly once (expert weights): evicted first, so the activations and
// the outputs that later kernels read stay in L2.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// L2 policy for data that several CTAs read at about the same time (a weight tile shared by the
// token tiles of a prefill GEMM): kept at normal priority.
__device__ __forceinline__ uint64_t l2_evict_normal_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// 2-D tile copy global -> shared, completion counted on `bar` (coordinates in elements,
// innermost first).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tensor_map, uint32_t bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(tensor_map), "r"(bar), "r"(x), "r"(y)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d_hint(uint32_t dst, const void* tensor_map, uint32_t bar, int x, int y,
                                                 uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, "
      "%4}], [%2], %5;\n" ::"r"(dst),
      "l"(tensor_map), "r"(bar), "r"(x), "r"(y), "l"(policy)
      : "memory");
}
// 1-D bulk copy global -> shared of `bytes` (a multiple of 16; both addresses 16-byte aligned),
// completion counted on `bar`, with an L2 cache policy.
__device__ __forceinline__ void bulk_load_hint(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                               uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// ---- wgmma (sm_90a) ----
// Shared-memory matrix descriptor of a K-major operand tile written by TMA with 128-byte swizzle:
// rows of 128 bytes, 8-row swizzle atoms of 1024 bytes (stride byte offset), tile base 1024-byte
// aligned. Advancing the start address by 32 bytes selects the next k32 slice of FP8 data.
__device__ __forceinline__ uint64_t wgmma_desc_k_major_sw128(uint32_t smem_addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;  // stride byte offset: next 8-row group
  desc |= static_cast<uint64_t>(1) << 62;          // layout: 128-byte swizzle
  return desc;
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator register across wgmma issue / wait.
__device__ __forceinline__ void fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}
__device__ __forceinline__ void fence_operand(uint32_t& r) {
  asm volatile("" : "+r"(r)::"memory");
}

// D[64 x N] (+)= A[64 x 32] * B[32 x N]^T, e4m3 x e4m3 -> f32, both operands K-major in shared
// memory. Accumulator layout (thread t of the warpgroup, w = t / 32, l = t % 32): d[4c + 2i + j]
// holds row 16 w + l / 4 + 8 i, column 8 c + 2 (l % 4) + j. accumulate = false overwrites D.
template <int kN>
struct WgmmaE4m3;

#define MOELORA_WGMMA_E4M3_ASM(N, REGS, ...)                                                         \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" #REGS ", 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " __VA_ARGS__ ", p, 1, 1;\n}\n"

template <>
struct WgmmaE4m3<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], uint64_t a, uint64_t b, bool accumulate) {
    MOELORA_WGMMA_E4M3_ASM(8, 6, "{%0, %1, %2, %3}, %4, %5")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaE4m3<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], uint64_t a, uint64_t b, bool accumulate) {
    MOELORA_WGMMA_E4M3_ASM(16, 10, "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaE4m3<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t a, uint64_t b, bool accumulate) {
    MOELORA_WGMMA_E4M3_ASM(32, 18,
                           "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaE4m3<64> {
  __device__ __forceinline__ static void mma(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
    MOELORA_WGMMA_E4M3_ASM(64, 34,
                           "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                           "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                           "%32, %33")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
#undef MOELORA_WGMMA_E4M3_ASM

// D[64 x N] = A[64 x 32] * B[32 x N]^T, e4m3 x e4m3 -> f32, A from registers (four .b32 of four
// e4m3 bytes, the fragment of mma.m16n8k32 for the warp's 16 rows: a[0] = (row l / 4, k 4 (l % 4)
// .. + 3), a[1] = row + 8, a[2] = k + 16, a[3] = row + 8 and k + 16), B K-major in shared memory.
// D is overwritten (scale-d false): the W4A8 NVFP4 GEMM scales each k16 group's product by its
// group scales before adding it up. Accumulator layout as for WgmmaE4m3; the A registers are read
// asynchronously (ptxas keeps them live until the wait).
template <int kN>
struct WgmmaE4m3RsFresh;
template <>
struct WgmmaE4m3RsFresh<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "%8, 0, 1, 1;\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

// D[64 x N] (+)= A[64 x 16] * B[16 x N]^T, f16 x f16 -> f32, A from registers (the fragment of
// mma.m16n8k16 for the warp's 16 rows: a[0] = (row l / 4, k 2 (l % 4) .. + 1), a[1] = row + 8,
// a[2] = k + 8, a[3] = row + 8 and k + 8), B K-major in shared memory. Accumulator layout as for
// WgmmaE4m3. The A registers are read asynchronously: ptxas keeps them live until the wait.
template <int kN>
struct WgmmaF16Rs;

#define MOELORA_WGMMA_F16_RS_ASM(N, REGS, ...)                                                       \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" #REGS ", 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 " __VA_ARGS__ ", p, 1, 1, 0;\n}\n"

template <>
struct WgmmaF16Rs<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(8, 9, "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaF16Rs<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(16, 13, "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaF16Rs<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(32, 21,
                             "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                             "{%16, %17, %18, %19}, %20")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaF16Rs<64> {
  __device__ __forceinline__ static void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(64, 37,
                             "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                             "{%32, %33, %34, %35}, %36")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaF16Rs<96> {
  __device__ __forceinline__ static void mma(float (&d)[48], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(96, 53,
                             "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
                             "{%48, %49, %50, %51}, %52")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
template <>
struct WgmmaF16Rs<128> {
  __device__ __forceinline__ static void mma(float (&d)[64], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
    MOELORA_WGMMA_F16_RS_ASM(128, 69,
                             "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                             "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                             "{%64, %65, %66, %67}, %68")
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
  }
};
#undef MOELORA_WGMMA_F16_RS_ASM

// ---- L2 prefetch ----
// Issues L2 fills of bytes [0, bytes) of `ptr`, one 128-byte line per request, spread over
// `workers` callers (worker = this caller's index): no registers wait for the data, so a kernel can
// start the fills of inputs it (or a kernel after it) reads later, and their DRAM latency overlaps
// its own. No-op for a null pointer.
__device__ __forceinline__ void prefetch_l2_range(const void* ptr, size_t bytes, int worker,
                                                  int workers) {
  if (!ptr) return;
  const char* base = static_cast<const char*>(ptr);
  for (size_t off = static_cast<size_t>(worker) * 128; off < bytes;
       off += static_cast<size_t>(workers) * 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(base + off));
}

// ---- register reallocation between warpgroups ----
// Every warp of the warpgroup executes these (sync.aligned). A producer warpgroup that only issues
// copies gives registers back so the consumer warpgroups can hold more (kRegs: 24..256, a
// multiple of 8); an increase draws on what the CTA's warps released.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0);
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0);
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- programmatic dependent launch ----
// Blocks until the grid this one depends on (launched with programmatic stream serialization) has
// completed and its memory is visible; a no-op for a normally launched grid.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the dependent grid be scheduled before this one finishes (its griddepcontrol.wait still
// waits for our completion).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace moelora::cuda::sm90
