#pragma once
// Fused low-rank QK^T + per-group top-k selection: the algorithm, constants and shared-memory
// layout. Kernel: topk_estimation_kernel.cuh (score tiles: topk_estimation_scorers.cuh), instantiated
// per dtype in topk_estimation_{f32,f16,bf16}.cu so that they compile in parallel.
//
// One CTA = one (batch, head) and TG = 32 consecutive query groups. The group proxies
// live in registers as mma A fragments; 8 warps stream the head's keys (r is tiny, so
// scores are recomputed in every pass rather than stored: nothing of size groups x keys
// is ever kept). The K-th best item of each group is found with ONE full pass in the
// common case:
//   range   min/max of a sparse sample of scores -> the row's bin map;
//   sample  histogram of every F-th 8-item tile (F = 1: exact counts);
//   window  from the sample, per row: an upper edge eH with (w.h.p.) fewer than K items
//           above it and a lower edge eL with at least K items at or above it;
//   main    every score once: bits of items >= eH into a bitmask (one 32-bit word per 32
//           items), exact count A of those, items in [eL, eH) appended to a per-row window
//           buffer (global scratch, exact count W);
//   select  if A <= K <= A + W (and the window fitted), the (K - A) best window items
//           (exact: histogram + rank of the boundary sub-bin) get their bits set;
//   compact each row's bitmask -> ascending item ids (popc + warp scan), -1 padding.
// Rows whose window missed (sampling bad luck, massive ties) take the exact fallback:
// full histogram, boundary-bin collect (or an 8-level radix select over the 64-bit key
// (score bits, ~index) when that bin overflows), then a rewrite pass of their bitmask.
// Order: higher score first, then lower index: exactly K items are selected.
// Scores: tensor-core mma (bf16/fp16) or ordered fp32 FMAs (bit-equal to the reference).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "topk_estimation.h"

namespace dsv {
namespace {

constexpr int TG = 32;      // query groups per CTA
constexpr int MT = TG / 16; // m16 row tiles
constexpr int NWARPS = 8;
constexpr int NTHREADS = NWARPS * 32;
constexpr int NB = 512;     // bins of the sample and fallback histograms
constexpr int CAP = 256;    // fallback: boundary-bin candidates ranked in shared memory per row
constexpr int SNB = 256;    // window selection: sub-histogram bins (per warp)
constexpr int SCAP = 128;   // window selection: boundary sub-bin candidates (per warp)
constexpr int RB = 256;     // radix bins (fallback)
constexpr int UH = 4;       // 8-item tiles per chunk: one chunk = one 32-bit bitmask word
constexpr unsigned FULL = 0xffffffffu;

struct Cand {
  float s;
  int idx;
};

struct Shared {
  union {
    uint32_t hist[TG * NB];  // sample / fallback / radix histograms
    Cand cand[TG * CAP];     // fallback candidates
    struct {
      uint32_t h[NWARPS][SNB];
      Cand c[NWARPS][SCAP];
      int n[NWARPS];
    } sel;
  } u;
  float proxy[TG][33];
  float lo[TG], scale[TG], eL[TG], eH[TG], t[TG];
  uint32_t smin[TG], smax[TG];  // ordered keys
  int A[TG], W[TG], fail[TG], jstar[TG];
  int bstar[TG], need[TG], nbin[TG], ccount[TG], ovf[TG];
  unsigned long long prefix[TG];
  int any_fail, any_overflow;
};

static_assert(sizeof(uint32_t) * TG * NB >= sizeof(int32_t) * NWARPS * 1024,
              "the compaction's staging buffers live in Shared::u");
// the launch asks for sizeof(Shared) bytes of dynamic shared memory, which no compiler checks: Hopper's limit here
static_assert(sizeof(Shared) <= 227 * 1024, "Shared exceeds an sm_90 block's 227 KB of shared memory");

}  // namespace
}  // namespace dsv
