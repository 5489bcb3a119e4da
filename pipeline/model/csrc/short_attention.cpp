// Attention of short query blocks (decode, verify) over a KV cache, for x86 CPUs with AVX2
// and FMA: one pass over each key and value, the scores of every query row of a KV head
// computed while its keys are in cache, softmax and the weighted sum of values fused
// (flash decoding: chunks of keys in parallel, combined exactly at the end).
//
// Built with AVX-512 where the CPU has it (__AVX512F__): the dot products, the exponentials
// and the sums of values then run 16 floats wide, and a row tile's sums of values cover 64
// floats of head_dim per pass over the values instead of 16. The two builds round alike in
// structure but not in bits; one machine runs one build, so alone and batched still agree.
//
// Each row's result depends only on its query, its keys and their fixed chunking, never on
// which other rows or requests share the call, so a request gives the same bits alone and
// inside a batch.
//
// Keys and values are fp32 (the fp16w mode's cache) or bf16 (the bf16 mode's), widened exactly
// to fp32 as they are loaded: the arithmetic, and so the bits, are those of the fp32 kernel over
// the widened cache.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_exp.h"

namespace {

// Keys per task: a chunk's keys and values of one head (2 x 256 x head_dim floats) stay
// in L2 while every query row of the head reads them.
constexpr int64_t kChunk = 256;
constexpr int64_t kRowTile = 4;

// A task fetches the next task's keys and values (`ahead`, or null) while it computes. Into
// L2: the two chunks (2 x 64 KB at head_dim 64) do not fit an L1 beside the ones being read.
// Each row tile of the task fetches its share (every `shares`-th step), so the fetches spread
// over the whole task: issued by the first tile alone they came in a burst that filled the
// core's miss buffers and stalled its arithmetic, and a multi-row task's memory time and
// compute time added up. (On a 2-core Xeon these three, L2, the next task whatever its head,
// the spread, took 4 tokens' attention over 30 layers at 4k context ~16% less time than the
// same head's next chunk fetched into L1 by the first tile; one token ~10%, a batch of 8 at
// 4k ~9-12%.)
template <typename T>
inline void fetch(const T* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// 8 keys' or values' floats from fp32, or from bf16 (its bits the top half of an fp32's).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// A 16-lane accumulator folded to 8 lanes (its halves added), for tile_sums.
inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// The sums of a 4-row x 4-key tile's accumulators a[4 * row + key], as lane 4 * key + row:
// four rounds of adding the halves of two vectors, every lane of every vector paired the
// same way, so each sum has one order wherever it lies in a tile.
inline __m512 tile_sums(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  // u[i]: 128-bit block b holds the four partial sums of a[4 * i + b]
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x88), _mm512_shuffle_ps(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_ps(v0, v1, 0x88), _mm512_shuffle_ps(v0, v1, 0xDD));
}
#endif

// The sums of a 4-row x 2-key tile's accumulators, as [r0k0, r0k1, r1k0, r1k1, ..., r3k1]:
// every pair is summed in the same order wherever it lies in a tile.
inline __m256 tile_sums(const __m256* a0, const __m256* a1) {
  const __m256 h01 = _mm256_hadd_ps(_mm256_hadd_ps(a0[0], a1[0]), _mm256_hadd_ps(a0[1], a1[1]));
  const __m256 h23 = _mm256_hadd_ps(_mm256_hadd_ps(a0[2], a1[2]), _mm256_hadd_ps(a0[3], a1[3]));
  // h01 = [r0k0, r0k1, r1k0, r1k1] over lanes 0-3 | the same over lanes 4-7; h23 for rows 2, 3
  const __m256 low = _mm256_permute2f128_ps(h01, h23, 0x20), high = _mm256_permute2f128_ps(h01, h23, 0x31);
  return _mm256_add_ps(low, high);
}

// Scores of rows [m0, m0 + rows) against keys [0, num_keys) of a chunk, four rows at a time
// (by four keys with AVX-512, by two with AVX2); q holds whole tiles of rows (zero-padded).
// Keys past the last are the last again: a key's score never depends on its neighbours.
// `ahead`: the next task's keys, so that a one-row decode at long context streams memory
// instead of waiting on each chunk's first miss (the AVX-512 build without it took a 1-row
// decode's attention over 30 layers at 4k context ~9% longer, at 1k ~30%, on a 2-core Xeon).
template <int64_t D, typename T>
void tile_scores(const float* q, const T* keys, int64_t key_stride, int64_t m0, int64_t rows,
                 int64_t num_keys, float* scores, const T* ahead, int64_t share, int64_t shares) {
#ifdef __AVX512F__
  static_assert(D % 16 == 0, "head_dim in steps of 16");
  constexpr int64_t kKeys = 4;
  alignas(64) float sums[16];
  for (int64_t j = 0; j < num_keys; j += kKeys) {
    if (ahead && (j / kKeys) % shares == share) {
      for (int64_t t = 0; t < kKeys; ++t)
        for (int64_t l = 0; l < D; l += 16) fetch(ahead + (j + t) * key_stride + l);
    }
    const T* k[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) k[t] = keys + std::min(j + t, num_keys - 1) * key_stride;
    __m512 a[kRowTile * kKeys];
    for (int64_t i = 0; i < kRowTile * kKeys; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 x[kKeys];
      for (int64_t t = 0; t < kKeys; ++t) x[t] = load16(k[t] + d);
      for (int64_t i = 0; i < kRowTile; ++i) {
        const __m512 qi = _mm512_loadu_ps(q + (m0 + i) * D + d);
        for (int64_t t = 0; t < kKeys; ++t) a[kKeys * i + t] = _mm512_fmadd_ps(qi, x[t], a[kKeys * i + t]);
      }
    }
    _mm512_store_ps(sums, tile_sums(a));
    // kChunk is a multiple of kKeys: a row's padding stays inside its own kChunk floats.
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t t = 0; t < kKeys; ++t) scores[(m0 + i) * kChunk + j + t] = sums[kRowTile * t + i];
  }
#else
  for (int64_t j = 0; j < num_keys; j += 2) {
    if (ahead && (j / 2) % shares == share) {
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t l = 0; l < D; l += 16) fetch(ahead + (j + t) * key_stride + l);
    }
    const T* k0 = keys + j * key_stride;
    const T* k1 = j + 1 < num_keys ? k0 + key_stride : k0;
    __m256 a0[kRowTile], a1[kRowTile];
    for (int64_t i = 0; i < kRowTile; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x0 = load8(k0 + d), x1 = load8(k1 + d);
      for (int64_t i = 0; i < kRowTile; ++i) {
        const __m256 qi = _mm256_loadu_ps(q + (m0 + i) * D + d);
        a0[i] = _mm256_fmadd_ps(qi, x0, a0[i]);
        a1[i] = _mm256_fmadd_ps(qi, x1, a1[i]);
      }
    }
    const __m256 pairs = tile_sums(a0, a1);
    const __m128 low = _mm256_castps256_ps128(pairs), high = _mm256_extractf128_ps(pairs, 1);
    float* row = scores + m0 * kChunk + j;  // k1's score is the row's padding when j + 1 = num_keys
    _mm_storel_pi(reinterpret_cast<__m64*>(row), low);
    _mm_storeh_pi(reinterpret_cast<__m64*>(row + kChunk), low);
    _mm_storel_pi(reinterpret_cast<__m64*>(row + 2 * kChunk), high);
    _mm_storeh_pi(reinterpret_cast<__m64*>(row + 3 * kChunk), high);
  }
