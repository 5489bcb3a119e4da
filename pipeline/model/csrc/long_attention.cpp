// Causal attention of a prompt chunk in bf16, for x86 CPUs with AVX512-BF16: the chunk's
// queries against the keys before it and its own, both products through the CPU's bf16 dot
// product (vdpbf16ps: 32 bf16 pairs into 16 fp32 sums per instruction), the softmax in fp32,
// online over blocks of 64 keys (flash attention's recurrence).
//
// PyTorch's CPU flash kernel runs bf16 at the speed of its fp32 path where the CPU has
// AVX512-BF16 but no AMX (~150 GFLOP/s on 2 cores of an AMD EPYC whose bf16 matmuls reach
// ~900): at 4k-8k prompt tokens a chunk's attention was most of its time there.
//
// Layout: the keys are repacked per KV head into blocks of 64 keys whose head_dim pairs lie
// side by side ([block][dim pair][64 keys][2]), so one 64-byte load feeds 16 keys' dot products;
// the values into pairs of consecutive keys ([key pair][head_dim][2]), so one load feeds 16
// output dims of two keys. A tile of 4 query rows reads each loaded vector 4 times.
//
// A row's result depends on its query, its keys and the fixed blocking (key blocks of 64 from
// position 0, rows in tiles of 4 from the chunk's first row), never on the thread that runs it
// nor on what else the forward carries: a request's chunk gives the same bits alone and in a
// batch. The probabilities are rounded to bf16 before their product with the values, as a bf16
// flash kernel rounds them; the sums, the maximum and the normalization stay fp32.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_exp.h"

#ifdef __AVX512F__

namespace {

constexpr int64_t kKeys = 64;    // keys per block: 4 vectors of 16 scores per query row
constexpr int64_t kRows = 4;     // query rows per tile
constexpr int64_t kQBlock = 64;  // query rows per task: its key blocks stay in L2 while its tiles read them
constexpr int64_t kDims = 64;    // output dims per pass over a block's values: 4 vectors per row

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

BF16_TARGET inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

BF16_TARGET inline __m512i broadcast_pair(const uint32_t* p) { return _mm512_set1_epi32(static_cast<int>(*p)); }

// keys [KV, S, D] bf16 -> [KV][blocks][D / 2][64][2], zeros past the S used keys.
void pack_keys(const uint32_t* keys, uint32_t* packed, int64_t kv_heads, int64_t stride, int64_t used,
               int64_t pairs, int64_t blocks) {
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, block = task % blocks;
      uint32_t* out = packed + task * pairs * kKeys;
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t key = block * kKeys + j;
        const uint32_t* row = keys + (head * stride + key) * pairs;
        for (int64_t p = 0; p < pairs; ++p) out[p * kKeys + j] = key < used ? row[p] : 0u;
      }
    }
  });
}

// values [KV, S, D] bf16 -> [KV][key pairs][D][2], zeros past the S used keys.
void pack_values(const uint16_t* values, uint16_t* packed, int64_t kv_heads, int64_t stride, int64_t used,
                 int64_t dims, int64_t key_pairs) {
  at::parallel_for(0, kv_heads * key_pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / key_pairs, pair = task % key_pairs;
      uint16_t* out = packed + task * dims * 2;
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t key = 2 * pair + half;
        const uint16_t* row = values + (head * stride + key) * dims;
        for (int64_t d = 0; d < dims; ++d) out[2 * d + half] = key < used ? row[d] : uint16_t{0};
      }
    }
  });
}

struct Chunk {
  const uint32_t* q;        // [H, T, D / 2] bf16 pairs
  const uint32_t* keys;     // pack_keys
  const uint16_t* values;   // pack_values
  float* out;               // [T, H * D]
  int64_t heads, groups, rows, dims, start, blocks, key_pairs;
  float scale;
};

