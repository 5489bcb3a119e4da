// y = x W^T + b for fp32 rows x and 16-bit weights W (fp16 or bf16), accumulated in fp32: the
// linears of decode and verify blocks (up to a few dozen rows) in the fp16w mode (fp16 weights)
// and the bf16 mode (bf16 weights, its rows widened exactly to fp32 and the sums rounded back by
// the caller), 16 floats wide where the CPU has AVX-512 and 8 wide on AVX2 (with F16C, as every
// AVX2 CPU has).
//
// FBGEMM's fp16 kernel, which the mode used alone before, ran SmolLM2's linears at ~15 GB/s of
// weights for one row, and its time for 16 rows was about that of memory plus that of the
// FMAs. Here the weights are slices of 16 output columns, K-major, each streamed once with the
// weights asked for ahead: up to 8 rows take three slices at once (a converted weight serves
// every row), more rows one slice at a time, so no slice is read twice for 9 to 16 rows. With
// AVX2's sixteen 8-float registers the blocks are smaller (up to 2 rows over three slices, 6
// rows a pass over one) and a converted weight serves fewer rows; the packing is the same.
//
// Every output element is one FMA chain over k in ascending order, then the bias: its bits
// depend on its row and column alone, not on how many rows came with it or where they sat,
// so a request gives the same bits alone and in a batch. That is also FBGEMM's order (its
// micro-kernels keep one accumulator per row and 8 or 16 columns over k): both builds gave its
// bits on the Xeon measured, there against FBGEMM's AVX-512 kernel; the test asks the same of
// FBGEMM's AVX2 kernel on an AVX2-only CPU. For bf16 weights the same order replaces oneDNN,
// whose bf16 kernels change with the number of rows and with the CPU (on AVX-512 without AMX
// at 4 rows and more, with AMX past 32), which let a bf16 verify round a row differently from
// its decode alone.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

namespace {

constexpr int64_t kSlice = 16;   // output columns per slice: one 16-float register (two of 8), K-major
constexpr int64_t kPanel = 48;   // slices are padded to whole panels of three (a block of few rows takes three)
#ifdef __AVX512F__
constexpr int kFewRows = 8;      // up to this many rows, three slices at once: 24 accumulators
constexpr int kManyRows = 16;    // more rows, one slice at a time, up to this many rows per pass
#else
constexpr int kFewRows = 2;      // 2 rows x 3 slices x 2 registers: 12 accumulators
constexpr int kManyRows = 6;     // 6 rows x 2 registers, a slice's 2 and a row's broadcast: 15 registers
#endif
// How far ahead of its reads a stream of weights asks for them: the hardware prefetcher alone
// left a 1-row product at ~0.75 of what the memory gives and did not overlap loads with the
// FMAs of 8-16 rows (their time was the sum of both); a few KB ahead took a whole model's
// linears ~25-30% less time.
constexpr int64_t kPrefetchBytes = 4096;

// A weight's format: its 16 bits widened exactly to fp32.
enum class Format { kFp16, kBf16 };

#ifdef __AVX512F__
template <Format F>
inline __m512 load_slice(const uint16_t* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  if constexpr (F == Format::kFp16) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // bf16: the top half of an fp32
}

inline __mmask16 columns_mask(int64_t left) {
  return left >= kSlice ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// R (<= kFewRows) rows times the three slices of a panel: a weight converted once serves R rows.
template <Format F, int R>
void few_rows(const float* x, int64_t k_size, const uint16_t* w, const float* bias, float* out, int64_t ld,
              int64_t cols) {
  const uint16_t* w1 = w + k_size * kSlice;
  const uint16_t* w2 = w1 + k_size * kSlice;
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    if ((k & 1) == 0) {  // a 64-byte line holds two k's of a slice
      _mm_prefetch(reinterpret_cast<const char*>(w + k * kSlice) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k * kSlice) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w2 + k * kSlice) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m512 v0 = load_slice<F>(w + k * kSlice), v1 = load_slice<F>(w1 + k * kSlice),
                 v2 = load_slice<F>(w2 + k * kSlice);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_size + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, v2, acc[r][2]);
    }
  }
  for (int c = 0; c < 3 && cols > c * kSlice; ++c) {
    const __mmask16 mask = columns_mask(cols - c * kSlice);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c * kSlice);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ld + c * kSlice, mask, _mm512_add_ps(acc[r][c], b));
  }
}

// R (<= kManyRows) rows times one slice: the slice is read once for all of them, where blocks
// of eight rows over whole panels read each panel again per block (from cache, but with the
// memory idle meanwhile: a 9th row cost ~20% of the first eight).
template <Format F, int R>
void many_rows(const float* x, int64_t k_size, const uint16_t* w, const float* bias, float* out, int64_t ld,
               int64_t cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * kSlice) + kPrefetchBytes, _MM_HINT_T0);
    const __m512 v = load_slice<F>(w + k * kSlice);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k_size + k]), v, acc[r]);
  }
  const __mmask16 mask = columns_mask(cols);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ld, mask, _mm512_add_ps(acc[r], b));
}

#define KNAPSPEC_HALF_LINEAR 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
template <Format F>
inline __m256 load8(const uint16_t* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if constexpr (F == Format::kFp16) return _mm256_cvtph_ps(bits);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));  // bf16: the top half of an fp32
}

// A slice's 16 columns at one k, as two 8-float registers.
template <Format F>
inline void load_slice(const uint16_t* w, __m256& low, __m256& high) {
  low = load8<F>(w);
  high = load8<F>(w + 8);
}

