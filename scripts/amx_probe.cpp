// A probe, not part of the package: can AMX make the skinny kernel's exact Q4_1 grid linears cheap at many rows while
// staying row-independent (each row's output the same whatever rows come with it, which greedy losslessness needs)?
// Built and run by scripts/amx_probe.py (an Intel CPU with AMX-INT8 and AVX-512; Linux).
//
// Arithmetic ("integer digits"): each row's inputs, per block of 32, are scaled by a power of two s so that the
// block's largest |x| / s lies in [2^21, 2^22), rounded to integers I (one rounding, relative 2^-22 of the block's
// largest input) and split into three signed 8-bit digits, I = D0 * 65536 + D1 * 256 + D2. Each digit row times the
// block's 4-bit levels q is an exact int32 (AMX TDPBSUD), so the block's sum of I * q is exact and is rounded once to
// float32; then acc = fma(d * s, that, acc) and acc = fma(m, s * sum(I), acc). Every step is exact integer
// arithmetic or a fixed float32 sequence per row, so the result does not depend on the row count or on the engine
// (AMX, AVX-512 VNNI or AVX2 could compute the same integers).
//
// Layout per 16-output panel and block: d (16 floats), m (16 floats), 256 bytes whose low nibbles are the int8 VNNI
// rows 0-3 of the block's B tile (row kk, byte 4c + j = q[4kk + j][c]) and whose high nibbles are rows 4-7.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>
#include <cmath>

namespace {
struct TileConfig { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// tiles: A_t = t (t < 3), C_t = 3 + t, B = 6 (8 rows x 64 bytes: 32 K x 16 cols int8, VNNI)
void configure(int64_t S) {
  alignas(64) TileConfig cfg; std::memset(&cfg, 0, sizeof cfg); cfg.palette_id = 1;
  for (int t = 0; t < 3; ++t) {
    int rows = (int)std::min<int64_t>(16, std::max<int64_t>(0, S - 16 * t));
    if (rows == 0) continue;
    cfg.rows[t] = rows; cfg.colsb[t] = 32; cfg.rows[3 + t] = rows; cfg.colsb[3 + t] = 64;
  }
  cfg.rows[6] = 8; cfg.colsb[6] = 64; cfg.rows[7] = 8; cfg.colsb[7] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// x [n, K] -> digits [3][n][K] int8 with x ~= s_rb * (D0 * 65536 + D1 * 256 + D2), s_rb a power of two per row and
// block of 32 with the block's largest |x| / s in [2^21, 2^22); scale [n][nb] = s_rb, isum [n][nb] = sum of I.
void split_rows(const float* x, int64_t n, int64_t K, int8_t* dig, float* scale, float* isum) {
  const int64_t nb = K / 32;
  const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      int e = 0;
      if (mx > 0) std::frexp(mx, &e);  // mx in [2^(e-1), 2^e)
      const float s = std::ldexp(1.f, e - 22), inv = std::ldexp(1.f, 22 - e);  // mx / s in [2^21, 2^22)
      __m512i tot = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i I = _mm512_cvtps_epi32(_mm512_mul_ps(h ? v1 : v0, _mm512_set1_ps(inv)));  // exact scaling, RNE
        tot = _mm512_add_epi32(tot, I);
        const __m512i d2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(I, k128), k255), k128);
        const __m512i J = _mm512_srai_epi32(_mm512_sub_epi32(I, d2), 8);
        const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(J, k128), k255), k128);
        const __m512i d0 = _mm512_srai_epi32(_mm512_sub_epi32(J, d1), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dig + (0 * n + r) * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(d0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dig + (1 * n + r) * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(d1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dig + (2 * n + r) * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(d2));
      }
      scale[r * nb + b] = s;
      isum[r * nb + b] = (float)_mm512_reduce_add_epi32(tot) * s;
    }
}

