// Skinny float32 GEMM for decoding: y[n, M] = x[n, K] @ W[M, K]^T + b, for the 1 to ~24 rows of a decode step or a
// draft tree, against a weight repacked once into column panels.
//
// Why: a decode step multiplies every weight matrix by a handful of rows. That is memory-bound for one row and
// compute-bound from a few rows on, and the BLAS kernels PyTorch calls handle both badly at these shapes (MKL falls
// back to a slow GEMV at one row; MKL and oneDNN reach about 40% of the FMA peak at 8-16 rows). Here each output tile
// of R rows x C panels stays in vector registers for the whole K loop, every weight vector loaded is used by all R
// rows, and every input scalar by all C panels; the panel layout makes each weight stream contiguous.
//
// Layout: W [M, K] -> P [ceil(M / L)][K][L], L = one vector of floats (16 with AVX-512, 8 otherwise), rows past M
// zero. Built with -O3 -march=native; GCC's vector extensions keep the code portable across ISAs.
//
// Threads: output panels are split over PyTorch's intra-op threads with at::parallel_for, a header template that is
// compiled into this file: it must be built with OpenMP (selfspec/runtime/skinny.py does), or it runs serially.
//
// Rounding: each output is a plain K-ordered sum of products in float32 (no reassociation), so results differ from
// BLAS only in summation order, the same class of difference as batched against unbatched matmuls.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;  // 32 vector registers
#else
constexpr int kLanes = 8;  // 16 vector registers (AVX2; also the generic fallback)
#endif

typedef float vec __attribute__((vector_size(kLanes * 4), aligned(kLanes * 4)));
typedef float vec_unaligned __attribute__((vector_size(kLanes * 4), aligned(4)));

// One panel row of weights as a vector of floats: float32 panels as they are, float16 panels (a drafter's weights,
// see `pack`) widened on load, one instruction per vector where the CPU converts half floats (F16C, AVX-512).
inline vec load_weights(const float* p) { return *reinterpret_cast<const vec*>(p); }

inline vec load_weights(const at::Half* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  static_assert(kLanes == 8, "an AVX2 panel is 8 floats");
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// A tile's accumulators to its outputs: + bias, then the residual added last (what `h + linear(x)` computes); the
// last panel's outputs past M are not written.
template <int R, int C>
inline void store_tile(const vec (&acc)[R][C], int64_t panel, float* __restrict out, int64_t M,
                       const float* __restrict bias, const float* __restrict residual) {
  for (int c = 0; c < C; ++c) {
    const int64_t m0 = (panel + c) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, M - m0);
    vec b{};
    if (bias != nullptr)
      for (int i = 0; i < width; ++i) b[i] = bias[m0 + i];
    for (int r = 0; r < R; ++r) {
      vec v = acc[r][c] + b;
      if (width == kLanes) {
        if (residual != nullptr) v = *reinterpret_cast<const vec_unaligned*>(residual + r * M + m0) + v;
        *reinterpret_cast<vec_unaligned*>(out + r * M + m0) = v;
      } else {
        for (int i = 0; i < width; ++i) out[r * M + m0 + i] = residual != nullptr ? residual[r * M + m0 + i] + v[i] : v[i];
      }
    }
  }
}

// One tile: rows [0, R) of x against panels [panel, panel + C), written to out (row stride M). With Prefetch, each
// step also requests the matching line of the next C panels (the next tile's streams, contiguous after these), so
// the next tile's weights arrive while this one computes. They are requested into L2 (locality 2), not L1: a tile's
// panels are C x K x 64 bytes (74-110 KB for SmolLM2), more than an L1, and pulling the next tile into L1 evicted the
// panels the current tile still reads.
// `streams` is panel `panel`'s stream, the next C - 1 panels' following it ([C][K][L]): a slice of a packed weight,
// or panels rebuilt from a grid into a scratch buffer (see `grid_unpacked`).
template <typename W, int R, int C, bool Prefetch>
inline void tile(const float* __restrict x, int64_t K, const W* __restrict first, int64_t panel,
                 float* __restrict out, int64_t M, const float* __restrict bias, const float* __restrict residual) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec{};
  const W* streams[C];
  for (int c = 0; c < C; ++c) streams[c] = first + c * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    vec w[C];
    for (int c = 0; c < C; ++c) w[c] = load_weights(streams[c] + k * kLanes);
    if (Prefetch && (k & (64 / (kLanes * sizeof(W)) - 1)) == 0)  // one request per 64-byte line
      for (int c = 0; c < C; ++c) __builtin_prefetch(streams[c] + C * K * kLanes + k * kLanes, 0, 2);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      for (int c = 0; c < C; ++c) acc[r][c] += xv * w[c];
    }
  }
  store_tile<R, C>(acc, panel, out, M, bias, residual);
}

// A tile of n rows (0 < n <= R) against panels [panel, panel + C), the row count dispatched to its instantiation.
template <typename W, int C, bool Prefetch, int R>
inline void tile_n(int64_t n, const float* x, int64_t K, const W* first, int64_t panel, float* out, int64_t M,
                   const float* bias, const float* residual) {
  if constexpr (R > 0) {
    if (n == R) tile<W, R, C, Prefetch>(x, K, first, panel, out, M, bias, residual);
    else tile_n<W, C, Prefetch, R - 1>(n, x, K, first, panel, out, M, bias, residual);
  }
}

// All n rows against panels [panel, panel + C): blocks of Rows rows, then the remainder, while the panels are in
// cache.
template <typename W, int Rows, int C, bool Prefetch>
void rows(const float* x, int64_t n, int64_t K, const W* first, int64_t panel, float* out, int64_t M,
          const float* bias, const float* residual) {
  int64_t r = 0;
  for (; r + Rows <= n; r += Rows)
    tile<W, Rows, C, Prefetch>(x + r * K, K, first, panel, out + r * M, M, bias, residual ? residual + r * M : nullptr);
  if (n > r)
    tile_n<W, C, Prefetch, Rows - 1>(n - r, x + r * K, K, first, panel, out + r * M, M, bias,
                                  residual ? residual + r * M : nullptr);
}

// Software prefetch always pays from tiles of this many rows on: a tile computes long enough for the next one's
// weights to arrive meanwhile (8 rows: 21 -> 18 ms for SmolLM2's linears on a 2-core AVX2 EPYC; 16: 32.5 -> 28).
constexpr int64_t kPrefetchRows = 5;

// Below it, a tile is bound by memory, and whether the requests pay depends on the CPU's own prefetchers: on a
// 2-core AVX2 EPYC the hardware kept up and the extra requests cost ~10% at 2 rows; on a 2-core Zen 5 EPYC, after a
// step has streamed ~110 MB of other weights, a drafter's 5 MB head ran at ~10 GB/s for its first call and warmed up
// over five (0.54, 0.31, 0.21, 0.14, 0.12 ms) even with its weights already swept into L3, and with the requests at
// 0.28, 0.13, 0.12 ms; SmolLM2's 1-token forward went 11.3 -> 9.2 ms. (The ~10% loss is from an older kernel, and
// may date from when it ran on one core.) So it is on by default and a per-machine choice (`set_small_prefetch`;
// selfspec.runtime.kernels measures both once per machine). Prefetching never changes a result.
std::atomic<int> g_small_prefetch{1};  // 1: tiles of fewer than kPrefetchRows rows prefetch too

// Whether tiles of Rows rows prefetch now: always from kPrefetchRows on, below it as `set_small_prefetch` says.
template <int Rows>
inline bool prefetching() {
  return Rows >= kPrefetchRows || g_small_prefetch.load(std::memory_order_relaxed) == 1;
}

// Panels [begin, end) in groups of C (then one by one), each group against all n rows in tiles of Rows rows.
template <int Rows, int C, bool Prefetch, typename W>
void panels_with(const float* x, int64_t n, int64_t K, const W* packed, float* out, int64_t M, const float* bias,
                 const float* residual, int64_t begin, int64_t end) {
  int64_t p = begin;
  for (; p + C <= end; p += C) rows<W, Rows, C, Prefetch>(x, n, K, packed + p * K * kLanes, p, out, M, bias, residual);
  for (; p < end; ++p) rows<W, Rows, 1, Prefetch>(x, n, K, packed + p * K * kLanes, p, out, M, bias, residual);
}

template <int Rows, int C, typename W>
void panels(const float* x, int64_t n, int64_t K, const W* packed, float* out, int64_t M, const float* bias,
            const float* residual, int64_t begin, int64_t end) {
  if (prefetching<Rows>())
    panels_with<Rows, C, true>(x, n, K, packed, out, M, bias, residual, begin, end);
  else
    panels_with<Rows, C, false>(x, n, K, packed, out, M, bias, residual, begin, end);
}