// The first `cols` (<= 16) of a slice's sums, plus the bias, into a row of the output.
inline void store_slice(float* out, __m256 low, __m256 high, const float* bias, int64_t cols) {
  alignas(32) float sums[kSlice];
  _mm256_store_ps(sums, low);
  _mm256_store_ps(sums + 8, high);
  for (int64_t c = 0; c < cols; ++c) out[c] = bias == nullptr ? sums[c] : sums[c] + bias[c];
}

template <Format F, int R>
void few_rows(const float* x, int64_t k_size, const uint16_t* w, const float* bias, float* out, int64_t ld,
              int64_t cols) {
  __m256 acc[R][3][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ss(x + r * k_size + k);
    for (int c = 0; c < 3; ++c) {
      const uint16_t* wc = w + (c * k_size + k) * kSlice;
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wc) + kPrefetchBytes, _MM_HINT_T0);
      __m256 low, high;
      load_slice<F>(wc, low, high);
      for (int r = 0; r < R; ++r) {
        acc[r][c][0] = _mm256_fmadd_ps(xv[r], low, acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(xv[r], high, acc[r][c][1]);
      }
    }
  }
  for (int c = 0; c < 3 && cols > c * kSlice; ++c)
    for (int r = 0; r < R; ++r)
      store_slice(out + r * ld + c * kSlice, acc[r][c][0], acc[r][c][1], bias == nullptr ? nullptr : bias + c * kSlice,
                  std::min(kSlice, cols - c * kSlice));
}

template <Format F, int R>
void many_rows(const float* x, int64_t k_size, const uint16_t* w, const float* bias, float* out, int64_t ld,
               int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * kSlice) + kPrefetchBytes, _MM_HINT_T0);
    __m256 low, high;
    load_slice<F>(w + k * kSlice, low, high);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k_size + k);
      acc[r][0] = _mm256_fmadd_ps(xv, low, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, high, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) store_slice(out + r * ld, acc[r][0], acc[r][1], bias, cols);
}
#define KNAPSPEC_HALF_LINEAR 1
#endif

#ifdef KNAPSPEC_HALF_LINEAR
using BlockFn = void (*)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t);

template <Format F, int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs) + 1> few_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, few_rows<F, Rs + 1>...};
}
template <Format F, int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs) + 1> many_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, many_rows<F, Rs + 1>...};
}

template <Format F>
void multiply(const float* xp, int64_t m, int64_t k, const uint16_t* wp, int64_t num_slices, const float* bp,
              float* op, int64_t n) {
  static constexpr auto kFew = few_table<F>(std::make_integer_sequence<int, kFewRows>{});
  static constexpr auto kMany = many_table<F>(std::make_integer_sequence<int, kManyRows>{});
  if (m > 0 && m <= kFewRows) {
    constexpr int64_t per_panel = kPanel / kSlice;
    at::parallel_for(0, num_slices / per_panel, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end && p * kPanel < n; ++p) {
        kFew[m](xp, k, wp + p * per_panel * k * kSlice, bp == nullptr ? nullptr : bp + p * kPanel, op + p * kPanel, n,
                std::min(kPanel, n - p * kPanel));
      }
    });
  } else if (m > kFewRows) {
    at::parallel_for(0, num_slices, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end && s * kSlice < n; ++s) {
        for (int64_t r = 0; r < m; r += kManyRows) {
          const int64_t rows = std::min<int64_t>(kManyRows, m - r);
          kMany[rows](xp + r * k, k, wp + s * k * kSlice, bp == nullptr ? nullptr : bp + s * kSlice,
                      op + r * n + s * kSlice, n, std::min(kSlice, n - s * kSlice));
        }
      }
    });
  }
}
#endif

}  // namespace

bool half_linear_available() {
#ifdef KNAPSPEC_HALF_LINEAR
  return true;
#else
  return false;
#endif
}

// `bf16`: the weights kept in bf16, else in fp16.
torch::Tensor half_linear_pack(const torch::Tensor& weight, bool bf16) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_floating_point(), "weight: [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t slices = (n + kPanel - 1) / kPanel * (kPanel / kSlice);
  torch::Tensor padded = torch::zeros({slices * kSlice, k}, weight.options().dtype(torch::kFloat32));
  padded.narrow(0, 0, n).copy_(weight);
  // [slices, K, 16]: a slice's weights for one k are 32 contiguous bytes, its k's follow each other.
  return padded.view({slices, kSlice, k}).transpose(1, 2).contiguous().to(bf16 ? torch::kBFloat16 : torch::kHalf);
}

torch::Tensor half_linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features,
                          const c10::optional<torch::Tensor>& out_in) {
  TORCH_CHECK(half_linear_available(), "half_linear needs a build with AVX-512, or AVX2 with F16C");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2, "x: [rows, in] fp32");
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((packed.scalar_type() == torch::kHalf || bf16) && packed.dim() == 3 && packed.size(2) == kSlice &&
                  packed.size(1) == x_in.size(1) && packed.size(0) * kSlice >= out_features &&
                  packed.size(0) % (kPanel / kSlice) == 0 && packed.is_contiguous(),
              "packed: half_linear_pack's [slices, in, 16] for x's in_features");
  const torch::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias: [out] fp32");
    bp = bias->data_ptr<float>();
  }
  torch::Tensor out;
  if (out_in.has_value() && out_in->defined()) {
    out = *out_in;
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == m &&
                    out.size(1) == n,
                "out: contiguous [rows, out_features] fp32");
  } else {
    out = torch::empty({m, n}, x.options());
  }
#ifdef KNAPSPEC_HALF_LINEAR
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  if (bf16) {
    multiply<Format::kBf16>(xp, m, k, wp, packed.size(0), bp, op, n);
  } else {
    multiply<Format::kFp16>(xp, m, k, wp, packed.size(0), bp, op, n);
  }
#endif
  return out;
}
