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
//
// bf16 rows (a prefill chunk's products in fp16w-bf16 and bf16) are widened, run through the same
// fp32 path and rounded to bf16 once, to nearest even as PyTorch rounds: the bits of widening the
// tensor, the fp32 kernel and `.to(bfloat16)`, without the fp32 tensors (a chunk's gate and up are
// 50 MB in fp32, and allocating that much costs more than the arithmetic).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t round_to_bf16(float value) {  // as PyTorch's vectorized conversion: NaN to all ones
  if (value != value) return 0xFFFF;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void bf16_rows(const uint16_t* gp, int64_t stride, uint16_t* op, int64_t n, int64_t begin, int64_t end) {
  std::vector<float> wide(3 * n);
  float *g = wide.data(), *u = g + n, *y = u + n;
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* in = gp + r * stride;
    for (int64_t j = 0; j < n; ++j) g[j] = widen(in[j]);
    for (int64_t j = 0; j < n; ++j) u[j] = widen(in[n + j]);
    row(g, u, y, n);
    for (int64_t j = 0; j < n; ++j) op[r * n + j] = round_to_bf16(y[j]);
  }
}

}  // namespace

// gate_up: [rows, 2 * I] fp32 with unit stride along its last dimension, the gate's I columns
// then the up's (the fused gate_up linear's output). Returns [rows, I] contiguous.
torch::Tensor silu_mul_rows(const torch::Tensor& gate_up) {
  const bool bf16 = gate_up.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(gate_up.dim() == 2 && (gate_up.scalar_type() == torch::kFloat32 || bf16) && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up: [rows, 2 * I] fp32 or bf16 with unit stride along its last dimension");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows_per_task = std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
  if (bf16) {
    const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, rows, rows_per_task, [&](int64_t begin, int64_t end) { bf16_rows(gp, stride, op, n, begin, end); });
    return out;
  }
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(gp + r * stride, gp + r * stride + n, op + r * n, n);
  });
  return out;
}