// The tile shape for n rows. The weights are the traffic: each weight vector loaded is used by every row of its
// tile, so a tile takes as many of the n rows as the registers allow (R x C accumulators + C weights + 1 broadcast),
// and every weight is streamed from memory once when n fits one tile; few rows leave registers for more panels
// (more weight streams in flight). A second row tile over the same panels re-reads them from cache but does not
// overlap that with the memory stream: on a 2-core Xeon (AVX-512) SmolLM2's linears at 12 rows took 28 ms as
// 8 + 4 rows x 3 panels and 21 ms as one 12-row x 2-panel tile, at 16 rows 28.6 -> 24.5 ms (16 x 1).
//
// 15-16 rows have two candidate shapes that win on different CPUs: one 16 x 1 tile (every weight streamed once; the
// faster on the Xeon this dispatch was first tuned on) or a 12 x 2 tile and the rest over the same panels (more
// multiply-adds per load, one more pass from cache; 5% faster whole forwards at 16 tokens on a later 2-core Xeon).
// `set_wide_tiles` picks one; selfspec.runtime.kernels measures both once per machine. The shape never changes a
// result: every output is the same K-ordered sum in any tiling.
std::atomic<int> g_wide_tiles{0};  // 0: 16 x 1; 1: 12 x 2 (+ the rest)

template <typename W>
void dispatch(const float* x, int64_t n, int64_t K, const W* packed, float* out, int64_t M, const float* bias,
              const float* r, int64_t begin, int64_t end) {
#ifdef __AVX512F__
  if (n == 1) panels<1, 8>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n == 2) panels<2, 6>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 4) panels<4, 4>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 8) panels<8, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 12) panels<12, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 14) panels<14, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 16 && g_wide_tiles.load(std::memory_order_relaxed) == 1)
    panels<12, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 16) panels<16, 1>(x, n, K, packed, out, M, bias, r, begin, end);
  else panels<12, 2>(x, n, K, packed, out, M, bias, r, begin, end);
#else
  if (n == 1) panels<1, 6>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n == 2) panels<2, 4>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 4) panels<4, 3>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 6) panels<6, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 12) panels<12, 1>(x, n, K, packed, out, M, bias, r, begin, end);
  else panels<6, 2>(x, n, K, packed, out, M, bias, r, begin, end);
#endif
}


// ---------------------------------------------------------------------------------------------------------------
// Exact grids: weights whose float32 values all lie on a llama.cpp block grid, stored as that grid.
//
// A model loaded from a Q4_1 or Q8_0 GGUF file (the embedded default is one) holds float32 weights that are each
// d * q + m (Q4_1: q in 0..15, d and m float16, one pair per 32 consecutive inputs of an output) or d * q (Q8_0: q
// in -127..127). d * q is exact in float32 (at most 11 + 8 significant bits), so rebuilding a weight from (d, q, m)
// on load gives back its float32 bits exactly, and every product and sum below is the float32 kernel's own, in the
// same order: the outputs are bitwise those of the float32 panels (tested), at 5.3x (Q4_1) or 3.6x (Q8_0) fewer
// bytes streamed. selfspec/runtime/skinny.py finds the grid from the float32 weight alone and checks every weight
// against it before packing; a matrix off the grid keeps float32 panels.
//
// Layout: uint8 [ceil(M / L)][K / 32][block bytes]; a block is 32 inputs of one panel of L outputs:
//   Q4_1: d (L floats), m (L floats), then 16 x L bytes, byte j * L + i = q[2j][i] | q[2j + 1][i] << 4   (24 L bytes)
//   Q8_0: d (L floats), then 32 x L int8, byte k * L + i = q[k][i]                                         (36 L bytes)
//   Q6_K: d of inputs 0-15 (L floats), d of inputs 16-31 (L floats), then 32 x L int8 as Q8_0's              (40 L bytes)
// (the layouts are named by the GGUF type they were made for, and hold others: Q4_1 also Q4_K's 32-input sub-blocks
// with float32 D and M; Q8_0 also Q5_0 and Q4_0; Q6_K is weight = D * q with one D per 16 inputs, any int8 q)

constexpr int64_t kGridBlock = 32;
constexpr int64_t kQ41Bytes = 24 * kLanes, kQ80Bytes = 36 * kLanes, kQ6KBytes = 40 * kLanes;
typedef int qivec __attribute__((vector_size(kLanes * 4)));