// 256 nibble bytes -> 512 bytes: low nibbles are VNNI rows 0-3, high nibbles rows 4-7
inline void build_b(const uint8_t* nib, uint8_t* out) {
  const __m512i mask = _mm512_set1_epi8(15);
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(nib + 64 * t);
    _mm512_store_si512(out + 64 * t, _mm512_and_si512(v, mask));
    _mm512_store_si512(out + 256 + 64 * t, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

template <int T>
inline void tdps(const int8_t* dig, int64_t b, int64_t K, const uint8_t* bb, int32_t* cb) {
  _tile_loadd(6, bb, 64);
  _tile_loadd(0, dig + b * 32, K); _tile_zero(3); _tile_dpbsud(3, 0, 6); _tile_stored(3, cb, 64);
  if (T > 1) { _tile_loadd(1, dig + 16 * K + b * 32, K); _tile_zero(4); _tile_dpbsud(4, 1, 6); _tile_stored(4, cb + 256, 64); }
  if (T > 2) { _tile_loadd(2, dig + 32 * K + b * 32, K); _tile_zero(5); _tile_dpbsud(5, 2, 6); _tile_stored(5, cb + 512, 64); }
}

template <int T>
void q41_panels(const int8_t* dig, const float* scale, const float* isum, int64_t n, int64_t K, const uint8_t* packed,
                float* out, int64_t M, int64_t begin, int64_t end, int mode) {
  const int64_t nb = K / 32;
  alignas(64) uint8_t bbuf[2][512];
  alignas(64) int32_t cbuf[2][48][16];
  configure(3 * n);
  if (mode == 1) build_b(packed + 128, bbuf[0]), build_b(packed + 128, bbuf[1]);
  const __m512 k256 = _mm512_set1_ps(256.f);
  auto combine = [&](int64_t g, int64_t b, __m512* acc) {
    const uint8_t* blk = packed + (g * nb + b) * 384;
    const int h = b & 1;
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    for (int r = 0; r < n; ++r) {
      const __m512i c0 = _mm512_load_si512(cbuf[h][r]), c1 = _mm512_load_si512(cbuf[h][n + r]);
      const __m512i c2 = _mm512_load_si512(cbuf[h][2 * n + r]);
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(c0, 8), c1));  // exact: < 2^24
      const __m512 t = _mm512_fmadd_ps(hi, k256, _mm512_cvtepi32_ps(c2));                       // one rounding
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), t, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(isum[r * nb + b]), acc[r]);
    }
  };
  for (int64_t g = begin; g < end; ++g) {
    __m512 acc[16];
    for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
    if (mode != 1) build_b(packed + (g * nb) * 384 + 128, bbuf[0]);
    for (int64_t b = 0; b < nb; ++b) {
      const int h = b & 1;
      if (mode != 2) tdps<T>(dig, b, K, bbuf[h], &cbuf[h][0][0]);
      if (mode != 1 && b + 1 < nb) build_b(packed + (g * nb + b + 1) * 384 + 128, bbuf[h ^ 1]);
      if (g + 1 < end) for (int l = 0; l < 384; l += 64) __builtin_prefetch(packed + ((g + 1) * nb + b) * 384 + l, 0, 2);
      if (b > 0) combine(g, b - 1, acc);
    }
    combine(g, nb - 1, acc);
    for (int r = 0; r < n; ++r) {
      const int64_t m0 = g * 16;
      if (m0 + 16 <= M) _mm512_storeu_ps(out + r * M + m0, acc[r]);
      else { alignas(64) float t[16]; _mm512_store_ps(t, acc[r]); for (int i = 0; m0 + i < M; ++i) out[r * M + m0 + i] = t[i]; }
    }
  }
  _tile_release();
}
}  // namespace

bool init() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t M, int64_t mode) {
  const int64_t n = x.size(0), K = x.size(1), nb = K / 32, panels = packed.size(0);
  TORCH_CHECK(n <= 16);
  auto dig = torch::empty({3, n, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({n, nb}, x.options());
  auto isum = torch::empty({n, nb}, x.options());
  split_rows(x.data_ptr<float>(), n, K, dig.data_ptr<int8_t>(), scale.data_ptr<float>(), isum.data_ptr<float>());
  auto out = torch::empty({n, M}, x.options());
  const int8_t* dp = dig.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* ip = isum.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t S = 3 * n;
  at::parallel_for(0, panels, 8, [&](int64_t b0, int64_t b1) {
    if (S <= 16) q41_panels<1>(dp, sp, ip, n, K, wp, op, M, b0, b1, (int)mode);
    else if (S <= 32) q41_panels<2>(dp, sp, ip, n, K, wp, op, M, b0, b1, (int)mode);
    else q41_panels<3>(dp, sp, ip, n, K, wp, op, M, b0, b1, (int)mode);
  });
  return out;
}

// One TDPBF16PS: c [rows, 16] += a [rows, 32 bf16] . b [32, 16] (b given in VNNI pairs [16][32]), to compare the
// hardware's rounding with a sequential float32 sum.
torch::Tensor tdp_bf16(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
  const int rows = (int)a.size(0);
  TORCH_CHECK(rows <= 16 && a.size(1) == 32 && b.size(0) == 16 && b.size(1) == 32 && c.size(0) == rows);
  alignas(64) TileConfig cfg; std::memset(&cfg, 0, sizeof cfg); cfg.palette_id = 1;
  cfg.rows[0] = rows; cfg.colsb[0] = 64; cfg.rows[1] = 16; cfg.colsb[1] = 64; cfg.rows[2] = rows; cfg.colsb[2] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  auto out = c.contiguous().clone();
  auto ac = a.contiguous(), bc = b.contiguous();
  _tile_loadd(2, out.data_ptr<float>(), 64);
  _tile_loadd(0, ac.data_ptr<int16_t>(), 64);
  _tile_loadd(1, bc.data_ptr<int16_t>(), 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_stored(2, out.data_ptr<float>(), 64);
  _tile_release();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init, "request AMX tile state for this process (Linux arch_prctl)");
  m.def("linear", &linear, "x [n <= 16, K] through a packed Q4_1 grid; mode 0 all, 1 no weight stream, 2 no tiles");
  m.def("tdp_bf16", &tdp_bf16);
}