// Rows [first, first + count) of one head: a task.
BF16_TARGET void attend_rows(const Chunk& c, int64_t head, int64_t first, int64_t count) {
  const int64_t pairs = c.dims / 2, kv = head / c.groups;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  // Running state per row (a tile past the last row computes on copies of it into spare rows).
  std::vector<float> sums((kQBlock + kRows) * c.dims, 0.0f), most(kQBlock + kRows, minus_inf),
      total(kQBlock + kRows, 0.0f);
  alignas(64) uint16_t probs[kRows][kKeys];
  alignas(64) float rescale[kRows];
  const int64_t last_key = c.start + first + count - 1;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t block = 0; block * kKeys <= last_key; ++block) {
    const uint32_t* kblock = c.keys + (kv * c.blocks + block) * pairs * kKeys;
    for (int64_t t = 0; t < count; t += kRows) {
      if (block * kKeys > c.start + first + std::min(t + kRows, count) - 1) continue;  // no row of the tile sees it
      const uint32_t* q[kRows];
      int64_t limit[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = first + std::min(t + r, count - 1);
        q[r] = c.q + (head * c.rows + row) * pairs;
        limit[r] = c.start + first + t + r;  // the row's last visible key (a spare row's: past the block)
      }
      // Scores of 4 rows x 64 keys.
      __m512 acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512i* kp = reinterpret_cast<const __m512i*>(kblock + p * kKeys);
        const __m512i k0 = _mm512_loadu_si512(kp), k1 = _mm512_loadu_si512(kp + 1), k2 = _mm512_loadu_si512(kp + 2),
                      k3 = _mm512_loadu_si512(kp + 3);
        for (int r = 0; r < kRows; ++r) {
          const __m512i a = broadcast_pair(q[r] + p);
          acc[r][0] = dot(acc[r][0], a, k0);
          acc[r][1] = dot(acc[r][1], a, k1);
          acc[r][2] = dot(acc[r][2], a, k2);
          acc[r][3] = dot(acc[r][3], a, k3);
        }
      }
      // Online softmax: the block's probabilities (bf16) and each row's rescaling of its sums.
      for (int r = 0; r < kRows; ++r) {
        const int64_t state = t + r;
        const bool spare = t + r >= count;
        __mmask16 visible[4];
        __m512 s[4];
        __m512 high = _mm512_set1_ps(minus_inf);
        for (int v = 0; v < 4; ++v) {
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(block * kKeys + 16 * v)), lane);
          visible[v] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(limit[r])));
          s[v] = _mm512_mask_mov_ps(_mm512_set1_ps(minus_inf), visible[v], _mm512_mul_ps(acc[r][v], _mm512_set1_ps(c.scale)));
          high = _mm512_max_ps(high, s[v]);
        }
        const float previous = most[state];
        const float now = std::max(previous, _mm512_reduce_max_ps(high));  // finite: key 0 is always visible
        const __m512 shift = _mm512_set1_ps(now);
        __m512 mass = _mm512_setzero_ps();
        __m512 p[4];
        for (int v = 0; v < 4; ++v) {
          p[v] = _mm512_maskz_mov_ps(visible[v], exp_nonpositive(_mm512_sub_ps(s[v], shift)));
          mass = _mm512_add_ps(mass, p[v]);
        }
        const float factor = previous == minus_inf ? 0.0f : _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(previous - now)));
        if (!spare) {
          most[state] = now;
          total[state] = total[state] * factor + _mm512_reduce_add_ps(mass);
        }
        rescale[r] = factor;
        _mm512_store_si512(reinterpret_cast<__m512i*>(probs[r]), (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        _mm512_store_si512(reinterpret_cast<__m512i*>(probs[r] + 32), (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
      }
      // Sums of values: 4 rows x 64 dims per pass, two keys per dot product.
      const uint16_t* vblock = c.values + (kv * c.key_pairs + block * (kKeys / 2)) * c.dims * 2;
      for (int64_t d0 = 0; d0 < c.dims; d0 += kDims) {
        __m512 o[kRows][4];
        for (int r = 0; r < kRows; ++r) {
          const __m512 f = _mm512_set1_ps(rescale[r]);
          for (int v = 0; v < 4; ++v) o[r][v] = _mm512_mul_ps(_mm512_loadu_ps(&sums[(t + r) * c.dims + d0 + 16 * v]), f);
        }
        for (int64_t m = 0; m < kKeys / 2; ++m) {
          const __m512i* vp = reinterpret_cast<const __m512i*>(vblock + (m * c.dims + d0) * 2);
          const __m512i v0 = _mm512_loadu_si512(vp), v1 = _mm512_loadu_si512(vp + 1), v2 = _mm512_loadu_si512(vp + 2),
                        v3 = _mm512_loadu_si512(vp + 3);
          for (int r = 0; r < kRows; ++r) {
            const __m512i a = broadcast_pair(reinterpret_cast<const uint32_t*>(probs[r]) + m);
            o[r][0] = dot(o[r][0], a, v0);
            o[r][1] = dot(o[r][1], a, v1);
            o[r][2] = dot(o[r][2], a, v2);
            o[r][3] = dot(o[r][3], a, v3);
          }
        }
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < 4; ++v) _mm512_storeu_ps(&sums[(t + r) * c.dims + d0 + 16 * v], o[r][v]);
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total[i]);
    float* out = c.out + (first + i) * c.heads * c.dims + head * c.dims;
    for (int64_t d = 0; d < c.dims; d += 16)
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(&sums[i * c.dims + d]), inverse));
  }
}

}  // namespace