// kLanes bytes -> kLanes int32, zero- or sign-extended: one instruction where the ISA has it.
inline qivec widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (qivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (qivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  qivec v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

inline qivec widen_s8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (qivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (qivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  qivec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<int8_t>(p[i]);
  return v;
#endif
}

// A grid format: its block size, and the weights of inputs 2j and 2j + 1 of a block from its scales (d, m).
struct Q41 {
  static constexpr int64_t bytes = kQ41Bytes;
  static constexpr bool has_min = true;
  static inline void pair(const uint8_t* block, int j, vec d, vec m, vec& w0, vec& w1) {
    const qivec q = widen_u8(block + 8 * kLanes + j * kLanes);
    w0 = __builtin_convertvector(q & 15, vec) * d + m;
    w1 = __builtin_convertvector(q >> 4, vec) * d + m;
  }
};

struct Q80 {
  static constexpr int64_t bytes = kQ80Bytes;
  static constexpr bool has_min = false;
  static inline void pair(const uint8_t* block, int j, vec d, vec, vec& w0, vec& w1) {
    w0 = __builtin_convertvector(widen_s8(block + 4 * kLanes + 2 * j * kLanes), vec) * d;
    w1 = __builtin_convertvector(widen_s8(block + 4 * kLanes + (2 * j + 1) * kLanes), vec) * d;
  }
};

// Two scales a block, one per 16 inputs, loaded where Q4_1 keeps its minimum (the `m` argument): inputs 2j and
// 2j + 1 share the first for j < 8 and the second after. One multiply a weight, as Q8_0.
struct Q6K {
  static constexpr int64_t bytes = kQ6KBytes;
  static constexpr bool has_min = true;
  static inline void pair(const uint8_t* block, int j, vec d, vec d_high, vec& w0, vec& w1) {
    const vec scale = j < 8 ? d : d_high;
    w0 = __builtin_convertvector(widen_s8(block + 8 * kLanes + 2 * j * kLanes), vec) * scale;
    w1 = __builtin_convertvector(widen_s8(block + 8 * kLanes + (2 * j + 1) * kLanes), vec) * scale;
  }
};

// As `tile`, over grid panels: the same products, summed in the same K order.
template <typename F, int R, int C, bool Prefetch>
inline void grid_tile(const float* __restrict x, int64_t K, const uint8_t* __restrict packed, int64_t panel,
                      float* __restrict out, int64_t M, const float* __restrict bias, const float* __restrict residual) {
  const int64_t nb = K / kGridBlock, stride = nb * F::bytes;
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec{};
  const uint8_t* streams[C];
  for (int c = 0; c < C; ++c) streams[c] = packed + (panel + c) * stride;
  for (int64_t b = 0; b < nb; ++b) {
    vec d[C], m[C];
    for (int c = 0; c < C; ++c) {
      d[c] = load_weights(reinterpret_cast<const float*>(streams[c] + b * F::bytes));
      m[c] = F::has_min ? load_weights(reinterpret_cast<const float*>(streams[c] + b * F::bytes + kLanes * 4)) : vec{};
    }
    if (Prefetch)
      for (int c = 0; c < C; ++c)
        for (int64_t line = 0; line < F::bytes; line += 64)
          __builtin_prefetch(streams[c] + C * stride + b * F::bytes + line, 0, 2);
    const float* xb = x + b * kGridBlock;
    for (int j = 0; j < kGridBlock / 2; ++j) {
      vec w0[C], w1[C];
      for (int c = 0; c < C; ++c) F::pair(streams[c] + b * F::bytes, j, d[c], m[c], w0[c], w1[c]);
      for (int r = 0; r < R; ++r) {
        const float xv = xb[r * K + 2 * j];
        for (int c = 0; c < C; ++c) acc[r][c] += xv * w0[c];
      }
      for (int r = 0; r < R; ++r) {
        const float xv = xb[r * K + 2 * j + 1];
        for (int c = 0; c < C; ++c) acc[r][c] += xv * w1[c];
      }
    }
  }
  store_tile<R, C>(acc, panel, out, M, bias, residual);
}

template <typename F, int C, bool Prefetch, int R>
inline void grid_tile_n(int64_t n, const float* x, int64_t K, const uint8_t* packed, int64_t panel, float* out,
                        int64_t M, const float* bias, const float* residual) {
  if constexpr (R > 0) {
    if (n == R) grid_tile<F, R, C, Prefetch>(x, K, packed, panel, out, M, bias, residual);
    else grid_tile_n<F, C, Prefetch, R - 1>(n, x, K, packed, panel, out, M, bias, residual);
  }
}

template <typename F, int Rows, int C, bool prefetch>
void grid_panels_with(const float* x, int64_t n, int64_t K, const uint8_t* packed, float* out, int64_t M,
                      const float* bias, const float* residual, int64_t begin, int64_t end) {
  auto group = [&](int64_t p, auto width) {
    constexpr int W = decltype(width)::value;
    int64_t r = 0;
    for (; r + Rows <= n; r += Rows)
      grid_tile<F, Rows, W, prefetch>(x + r * K, K, packed, p, out + r * M, M, bias, residual ? residual + r * M : nullptr);
    if (n > r)
      grid_tile_n<F, W, prefetch, Rows - 1>(n - r, x + r * K, K, packed, p, out + r * M, M, bias,
                                          residual ? residual + r * M : nullptr);
  };
  int64_t p = begin;
  for (; p + C <= end; p += C) group(p, std::integral_constant<int, C>{});
  for (; p < end; ++p) group(p, std::integral_constant<int, 1>{});
}

template <typename F, int Rows, int C>
void grid_panels(const float* x, int64_t n, int64_t K, const uint8_t* packed, float* out, int64_t M,
                 const float* bias, const float* residual, int64_t begin, int64_t end) {
  if (prefetching<Rows>())
    grid_panels_with<F, Rows, C, true>(x, n, K, packed, out, M, bias, residual, begin, end);
  else
    grid_panels_with<F, Rows, C, false>(x, n, K, packed, out, M, bias, residual, begin, end);
}

// Rows past one grid tile against grid panels, rebuilt once. A grid tile rebuilds each weight vector for its own
// rows, so a second row tile over the same panels pays the rebuild again: with AVX2's 16 registers a grid tile holds
// 8 rows, and on a 2-core Zen 3 a 9-row forward of SmolLM2 cost 1.4x an 8-row one (linears 15.1 -> 24.0 ms). Here
// each group of C panels is rebuilt once into a float32 scratch laid out as float32 panels ([C][K][L], a few dozen
// KB, in L1/L2), and the float32 tiles run all n rows over it. The scratch holds the weights the grid tile rebuilds
// (the same F::pair), and the float32 tile sums the same products in the same K order: the outputs are bitwise the
// grid tile's (and the float32 panels').
template <typename F, int Rows, int C>
void grid_unpacked(const float* x, int64_t n, int64_t K, const uint8_t* packed, float* out, int64_t M,
                   const float* bias, const float* residual, int64_t begin, int64_t end) {
  thread_local std::vector<vec> scratch;  // vec's alignment; each thread rebuilds its own panels
  if (static_cast<int64_t>(scratch.size()) < C * K) scratch.resize(C * K);
  const int64_t nb = K / kGridBlock, stride = nb * F::bytes;
  const auto rebuild = [&](int64_t p, int width) {
    for (int c = 0; c < width; ++c) {
      vec* dst = scratch.data() + c * K;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = packed + (p + c) * stride + b * F::bytes;
        const vec d = load_weights(reinterpret_cast<const float*>(block));
        const vec m = F::has_min ? load_weights(reinterpret_cast<const float*>(block + kLanes * 4)) : vec{};
        for (int j = 0; j < kGridBlock / 2; ++j)
          F::pair(block, j, d, m, dst[b * kGridBlock + 2 * j], dst[b * kGridBlock + 2 * j + 1]);
      }
    }
  };
  const float* weights = reinterpret_cast<const float*>(scratch.data());
  int64_t p = begin;
  for (; p + C <= end; p += C) {
    rebuild(p, C);
    rows<float, Rows, C, false>(x, n, K, weights, p, out, M, bias, residual);
  }
  for (; p < end; ++p) {
    rebuild(p, 1);
    rows<float, Rows, 1, false>(x, n, K, weights, p, out, M, bias, residual);
  }
}

// Tile shapes for grid panels. A grid streams 3.6-6.4x fewer bytes than float32 panels, so from a few rows on a
// call is bound by the multiply-adds, not by memory: rebuilding a weight vector costs a few instructions, paid once
// per tile for all its rows, and a second row tile over the same panels re-reads a few KB from L1 (a panel's grid
// for K = 576 is 7 KB). Measured on a 2-core Xeon (AVX-512; SmolLM2's MLP, attention and LM-head shapes as Q4_1
// and Q8_0 grids, `scripts/kernel_shapes.py --grid`): 12 x 2 beat 16 x 1 by 8-12% at 9-12 rows, and 8 x 2 row
// passes beat 16 x 1 by 2-6% at 15-24 rows. 3-4 rows take the 8 x 2 tile too (with its software prefetch): as 4 x 3
// tiles without it, a whole 4-token forward of SmolLM2 cost more than a 5-token one (11.9 against 11.1-12.3 ms;
// `scripts/kernel_ab.py --tokens 1,3,4,5`: 3 tokens 11.5 -> 11.1 ms, 4 tokens 11.9 -> 11.6, same Xeon).
// AVX2 (16 registers) holds one 8-row grid tile; past 8 rows the panels are rebuilt once and the float32 6 x 2 tile
// runs over them (`grid_unpacked`). On a 2-core Zen 3, SmolLM2's linears on their grids (`scripts/kernel_ab.py
// --linears --grids`, 30 interleaved rounds): 9 rows 28.0 -> 23.0 ms, 12 rows 28.4 -> 25.3, 16 rows alike (33.8,
// 34.4: two full 8-row tiles waste no rebuild). A 6 x 2 grid tile in registers spilled (slower than 8 x 1 at 6-9 rows).
template <typename F>
void grid_dispatch(const float* x, int64_t n, int64_t K, const uint8_t* packed, float* out, int64_t M,
                   const float* bias, const float* r, int64_t begin, int64_t end) {
#ifdef __AVX512F__
  if (n == 1) grid_panels<F, 1, 4>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n == 2) grid_panels<F, 2, 4>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 8) grid_panels<F, 8, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 12) grid_panels<F, 12, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else grid_panels<F, 8, 2>(x, n, K, packed, out, M, bias, r, begin, end);
#else
  if (n == 1) grid_panels<F, 1, 3>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 4) grid_panels<F, 4, 2>(x, n, K, packed, out, M, bias, r, begin, end);
  else if (n <= 8) grid_panels<F, 8, 1>(x, n, K, packed, out, M, bias, r, begin, end);
  else grid_unpacked<F, 6, 2>(x, n, K, packed, out, M, bias, r, begin, end);
#endif
}

}  // namespace

int64_t lanes() { return kLanes; }

// Whether tiles of fewer than kPrefetchRows rows software-prefetch the next tile's weights (see `panels`): 0 or 1;
// returns the setting in effect.
int64_t set_small_prefetch(int64_t on) {
  TORCH_CHECK(on == 0 || on == 1, "skinny set_small_prefetch: 0 (off) or 1 (on), got ", on);
  g_small_prefetch.store(static_cast<int>(on));
  return g_small_prefetch.load();
}

// The tile shape for 15-16 rows (see `dispatch`): 0 = 16 x 1, 1 = 12 x 2; a no-op without AVX-512 (returns the
// plan in effect, always 0 there).
int64_t set_wide_tiles(int64_t plan) {
  TORCH_CHECK(plan == 0 || plan == 1, "skinny set_wide_tiles: plan 0 (16 x 1) or 1 (12 x 2), got ", plan);
#ifdef __AVX512F__
  g_wide_tiles.store(static_cast<int>(plan));
#endif
  return g_wide_tiles.load();
}

// How many threads a parallel region of this module really runs on: at::parallel_for is compiled into this file, so
// without OpenMP at build time it silently runs serially, whatever torch.set_num_threads says.
int64_t parallel_threads() {
  std::atomic<int64_t> seen{0};
  const int64_t slots = 64;
  std::vector<std::atomic<int>> used(slots);
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    const int64_t id = at::get_thread_num();
    if (id < slots && used[id].exchange(1) == 0) seen.fetch_add(1);
  });
  return seen.load();
}

// half: the panels in float16 (rounded to nearest), half the bytes a call streams; for drafters, whose outputs only
// propose tokens (verification decides every one), never for the model being verified.
torch::Tensor pack(const torch::Tensor& weight, bool half) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "skinny_linear.pack: expected a 2-D float32 CPU weight, got ", weight.sizes(), " ", weight.dtype());
  const int64_t M = weight.size(0), K = weight.size(1), blocks = (M + kLanes - 1) / kLanes;
  auto padded = torch::zeros({blocks * kLanes, K}, weight.options().dtype(half ? torch::kHalf : torch::kFloat32));
  padded.narrow(0, 0, M).copy_(weight);
  // [blocks, L, K] -> [blocks, K, L]
  return padded.view({blocks, kLanes, K}).transpose(1, 2).contiguous();
}

int64_t grid_block_bytes(const std::string& kind) {
  TORCH_CHECK(kind == "q4_1" || kind == "q8_0" || kind == "q6_k", "skinny grid: kind q4_1, q8_0 or q6_k, got ", kind);
  return kind == "q4_1" ? kQ41Bytes : kind == "q8_0" ? kQ80Bytes : kQ6KBytes;
}