#endif
}

// One row's softmax numerators over a chunk, in place: e^(s - max) for its n keys and 0 up
// to `reach` (the row tile's keys), with their max and sum.
inline void row_softmax(float* s, int64_t n, int64_t reach, float* max_out, float* sum_out) {
  // The maximum is exact in any order: eight or sixteen lanes, then across them.
#ifdef __AVX512F__
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j + 16 <= n; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  float most = _mm512_reduce_max_ps(top);
  for (int64_t j = n / 16 * 16; j < n; ++j) most = std::max(most, s[j]);
  const __m512 m = _mm512_set1_ps(most);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    // The last vector's lanes past n: their scores are not read, their numerators are 0.
    const __mmask16 keep = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(m, keep, s + j);
    const __m512 p = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(x, m)));
    _mm512_mask_storeu_ps(s + j, keep, p);
    total = _mm512_add_ps(total, p);
  }
  std::fill(s + n, s + std::max(n, reach), 0.0f);
  *max_out = most;
  *sum_out = hsum(fold(total));
#else
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float most = *std::max_element(lanes, lanes + 8);
  for (int64_t j = n / 8 * 8; j < n; ++j) most = std::max(most, s[j]);
  const __m256 m = _mm256_set1_ps(most);
  const int64_t whole = n / 8 * 8;
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, p);
    total = _mm256_add_ps(total, p);
  }
  if (whole < n) {
    alignas(32) float tail[8];
    alignas(32) int32_t keep[8];
    for (int64_t t = 0; t < 8; ++t) {
      tail[t] = whole + t < n ? s[whole + t] : most;
      keep[t] = whole + t < n ? -1 : 0;
    }
    __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), m));
    p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(keep))));
    _mm256_store_ps(tail, p);
    for (int64_t t = 0; whole + t < n; ++t) s[whole + t] = tail[t];
    total = _mm256_add_ps(total, p);
  }
  std::fill(s + n, s + std::max(n, reach), 0.0f);
  *max_out = most;
  *sum_out = hsum(total);
