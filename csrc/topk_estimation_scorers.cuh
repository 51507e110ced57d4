// Score tiles of the top-k estimation kernel: proxies as mma A fragments, keys streamed in
// 8-item tiles (tokens, or key blocks scored by max / log-sum-exp of their tokens).
#pragma once
#include "topk_estimation_common.cuh"

namespace dsv {
namespace {
template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ float round_to(float x);
template <> __device__ __forceinline__ float round_to<float>(float x) { return x; }
template <> __device__ __forceinline__ float round_to<__half>(float x) { return __half2float(__float2half_rn(x)); }
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T> __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// -0.0 reads as +0.0 so that equal scores compare equal bit for bit too.
__device__ __forceinline__ float canon(float x) {
  uint32_t u = __float_as_uint(x);
  return __uint_as_float(u == 0x80000000u ? 0u : u);
}
// Monotone map float -> uint32 (larger float -> larger key).
__device__ __forceinline__ uint32_t ordered(float x) {
  uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unordered(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// The bin map shared by every histogram of a row: monotone non-decreasing in s and the same
// instructions everywhere, so "bin >= b" is exactly "s >= bin_edge(b)" (found by bisection).
__device__ __forceinline__ int bin_of(float s, float lo, float scale, int nbins) {
  float x = __fmul_rn(__fsub_rn(s, lo), scale);
  int b = __float2int_rz(x);
  return min(max(b, 0), nbins - 1);
}
// Smallest float x with bin_of(x) >= b (-inf for b <= 0, +inf when no float reaches b).
__device__ float bin_edge(int b, float lo, float scale, int nbins) {
  if (b <= 0) return -INFINITY;
  if (b >= nbins || bin_of(INFINITY, lo, scale, nbins) < b) return INFINITY;
  uint32_t a = ordered(-INFINITY), z = ordered(INFINITY);  // pred(a) false, pred(z) true
  while (z - a > 1u) {
    const uint32_t m = a + (z - a) / 2u;
    if (bin_of(unordered(m), lo, scale, nbins) >= b) z = m;
    else a = m;
  }
  return unordered(z);
}

// Scores of one 16-row tile layout: v[mt][c] is (row mt*16 + (c>>1)*8 + g, col 2t + (c&1)).
template <typename T, int R>
struct TokenScorer {
  static constexpr int KS = (R + 15) / 16;
  uint32_t a[MT][KS][4];
  const T* k;
  int S;

  __device__ void init(const Shared& sm, const T* k_, int S_, int lane) {
    k = k_;
    S = S_;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = mt * 16 + g + ((i & 1) ? 8 : 0);
          const int col = ks * 16 + 2 * t + ((i & 2) ? 8 : 0);
          a[mt][ks][i] = col < R ? pack2<T>(sm.proxy[row][col], sm.proxy[row][col + 1]) : 0u;
        }
  }

  struct Frag {
    uint32_t b[KS][2];
  };
  // B fragments of tokens tok0 .. tok0+7 (zero keys past S: callers mask them).
  __device__ __forceinline__ void load(int tok0, Frag& f, int lane) const {
    const int g = lane >> 2, t = lane & 3;
    const int tok = tok0 + g;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(k + (size_t)tok * R + ks * 16 + 2 * t);
      f.b[ks][0] = tok < S ? __ldg(p) : 0u;
      f.b[ks][1] = (R >= 16 && tok < S) ? __ldg(p + 4) : 0u;
    }
  }
  __device__ __forceinline__ void tile(int tok0, float v[MT][4], int lane) const {
    Frag f;
    load(tok0, f, lane);
    compute(f, v, lane);
  }
  __device__ __forceinline__ void compute(const Frag& f, float v[MT][4], int) const {
    const auto& b = f.b;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) mma16816<T>(c, a[mt][ks], b[ks][0], b[ks][1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[mt][i] = c[i];  // -0.0 == +0.0 in every compare; key64 canonicalises
    }
  }
};

// fp32: the reference's order exactly (products rounded, then added for d = 0..r-1).
template <int R>
struct TokenScorer<float, R> {
  const float* k;
  const Shared* sm;
  int S;

  __device__ void init(const Shared& sm_, const float* k_, int S_, int) {
    k = k_;
    sm = &sm_;
    S = S_;
  }

