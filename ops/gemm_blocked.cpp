// The CPU's float32 GEMM for AVX2 and AVX-512 (ops/gemm_blocked.h).
//
// Why not Eigen: Eigen 3.4's micro-kernels reached 69% of a Zen 4 core's FMA peak with AVX-512 (80 of 117 GFLOP/s,
// thread CPU time, 1024^3), this one 85% (100 GFLOP/s), OpenBLAS's level. With AVX2, Eigen does 46-61 GFLOP/s on
// two cores on the language model's decoder products (k = 32, or n = 32; docs/benchmarks.md).
//
// C (row-major) is computed in tiles of kMR rows x kNR columns, kept in kMR x kVecs vector accumulators while the
// micro-kernel runs over kc steps of k: per step kVecs vector loads of packed B, kMR broadcasts of packed A and
// kMR x kVecs FMAs. AVX-512: 6 x 64 tiles, 24 of the 32 zmm registers accumulate; AVX2: 6 x 16 tiles, 12 of the
// 16 ymm registers. Loop nest, innermost last, with where each block lives:
//   ic (up to kMC rows of A) -> pc (kKC of k) -> pack A block [mc x kc]        (L3)
//     -> jc (kNC columns of B) -> pack B block [kc x kNC]                      (L2)
//       -> ir (kMR rows: one A micro-panel, L1) -> jr (kNR columns: B micro-panel streams from L2)
// Threads share the packed blocks: they pack their share of the panels, meet at a barrier, then split the
// (ir, jr) tiles. Products with n <= 2 kNR read row-major operands in place instead of packing them (see run).
#include "ops/gemm_blocked.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/error.h"

namespace halfgrad::gemm_blocked {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

// ---- The vector unit: width, loads and stores of the first n lanes, and a kWidth x kWidth transpose.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int64_t kVecs = 4;  // vectors per tile row
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline __mmask16 first(int64_t n) { return __mmask16((1u << n) - 1); }  // 0 < n < 16
inline Vec load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline void store_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }

// The shuffles below through their masked forms with a full mask: the plain intrinsics start from
// _mm512_undefined_ps(), on which GCC 12 warns (-Wuninitialized, GCC bug 105593).
constexpr __mmask16 kAll = 0xffff;
inline Vec unpacklo(Vec a, Vec b) { return _mm512_mask_unpacklo_ps(a, kAll, a, b); }
inline Vec unpackhi(Vec a, Vec b) { return _mm512_mask_unpackhi_ps(a, kAll, a, b); }
template <int Imm> inline Vec shuffle(Vec a, Vec b) { return _mm512_mask_shuffle_ps(a, kAll, a, b, Imm); }
template <int Imm> inline Vec shuffle_lanes(Vec a, Vec b) { return _mm512_mask_shuffle_f32x4(a, kAll, a, b, Imm); }

// dst[c * ld_dst + r] = src[r * ld_src + c] for a 16 x 16 block: 16 row loads, four rounds of shuffles
// (pairs, quads, 128-bit lanes twice), 16 row stores.
inline void transpose_block(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  Vec r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = load(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = unpacklo(r[i], r[i + 1]);
    t[i + 1] = unpackhi(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per lane: [a0 b0 c0 d0], [a1 b1 c1 d1], [a2 ..], [a3 ..]
    r[i] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i], t[i + 2]);
    r[i + 1] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i], t[i + 2]);
    r[i + 2] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i + 1], t[i + 3]);
    r[i + 3] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i + 1], t[i + 3]);
  }
  // r[4q + c] now holds, for rows 4q..4q+3, columns c, c+4, c+8, c+12 in its four lanes.
  for (int c = 0; c < 4; ++c) {
    t[c] = shuffle_lanes<0x88>(r[c], r[4 + c]);            // columns c, c+8 of rows 0-7
    t[4 + c] = shuffle_lanes<0xdd>(r[c], r[4 + c]);        // columns c+4, c+12 of rows 0-7
    t[8 + c] = shuffle_lanes<0x88>(r[8 + c], r[12 + c]);   // columns c, c+8 of rows 8-15
    t[12 + c] = shuffle_lanes<0xdd>(r[8 + c], r[12 + c]);  // columns c+4, c+12 of rows 8-15
  }
  for (int c = 0; c < 8; ++c) {
    store(dst + c * ld_dst, shuffle_lanes<0x88>(t[c], t[8 + c]));        // column c
    store(dst + (c + 8) * ld_dst, shuffle_lanes<0xdd>(t[c], t[8 + c]));  // column c + 8
  }
}
#else  // AVX2 + FMA
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int64_t kVecs = 2;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline __m256i first(int64_t n) {  // lanes [0, n) set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
inline void store_first(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }

// dst[c * ld_dst + r] = src[r * ld_src + c] for an 8 x 8 block: 8 row loads, pairs and quads within each 128-bit
// half, then the halves exchanged, 8 row stores.
inline void transpose_block(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  Vec r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) {  // per half: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + c]: column c of rows i..i+3 (low half) and column c + 4 (high half)
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    store(dst + c * ld_dst, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));        // column c
    store(dst + (c + 4) * ld_dst, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));  // column c + 4
  }
}
#endif