// q [H, T, D] bf16 (a chunk's queries, unscaled) at positions [start, start + T), over keys and
// values [KV, S >= start + T, D] bf16 -> out [T, H * D] fp32 (written in place).
void long_attention_bf16(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                         int64_t start, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "q [H, T, D], keys/values [KV, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "bf16 queries, keys and values");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous inputs");
  const int64_t heads = q.size(0), rows = q.size(1), dims = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(dims % kDims == 0 && keys.size(2) == dims, "head_dim must be a multiple of 64, got ", dims);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(start >= 0 && start + rows <= keys.size(1), "the chunk's keys past the given keys");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == rows * heads * dims,
              "out: contiguous fp32 [T, H * D]");
  const int64_t used = start + rows, blocks = (used + kKeys - 1) / kKeys, key_pairs = blocks * kKeys / 2;
  const int64_t pairs = dims / 2, stride = keys.size(1);
  auto packed_keys = torch::empty({kv_heads * blocks * pairs * kKeys * 2}, keys.options());
  auto packed_values = torch::empty({kv_heads * key_pairs * dims * 2}, values.options());
  pack_keys(reinterpret_cast<const uint32_t*>(keys.data_ptr()), reinterpret_cast<uint32_t*>(packed_keys.data_ptr()),
            kv_heads, stride, used, pairs, blocks);
  pack_values(reinterpret_cast<const uint16_t*>(values.data_ptr()),
              reinterpret_cast<uint16_t*>(packed_values.data_ptr()), kv_heads, stride, used, dims, key_pairs);
  const Chunk chunk{reinterpret_cast<const uint32_t*>(q.data_ptr()),
                    reinterpret_cast<const uint32_t*>(packed_keys.data_ptr()),
                    reinterpret_cast<const uint16_t*>(packed_values.data_ptr()),
                    out.data_ptr<float>(),
                    heads, heads / kv_heads, rows, dims, start, blocks, key_pairs, static_cast<float>(scale)};
  const int64_t q_blocks = (rows + kQBlock - 1) / kQBlock;
  // Head-major tasks: each thread's share of heads holds every length of causal row alike.
  at::parallel_for(0, heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / q_blocks, first = (task % q_blocks) * kQBlock;
      attend_rows(chunk, head, first, std::min(kQBlock, rows - first));
    }
  });
}

#else

void long_attention_bf16(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int64_t, double,
                         torch::Tensor&) {
  TORCH_CHECK(false, "the bf16 long-block attention needs a build with AVX-512");
}

#endif