  struct Frag {
    int tok0;
  };
  __device__ __forceinline__ void load(int tok0, Frag& f, int) const { f.tok0 = tok0; }
  __device__ __forceinline__ void compute(const Frag& f, float v[MT][4], int lane) const { tile(f.tok0, v, lane); }
  __device__ __forceinline__ void tile(int tok0, float v[MT][4], int lane) const {
    const int g = lane >> 2, t = lane & 3;
    float acc[MT][4];
#pragma unroll
    for (int d4 = 0; d4 < R / 4; ++d4) {
      float4 kv[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int tok = tok0 + 2 * t + j;
        kv[j] = tok < S ? __ldg(reinterpret_cast<const float4*>(k + (size_t)tok * R) + d4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = d4 * 4 + e;
        const float k0 = e == 0 ? kv[0].x : e == 1 ? kv[0].y : e == 2 ? kv[0].z : kv[0].w;
        const float k1 = e == 0 ? kv[1].x : e == 1 ? kv[1].y : e == 2 ? kv[1].z : kv[1].w;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float p0 = sm->proxy[mt * 16 + g][d], p1 = sm->proxy[mt * 16 + g + 8][d];
          const float x[4] = {__fmul_rn(p0, k0), __fmul_rn(p0, k1), __fmul_rn(p1, k0), __fmul_rn(p1, k1)};
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][i] = d == 0 ? x[i] : __fadd_rn(acc[mt][i], x[i]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[mt][i] = acc[mt][i];
  }
};

__device__ __forceinline__ void lse_push(float& m, float& l, float x) {
  if (x == -INFINITY) return;
  const float mn = fmaxf(m, x);
  l = (m == -INFINITY ? 0.f : l * __expf(m - mn)) + __expf(x - mn);
  m = mn;
}
__device__ __forceinline__ void lse_merge(float& m, float& l, float m2, float l2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; l = l2; return; }
  const float mn = fmaxf(m, m2);
  l = l * __expf(m - mn) + l2 * __expf(m2 - mn);
  m = mn;
}

// Item scores for items it0 .. it0+7 in the tile layout: tokens, or blocks of BS tokens.
template <typename T, int R, int BS>
struct ItemScorer {
  TokenScorer<T, R> ts;
  bool lse;
  using Frag = typename TokenScorer<T, R>::Frag;

  __device__ __forceinline__ void load(int it0, Frag& f, int lane) const {
    if constexpr (BS == 0) ts.load(it0, f, lane);  // blocks: computed from it0 in compute()
  }
  __device__ __forceinline__ void compute(int it0, const Frag& f, float v[MT][4], int lane) const {
    if constexpr (BS == 0) ts.compute(f, v, lane);
    else tile(it0, v, lane);
  }

  __device__ __forceinline__ void tile(int it0, float v[MT][4], int lane) const {
    if constexpr (BS == 0) {
      ts.tile(it0, v, lane);
    } else {
      const int t = lane & 3;
#pragma unroll 1
      for (int n = 0; n < 8; ++n) {
        float m[MT][2], l[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
        for (int st = 0; st < BS / 8; ++st) {
          const int tok0 = (it0 + n) * BS + st * 8;
          float w[MT][4];
          ts.tile(tok0, w, lane);
          const bool ok0 = tok0 + 2 * t < ts.S, ok1 = tok0 + 2 * t + 1 < ts.S;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float x0 = ok0 ? w[mt][2 * h] : -INFINITY, x1 = ok1 ? w[mt][2 * h + 1] : -INFINITY;
              if (lse) {
                lse_push(m[mt][h], l[mt][h], x0);
                lse_push(m[mt][h], l[mt][h], x1);
              } else {
                m[mt][h] = fmaxf(m[mt][h], fmaxf(x0, x1));
              }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
              const float m2 = __shfl_xor_sync(FULL, m[mt][h], off);
              const float l2 = __shfl_xor_sync(FULL, l[mt][h], off);
              if (lse) lse_merge(m[mt][h], l[mt][h], m2, l2);
              else m[mt][h] = fmaxf(m[mt][h], m2);
            }
            const float sc = lse ? (m[mt][h] == -INFINITY ? -INFINITY : m[mt][h] + __logf(l[mt][h])) : m[mt][h];
            if (t == (n >> 1)) {
              if (n & 1) v[mt][2 * h + 1] = canon(sc);
              else v[mt][2 * h] = canon(sc);
            }
          }
      }
    }
  }
};

}  // namespace
}  // namespace dsv