constexpr int64_t kMR = 6;                // rows per tile
constexpr int64_t kNR = kVecs * kWidth;   // columns per tile: 64 (AVX-512) or 16 (AVX2)
constexpr int64_t kKC = 256;              // k per block: an A micro-panel is kKC x kMR x 4 B = 6 KiB (L1)
constexpr int64_t kNC = 512;              // columns per B block: kKC x kNC x 4 B = 512 KiB (half of a 1 MiB L2)
constexpr int64_t kMC = 4096;             // at most this many rows per A block (4 MiB, L3); blocks are made equal

// Micro-panels first .. last - 1 of the A block whose rows start at row0 (block_rows of them), columns pc .. pc + kc:
// panel r's step p holds the kMR values of column pc + p, rows row0 + r kMR on (rows past the block are zeros, so
// edge tiles need no special case in the kernel). Panel r lives at dst + r kc kMR.
void pack_a(const float* a, Trans trans, int64_t lda, int64_t row0, int64_t block_rows, int64_t pc, int64_t kc,
            int64_t first, int64_t last, float* dst) {
  if (trans == Trans::Yes) {
    // A stored k x m: a step's values are a contiguous run of a stored row. 16 steps at a time across all the
    // panels: the reads stream along 16 stored rows and each panel gets 16 whole steps (384 bytes) at once. (Panel
    // by panel every step is a new stored row, a page apart; step by step every write is a different panel: the
    // language model's dW = g^T x took 22-25 ms either way, 17-19 ms like this.)
    constexpr int64_t kSteps = 16;
    for (int64_t p0 = 0; p0 < kc; p0 += kSteps) {
      const int64_t steps = std::min(kSteps, kc - p0);
      for (int64_t r = first; r < last; ++r) {
        float* out = dst + r * kc * kMR + p0 * kMR;
        const int64_t rows = std::min(kMR, block_rows - r * kMR);
        const float* src = a + (pc + p0) * lda + row0 + r * kMR;
        for (int64_t p = 0; p < steps; ++p, out += kMR, src += lda) {
          if (rows == kMR) {
#pragma GCC unroll 6
            for (int64_t i = 0; i < kMR; ++i) out[i] = src[i];  // (std::copy: a memmove call per 24 bytes)
          } else {
            for (int64_t i = 0; i < kMR; ++i) out[i] = i < rows ? src[i] : 0.0f;
          }
        }
      }
    }
    return;
  }
  for (int64_t r = first; r < last; ++r) {  // A stored m x k: kMR rows, each read along k
    float* out = dst + r * kc * kMR;
    const int64_t rows = std::min(kMR, block_rows - r * kMR);
    for (int64_t i = 0; i < kMR; ++i) {
      const float* src = a + (row0 + r * kMR + i) * lda + pc;
      for (int64_t p = 0; p < kc; ++p) out[p * kMR + i] = i < rows ? src[p] : 0.0f;
    }
  }
}

// B[pc .. pc + kc, col0 .. + kNR] as one micro-panel: step p holds kNR contiguous values of row p.
void pack_b(const float* b, Trans trans, int64_t ldb, int64_t col0, int64_t cols, int64_t pc, int64_t kc, float* dst) {
  if (trans == Trans::No) {  // B stored k x n: rows are contiguous
    for (int64_t p = 0; p < kc; ++p) {
      const float* src = b + (pc + p) * ldb + col0;
      float* out = dst + p * kNR;
      if (cols == kNR) {
#pragma GCC unroll 4
        for (int64_t j = 0; j < kVecs; ++j) store(out + j * kWidth, load(src + j * kWidth));
      } else {
        for (int64_t j = 0; j < kNR; ++j) out[j] = j < cols ? src[j] : 0.0f;
      }
    }
    return;
  }
  // B stored n x k (a transposed weight: x W^T): a transpose, a kWidth x kWidth block at a time in registers.
  // (Element by element it took as long as the GEMM itself: kNR source rows, each a row of W apart, defeat the
  // prefetchers.)
  for (int64_t p0 = 0; p0 < kc; p0 += kWidth) {
    const int64_t steps = std::min(kWidth, kc - p0);
    for (int64_t j0 = 0; j0 < kNR; j0 += kWidth) {
      if (steps == kWidth && j0 + kWidth <= cols) {
        transpose_block(b + (col0 + j0) * ldb + pc + p0, ldb, dst + p0 * kNR + j0, kNR);
        continue;
      }
      for (int64_t j = j0; j < j0 + kWidth; ++j) {  // edges: partial blocks
        const float* src = b + (col0 + j) * ldb + pc + p0;
        for (int64_t p = 0; p < steps; ++p) dst[(p0 + p) * kNR + j] = j < cols ? src[p] : 0.0f;
      }
    }
  }
}

