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
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;  // 32 vector registers
#else
constexpr int kLanes = 8;  // 16 vector registers (AVX2; also the generic fallback)
#endif

typedef float vec __attribute__((vector_size(kLanes * 4), aligned(kLanes * 4)));
typedef float vec_unaligned __attribute__((vector_size(kLanes * 4), aligned(4)));

// One tile: rows [0, R) of x against panels [panel, panel + C), written to out (row stride M). With Prefetch, each
// step also requests the matching line of the next C panels (the next tile's streams, contiguous after these), so
// the next tile's weights arrive while this one computes. They are requested into L2 (locality 2), not L1: a tile's
// panels are C x K x 64 bytes (74-110 KB for SmolLM2), more than an L1, and pulling the next tile into L1 evicted the
// panels the current tile still reads.
template <int R, int C, bool Prefetch>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict packed, int64_t panel,
                 float* __restrict out, int64_t M, const float* __restrict bias) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vec{};
  const float* streams[C];
  for (int c = 0; c < C; ++c) streams[c] = packed + (panel + c) * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    vec w[C];
    for (int c = 0; c < C; ++c) w[c] = *reinterpret_cast<const vec*>(streams[c] + k * kLanes);
    if (Prefetch && (k & (64 / (kLanes * 4) - 1)) == 0)  // one request per 64-byte line
      for (int c = 0; c < C; ++c) __builtin_prefetch(streams[c] + C * K * kLanes + k * kLanes, 0, 2);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      for (int c = 0; c < C; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t m0 = (panel + c) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, M - m0);
    vec b{};
    if (bias != nullptr)
      for (int i = 0; i < width; ++i) b[i] = bias[m0 + i];
    for (int r = 0; r < R; ++r) {
      const vec v = acc[r][c] + b;
      if (width == kLanes) {
        *reinterpret_cast<vec_unaligned*>(out + r * M + m0) = v;
      } else {
        for (int i = 0; i < width; ++i) out[r * M + m0 + i] = v[i];
      }
    }
  }
}

// A tile of n rows (0 < n <= R) against panels [panel, panel + C), the row count dispatched to its instantiation.
template <int C, bool Prefetch, int R>
inline void tile_n(int64_t n, const float* x, int64_t K, const float* packed, int64_t panel, float* out, int64_t M,
                   const float* bias) {
  if constexpr (R > 0) {
    if (n == R) tile<R, C, Prefetch>(x, K, packed, panel, out, M, bias);
    else tile_n<C, Prefetch, R - 1>(n, x, K, packed, panel, out, M, bias);
  }
}

// All n rows against panels [panel, panel + C): blocks of Rows rows, then the remainder, while the panels are in
// cache.
template <int Rows, int C, bool Prefetch>
void rows(const float* x, int64_t n, int64_t K, const float* packed, int64_t panel, float* out, int64_t M,
          const float* bias) {
  int64_t r = 0;
  for (; r + Rows <= n; r += Rows) tile<Rows, C, Prefetch>(x + r * K, K, packed, panel, out + r * M, M, bias);
  if (n > r) tile_n<C, Prefetch, Rows - 1>(n - r, x + r * K, K, packed, panel, out + r * M, M, bias);
}

// Software prefetch pays from tiles of this many rows on: below, a tile is bound by memory and the hardware
// prefetcher keeps up (the extra requests cost ~10% at 2 rows); above, a tile computes long enough for the next
// one's weights to arrive meanwhile (8 rows: 21 -> 18 ms for SmolLM2's linears on a 2-core AVX2 EPYC; 16: 32.5 -> 28).
constexpr int64_t kPrefetchRows = 5;

// Panels [begin, end) in groups of C (then one by one), each group against all n rows in tiles of Rows rows.
template <int Rows, int C>
void panels(const float* x, int64_t n, int64_t K, const float* packed, float* out, int64_t M, const float* bias,
            int64_t begin, int64_t end) {
  constexpr bool prefetch = Rows >= kPrefetchRows;
  int64_t p = begin;
  for (; p + C <= end; p += C) rows<Rows, C, prefetch>(x, n, K, packed, p, out, M, bias);
  for (; p < end; ++p) rows<Rows, 1, prefetch>(x, n, K, packed, p, out, M, bias);
}

// The tile shape for n rows. The weights are the traffic: each weight vector loaded is used by every row of its
// tile, so a tile takes as many of the n rows as the registers allow (R x C accumulators + C weights + 1 broadcast),
// and every weight is streamed from memory once when n fits one tile; few rows leave registers for more panels
// (more weight streams in flight). A second row tile over the same panels re-reads them from cache but does not
// overlap that with the memory stream: on a 2-core Xeon (AVX-512) SmolLM2's linears at 12 rows took 28 ms as
// 8 + 4 rows x 3 panels and 21 ms as one 12-row x 2-panel tile, at 16 rows 28.6 -> 24.5 ms (16 x 1).
void dispatch(const float* x, int64_t n, int64_t K, const float* packed, float* out, int64_t M, const float* bias,
              int64_t begin, int64_t end) {
#ifdef __AVX512F__
  if (n == 1) panels<1, 8>(x, n, K, packed, out, M, bias, begin, end);
  else if (n == 2) panels<2, 6>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 4) panels<4, 4>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 8) panels<8, 2>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 12) panels<12, 2>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 14) panels<14, 2>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 16) panels<16, 1>(x, n, K, packed, out, M, bias, begin, end);
  else panels<12, 2>(x, n, K, packed, out, M, bias, begin, end);
#else
  if (n == 1) panels<1, 6>(x, n, K, packed, out, M, bias, begin, end);
  else if (n == 2) panels<2, 4>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 4) panels<4, 3>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 6) panels<6, 2>(x, n, K, packed, out, M, bias, begin, end);
  else if (n <= 12) panels<12, 1>(x, n, K, packed, out, M, bias, begin, end);
  else panels<6, 2>(x, n, K, packed, out, M, bias, begin, end);
#endif
}

}  // namespace

int64_t lanes() { return kLanes; }

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

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "skinny_linear.pack: expected a 2-D float32 CPU weight, got ", weight.sizes(), " ", weight.dtype());
  const int64_t M = weight.size(0), K = weight.size(1), blocks = (M + kLanes - 1) / kLanes;
  auto padded = torch::zeros({blocks * kLanes, K}, weight.options());
  padded.narrow(0, 0, M).copy_(weight);
  // [blocks, L, K] -> [blocks, K, L]
  return padded.view({blocks, kLanes, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32 && input.device().is_cpu(),
              "skinny_linear.linear: expected 2-D float32 CPU rows, got ", input.sizes(), " ", input.dtype());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.size(1) == input.size(1) &&
                  packed.size(0) * kLanes >= out_features && packed.is_contiguous(),
              "skinny_linear.linear: packed weight ", packed.sizes(), " does not fit rows ", input.sizes(),
              " and ", out_features, " outputs");
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
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(8, blocks / (4 * at::get_num_threads()));
  at::parallel_for(0, blocks, grain,
                   [&](int64_t begin, int64_t end) { dispatch(xp, n, K, pp, op, M, bp, begin, end); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lanes", &lanes, "floats per panel (the vector width the kernel was built for)");
  m.def("parallel_threads", &parallel_threads, "threads a parallel region of this module runs on");
  m.def("pack", &pack, "weight [M, K] -> panels [ceil(M / lanes), K, lanes]");
  m.def("linear", &linear, "rows [n, K] x packed panels -> [n, out_features] (+ bias)");
}