// rows [n, K] @ W^T (+ bias) (+ residual [n, M], added last: residual + (x W^T + b), what `h + linear(x)` computes)
torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32 && input.device().is_cpu(),
              "skinny_linear.linear: expected 2-D float32 CPU rows, got ", input.sizes(), " ", input.dtype());
  const bool grid = packed.scalar_type() == torch::kByte;  // an exact grid (see "Exact grids"), told by block size
  if (grid) {
    const int64_t K = input.size(1);
    TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && K % kGridBlock == 0 && packed.size(1) * kGridBlock == K &&
                    (packed.size(2) == kQ41Bytes || packed.size(2) == kQ80Bytes || packed.size(2) == kQ6KBytes) &&
                    packed.size(0) * kLanes >= out_features,
                "skinny_linear.linear: grid-packed weight ", packed.sizes(), " does not fit rows ", input.sizes(),
                " and ", out_features, " outputs");
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.size(1) == input.size(1) &&
                    packed.size(0) * kLanes >= out_features && packed.is_contiguous() &&
                    (packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kHalf),
                "skinny_linear.linear: packed weight ", packed.sizes(), " does not fit rows ", input.sizes(),
                " and ", out_features, " outputs");
  }
  const auto x = input.contiguous();
  const int64_t n = x.size(0), K = x.size(1), blocks = packed.size(0), M = out_features;
  auto out = torch::empty({n, M}, x.options());
  if (n == 0) return out;
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b->numel() == M && b->scalar_type() == torch::kFloat32, "skinny_linear.linear: bias of ",
                b->numel(), " elements for ", M, " outputs");
  }
  torch::Tensor res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    TORCH_CHECK(res.scalar_type() == torch::kFloat32 && res.device().is_cpu() && res.numel() == n * M,
                "skinny_linear.linear: residual of ", res.sizes(), " for ", n, " x ", M, " outputs");
    res = res.contiguous();
  }
  const float* xp = x.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(8, blocks / (4 * at::get_num_threads()));
  if (grid && packed.size(2) == kQ41Bytes) {
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, grain,
                     [&](int64_t begin, int64_t end) { grid_dispatch<Q41>(xp, n, K, pp, op, M, bp, rp, begin, end); });
  } else if (grid && packed.size(2) == kQ6KBytes) {
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, grain,
                     [&](int64_t begin, int64_t end) { grid_dispatch<Q6K>(xp, n, K, pp, op, M, bp, rp, begin, end); });
  } else if (grid) {
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, grain,
                     [&](int64_t begin, int64_t end) { grid_dispatch<Q80>(xp, n, K, pp, op, M, bp, rp, begin, end); });
  } else if (packed.scalar_type() == torch::kHalf) {
    const at::Half* pp = packed.data_ptr<at::Half>();
    at::parallel_for(0, blocks, grain,
                     [&](int64_t begin, int64_t end) { dispatch(xp, n, K, pp, op, M, bp, rp, begin, end); });
  } else {
    const float* pp = packed.data_ptr<float>();
    at::parallel_for(0, blocks, grain,
                     [&](int64_t begin, int64_t end) { dispatch(xp, n, K, pp, op, M, bp, rp, begin, end); });
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Attention for a few queries: the 2 to ~32 tokens of a verified tree (or a padded batch row) over the KV cache,
// grouped-query heads read as they are.
//
// Why: PyTorch's CPU flash attention runs each (head, query block) as small BLAS calls; at SmolLM2's shapes (9 query
// heads, 3 KV heads, 64 dims, 8 queries over 264 keys) that is ~64 us a layer on a 2-core Zen 5 and grows about
// linearly with the queries (~7 us each), which is most of what a tree costs above one token besides the linears.
// Here one task takes a KV head's keys and values through L1/L2 once for a block of its query rows (every query of
// every head sharing that KV head): scores for all the rows at once (the queries transposed, key dims broadcast), a
// softmax with a vectorised exp, then the probability-weighted sum of values as a small GEMM whose accumulators stay
// in registers.
//
// Rounding: float32 throughout; sums in a different order from PyTorch's kernels, and exp by a degree-6 polynomial
// after exact range reduction (Cephes' expf, ~1 ulp): the same class of difference as one BLAS against another.
// The exp's rounding trick (adding 1.5 * 2^23) needs IEEE float semantics: never build this file with -ffast-math.

namespace {

constexpr int kHalf = kLanes / 2;
typedef float half_vec __attribute__((vector_size(kHalf * 4)));
typedef int ivec __attribute__((vector_size(kLanes * 4)));

// e^x lane by lane; lanes below -87 (masked keys, or weights below float's normal range) give exactly 0.
inline vec vexp(vec x) {
  const vec lowest = vec{} - 87.0f;
  const ivec dead = x < lowest;
  x = dead ? lowest : x;
  const vec shifter = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vec n = x * 1.44269504088896341f + shifter;
  n = n - shifter;
  vec r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec y = p * r * r + r + 1.0f;
  ivec e = __builtin_convertvector(n, ivec) + 127;
  e = e << 23;
  vec two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  const vec result = y * two_n;
  return dead ? vec{} : result;
}

struct AttentionArgs {
  const float* q; int64_t q_b, q_h, q_i;  // [B, H, n, D], last dim contiguous
  const float* k; int64_t k_b, k_h, k_j;  // [B, KV, L, D]
  const float* v; int64_t v_b, v_h, v_j;
  const void* mask; int mask_kind; int64_t m_b, m_i, m_j;  // [B or 1, 1, n, L]: 0 none, 1 bool (true: attend), 2 additive
  float* out;  // [B, n, H, D] contiguous
  int64_t B, H, KV, n, L, D;
  float scale;
};

// Rows [row0, row0 + R) of P @ V (P: S[t * W + x], already exp'd; scaled by inv_row[x]) into the output: each
// row's sum over keys t in order, as one multiply-add per key.
template <int DV, int R>
inline void pv_block(const AttentionArgs& a, int64_t b, int64_t g, int64_t row0, const float* S, int64_t W, int64_t L,
                     const float* values, const float* inv_row, int64_t d0) {
  const int64_t group = a.H / a.KV, n = a.n;
  vec acc[R][DV];
  for (int x = 0; x < R; ++x)
    for (int d = 0; d < DV; ++d) acc[x][d] = vec{};
  for (int64_t t = 0; t < L; ++t) {
    const float* vt = values + t * a.v_j + d0 * kLanes;
    vec vv[DV];
    for (int d = 0; d < DV; ++d) vv[d] = *reinterpret_cast<const vec_unaligned*>(vt + d * kLanes);
    const float* pt = S + t * W;
    for (int x = 0; x < R; ++x) {
      const float p = pt[x];
      for (int d = 0; d < DV; ++d) acc[x][d] += p * vv[d];
    }
  }
  for (int x = 0; x < R; ++x) {
    const int64_t row = row0 + x, i = row % n, h = g * group + row / n;
    float* o = a.out + ((b * n + i) * a.H + h) * a.D + d0 * kLanes;
    const float scale = inv_row[x];
    for (int d = 0; d < DV; ++d) {
      const vec y = acc[x][d] * scale;
      std::memcpy(o + d * kLanes, &y, sizeof(vec));
    }
  }
}

// pv_block for rb (1 <= rb <= R) rows, the count dispatched to its instantiation.
template <int DV, int R>
inline void pv_rows(int64_t rb, const AttentionArgs& a, int64_t b, int64_t g, int64_t row0, const float* S, int64_t W,
                    int64_t L, const float* values, const float* inv_row, int64_t d0) {
  if constexpr (R > 0) {
    if (rb == R) pv_block<DV, R>(a, b, g, row0, S, W, L, values, inv_row, d0);
    else pv_rows<DV, R - 1>(rb, a, b, g, row0, S, W, L, values, inv_row, d0);
  }
}

// Rows [r0, r0 + RV * kLanes) (fewer at the end) of KV head g of batch row b; row r is query i = r % n of head
// g * group + r / n. Scores are computed for all the block's rows at once, one vector of rows per key and dim
// (the query block transposed and the key dims broadcast: no horizontal sums), kept as S[key][row].
template <int DV, int RV>
void attention_block(const AttentionArgs& a, int64_t b, int64_t g, int64_t r0, int64_t r1, float* qt, float* S) {
  constexpr int64_t W = RV * kLanes;  // rows a block holds
  const int64_t group = a.H / a.KV, L = a.L, n = a.n, D = a.D, rows = r1 - r0;
  const float* keys = a.k + b * a.k_b + g * a.k_h;
  const float* values = a.v + b * a.v_b + g * a.v_h;
  // qt[d][row] = scale * q[row][d], rows past the block zero
  for (int64_t d = 0; d < D; ++d)
    for (int64_t x = 0; x < W; ++x) qt[d * W + x] = 0.0f;
  for (int64_t x = 0; x < rows; ++x) {
    const int64_t r = r0 + x, i = r % n, h = g * group + r / n;
    const float* qr = a.q + b * a.q_b + h * a.q_h + i * a.q_i;
    for (int64_t d = 0; d < D; ++d) qt[d * W + x] = qr[d] * a.scale;
  }
  // S[j][rows] = sum_d qt[d][rows] * k[j][d], KG keys at a time: independent accumulator chains, enough of them to
  // cover the multiply-add latency on two pipes where the registers allow (8 with one vector of rows, else 4; the
  // grouping of keys leaves every score's own sum, over d in order, as it is)
  constexpr int KG = RV == 1 ? 8 : 4;
  int64_t j = 0;
  for (; j + KG <= L; j += KG) {
    vec acc[KG][RV];
    for (int t = 0; t < KG; ++t)
      for (int c = 0; c < RV; ++c) acc[t][c] = vec{};
    const float* k0 = keys + j * a.k_j;
    for (int64_t d = 0; d < D; ++d) {
      for (int c = 0; c < RV; ++c) {
        vec q;
        std::memcpy(&q, qt + d * W + c * kLanes, sizeof q);
        for (int t = 0; t < KG; ++t) acc[t][c] += q * k0[t * a.k_j + d];
      }
    }
    for (int t = 0; t < KG; ++t)
      for (int c = 0; c < RV; ++c) std::memcpy(S + (j + t) * W + c * kLanes, &acc[t][c], sizeof(vec));
  }
  for (; j < L; ++j) {
    vec acc[RV];
    for (int c = 0; c < RV; ++c) acc[c] = vec{};
    const float* kj = keys + j * a.k_j;
    for (int64_t d = 0; d < D; ++d)
      for (int c = 0; c < RV; ++c) {
        vec q;
        std::memcpy(&q, qt + d * W + c * kLanes, sizeof q);
        acc[c] += q * kj[d];
      }
    for (int c = 0; c < RV; ++c) std::memcpy(S + j * W + c * kLanes, &acc[c], sizeof(vec));
  }
  // the mask: each row's query mask is scanned and only entries that change a score are applied (a tree mask hides
  // a few keys; a prefix every query sees costs one comparison a key)
  if (a.mask_kind != 0) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t x = 0; x < rows; ++x) {
        if ((r0 + x) % n != i) continue;
        if (a.mask_kind == 1) {
          const bool* m = static_cast<const bool*>(a.mask) + b * a.m_b + i * a.m_i;
          for (int64_t t = 0; t < L; ++t)
            if (!m[t * a.m_j]) S[t * W + x] = -INFINITY;
        } else {
          const float* m = static_cast<const float*>(a.mask) + b * a.m_b + i * a.m_i;
          for (int64_t t = 0; t < L; ++t) {
            const float add = m[t * a.m_j];
            if (add != 0.0f) S[t * W + x] += add;
          }
        }
      }
    }
  }
  // softmax over keys, every row of the block at once
  vec top[RV], total[RV], inv[RV];
  for (int c = 0; c < RV; ++c) {
    top[c] = vec{} - INFINITY;
    total[c] = vec{};
  }
  for (int64_t t = 0; t < L; ++t)
    for (int c = 0; c < RV; ++c) {
      vec x;
      std::memcpy(&x, S + t * W + c * kLanes, sizeof x);
      top[c] = x > top[c] ? x : top[c];
    }
  for (int c = 0; c < RV; ++c)  // padded rows: all scores 0, any finite top will do
    top[c] = top[c] == (vec{} - INFINITY) ? vec{} : top[c];
  for (int64_t t = 0; t < L; ++t)
    for (int c = 0; c < RV; ++c) {
      vec x;
      std::memcpy(&x, S + t * W + c * kLanes, sizeof x);
      x = vexp(x - top[c]);
      total[c] += x;
      std::memcpy(S + t * W + c * kLanes, &x, sizeof x);
    }
  for (int c = 0; c < RV; ++c) {  // a row that sees no key gets zeros, as PyTorch's SDPA gives
    const vec one_over = 1.0f / total[c];
    inv[c] = total[c] > 0.0f ? one_over : vec{};
  }
  float inv_row[W];
  std::memcpy(inv_row, inv, sizeof inv_row);
  // out rows = P @ V, RB rows at a time with their accumulators in registers (the last block's row count a
  // template argument too: a run-time bound spilled the accumulators to the stack, and copying each value row
  // through a stack array stalled every load on store forwarding: 53 -> 32 us a layer for 9 queries, 19 -> 14 for
  // one, on a 2-core Xeon; its AVX2 build, with blocks sized to its 16 registers, 59 -> 51 us at 9; the same sums in
  // the same order, bitwise the old outputs)
  // rows a block holds: as many as leave registers for the value row (RB x DV accumulators + DV values + 1)
  // A head wider than 16 vectors (Gemma 3's 256 dims on AVX2: 32 vectors, twice the registers there are) is
  // summed DC vectors of value columns at a time; every output's sum over the keys runs in the same order whatever
  // the split, so the chunks change which registers hold it, not its bits.
  constexpr int kRegisters = kLanes == 16 ? 32 : 16;
  constexpr int DC = DV <= 16 ? DV : kRegisters / 4;
  static_assert(DV % DC == 0, "value columns split into whole chunks");
  constexpr int RB = std::max(1, (kRegisters - DC - 1) / DC);
  for (int64_t d0 = 0; d0 < DV; d0 += DC)
    for (int64_t r = 0; r < rows; r += RB)
      pv_rows<DC, RB>(std::min<int64_t>(RB, rows - r), a, b, g, r0 + r, S + r, W, L, values, inv_row + r, d0);
}