#endif
}

// The unnormalized weighted sums of values for rows [m0, m0 + rows) over keys [0, reach):
// four rows share each load of a value, 16 of its floats at a time (64 with AVX-512). A key
// past a row's own has weight 0, and fma(0, v, acc) is acc: a row's sums do not depend on
// its tile. Every row of the tile is stored (`out` has whole tiles): a store loop bounded by
// `rows` made GCC keep the sums in memory, a load and a store per FMA. `ahead`: the next
// task's values, fetched during the first pass.
template <int64_t D, typename T>
void tile_values(const float* scores, int64_t m0, int64_t rows, int64_t reach, const T* values,
                 int64_t value_stride, float* out, const T* ahead, int64_t share, int64_t shares) {
  const float* p[kRowTile];
  for (int64_t i = 0; i < kRowTile; ++i) p[i] = scores + (m0 + std::min(i, rows - 1)) * kChunk;
#ifdef __AVX512F__
  constexpr int64_t kSpan = D < 64 ? D : 64;  // floats of head_dim per pass: 4 rows x 4 registers at most
  constexpr int64_t kVecs = kSpan / 16;
  for (int64_t b = 0; b < D; b += kSpan) {
    __m512 acc[kRowTile][kVecs];
    for (int64_t i = 0; i < kRowTile; ++i)
      for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < reach; ++j) {
      if (ahead && b == 0 && j % shares == share)
        for (int64_t l = 0; l < D; l += 16) fetch(ahead + j * value_stride + l);
      const T* v = values + j * value_stride + b;
      __m512 x[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) x[c] = load16(v + 16 * c);
      for (int64_t i = 0; i < kRowTile; ++i) {
        const __m512 w = _mm512_set1_ps(p[i][j]);
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = _mm512_fmadd_ps(w, x[c], acc[i][c]);
      }
    }
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(out + (m0 + i) * D + b + 16 * c, acc[i][c]);
  }
#else
  for (int64_t b = 0; b < D; b += 16) {
    __m256 acc[kRowTile][2];
    for (int64_t i = 0; i < kRowTile; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < reach; ++j) {
      if (ahead && b == 0 && j % shares == share)
        for (int64_t l = 0; l < D; l += 16) fetch(ahead + j * value_stride + l);
      const T* v = values + j * value_stride + b;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
      for (int64_t i = 0; i < kRowTile; ++i) {
        const __m256 w = _mm256_broadcast_ss(p[i] + j);
        acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
      }
    }
    for (int64_t i = 0; i < kRowTile; ++i) {
      _mm256_storeu_ps(out + (m0 + i) * D + b, acc[i][0]);
      _mm256_storeu_ps(out + (m0 + i) * D + b + 8, acc[i][1]);
    }
  }
#endif
}