// A's kMR rows read in place, where packing would not pay (see run): row i's value at step p is
// row[i][p * step]. Past the panel's `rows` the last row again (computed, never stored), so that edge tiles read
// nothing outside A.
struct InPlaceA {
  const float* row[kMR];
  int64_t step;

  InPlaceA(const float* a, Trans trans, int64_t lda, int64_t row0, int64_t rows, int64_t pc)
      : step(trans == Trans::Yes ? lda : 1) {
    for (int64_t i = 0; i < kMR; ++i) {
      const int64_t r = row0 + std::min(i, rows - 1);
      row[i] = trans == Trans::Yes ? a + pc * lda + r : a + r * lda + pc;
    }
  }
};

// C[rows x cols] = alpha * (a-panel . b-panel) + beta * C (+ bias, the tile's cols values, on every row, when not
// null), where rows <= kMR and cols <= kNR (masked edges). beta == 0 never reads C.
// A is a packed micro-panel (const float*: step p's kMR values at a + p * kMR) or an InPlaceA. B's step p is the
// kNR values at b + p * b_step: kNR for a packed micro-panel, ldb for one read in place.
template <typename APanel>
void micro_kernel(int64_t kc, const APanel& a, const float* __restrict b, int64_t b_step, float* c, int64_t ldc,
                  int64_t rows, int64_t cols, float alpha, float beta, const float* bias) {
  Vec acc[kMR][kVecs];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) acc[i][j] = zero();
  }
  constexpr bool kPacked = std::is_same_v<APanel, const float*>;
  const float* packed = nullptr;
  const float* row[kMR];
  int64_t step = 0;
  if constexpr (kPacked) {
    packed = a;
  } else {
    std::copy(a.row, a.row + kMR, row);
    step = a.step;
  }
  for (int64_t p = 0, offset = 0; p < kc; ++p, offset += step) {
    Vec bv[kVecs];
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) bv[j] = load(b + j * kWidth);
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      const Vec ai = broadcast(kPacked ? packed[i] : row[i][offset]);
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) acc[i][j] = fma(ai, bv[j], acc[i][j]);
    }
    if constexpr (kPacked) packed += kMR;
    b += b_step;
  }
  const Vec va = broadcast(alpha), vb = broadcast(beta);
  Vec bias_v[kVecs];
  for (int64_t j = 0; j < kVecs; ++j) {
    const int64_t left = cols - j * kWidth;
    bias_v[j] = !bias || left <= 0  ? zero()
                : left >= kWidth        ? load(bias + j * kWidth)
                                        : load_first(bias + j * kWidth, left);
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < kVecs && j * kWidth < cols; ++j) {
      const int64_t left = cols - j * kWidth;
      float* out = c + i * ldc + j * kWidth;
      Vec v = fma(acc[i][j], va, bias_v[j]);
      if (left >= kWidth) {
        if (beta != 0) v = fma(load(out), vb, v);
        store(out, v);
      } else {
        if (beta != 0) v = fma(load_first(out, left), vb, v);
        store_first(out, v, left);
      }
    }
  }
}

// Packing buffers, reused across calls (a fresh multi-MiB allocation per call would cost page faults).
std::vector<float>& buffer(int which) {
  thread_local std::vector<float> buffers[2];
  return buffers[which];
}

}  // namespace

bool suits(const GemmArgs& g) { return g.m >= kMR && g.n >= std::min<int64_t>(kNR, 32) && g.k >= 16; }