template <int DV>
void attention_all(const AttentionArgs& a) {
  constexpr int RV = kLanes == 16 ? 1 : 2;  // a block holds 16 rows
  constexpr int64_t W = RV * kLanes;
  const int64_t rows = a.H / a.KV * a.n;
  const int64_t blocks = (rows + W - 1) / W, tasks = a.B * a.KV * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt(a.D * W), S(a.L * W);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (a.KV * blocks), g = t / blocks % a.KV, r0 = t % blocks * W;
      const int64_t r1 = std::min(rows, r0 + W);
      if (r1 - r0 <= kLanes)
        attention_block<DV, 1>(a, b, g, r0, r1, qt.data(), S.data());  // W' = kLanes: buffers are large enough
      else
        attention_block<DV, RV>(a, b, g, r0, r1, qt.data(), S.data());
    }
  });
}

}  // namespace

bool attention_supported(int64_t head_dim) {
  const int64_t dv = head_dim / kLanes;
  return head_dim % kLanes == 0 && (dv == 4 || dv == 8 || dv == 16 || dv == 32);
}

// query [B, H, n, D], key/value [B, KV, L, D] (any strides but a contiguous last dim), mask None or [B or 1, 1, n, L]
// bool (true: attend) or float (added) -> [B, n, H, D]
torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "skinny attention: 4-D query/key/value");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat32 &&
                  value.scalar_type() == torch::kFloat32 && query.device().is_cpu() && key.device().is_cpu() &&
                  value.device().is_cpu(),
              "skinny attention: float32 CPU tensors");
  const int64_t B = query.size(0), H = query.size(1), n = query.size(2), D = query.size(3);
  const int64_t KV = key.size(1), L = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && value.size(1) == KV && value.size(2) == L &&
                  key.size(3) == D && value.size(3) == D && KV > 0 && H % KV == 0,
              "skinny attention: shapes ", query.sizes(), " ", key.sizes(), " ", value.sizes());
  TORCH_CHECK(attention_supported(D), "skinny attention: head dim ", D, " unsupported");
  TORCH_CHECK(L > 0, "skinny attention: no keys");
  const auto q = query.stride(3) == 1 ? query : query.contiguous();
  const auto k = key.stride(3) == 1 ? key : key.contiguous();
  const auto v = value.stride(3) == 1 ? value : value.contiguous();
  auto out = torch::empty({B, n, H, D}, query.options());
  AttentionArgs a{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
                  k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2),
                  v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2),
                  nullptr, 0, 0, 0, 0, out.data_ptr<float>(), B, H, KV, n, L, D, static_cast<float>(scale)};
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) && m.size(1) == 1 && m.size(2) == n &&
                    m.size(3) == L,
                "skinny attention: mask ", m.sizes(), " for ", n, " queries over ", L, " keys");
    TORCH_CHECK((m.scalar_type() == torch::kBool || m.scalar_type() == torch::kFloat32) && m.device().is_cpu(),
                "skinny attention: bool or float32 CPU mask");
    a.mask = m.data_ptr();
    a.mask_kind = m.scalar_type() == torch::kBool ? 1 : 2;
    a.m_b = m.size(0) == 1 ? 0 : m.stride(0);
    a.m_i = m.stride(2);
    a.m_j = m.stride(3);
  }
  switch (D / kLanes) {
    case 4: attention_all<4>(a); break;
    case 8: attention_all<8>(a); break;
    case 16: attention_all<16>(a); break;
    default: attention_all<32>(a); break;
  }
  return out;
}


