// SiLU(gate) * up for the rows of an MLP, in the kernel build's modes. PyTorch's element-wise
// kernels run most elements through a vector path and the tail of each thread's range through a
// scalar one, with another exp; where a range ends depends on how many rows share the call and
// how many threads run it, so a row could round otherwise in a batch than alone (a 5-row verify
// of an 8B-shaped MLP on 3 threads: 3 elements; rows of a width that is no multiple of the
// vector: already on one thread). Here every element takes the same vector path, a row's last
// few through a masked (AVX-512) or padded (AVX2) vector: its bits depend on its value alone.
//
// silu(g) = g * sigmoid(g), sigmoid from t = e^-|g| (never overflows): 1 / (1 + t) for g >= 0,
// t / (1 + t) below.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "vec_exp.h"

namespace {

// Elements per task where a prefill chunk has millions: enough work to pay for a thread.
constexpr int64_t kGrain = 1 << 15;

#ifdef __AVX512F__
constexpr int64_t kWidth = 16;

inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, t), _mm512_add_ps(one, t));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

void row(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kWidth) {
    const __mmask16 keep = n - j >= kWidth ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 y = silu_mul(_mm512_maskz_loadu_ps(keep, g + j), _mm512_maskz_loadu_ps(keep, u + j));
    _mm512_mask_storeu_ps(out + j, keep, y);
  }
}
#else
constexpr int64_t kWidth = 8;

inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 t = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, t, negative), _mm256_add_ps(one, t));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

void row(const float* g, const float* u, float* out, int64_t n) {
  const int64_t whole = n / kWidth * kWidth;
  for (int64_t j = 0; j < whole; j += kWidth)
    _mm256_storeu_ps(out + j, silu_mul(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (whole < n) {
    alignas(32) float gt[kWidth] = {}, ut[kWidth] = {}, yt[kWidth];
    std::copy(g + whole, g + n, gt);
    std::copy(u + whole, u + n, ut);
    _mm256_store_ps(yt, silu_mul(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::copy(yt, yt + (n - whole), out + whole);
  }
}
#endif

}  // namespace

// gate_up: [rows, 2 * I] fp32 with unit stride along its last dimension, the gate's I columns
// then the up's (the fused gate_up linear's output). Returns [rows, I] contiguous.
torch::Tensor silu_mul_rows(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up: [rows, 2 * I] fp32 with unit stride along its last dimension");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows_per_task = std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, rows_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(gp + r * stride, gp + r * stride + n, op + r * n, n);
  });
  return out;
}