void run(const GemmArgs& g, const float* a, const float* b, float* c, int threads) {
  const int64_t m = g.m, n = g.n, k = g.k;
  // Equal A blocks of whole micro-panels (m = 4100 gives two blocks of 2052 rows, not 4096 and 4).
  const int64_t m_blocks = (m + kMC - 1) / kMC;
  const int64_t mc_max = ((m + m_blocks - 1) / m_blocks + kMR - 1) / kMR * kMR;
  const int64_t nc_max = std::min(kNC, (n + kNR - 1) / kNR * kNR);
  // A packed micro-panel is read once per tile of its row. With at most two tiles a row (n <= 2 kNR: the language
  // model's dX = G W with n = 32) packing a row-major A costs about what it saves, so the kernel reads its rows in
  // place; a transposed A is still packed, as reading it in place would cross a stored row per step.
  const bool pack_a_blocks = n > 2 * kNR || g.trans_a == Trans::Yes;
  // Likewise a narrow row-major B (dX = G W again: n = 32, W's rows 128 bytes) is read in place, its full panels at
  // least: a step of a panel is kNR contiguous values of a stored row. Packing it cost a third of that product
  // (1.75 against 1.12 ms for a 30-row block, one thread; docs/benchmarks.md).
  const bool b_in_place = n <= 2 * kNR && g.trans_b == Trans::No;
  std::vector<float>& a_pack = buffer(0);
  std::vector<float>& b_pack = buffer(1);
  if (pack_a_blocks) a_pack.resize(size_t(mc_max * std::min(kKC, k)));
  b_pack.resize(size_t(nc_max * std::min(kKC, k)));
  float* ap = a_pack.data();
  float* bp = b_pack.data();
  const float alpha = float(g.alpha), beta = float(g.beta);
  HG_CHECK(!g.bias || g.beta == 0, "gemm: a bias is added to C's rows with beta = 0 (got beta {})", g.beta);
  const float* bias = static_cast<const float*>(g.bias);

#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t ic = 0; ic < m; ic += mc_max) {
    const int64_t mc = std::min(mc_max, m - ic), a_panels = (mc + kMR - 1) / kMR;
    for (int64_t pc = 0; pc < k; pc += kKC) {
      const int64_t kc = std::min(kKC, k - pc);
      const float block_beta = pc == 0 ? beta : 1.0f;  // later k blocks accumulate onto the first
      if (pack_a_blocks) {  // each thread its share of the panels; the barrier after pack_b covers these too
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        pack_a(a, g.trans_a, g.lda, ic, mc, pc, kc, a_panels * me / team, a_panels * (me + 1) / team, ap);
      }
      for (int64_t jc = 0; jc < n; jc += kNC) {
        const int64_t nc = std::min(kNC, n - jc), b_panels = (nc + kNR - 1) / kNR;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < b_panels; ++q) {
          if (b_in_place && (q + 1) * kNR <= nc) continue;
          pack_b(b, g.trans_b, g.ldb, jc + q * kNR, std::min(kNR, nc - q * kNR), pc, kc, bp + q * kc * kNR);
        }
        // Implicit barrier above: both blocks are packed. Tiles row-panel-major, so that consecutive tiles of
        // one thread reuse its A micro-panel from L1.
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < a_panels; ++r) {
          for (int64_t q = 0; q < b_panels; ++q) {
            const int64_t rows = std::min(kMR, mc - r * kMR);
            const int64_t cols = std::min(kNR, nc - q * kNR);
            float* tile = c + (ic + r * kMR) * g.ldc + jc + q * kNR;
            const float* tile_bias = bias && pc == 0 ? bias + jc + q * kNR : nullptr;  // added once, with beta 0
            const bool b_here = b_in_place && cols == kNR;
            const float* b_panel = b_here ? b + pc * g.ldb + jc + q * kNR : bp + q * kc * kNR;
            const int64_t b_step = b_here ? g.ldb : kNR;
            if (pack_a_blocks) {
              const float* panel = ap + r * kc * kMR;
              micro_kernel(kc, panel, b_panel, b_step, tile, g.ldc, rows, cols, alpha, block_beta, tile_bias);
            } else {
              const InPlaceA panel(a, g.trans_a, g.lda, ic + r * kMR, rows, pc);
              micro_kernel(kc, panel, b_panel, b_step, tile, g.ldc, rows, cols, alpha, block_beta, tile_bias);
            }
          }
        }
        // Implicit barrier: nobody repacks B while others still read it.
      }
    }
  }
}

#else  // neither AVX2 + FMA nor AVX-512: Eigen does every product

bool suits(const GemmArgs&) { return false; }
void run(const GemmArgs&, const float*, const float*, float*, int) {
  HG_CHECK(false, "gemm (cpu): this build has no AVX2 or AVX-512 GEMM; check gemm_blocked::suits first");
}

#endif

}  // namespace halfgrad::gemm_blocked