// ---------------------------------------------------------------------------------------------------------------
// The small operations between a decoder layer's kernels, each one pass over the rows: RMSNorm, rotary embedding
// (rotate-half, in place) and the SwiGLU product. Through PyTorch they are ~25 tensor ops a layer (RMSNorm alone is
// seven on the CPU), 2-5 us each at decode sizes, ~4 ms of a 15 ms SmolLM2 step on a 2-core CPU. Each row's result
// depends on that row alone, computed the same way whatever the row count, so a tree's rows get exactly what a
// one-token step gets (the property lossless verification needs); against PyTorch's ops they differ in summation
// order and exp's rounding only.

namespace {

inline float hsum(vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(),
              "skinny ", what, ": expected contiguous 2-D float32 CPU rows, got ", t.sizes(), " ", t.dtype());
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) for each row of x [rows, H], as the Llama family's RMSNorm.
torch::Tensor rms_norm(const torch::Tensor& input, const torch::Tensor& weight, double eps) {
  check_rows(input, "rms_norm");
  const int64_t rows = input.size(0), H = input.size(1);
  TORCH_CHECK(weight.numel() == H && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "skinny rms_norm: weight of ", weight.sizes(), " for rows of ", H);
  auto out = torch::empty_like(input);
  const float* x = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r, x += H, o += H) {
    vec acc{};
    int64_t i = 0;
    for (; i + kLanes <= H; i += kLanes) {
      const vec v = *reinterpret_cast<const vec_unaligned*>(x + i);
      acc += v * v;
    }
    float squares = hsum(acc);
    for (; i < H; ++i) squares += x[i] * x[i];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(H) + e);
    for (i = 0; i + kLanes <= H; i += kLanes)
      *reinterpret_cast<vec_unaligned*>(o + i) =
          *reinterpret_cast<const vec_unaligned*>(w + i) * (*reinterpret_cast<const vec_unaligned*>(x + i) * scale);
    for (; i < H; ++i) o[i] = w[i] * (x[i] * scale);
  }
  return out;
}

// In place, x [rows, heads * D] (each row one token's heads): x * cos + rotate_half(x) * sin per head, with cos /
// sin [rows or n, D] (n rows: one position per token of a row of n tokens, shared by every batch row).
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim) {
  check_rows(x, "rope");
  check_rows(cos, "rope (cos)");
  check_rows(sin, "rope (sin)");
  const int64_t rows = x.size(0), width = x.size(1), D = head_dim, half = D / 2;
  TORCH_CHECK(D > 0 && D % 2 == 0 && width % D == 0 && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                  rows % cos.size(0) == 0,
              "skinny rope: rows ", x.sizes(), " with cos ", cos.sizes(), " and head dim ", D);
  const int64_t positions = cos.size(0);
  float* p = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cp + (r % positions) * D;
    const float* s = sp + (r % positions) * D;
    for (int64_t h = 0; h < width; h += D) {
      float* q = p + r * width + h;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vec a = *reinterpret_cast<const vec_unaligned*>(q + i);
        const vec b = *reinterpret_cast<const vec_unaligned*>(q + half + i);
        *reinterpret_cast<vec_unaligned*>(q + i) = a * *reinterpret_cast<const vec_unaligned*>(c + i) +
                                                   (vec{} - b) * *reinterpret_cast<const vec_unaligned*>(s + i);
        *reinterpret_cast<vec_unaligned*>(q + half + i) =
            b * *reinterpret_cast<const vec_unaligned*>(c + half + i) +
            a * *reinterpret_cast<const vec_unaligned*>(s + half + i);
      }
      for (; i < half; ++i) {
        const float a = q[i], b = q[half + i];
        q[i] = a * c[i] + (-b) * s[i];
        q[half + i] = b * c[half + i] + a * s[half + i];
      }
    }
  }
}

// In place: gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, element by element ([rows, I] both).
void silu_mul_(torch::Tensor& gate, const torch::Tensor& up) {
  check_rows(gate, "silu_mul (gate)");
  check_rows(up, "silu_mul (up)");
  TORCH_CHECK(gate.sizes() == up.sizes(), "skinny silu_mul: gate ", gate.sizes(), " and up ", up.sizes());
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t count = gate.numel();
  const vec top = vec{} + 88.0f;  // exp(88) is finite: 1 + exp(-g) never overflows to inf
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const vec x = *reinterpret_cast<const vec_unaligned*>(g + i);
    vec minus = vec{} - x;
    minus = minus > top ? top : minus;
    *reinterpret_cast<vec_unaligned*>(g + i) = x / (1.0f + vexp(minus)) * *reinterpret_cast<const vec_unaligned*>(u + i);
  }
  if (i < count) {  // the tail through the same vector code, so every element rounds alike
    vec x{}, v{};
    for (int64_t j = i; j < count; ++j) x[j - i] = g[j], v[j - i] = u[j];
    vec minus = vec{} - x;
    minus = minus > top ? top : minus;
    const vec y = x / (1.0f + vexp(minus)) * v;
    for (int64_t j = i; j < count; ++j) g[j] = y[j - i];
  }
}

// ---------------------------------------------------------------------------------------------------------------
// One pre-norm decoder layer (Llama family) as one call: the lean layer's twelve extension calls (RMSNorm, seven
// linears, rotary twice, attention, SwiGLU) and the Python between them (~150 us a layer on a 2-core Xeon, 4.5 ms
// of a 26 ms SmolLM2 step), with the new keys and values written into the cache's buffers. Each step is the same
// function the lean layer calls, on the same inputs in the same order, so the result is bitwise the lean layer's.
//
// hidden [rows = B * n, hidden] (the residual stream); packed / biases / out_features: q, k, v, o, gate, up, down;
// cos / sin [rows or n, head_dim]; k_buffer / v_buffer [B, KV, capacity, head_dim] holding `length` entries, with
// room for n more (the caller reserves it); mask as `attention` takes it; normed: the attention input [rows, any
// width] where it is not RMSNorm(hidden) (then norm1 is not read). Returns the layer's output [B, n, hidden].

torch::Tensor decoder_layer(const torch::Tensor& hidden, const torch::Tensor& norm1, double eps1,
                            const std::vector<torch::Tensor>& packed,
                            const std::vector<c10::optional<torch::Tensor>>& biases,
                            const std::vector<int64_t>& out_features, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t head_dim, const torch::Tensor& k_buffer,
                            const torch::Tensor& v_buffer, int64_t length, const c10::optional<torch::Tensor>& mask,
                            double scale, const torch::Tensor& norm2, double eps2,
                            const c10::optional<torch::Tensor>& normed) {
  TORCH_CHECK(packed.size() == 7 && biases.size() == 7 && out_features.size() == 7,
              "skinny decoder_layer: seven linears (q, k, v, o, gate, up, down)");
  check_rows(hidden, "decoder_layer");
  TORCH_CHECK(k_buffer.dim() == 4 && v_buffer.dim() == 4 && k_buffer.sizes() == v_buffer.sizes() &&
                  k_buffer.size(3) == head_dim && k_buffer.stride(3) == 1 && v_buffer.stride(3) == 1 &&
                  hidden.size(0) % k_buffer.size(0) == 0,
              "skinny decoder_layer: key/value buffers ", k_buffer.sizes(), " ", v_buffer.sizes(), " for rows ",
              hidden.sizes());
  const int64_t B = k_buffer.size(0), KV = k_buffer.size(1), n = hidden.size(0) / B, D = head_dim;
  TORCH_CHECK(length >= 0 && length + n <= k_buffer.size(2), "skinny decoder_layer: ", length, " + ", n,
              " entries in buffers of ", k_buffer.size(2));
  torch::Tensor x;
  if (normed.has_value() && normed->defined()) {  // an attention input of its own (a feature drafter's two halves)
    check_rows(*normed, "decoder_layer (normed input)");
    TORCH_CHECK(normed->size(0) == hidden.size(0), "skinny decoder_layer: ", normed->size(0), " normed rows for ",
                hidden.size(0), " hidden rows");
    x = *normed;
  } else {
    x = rms_norm(hidden, norm1, eps1);
  }
  auto q = linear(x, packed[0], out_features[0], biases[0], c10::nullopt);
  rope_(q, cos, sin, D);
  auto k = linear(x, packed[1], out_features[1], biases[1], c10::nullopt);
  rope_(k, cos, sin, D);
  auto v = linear(x, packed[2], out_features[2], biases[2], c10::nullopt);
  TORCH_CHECK(k.size(1) == KV * D && v.size(1) == KV * D && q.size(1) % D == 0,
              "skinny decoder_layer: projections ", q.sizes(), " ", k.sizes(), " ", v.sizes(), " for ", KV,
              " key/value heads of ", D);
  k_buffer.narrow(2, length, n).copy_(k.view({B, n, KV, D}).transpose(1, 2));
  v_buffer.narrow(2, length, n).copy_(v.view({B, n, KV, D}).transpose(1, 2));
  const int64_t H = q.size(1) / D;
  auto attended = attention(q.view({B, n, H, D}).transpose(1, 2), k_buffer.narrow(2, 0, length + n),
                            v_buffer.narrow(2, 0, length + n), mask, scale);
  auto h = linear(attended.view({B * n, H * D}), packed[3], out_features[3], biases[3], hidden);
  auto y = rms_norm(h, norm2, eps2);
  auto gate = linear(y, packed[4], out_features[4], biases[4], c10::nullopt);
  silu_mul_(gate, linear(y, packed[5], out_features[5], biases[5], c10::nullopt));
  return linear(gate, packed[6], out_features[6], biases[6], h).view({B, n, -1});
}

