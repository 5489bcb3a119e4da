// y = x W^T + b for fp32 rows x and fp16 weights W, accumulated in fp32: the fp16w mode's
// linears for decode and verify blocks (up to a few dozen rows), where CPUs with AVX-512 have it.
//
// FBGEMM's fp16 kernel, which the mode used alone before, ran SmolLM2's linears at ~15 GB/s of
// weights for one row and ~40% of the cores' fp32 FMA peak for 16 rows on a 2-core Xeon. Here
// each thread streams its own run of panels (48 output columns, K-major) with the weights asked
// for ahead, converts a panel row of weights once per block of up to 8 input rows and feeds 24
// independent FMA chains: over a whole model's weights, 0.6-0.8x FBGEMM's time at 1 to 32 rows.
//
// Every output element is one FMA chain over k in ascending order, then the bias: its bits
// depend on its row and column alone, not on how many rows came with it or where they sat,
// so a request gives the same bits alone and in a batch. (On the CPUs measured that is also
// FBGEMM's AVX-512 order: the outputs are bit-equal to it.)
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 48;   // output columns per panel: three 16-float registers
constexpr int kBlockRows = 8;    // input rows per pass: 24 accumulators, 3 weights, 1 broadcast
// How far ahead of its reads a pass asks for weights: the hardware prefetcher alone left a
// 1-row product at ~0.75 of what the memory gives and did not overlap loads with the FMAs of
// 8-16 rows (their time was the sum of both); a few KB ahead (~40 k's of a panel, past the
// latency of memory at its bandwidth per core) took a whole model's linears ~25-30% less time.
constexpr int64_t kPrefetchBytes = 4096;

#ifdef __AVX512F__
template <int R>
void block(const float* x, int64_t k_size, const uint16_t* w, const float* bias, float* out, int64_t ld,
           int64_t cols) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const uint16_t* row = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);  // past a panel: the next one
    const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    const __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)));
    const __m512 w2 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_size + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
    }
  }
  for (int c = 0; c < 3; ++c) {
    const int64_t left = cols - c * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c * 16);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ld + c * 16, mask, _mm512_add_ps(acc[r][c], b));
  }
}

using BlockFn = void (*)(const float*, int64_t, const uint16_t*, const float*, float*, int64_t, int64_t);
constexpr BlockFn kBlocks[kBlockRows + 1] = {nullptr,  block<1>, block<2>, block<3>, block<4>,
                                             block<5>, block<6>, block<7>, block<8>};
#endif

}  // namespace

bool fp16_linear_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

torch::Tensor fp16_linear_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_floating_point(), "weight: [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  torch::Tensor padded = torch::zeros({panels * kPanel, k}, weight.options().dtype(torch::kFloat32));
  padded.narrow(0, 0, n).copy_(weight);
  // [panels, K, 48]: a panel's weights for one k are 96 contiguous bytes, its k's follow each other.
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous().to(torch::kHalf);
}

torch::Tensor fp16_linear(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features, const c10::optional<torch::Tensor>& out_in) {
  TORCH_CHECK(fp16_linear_available(), "fp16_linear needs a build with AVX-512");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2, "x: [rows, in] fp32");
  TORCH_CHECK(packed.scalar_type() == torch::kHalf && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.size(1) == x_in.size(1) && packed.size(0) * kPanel >= out_features &&
                  packed.is_contiguous(),
              "packed: fp16_linear_pack's [panels, in, 48] for x's in_features");
  const torch::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n, "bias: [out] fp32");
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
#ifdef __AVX512F__
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end && p * kPanel < n; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t r = 0; r < m; r += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, m - r));
        kBlocks[rows](xp + r * k, k, wp + p * k * kPanel, bp == nullptr ? nullptr : bp + p * kPanel,
                      op + r * n + p * kPanel, n, cols);
      }
    }
  });
#endif
  return out;
}