// The most keys any row sees. Read from the CPU tensor's memory, not through limits.max().item():
// an operator that would return a scalar to the host is what a device step must never run, and
// the checks of a step's forward look for it.
static int64_t max_limit(const torch::Tensor& limits) {
  const int32_t* lp = limits.data_ptr<int32_t>();
  int32_t most = 0;
  for (int64_t i = 0; i < limits.numel(); ++i) most = std::max(most, lp[i]);
  return most;
}

// T: the cache's element, float or uint16_t (bf16's bits).
template <int64_t D, typename T>
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& limits) {
  const int64_t num_slots = q.size(0), num_heads = q.size(1), num_rows = q.size(2), block = limits.size(1);
  const int64_t max_keys = max_limit(limits);
  const int64_t num_chunks = std::max<int64_t>((max_keys + kChunk - 1) / kChunk, 1);
  const int64_t groups = num_rows / block;
  auto options = q.options();
  const int64_t tiled_rows = (num_rows + kRowTile - 1) / kRowTile * kRowTile;
  auto partial = torch::empty({num_slots * num_heads, num_chunks, tiled_rows, D}, options);
  auto stats = torch::empty({num_slots * num_heads, num_chunks, num_rows, 2}, options);
  const float* qp = q.data_ptr<float>();
  const T* kp = static_cast<const T*>(keys.data_ptr());
  const T* vp = static_cast<const T*>(values.data_ptr());
  const int32_t* lp = limits.data_ptr<int32_t>();
  float* pp = partial.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  const int64_t k_head = keys.stride(0), k_key = keys.stride(1);
  const int64_t v_head = values.stride(0), v_key = values.stride(1);

  at::parallel_for(0, num_slots * num_heads * num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(tiled_rows * kChunk + 8);  // + 8: an odd key's pair
    std::vector<int64_t> counts(num_rows);
    std::vector<float> qtile(tiled_rows * D, 0.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / num_chunks, chunk = task % num_chunks, slot = head / num_heads;
      const int64_t first = chunk * kChunk;
      std::copy(qp + head * num_rows * D, qp + (head + 1) * num_rows * D, qtile.begin());
      const T* kh = kp + head * k_head + first * k_key;
      const T* vh = vp + head * v_head + first * v_key;
      for (int64_t m = 0; m < num_rows; ++m)
        counts[m] = std::clamp<int64_t>(lp[slot * block + m / groups] - first, 0, kChunk);
      float* out = pp + (head * num_chunks + chunk) * tiled_rows * D;
      float* st = sp + (head * num_chunks + chunk) * num_rows * 2;
      // The next task of this thread, of this head or the next: its chunk is fetched meanwhile.
      const bool more = task + 1 < end;
      const int64_t next_head = (task + 1) / num_chunks, next_first = (task + 1) % num_chunks * kChunk;
      const T* keys_ahead = more ? kp + next_head * k_head + next_first * k_key : nullptr;
      const T* values_ahead = more ? vp + next_head * v_head + next_first * v_key : nullptr;
      const int64_t shares = tiled_rows / kRowTile;
      for (int64_t m0 = 0; m0 < num_rows; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, num_rows - m0);
        const int64_t reach = *std::max_element(counts.begin() + m0, counts.begin() + m0 + rows);
        if (reach == 0) {
          std::fill(out + m0 * D, out + (m0 + rows) * D, 0.0f);
          for (int64_t m = m0; m < m0 + rows; ++m) st[2 * m] = -std::numeric_limits<float>::infinity(), st[2 * m + 1] = 0.0f;
          continue;
        }
        tile_scores<D>(qtile.data(), kh, k_key, m0, rows, reach, scores.data(), keys_ahead, m0 / kRowTile, shares);
        for (int64_t m = m0; m < m0 + rows; ++m) {
          if (counts[m] == 0) {
            std::fill(scores.data() + m * kChunk, scores.data() + m * kChunk + reach, 0.0f);
            st[2 * m] = -std::numeric_limits<float>::infinity(), st[2 * m + 1] = 0.0f;
          } else {
            row_softmax(scores.data() + m * kChunk, counts[m], reach, st + 2 * m, st + 2 * m + 1);
          }
        }
        tile_values<D>(scores.data(), m0, rows, reach, vh, v_key, out, values_ahead, m0 / kRowTile, shares);
      }
    }
  });

  auto result = torch::empty({num_slots, num_heads, num_rows, D}, options);
  float* rp = result.data_ptr<float>();
  at::parallel_for(0, num_slots * num_heads * num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t head = index / num_rows, m = index % num_rows;
      float most = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < num_chunks; ++c)
        most = std::max(most, sp[((head * num_chunks + c) * num_rows + m) * 2]);
      float* out = rp + index * D;
      std::fill(out, out + D, 0.0f);
      if (most == -std::numeric_limits<float>::infinity()) continue;  // a row that sees no key
      float total = 0.0f;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const float* st = sp + ((head * num_chunks + c) * num_rows + m) * 2;
        if (st[1] == 0.0f) continue;
        const float w = std::exp(st[0] - most);
        total += w * st[1];
        const float* part = pp + ((head * num_chunks + c) * tiled_rows + m) * D;
        for (int64_t d = 0; d < D; ++d) out[d] += w * part[d];
      }
      for (int64_t d = 0; d < D; ++d) out[d] /= total;
    }
  });
  return result;
}

}  // namespace