// ---------------------------------------------------------------------------------------------------------------
// The k largest log-probabilities of each row of logits [rows, V] (log_softmax, then top-k), largest first, the
// earlier index first among equal values, NaN never chosen: a drafter ranks its candidates with them. One pass for
// the maximum, one for the sum of exponentials (the vector exp above; a draft's ranking needs no more), one for the
// top k, held sorted in a small array. Returns {values [rows, k] float32, indices [rows, k] int64}.
inline bool any_lane(ivec m) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif defined(__AVX__)
  return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
  for (int i = 0; i < kLanes; ++i)
    if (m[i]) return true;
  return false;
#endif
}

std::vector<torch::Tensor> top_log_probs(const torch::Tensor& logits, int64_t k) {
  check_rows(logits, "top_log_probs");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && V >= 1, "skinny top_log_probs: k ", k, " of ", V, " columns");
  k = std::min(k, V);
  auto values = torch::empty({rows, k}, logits.options());
  auto indices = torch::empty({rows, k}, logits.options().dtype(torch::kInt64));
  const float* src = logits.data_ptr<float>();
  float* out_v = values.data_ptr<float>();
  int64_t* out_i = indices.data_ptr<int64_t>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * V;
    int64_t filled = 0;
    float kth = kNegInf;  // the k-th best so far (-inf until k are held): only larger values enter
    auto offer = [&](float v, int64_t j) {
      if (!(v == v) || (filled == k && !(v > kth))) return;  // NaN never; ties keep the earlier column
      int64_t at = filled < k ? filled++ : k - 1;
      while (at > 0 && v > best[at - 1]) {
        best[at] = best[at - 1];
        where[at] = where[at - 1];
        --at;
      }
      best[at] = v;
      where[at] = j;
      if (filled == k) kth = best[k - 1];
    };
    // one pass: the lane-wise maximum, and the top k from the few vectors that hold a value above the k-th best
    vec top_lanes = vec{} + kNegInf;
    int64_t i = 0;
    for (; i + kLanes <= V; i += kLanes) {
      const vec v = *reinterpret_cast<const vec_unaligned*>(x + i);
      top_lanes = v > top_lanes ? v : top_lanes;  // NaN compares false: never the maximum
      if (filled < k || any_lane(v > (vec{} + kth)))
        for (int j = 0; j < kLanes; ++j) offer(v[j], i + j);
    }
    float top = kNegInf;
    for (int j = 0; j < kLanes; ++j) top = top_lanes[j] > top ? top_lanes[j] : top;
    for (int64_t j = i; j < V; ++j) {
      top = x[j] > top ? x[j] : top;
      offer(x[j], j);
    }
    // the normalizer: sum of exp(x - max) (the vector exp; a draft's ranking needs no more), NaN adding nothing
    vec acc{};
    const vec shift = vec{} + top;
    for (i = 0; i + kLanes <= V; i += kLanes) {
      const vec e = vexp(*reinterpret_cast<const vec_unaligned*>(x + i) - shift);
      acc += e == e ? e : vec{};
    }
    double sum = hsum(acc);
    for (; i < V; ++i)
      if (x[i] == x[i]) sum += std::exp(static_cast<double>(x[i]) - top);
    const float lse = std::isfinite(top) ? top + static_cast<float>(std::log(sum)) : top;
    for (int64_t c = 0; c < k; ++c) {
      const bool have = c < filled;
      out_v[r * k + c] = have ? best[c] - lse : kNegInf;
      out_i[r * k + c] = have ? where[c] : 0;
    }
  }
  return {values, indices};
}

// A draft head in one call: RMSNorm of each row of hidden [rows, H], the packed head, then top_log_probs.
std::vector<torch::Tensor> head_top(const torch::Tensor& hidden, const torch::Tensor& norm, double eps,
                                    const torch::Tensor& packed, int64_t out_features,
                                    const c10::optional<torch::Tensor>& bias, int64_t k) {
  return top_log_probs(linear(rms_norm(hidden, norm, eps), packed, out_features, bias, c10::nullopt), k);
}

// ---------------------------------------------------------------------------------------------------------------
// After a tree verification: every layer's cache keeps its first `prefix` entries, the root's at `prefix`, and the
// accepted nodes' (node i at prefix + 1 + i) moved down behind it in order. buffers [B, KV, capacity, D], row-major
// in their last dim; `accepted` ascending (a path from the root: parents come before children), so each entry moves
// down or stays and the copies never overwrite an entry still to be read. Returns the views [:, :, :new length].
std::tuple<std::vector<torch::Tensor>, std::vector<torch::Tensor>> keep_entries(
    const std::vector<torch::Tensor>& k_buffers, const std::vector<torch::Tensor>& v_buffers, int64_t prefix,
    const std::vector<int64_t>& accepted) {
  TORCH_CHECK(k_buffers.size() == v_buffers.size(), "skinny keep_entries: ", k_buffers.size(), " key and ",
              v_buffers.size(), " value buffers");
  const int64_t count = static_cast<int64_t>(accepted.size()), end = prefix + 1 + count;
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(accepted[i] >= i && (i == 0 || accepted[i] > accepted[i - 1]),
                "skinny keep_entries: accepted nodes must ascend (a path from the root)");
  std::vector<torch::Tensor> keys, values;
  keys.reserve(k_buffers.size());
  values.reserve(v_buffers.size());
  for (size_t l = 0; l < k_buffers.size(); ++l) {
    for (const torch::Tensor* t : {&k_buffers[l], &v_buffers[l]}) {
      const torch::Tensor& b = *t;
      TORCH_CHECK(b.dim() == 4 && b.scalar_type() == torch::kFloat32 && b.device().is_cpu() && b.stride(3) == 1 &&
                      b.stride(2) == b.size(3) && prefix + 1 + (count ? accepted[count - 1] + 1 : 0) <= b.size(2),
                  "skinny keep_entries: buffer ", b.sizes(), " for ", prefix, " + ", end - prefix, " entries");
      float* base = b.data_ptr<float>();
      const int64_t D = b.size(3);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t src = prefix + 1 + accepted[i], dst = prefix + 1 + i;
        if (src == dst) continue;
        for (int64_t bh = 0; bh < b.size(0) * b.size(1); ++bh) {
          const int64_t row = (bh / b.size(1)) * b.stride(0) + (bh % b.size(1)) * b.stride(1);
          std::memcpy(base + row + dst * D, base + row + src * D, sizeof(float) * D);
        }
      }
    }
    keys.push_back(k_buffers[l].narrow(2, 0, end));
    values.push_back(v_buffers[l].narrow(2, 0, end));
  }
  return {keys, values};
}

// The first maximal column of each row of logits [rows, V] (int64 [rows]): torch.max(dim=-1).indices, a NaN
// counting as the maximum (the first NaN's column where a row has one). Lane-wise maxima and their first columns,
// then the smallest column among the lanes holding the row's maximum.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_rows(logits, "argmax_rows");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "skinny argmax_rows: rows of no columns");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* result = out.data_ptr<int64_t>();
  const float* src = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t r = begin; r < stop; ++r) {
      const float* x = src + r * V;
      vec best = vec{} - std::numeric_limits<float>::infinity();
      ivec column{}, lane_index{}, nan{};
      for (int j = 0; j < kLanes; ++j) lane_index[j] = j;
      column = lane_index;  // every lane's first column holds -inf until something larger comes
      int64_t i = 0;
      bool filled = false;
      // (columns are tracked in 32-bit lanes: a row past 2^30 columns finishes in the scalar loop below)
      for (; i + kLanes <= V && i + kLanes <= (int64_t{1} << 30); i += kLanes) {
        const vec v = *reinterpret_cast<const vec_unaligned*>(x + i);
        nan |= v != v;
        const ivec larger = v > best;  // strictly: equal values keep the earlier column
        best = larger ? v : best;
        column = larger ? lane_index + static_cast<int>(i) : column;
        filled = true;
      }
      int64_t at = -1;
      float top = -std::numeric_limits<float>::infinity();
      if (any_lane(nan)) {  // the first NaN, as torch.max reports it
        for (int64_t j = 0; j < V; ++j)
          if (x[j] != x[j]) { at = j; break; }
      } else {
        if (filled)
          for (int j = 0; j < kLanes; ++j)
            if (best[j] > top || (best[j] == top && (at < 0 || column[j] < at))) top = best[j], at = column[j];
        for (int64_t j = i; j < V; ++j) {
          if (x[j] != x[j]) { at = j; break; }
          if (at < 0 || x[j] > top) top = x[j], at = j;
        }
        if (at < 0) at = 0;
      }
      result[r] = at;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// A whole decoder stack as one call: `decoder_layer` for every layer in turn, with the per-layer constants (norm
// weights, packed linears, biases, widths, attention scale) held here from construction instead of crossing from
// Python on every call. Python's per-layer share of a forward (module calls, hooks, kernel checks: ~30 us a layer,
// ~1 ms of a SmolLM2 step) becomes one call. Each layer runs exactly `decoder_layer` on the same inputs, so the
// outputs are bitwise the per-layer calls'.
class DecoderStack {
 public:
  DecoderStack(std::vector<torch::Tensor> norm1, std::vector<double> eps1,
               std::vector<std::vector<torch::Tensor>> packed,
               std::vector<std::vector<c10::optional<torch::Tensor>>> biases,
               std::vector<std::vector<int64_t>> out_features, std::vector<double> scale,
               std::vector<torch::Tensor> norm2, std::vector<double> eps2, int64_t head_dim)
      : norm1_(std::move(norm1)), eps1_(std::move(eps1)), packed_(std::move(packed)), biases_(std::move(biases)),
        out_features_(std::move(out_features)), scale_(std::move(scale)), norm2_(std::move(norm2)),
        eps2_(std::move(eps2)), head_dim_(head_dim) {
    const size_t L = norm1_.size();
    TORCH_CHECK(L > 0 && eps1_.size() == L && packed_.size() == L && biases_.size() == L &&
                    out_features_.size() == L && scale_.size() == L && norm2_.size() == L && eps2_.size() == L,
                "skinny DecoderStack: every per-layer list needs one entry a layer");
  }

  int64_t layers() const { return static_cast<int64_t>(norm1_.size()); }

  // hidden [rows, hidden]; cos / sin as decoder_layer takes them; k_buffers / v_buffers one a layer, each holding
  // `length` entries with room for the new ones; all_outputs: return every layer's output (for hidden states), else
  // only the last one. Returns [B, n, hidden] tensors.
  // Also returns the views [:, :, :length + n] of every key and value buffer (what a cache layer holds after the
  // append), made here rather than by sixty slicing calls in Python.
  std::tuple<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>> run(
      const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
      const std::vector<torch::Tensor>& k_buffers, const std::vector<torch::Tensor>& v_buffers, int64_t length,
      const c10::optional<torch::Tensor>& mask, bool all_outputs) const {
    const size_t L = norm1_.size();
    TORCH_CHECK(k_buffers.size() == L && v_buffers.size() == L, "skinny DecoderStack: ", k_buffers.size(), " / ",
                v_buffers.size(), " key / value buffers for ", L, " layers");
    std::vector<torch::Tensor> outputs, keys, values;
    outputs.reserve(all_outputs ? L : 1);
    keys.reserve(L);
    values.reserve(L);
    torch::Tensor x = hidden;
    for (size_t i = 0; i < L; ++i) {
      torch::Tensor out = decoder_layer(x, norm1_[i], eps1_[i], packed_[i], biases_[i], out_features_[i], cos, sin,
                                        head_dim_, k_buffers[i], v_buffers[i], length, mask, scale_[i], norm2_[i],
                                        eps2_[i], c10::nullopt);
      x = out.view({-1, out.size(2)});
      if (all_outputs || i + 1 == L) outputs.push_back(out);
      const int64_t end = length + x.size(0) / k_buffers[i].size(0);
      keys.push_back(k_buffers[i].narrow(2, 0, end));
      values.push_back(v_buffers[i].narrow(2, 0, end));
    }
    return {outputs, keys, values};
  }

 private:
  std::vector<torch::Tensor> norm1_;
  std::vector<double> eps1_;
  std::vector<std::vector<torch::Tensor>> packed_;
  std::vector<std::vector<c10::optional<torch::Tensor>>> biases_;
  std::vector<std::vector<int64_t>> out_features_;
  std::vector<double> scale_;
  std::vector<torch::Tensor> norm2_;
  std::vector<double> eps2_;
  int64_t head_dim_;
};

// ---------------------------------------------------------------------------------------------------------------
// The multiply-add rate this build's vectors reach on PyTorch's threads: independent chains of fused multiply-adds
// in registers, no memory traffic. BLAS benchmarks understate it on some CPUs (MKL's large GEMM reached 216 of the
// 510 GFLOPS this measures on a 2-core Zen 5, and the skinny kernel itself 340 at 24 rows), so the compute floor of
// `selfspec cost` is taken from here. Returns GFLOPS over the wall time of one parallel region.
double fma_peak_gflops(int64_t iterations) {
  constexpr int kChains = 12;  // enough independent chains to cover the FMA latency on two pipes
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> ran{0};
  std::vector<float> sink(threads * 64, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      vec acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = vec{} + 0.001f * static_cast<float>(c + t);
      const vec a = vec{} + 0.999999f, b = vec{} + 1e-7f;
      for (int64_t i = 0; i < iterations; ++i)  // no -ffast-math: float math is not re-associated or folded
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
      vec total{};
      for (int c = 0; c < kChains; ++c) total += acc[c];
      sink[t * 64] = hsum(total);
      ran.fetch_add(1);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 2.0 * kChains * kLanes * static_cast<double>(iterations) * static_cast<double>(ran.load()) / seconds / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lanes", &lanes, "floats per panel (the vector width the kernel was built for)");
  m.def("wide_tiles", []() { return static_cast<int64_t>(g_wide_tiles.load()); }, "the tile shape for 15-16 rows");
  m.def("small_prefetch", []() { return static_cast<int64_t>(g_small_prefetch.load()); },
        "whether tiles of 1-4 rows prefetch the next tile's weights");
  m.def("set_small_prefetch", &set_small_prefetch, "0 / 1: tiles of 1-4 rows prefetch too; returns the setting");
  m.def("set_wide_tiles", &set_wide_tiles, "tile shape for 15-16 rows: 0 = 16 x 1, 1 = 12 x 2; returns the one in effect");
  m.def("parallel_threads", &parallel_threads, "threads a parallel region of this module runs on");
  m.def("pack", &pack, "weight [M, K] -> panels [ceil(M / lanes), K, lanes] (float16 with half=True)",
        py::arg("weight"), py::arg("half") = false);
  m.def("linear", &linear, "rows [n, K] x packed panels -> [n, out_features] (+ bias) (+ residual)",
        py::arg("input"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("grid_block_bytes", &grid_block_bytes, "bytes of one 32-input block of a panel in grid format q4_1, q8_0 or q6_k");
  m.def("fma_peak_gflops", &fma_peak_gflops, "float32 multiply-add rate of this build's vectors on torch's threads");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row: weight * x * rsqrt(mean(x^2) + eps)");
  m.def("rope_", &rope_, "rotary embedding (rotate-half) in place on rows [n, heads * head_dim]");
  m.def("silu_mul_", &silu_mul_, "gate = silu(gate) * up, in place");
  m.def("decoder_layer", &decoder_layer, "one Llama-family decoder layer on the kernels above, cache write included");
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local())  // local: two builds may load (tests' AVX2)
      .def(py::init<std::vector<torch::Tensor>, std::vector<double>, std::vector<std::vector<torch::Tensor>>,
                    std::vector<std::vector<c10::optional<torch::Tensor>>>, std::vector<std::vector<int64_t>>,
                    std::vector<double>, std::vector<torch::Tensor>, std::vector<double>, int64_t>())
      .def("layers", &DecoderStack::layers)
      .def("run", &DecoderStack::run, "every layer's decoder_layer in turn; the outputs of each, or of the last");
  m.def("top_log_probs", &top_log_probs, "the k largest log_softmax values of each row and their columns");
  m.def("head_top", &head_top, "RMSNorm, a packed draft head, then top_log_probs, in one call");
  m.def("keep_entries", &keep_entries, "every layer's cache: the prefix, the root and the accepted nodes' entries");
  m.def("argmax_rows", &argmax_rows, "the first maximal column of each row (NaN first), as torch.max(dim=-1)");
  m.def("attention_supported", &attention_supported, "whether attention takes this head dim");
  m.def("attention", &attention, "few-query grouped attention: q [B,H,n,D], k/v [B,KV,L,D], mask -> [B,n,H,D]");
}