// q [slots, kv_heads, T * groups, head_dim] fp32 contiguous, already scaled: each KV head's
// rows by position, then query head (row m is position m / groups of the slot's block);
// keys and values [slots * kv_heads, >= keys seen, head_dim], both fp32 or both bf16, with unit
// stride along head_dim; limits [slots, T] int32: position t of a slot's block attends to its keys
// [0, limit). Returns [slots, kv_heads, T * groups, head_dim]. Rows by position keep a
// block's padding (positions past a slot's own rows) out of its real rows' tiles.
torch::Tensor short_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor limits) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: [S, H, M, D] fp32 contiguous");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.stride(2) == 1 && values.stride(2) == 1,
              "keys/values: [S * H, n, D] with unit stride along D");
  const bool bf16 = keys.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((keys.scalar_type() == torch::kFloat32 || bf16) && values.scalar_type() == keys.scalar_type(),
              "keys/values: both fp32 or both bf16");
  TORCH_CHECK(keys.size(0) == q.size(0) * q.size(1) && values.size(0) == keys.size(0), "one key head per (slot, head)");
  TORCH_CHECK(limits.dim() == 2 && limits.scalar_type() == torch::kInt32 && limits.is_contiguous() &&
                  limits.size(0) == q.size(0) && limits.size(1) > 0 && q.size(2) % limits.size(1) == 0,
              "limits: [S, T] int32, T dividing q's rows");
  TORCH_CHECK(max_limit(limits) <= keys.size(1), "a limit past the keys");
  switch (q.size(3)) {
    case 16: return bf16 ? attend<16, uint16_t>(q, keys, values, limits) : attend<16, float>(q, keys, values, limits);
    case 32: return bf16 ? attend<32, uint16_t>(q, keys, values, limits) : attend<32, float>(q, keys, values, limits);
    case 64: return bf16 ? attend<64, uint16_t>(q, keys, values, limits) : attend<64, float>(q, keys, values, limits);
    case 128:
      return bf16 ? attend<128, uint16_t>(q, keys, values, limits) : attend<128, float>(q, keys, values, limits);
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64 or 128, got ", q.size(3));
  }
}

torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);  // row_norm.cpp
torch::Tensor silu_mul_rows(const torch::Tensor& gate_up);  // silu_mul.cpp
// half_linear.cpp
bool half_linear_available();
torch::Tensor half_linear_pack(const torch::Tensor& weight, bool bf16);
torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features, const c10::optional<torch::Tensor>& out);
// long_attention.cpp
void long_attention_bf16(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                         int64_t start, double scale, torch::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("short_attention", &short_attention);
  m.def("rms_norm_rows", &rms_norm_rows);
  m.def("silu_mul_rows", &silu_mul_rows);
  m.def("half_linear_available", &half_linear_available);
  m.def("half_linear_pack", &half_linear_pack, pybind11::arg("weight"), pybind11::arg("bf16"));
  m.def("half_linear", &half_linear, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"),
        pybind11::arg("out_features"), pybind11::arg("out"));
  m.def("long_attention_bf16", &long_attention_bf16);
}
