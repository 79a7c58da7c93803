// Cedar's decode-step CPU kernels (torch ops under torch.ops.cedar_cpu), loaded by cpu_ext.py.
//
// NOTE: why C++: a decode step is a few rows per request, so the batched-torch path spends its
// time in per-op overhead (~3-10 us a call, dozens of calls per layer), not arithmetic. These
// kernels read the FP8 rings and FP4 pools in place (dequantizing only what a query reads) and do
// one layer's window attention, indexer scores, top-k or sparse attention in one call. Each has a
// pure-torch twin (kernels/*_ref.py) it is tested against; shapes and dtypes are checked in the
// Python launchers (kernels/*_cpu.py), not here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// NOTE: query rows per thread chunk: a decode step's few rows stay on the calling thread (an
// OpenMP region costs more than their work), prefills split across the cores.
constexpr int64_t kGrainRows = 32;
const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Lut {
  float e4m3[256];
  Lut() {
    for (int b = 0; b < 256; ++b) e4m3[b] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(b), c10::Float8_e4m3fn::from_bits()));
  }
};
const Lut& lut() {
  static Lut l;
  return l;
}

// An E8M0 scale: 2^(b - 127), NaN at 0xFF. Written as its float's bits (b << 23; b = 0, 2^-127,
// is the subnormal 0x00400000): ldexp's value exactly, where the call to it was ~2% of a decode step
inline float e8m0(uint8_t b) {
  if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = b ? uint32_t(b) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// FP8 window row (D codes, D/32 E8M0 scales) -> out[D]
inline void dequant_fp8(const uint8_t* codes, const uint8_t* scales, int64_t D, float* out) {
  const float* t = lut().e4m3;
  for (int64_t g = 0; g < D / 32; ++g) {
    const float s = e8m0(scales[g]);
    for (int64_t j = g * 32; j < g * 32 + 32; ++j) out[j] = t[codes[j]] * s;
  }
}

// FP4 row (D/2 packed bytes, low nibble first) with per-group scales -> out[D]
inline void dequant_fp4(const uint8_t* packed, const uint8_t* scales, int64_t D, int64_t group, bool e4m3, float* out) {
  for (int64_t j = 0; j < D / 2; ++j) {
    out[2 * j] = kE2M1[packed[j] & 15];
    out[2 * j + 1] = kE2M1[packed[j] >> 4];
  }
  for (int64_t g = 0; g < D / group; ++g) {
    const float s = e4m3 ? lut().e4m3[scales[g]] : e8m0(scales[g]);
    for (int64_t j = g * group; j < g * group + group; ++j) out[j] *= s;
  }
}

// NOTE: a fixed summation order (8 lanes, then a fixed tree), whatever the pointers' alignment or
// the caller, and no FMA contraction (-ffp-contract=off): the served path and the reference give
// the same bits for the same keys in the same order, so a quantized cache sees the same codes.
typedef float v8 __attribute__((vector_size(32)));  // lane j sums the products of elements i + j

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 weights (#23): a row of bf16 values widened to f32 exactly (the 16 bits are the f32's high
// half), then summed as dots() sums f32 (dots_n over a uint16_t row reads through this overload): the
// same bits as dots() over the widened row, half the bytes read. Plain AVX2/AVX-512F widening.
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

inline v8 load8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  const v8u w = __builtin_convertvector(h, v8u) << 16;
  v8 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

inline float reduce8(v8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return reduce8(acc) + tail;
}

// out[h] = dot(q + h * D, k, D) for h < H, each summed exactly as dot() sums it; the key row is
// read once for all heads (compile-time H for the common head counts, else dot() per head).
template <int H, typename K>
inline void dots_n(const float* q, const K* k, int64_t D, float* out) {
  v8 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = v8{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < D; i += 8) {
    const v8 kv = load8(k + i);
    for (int h = 0; h < H; ++h) acc[h] += load8(q + h * D + i) * kv;
  }
  for (int h = 0; h < H; ++h) out[h] = reduce8(acc[h]) + 0.f;
}

inline void dots(const float* q, int64_t H, const float* k, int64_t D, float* out) {
  if (D % 8 == 0) {
    switch (H) {
      case 1: return dots_n<1>(q, k, D, out);
      case 2: return dots_n<2>(q, k, D, out);
      case 4: return dots_n<4>(q, k, D, out);
      case 8: return dots_n<8>(q, k, D, out);
      default: break;
    }
  }
  for (int64_t h = 0; h < H; ++h) out[h] = dot(q + h * D, k, D);
}

// dots() of f32 queries against a bf16 key row, D % 8 == 0 (dot()'s tail is then empty).
inline void dots_bf16(const float* q, int64_t H, const uint16_t* k, int64_t D, float* out) {
  switch (H) {
    case 1: return dots_n<1>(q, k, D, out);
    case 2: return dots_n<2>(q, k, D, out);
    case 4: return dots_n<4>(q, k, D, out);
    case 8: return dots_n<8>(q, k, D, out);
    default:
      for (int64_t h = 0; h < H; ++h) dots_n<1>(q + h * D, k, D, out + h);
  }
}

// Index keys lane-major, kKeyLanes entries a block ([block][d][kKeyLanes]): the indexer scores a
// block per vector op (16 entries with AVX-512, else 8). Each dot is summed exactly as dots() sums
// it (its 8 lane partial sums over i, then reduce8's tree, entry-wise across the block's lanes), so
// a score is dots()'s bit for bit whatever the block width, and about 1.7x faster than
// 8-accumulator dots per entry at 8 lanes (the products stay in lanes: no transpose to reduce them).
#ifdef __AVX512F__
constexpr int64_t kKeyLanes = 16;
#else
constexpr int64_t kKeyLanes = 8;
#endif
typedef float vk __attribute__((vector_size(4 * kKeyLanes)));

inline vk loadk(const float* p) {
  vk v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Entry c's first value in lane-major keys of width D: its block, then its lane (stride kKeyLanes).
inline float* key_lane(float* kt, int64_t D, int64_t c) {
  return kt + (c / kKeyLanes) * D * kKeyLanes + c % kKeyLanes;
}

inline void put_key_lanes(const float* key, int64_t D, int64_t c, float* kt) {
  float* blk = key_lane(kt, D, c);
  for (int64_t d = 0; d < D; ++d) blk[d * kKeyLanes] = key[d];
}

// An FP4 row into entry c's lane of its lane-major block: dequant_fp4's values (each code's E2M1
// value times its group's scale: the same one multiply, here once per code value and group),
// written in place. NOTE: a decode step dequantizes every visible index key once per row (~2x
// faster so)
inline void dequant_fp4_lanes(const uint8_t* packed, const uint8_t* scales, int64_t D, int64_t group, bool e4m3,
                              int64_t c, float* kt) {
  float* blk = key_lane(kt, D, c);
  float tab[16];
  for (int64_t g = 0; g < D / group; ++g) {
    const float s = e4m3 ? lut().e4m3[scales[g]] : e8m0(scales[g]);
    for (int n = 0; n < 16; ++n) tab[n] = kE2M1[n] * s;
    for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
      blk[(2 * j) * kKeyLanes] = tab[packed[j] & 15];
      blk[(2 * j + 1) * kKeyLanes] = tab[packed[j] >> 4];
    }
  }
}

#ifdef __AVX2__
// Eight FP4 rows (pool rows rows[0..8), CB bytes each) into eight lanes of a lane-major block
// (`blk`: the first of them): lane j of code d is E2M1(code) * scale, the product
// dequant_fp4_lanes makes (the sign of codes 8-15 set on the magnitude of 0-7: the same values,
// -0.f included). Four code bytes of the 8 rows per gather.
// NOTE: group % 8 == 0 and byte offsets below 2^31 (the caller's `gather8`).
inline void dequant_fp4_block8(const uint8_t* packed, int64_t CB, const uint8_t* scales, int64_t SB,
                               const int64_t* rows, int64_t D, int64_t group, float* blk) {
  const __m256 mags = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i low4 = _mm256_set1_epi32(15);
  alignas(32) int32_t off[8];
  alignas(32) float sc[8];
  for (int j = 0; j < 8; ++j) off[j] = int32_t(rows[j] * CB);
  const __m256i voff = _mm256_load_si256(reinterpret_cast<const __m256i*>(off));
  for (int64_t g = 0; g < D / group; ++g) {
    for (int j = 0; j < 8; ++j) sc[j] = e8m0(scales[rows[j] * SB + g]);
    const __m256 vs = _mm256_load_ps(sc);
    for (int64_t b = g * group / 2; b < (g + 1) * group / 2; b += 4) {
      const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(packed + b), voff, 1);
      for (int q = 0; q < 8; ++q) {  // code 2 b + q: bits [4 q, 4 q + 4) of the little-endian word
        const __m256i n = _mm256_and_si256(_mm256_srli_epi32(w, 4 * q), low4);
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(n, 3), 31));
        const __m256 v = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, n), sign);
        _mm256_storeu_ps(blk + (2 * b + q) * kKeyLanes, _mm256_mul_ps(v, vs));
      }
    }
  }
}
#endif

// The scores of the kKeyLanes entries of a lane-major block for R query rows (row r's H * D values
// at q + r H D, its head weights at w + r H): sum_h w[h] relu(q[h] . key) over h in order from 0.f
// (the per-entry loop's order); D % 8 == 0. Each dot is dots()'s: 8 partial sums s_l over i = l,
// l + 8, ... from 0.f, then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) + 0.f, entry-wise.
// NOTE: the rows share each key vector's load and a query value is a broadcast operand, so a
// product costs no 64-byte query load (one query row at a time read two vectors a product); the
// partial sums are taken one l at a time into the tree, 4 R vectors live
template <int R>
inline void index_scores_rows(const float* q, const float* w, int64_t H, const float* kt, int64_t D, vk* out) {
  const vk zero = {};
  for (int r = 0; r < R; ++r) out[r] = zero;
  for (int64_t h = 0; h < H; ++h) {
    vk t0[R], t1[R], t2[R];  // the tree's pending sums: s0..3 / s4..5 / s6
    for (int l = 0; l < 8; ++l) {
      vk s[R];
      for (int r = 0; r < R; ++r) s[r] = zero;
      for (int64_t i = 0; i < D; i += 8) {
        const vk kv = loadk(kt + (i + l) * kKeyLanes);
        for (int r = 0; r < R; ++r) s[r] += q[(r * H + h) * D + i + l] * kv;
      }
      for (int r = 0; r < R; ++r) {
        switch (l) {
          case 0: t0[r] = s[r]; break;
          case 1: t0[r] = t0[r] + s[r]; break;
          case 2: t1[r] = s[r]; break;
          case 3: t0[r] = t0[r] + (t1[r] + s[r]); break;
          case 4: t1[r] = s[r]; break;
          case 5: t1[r] = t1[r] + s[r]; break;
          case 6: t2[r] = s[r]; break;
          default: t0[r] = t0[r] + (t1[r] + (t2[r] + s[r]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      vk d = t0[r] + 0.f;
      d = d < zero ? zero : d;  // std::max(d, 0.f), NaN and -0.f kept as it keeps them
      out[r] += d * w[r * H + h];
    }
  }
}

// Rows scored together (index_scores_rows): 4 (2 at a time cost 1.4x as much with AVX-512 and
// 1.2x with AVX2 alone; 6 no faster with AVX-512)
constexpr int64_t kScoreRows = 4;

// One row alone (a decode step's): the 8 partial sums taken side by side (8 independent chains; one
// at a time they would wait on each add's latency), the same sums in the same order.
inline vk index_scores_row(const float* q, const float* w, int64_t H, const float* kt, int64_t D) {
  const vk zero = {};
  vk acc = zero;
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * D;
    vk s[8];
    for (int l = 0; l < 8; ++l) s[l] = zero;
    for (int64_t i = 0; i < D; i += 8)
      for (int l = 0; l < 8; ++l) s[l] += qh[i + l] * loadk(kt + (i + l) * kKeyLanes);
    vk d = (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + 0.f;
    d = d < zero ? zero : d;  // std::max(d, 0.f), NaN and -0.f kept as it keeps them
    acc += d * w[h];
  }
  return acc;
}

inline void index_scores_n(int64_t R, const float* q, const float* w, int64_t H, const float* kt, int64_t D, vk* out) {
  switch (R) {
    case 1: out[0] = index_scores_row(q, w, H, kt, D); return;
    case 2: return index_scores_rows<2>(q, w, H, kt, D, out);
    case 3: return index_scores_rows<3>(q, w, H, kt, D, out);
    case 4: return index_scores_rows<4>(q, w, H, kt, D, out);
  }
}

// exp(x) for x <= 0 (a logit minus the row max) by Cody-Waite reduction and a degree-7 Taylor
// polynomial: relative error ~2e-7. NOTE: std::exp is a scalar libm call and was most of the
// window kernel's time; this one vectorizes (exp8: the same operations lane by lane, so a lane
// and the scalar version agree bit for bit) and is deterministic on every layout.
// e^(x - n ln2) by the Taylor polynomial, for float or v8 (the same operations lane by lane)
template <class T>
inline T exp_poly(T x, T n) {
  const T r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  T p = T{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p;
}

inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = float(int(t + (t >= 0.f ? 0.5f : -0.5f)));
  const float p = exp_poly(x, n);
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

typedef int32_t i8v __attribute__((vector_size(32)));

inline v8 exp8(v8 x) {
  const v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
  x = x < lo ? lo : x;
  const v8 t = x * 1.44269504088896341f;
  const v8 half = t >= 0.f ? v8{} + 0.5f : v8{} - 0.5f;
  const i8v ni = __builtin_convertvector(t + half, i8v);
  const v8 n = __builtin_convertvector(ni, v8);
  const v8 p = exp_poly(x, n);
  const i8v bits = (ni + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out[0, D) = sum_j p_j rows[j] (p_j = logits[j], in order from 0.f, each element on its own), denom
// += p_j in the same order: C = D / 8 vectors held in registers.
template <int C>
inline void accumulate_values(const float* logits, const float* const* rows, int64_t n, float& denom, float* out) {
  v8 o[C];
  for (int c = 0; c < C; ++c) o[c] = v8{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t j = 0; j < n; ++j) {
    const float p = logits[j];
    denom += p;
    for (int c = 0; c < C; ++c) o[c] += p * load8(rows[j] + 8 * c);
  }
  for (int c = 0; c < C; ++c) std::memcpy(out + 8 * c, &o[c], sizeof(v8));
}

inline void accumulate_values_any(const float* logits, const float* const* rows, int64_t n, int64_t D, float& denom,
                                  float* out) {
  std::fill(out, out + D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float p = logits[j];
    denom += p;
    const float* v = rows[j];
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {  // elementwise: the same products and sums as the scalar loop
      v8 o = load8(out + d);
      o += p * load8(v + d);
      std::memcpy(out + d, &o, sizeof(o));
    }
    for (; d < D; ++d) out[d] += p * v[d];
  }
}

// softmax over logits[0..n) plus an optional sink logit, out = sum p_j rows[j] / denom; returns
// lse. logits are overwritten by the unnormalised probabilities.
inline float softmax_values(float* logits, const float* const* rows, int64_t n, int64_t D, bool has_sink,
                            float sink, float* out) {
  float m = has_sink ? sink : kNegInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, logits[j]);
  if (std::isinf(m)) m = 0.f;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 e = exp8(load8(logits + j) - m);
    std::memcpy(logits + j, &e, sizeof(e));
  }
  for (; j < n; ++j) logits[j] = exp_neg(logits[j] - m);
  float denom = has_sink ? exp_neg(sink - m) : 0.f;
  switch (D) {  // NOTE: the common head sizes sum in registers (through memory, each add waited on a
                // store's forwarding): the same products and sums in the same order
    case 32: accumulate_values<4>(logits, rows, n, denom, out); break;
    case 64: accumulate_values<8>(logits, rows, n, denom, out); break;
    case 128: accumulate_values<16>(logits, rows, n, denom, out); break;
    default: accumulate_values_any(logits, rows, n, D, denom, out);
  }
  if (denom > 0.f) {
    for (int64_t d = 0; d < D; ++d) out[d] /= denom;
  } else {
    std::fill(out, out + D, 0.f);
  }
  return std::log(denom) + m;
}

// (out (T, H, D) zeros, lse (T, H) -inf): the partial of queries that see no key
inline std::tuple<at::Tensor, at::Tensor> empty_partials(const at::Tensor& q) {
  return {at::zeros({q.size(0), q.size(1), q.size(2)}, q.options()),
          at::full({q.size(0), q.size(1)}, kNegInf, q.options())};
}

#ifdef __AVX2__
// reduce8(acc[c]) + 0.f for c < 8, as one vector: reduce8's tree ((s0 + s1) + (s2 + s3)) + ((s4 +
// s5) + (s6 + s7)) for all 8 at once by two rounds of horizontal adds (each sum of two lanes a
// commuted add of the same two values) and one add of 128-bit halves: the same bits as reduce8().
inline __m256 reduce8x8(const __m256* acc) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  return _mm256_add_ps(sum, _mm256_setzero_ps());
}

// dot(q, rows[c], D) + 0.f for the 8 key rows rows[0..8), as one vector: each key's 8 lane sums over
// i as dots() takes them, then reduce8x8: the same bits as dots(); D % 8 == 0.
// NOTE: one key at a time spent most of its time in reduce8's scalar adds, 4 heads' chains waiting
// on each add's latency
inline __m256 dots_8keys(const float* q, const float* const* rows, int64_t D) {
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(qv, _mm256_loadu_ps(rows[c] + i)));
  }
  return reduce8x8(acc);
}
#endif

// one query's heads over n key rows: logits, softmax with the sink, values
// (logits: room for H * n floats, head h's in logits[h * n, (h + 1) * n); scratch: H floats)
inline void attend(const float* q, int64_t H, int64_t D, const float* const* rows, int64_t n, const float* sink,
                   float scale, float* logits, float* scratch, float* out, float* lse) {
  int64_t j0 = 0;
#ifdef __AVX2__
  if (D % 8 == 0)
    for (; j0 + 8 <= n; j0 += 8)
      for (int64_t h = 0; h < H; ++h)
        _mm256_storeu_ps(logits + h * n + j0, _mm256_mul_ps(dots_8keys(q + h * D, rows + j0, D), _mm256_set1_ps(scale)));
#endif
  for (int64_t j = j0; j < n; ++j) {
    dots(q, H, rows[j], D, scratch);
    for (int64_t h = 0; h < H; ++h) logits[h * n + j] = scratch[h] * scale;
  }
  for (int64_t h = 0; h < H; ++h)
    lse[h] = softmax_values(logits + h * n, rows, n, D, sink != nullptr, sink ? sink[h] : 0.f, out + h * D);
}

// ---------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> window_ring_attention(const at::Tensor& q, const at::Tensor& codes,
                                                         const at::Tensor& scales, const at::Tensor& ring_pos,
                                                         const at::Tensor& slot, const at::Tensor& q_pos,
                                                         const at::Tensor& floor, const c10::optional<at::Tensor>& sink,
                                                         int64_t window, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = codes.size(1), G = scales.size(2);
  auto [out, lse] = empty_partials(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const int64_t* rp = ring_pos.data_ptr<int64_t>();
  const int64_t* slp = slot.data_ptr<int64_t>();
  const int64_t* pp = q_pos.data_ptr<int64_t>();
  const int64_t* fp = floor.data_ptr<int64_t>();
  const float* skp = sink.has_value() ? sink->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, T, kGrainRows, [&](int64_t t0, int64_t t1) {
    std::vector<float> keys(S * D), logits(H * S), scratch(H);
    std::vector<const float*> rows(S);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slp[t], p = pp[t], lo = std::max({fp[t], p - window + 1, int64_t(0)});
      // NOTE: the order every layout shares (ragged keys, the reference caches): the older keys
      // in ring order, then the query's own row, so the sums agree bit for bit
      int64_t n = 0, own = -1;
      for (int64_t i = 0; i < S; ++i) {
        const int64_t kp = rp[s * S + i];
        if (kp == p) own = i;
        if (kp < lo || kp >= p) continue;
        dequant_fp8(cp + (s * S + i) * D, sp + (s * S + i) * G, D, keys.data() + n * D);
        ++n;
      }
      if (own >= 0 && p >= lo) {
        dequant_fp8(cp + (s * S + own) * D, sp + (s * S + own) * G, D, keys.data() + n * D);
        ++n;
      }
      for (int64_t j = 0; j < n; ++j) rows[j] = keys.data() + j * D;
      attend(qp + t * H * D, H, D, rows.data(), n, skp, float(scale), logits.data(), scratch.data(), op + t * H * D,
             lp + t * H);
    }
  });
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------
// Window attention over ragged float keys laid out per request as [S ring rows][new rows at
// consecutive positions from k_first]: each query reads the ring rows whose tag is in its window
// and the new rows of its window by position.
std::tuple<at::Tensor, at::Tensor> window_ragged_attention(const at::Tensor& q, const at::Tensor& keys,
                                                           const at::Tensor& key_pos, const at::Tensor& cu_k,
                                                           const at::Tensor& k_first, const at::Tensor& row_req,
                                                           const at::Tensor& q_pos, const at::Tensor& floor,
                                                           const c10::optional<at::Tensor>& sink, int64_t S,
                                                           int64_t window, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  auto [out, lse] = empty_partials(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const int64_t* posp = key_pos.data_ptr<int64_t>();
  const int64_t* cu = cu_k.data_ptr<int64_t>();
  const int64_t* kf = k_first.data_ptr<int64_t>();
  const int64_t* rq = row_req.data_ptr<int64_t>();
  const int64_t* pp = q_pos.data_ptr<int64_t>();
  const int64_t* fp = floor.data_ptr<int64_t>();
  const float* skp = sink.has_value() ? sink->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, T, kGrainRows, [&](int64_t t0, int64_t t1) {
    std::vector<const float*> rows(std::max<int64_t>(S, 0) + window);
    std::vector<float> logits(H * rows.size()), scratch(H);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = rq[t], base = cu[b], p = pp[t], first = kf[b];
      const int64_t lo = std::max({fp[b], p - window + 1, int64_t(0)});
      int64_t n = 0;
      if (S < 0) {  // any layout: every key of the request in storage order
        for (int64_t i = base; i < cu[b + 1]; ++i) {
          const int64_t kpos = posp[i];
          if (kpos >= lo && kpos <= p) {
            if (n == int64_t(rows.size())) rows.resize(2 * n + 1), logits.resize(H * (2 * n + 1));
            rows[n++] = kp + i * D;
          }
        }
      } else {  // [S ring rows][new rows from `first`]: the same order, new rows found by position
        for (int64_t i = 0; i < S && lo < first; ++i) {
          const int64_t kpos = posp[base + i];
          if (kpos >= lo && kpos <= p && kpos < first) rows[n++] = kp + (base + i) * D;
        }
        const int64_t end = std::min(p, first + (cu[b + 1] - base - S) - 1);
        for (int64_t pos = std::max(lo, first); pos <= end; ++pos) rows[n++] = kp + (base + S + pos - first) * D;
      }
      attend(qp + t * H * D, H, D, rows.data(), n, skp, float(scale), logits.data(), scratch.data(), op + t * H * D,
             lp + t * H);
    }
  });
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------
// A finite score and its id as one key ordered as the selection wants: a higher score first, of
// equal scores the lower id (the twin's stable descending sort). The score's bits made monotone
// (sign flipped, or all bits where negative) above the id's complement; -0.f is counted as 0.f
// (+ 0.f), as `==` counts it.
inline uint64_t rank_key(float score, int32_t id) {
  uint32_t bits;
  score += 0.f;
  std::memcpy(&bits, &score, sizeof(bits));
  bits ^= (bits >> 31) ? 0xFFFFFFFFu : 0x80000000u;
  return (uint64_t(bits) << 32) | uint32_t(~uint32_t(id));
}

inline int32_t rank_id(uint64_t key) { return int32_t(~uint32_t(key)); }

// The k best finite scores of a row and their ids, best first, ties to the lower id: the twin's
// stable-sort order. Candidates arrive either one by one with increasing ids (offer: kept when
// their key beats the k-th best kept at the last cut, then cut to the k best when the buffer fills)
// or as a whole row of score blocks (offer_scores); write() cuts to k and sorts. Keys are unique
// (one per id), so the k written do not depend on the order of the cuts.
// NOTE: a heap paid ~100 cycles an insertion, k ln(C / k) of them a row (~130 at k = 32 over 2k
// entries): as much as scoring the row
struct TopK {
  int64_t k;
  std::vector<uint64_t> buf;
  uint64_t tau = 0;  // a key must exceed it to be kept (0: below every finite score's key)
  // offer_scores' scratch, kept across rows (no allocation a row): the lane maxima, and the kept
  // scores and ids before they become keys
  std::vector<vk> mx;
  std::vector<float> kept_score;
  std::vector<int32_t> kept_id;
  int64_t cap() const { return std::max<int64_t>(4 * k, 64); }
  void reset() {
    buf.clear();
    tau = 0;
  }
  void cut() {  // the buffer to its k best; tau the k-th best's key
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<uint64_t>());
    buf.resize(k);
    tau = buf[k - 1];
  }
  void offer(float score, int32_t id) {
    if (k == 0 || !std::isfinite(score)) return;
    const uint64_t key = rank_key(score, id);
    if (key <= tau) return;
    buf.push_back(key);
    if (int64_t(buf.size()) >= cap()) cut();
  }
  // The k best of a row's n scores given a block of kKeyLanes a vector (ids 0..n; lanes past n
  // ignored), replacing whatever was offered: a lower bound on the k-th best first, the least of k
  // lane maxima over disjoint entries (block j's lane l goes to maximum (j % m, l), finite scores
  // only; -inf where one holds none), then the scores above it kept and, of those equal to it, the
  // k lowest ids (write() cuts them to k).
  // NOTE: ~100 of 2k entries kept at k = 32 on random keys (whose scores tie at 0 where both head
  // weights are negative), where offering every block raised the threshold slowly (~270 kept and
  // two cuts a row); AVX-512 stores a block's kept scores and ids in one compress each
  void offer_scores(const vk* sc, int64_t n) {
    reset();
    if (k == 0 || n <= 0) return;
    const int64_t nb = (n + kKeyLanes - 1) / kKeyLanes, m = (k + kKeyLanes - 1) / kKeyLanes;
    const int64_t tail = n - (nb - 1) * kKeyLanes;  // the live lanes of the last block, 1..kKeyLanes
    vk lane_id;
    for (int64_t l = 0; l < kKeyLanes; ++l) lane_id[l] = float(l);
    const vk inf = vk{} - kNegInf, ninf = vk{} + kNegInf;
    float bound = kNegInf;
    if (nb >= m) {
      mx.assign(m, ninf);
      for (int64_t j = 0; j < nb; ++j) {
        vk v = sc[j];
        v = v < inf ? v : ninf;  // +inf and NaN
        if (j == nb - 1) v = lane_id < float(tail) ? v : ninf;
        vk& a = mx[j % m];
        a = a < v ? v : a;
      }
      bound = -kNegInf;
      for (int64_t i = 0; i < k; ++i) bound = std::min(bound, mx[i / kKeyLanes][i % kKeyLanes]);
    }
    int64_t ties = 0;
#if defined(__AVX512F__)
    if (int64_t(kept_score.size()) < n + kKeyLanes) kept_score.resize(n + kKeyLanes), kept_id.resize(n + kKeyLanes);
    const __m512 vb = _mm512_set1_ps(bound), vinf = _mm512_set1_ps(-kNegInf), vninf = _mm512_set1_ps(kNegInf);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t kept = 0;
    for (int64_t j = 0; j < nb; ++j) {
      const __m512 v = reinterpret_cast<const __m512&>(sc[j]);
      __mmask16 live = _mm512_cmp_ps_mask(v, vinf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(v, vninf, _CMP_GT_OQ);
      if (j == nb - 1) live &= __mmask16((uint32_t(1) << tail) - 1);
      uint32_t eq = _mm512_cmp_ps_mask(v, vb, _CMP_EQ_OQ) & live;
      const uint32_t gt = _mm512_cmp_ps_mask(v, vb, _CMP_GT_OQ) & live;
      for (uint32_t e = eq; e; e &= e - 1)  // ties at the bound: the k lowest ids suffice
        if (ties++ >= k) eq &= ~(e & -e);
      const __mmask16 keep = __mmask16(gt | eq);
      // NOTE: compressed in registers, then stored whole (the buffers have a block's slack): a
      // compress to memory is microcoded on AMD's cores (~20x slower)
      _mm512_storeu_ps(kept_score.data() + kept, _mm512_maskz_compress_ps(keep, v));
      _mm512_storeu_si512(kept_id.data() + kept, _mm512_maskz_compress_epi32(
                                                     keep, _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(j * kKeyLanes)))));
      kept += __builtin_popcount(keep);
    }
    buf.resize(kept);
    for (int64_t i = 0; i < kept; ++i) buf[i] = rank_key(kept_score[i], kept_id[i]);
#else
    for (int64_t j = 0; j < nb; ++j) {
      const vk v = sc[j];
#if defined(__AVX2__)
      uint32_t msk = _mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<const __m256&>(v), _mm256_set1_ps(bound), _CMP_GE_OQ));
#else
      uint32_t msk = 0;
      for (int64_t l = 0; l < kKeyLanes; ++l) msk |= uint32_t(v[l] >= bound) << l;
#endif
      if (j == nb - 1) msk &= (uint32_t(1) << tail) - 1;
      for (; msk; msk &= msk - 1) {
        const int l = __builtin_ctz(msk);
        if (!std::isfinite(v[l])) continue;
        if (v[l] == bound && ties++ >= k) continue;  // ties at the bound: the k lowest ids suffice
        buf.push_back(rank_key(v[l], int32_t(j * kKeyLanes + l)));
      }
    }
#endif
  }
  void write(int32_t* out) {  // k slots, -1 padded
    if (int64_t(buf.size()) > k) cut();
    std::sort(buf.begin(), buf.end(), std::greater<uint64_t>());
    for (int64_t j = 0; j < k; ++j) out[j] = j < int64_t(buf.size()) ? rank_id(buf[j]) : -1;
  }
};

// Lightning-indexer scores and their top-k: entry c of a row's request scores sum_h w[h]
// relu(q[h] . key_c) where visible ((c + 1) ratio - 1 <= pos). Keys come from `keys` (float,
// ragged like the entries) when given, else from the FP4 pool in place. Up to kScoreRows
// consecutive rows of one request are scored together (a key block's load serves them all), each
// row's scores kept whole and its top-k taken from them (TopK::offer_scores).
at::Tensor indexer_topk(const at::Tensor& iq, const at::Tensor& iw, const c10::optional<at::Tensor>& keys,
                        const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& entry_rows,
                        const at::Tensor& cu_c, const at::Tensor& row_req, const at::Tensor& q_pos,
                        const at::Tensor& c_pos, int64_t k) {
  const int64_t T = iq.size(0), Hi = iq.size(1), Di = iq.size(2);
  auto idx = at::empty({T, k}, iq.options().dtype(at::kInt));
  const float* qp = iq.data_ptr<float>();
  const float* wp = iw.data_ptr<float>();
  const float* kp = keys.has_value() ? keys->data_ptr<float>() : nullptr;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const int64_t* er = entry_rows.data_ptr<int64_t>();
  const int64_t* cu = cu_c.data_ptr<int64_t>();
  const int64_t* qr = row_req.data_ptr<int64_t>();
  const int64_t* pp = q_pos.data_ptr<int64_t>();
  const int64_t* vp = c_pos.data_ptr<int64_t>();
  const int64_t CB = codes.size(1), SB = scales.size(1), group = Di / SB;
  int32_t* ip = idx.data_ptr<int32_t>();
  const bool lanes = Di % 8 == 0;
  // NOTE: eight pool rows per gather: a gather never straddles two scales, offsets fit int32
  const bool gather8 = group % 8 == 0 && codes.numel() < (int64_t(1) << 31);
  at::parallel_for(0, T, kGrainRows, [&](int64_t t0, int64_t t1) {
    // NOTE: a prefill's rows of one request read the same keys: each chunk lays out a request's
    // keys once (dequantized from the pool, or copied when given), as far as its rows reach (a 4k
    // hit + 16 replays 144 rows over 2k entries), lane-major where Di % 8 == 0 (else given keys
    // are read in place); every score is the per-entry dots() one, so the top-k is the same bits
    // row by row, however the rows are grouped
    std::vector<float> kt, d(Hi);
    std::vector<vk> sc;  // a group's scores, row r's block j at r * nb + j
    int64_t kt_req = -1, kt_n = 0, vis[kScoreRows];
    TopK top{k, {}};
    for (int64_t t = t0; t < t1;) {
      const int64_t b = qr[t], c0 = cu[b];
      // a group: up to kScoreRows consecutive rows of one request (scored together where lanes)
      int64_t R = 1;
      while (lanes && R < kScoreRows && t + R < t1 && qr[t + R] == b) ++R;
      // entries visible to each row: a prefix (entries in position order)
      int64_t reach = 0;
      for (int64_t r = 0; r < R; ++r) {
        vis[r] = std::upper_bound(vp + c0, vp + cu[b + 1], pp[t + r]) - (vp + c0);
        reach = std::max(reach, vis[r]);
      }
      if (b != kt_req) kt_req = b, kt_n = 0;
      if (kt_n < reach) {
        const int64_t need = (reach + kKeyLanes - 1) / kKeyLanes * kKeyLanes * Di;
        if (int64_t(kt.size()) < need) kt.resize(std::max<int64_t>(2 * kt.size(), need));
      }
      for (; kt_n < reach; ++kt_n) {
        const int64_t e = c0 + kt_n;
        if (kp) {
          if (lanes) put_key_lanes(kp + e * Di, Di, kt_n, kt.data());
        } else if (!lanes) {
          dequant_fp4(cp + er[e] * CB, sp + er[e] * SB, Di, group, false, kt.data() + kt_n * Di);
#ifdef __AVX2__
        } else if (gather8 && kt_n % 8 == 0 && kt_n + 8 <= reach) {
          dequant_fp4_block8(cp, CB, sp, SB, er + e, Di, group, key_lane(kt.data(), Di, kt_n));
          kt_n += 7;  // NOTE: the loop's ++kt_n makes it 8
#endif
        } else {
          dequant_fp4_lanes(cp + er[e] * CB, sp + er[e] * SB, Di, group, false, kt_n, kt.data());
        }
      }
      const float* q = qp + t * Hi * Di;
      const float* w = wp + t * Hi;
      if (lanes) {  // NOTE: a block's lanes past a row's `vis` hold other entries or stale keys: never offered
        const int64_t nb = (reach + kKeyLanes - 1) / kKeyLanes;
        if (int64_t(sc.size()) < R * nb) sc.resize(R * nb);
        vk out[kScoreRows];
        for (int64_t j = 0; j < nb; ++j) {
          index_scores_n(R, q, w, Hi, kt.data() + j * kKeyLanes * Di, Di, out);
          for (int64_t r = 0; r < R; ++r) sc[r * nb + j] = out[r];
        }
        for (int64_t r = 0; r < R; ++r) {
          top.offer_scores(sc.data() + r * nb, vis[r]);
          top.write(ip + (t + r) * k);
        }
      } else {
        top.reset();
        for (int64_t c = 0; c < vis[0]; ++c) {
          dots(q, Hi, kp ? kp + (c0 + c) * Di : kt.data() + c * Di, Di, d.data());
          float acc = 0.f;
          for (int64_t h = 0; h < Hi; ++h) acc += std::max(d[h], 0.f) * w[h];
          top.offer(acc, int32_t(c));
        }
        top.write(ip + t * k);
      }
      t += R;
    }
  });
  return idx;
}

// ---------------------------------------------------------------------------------------------
at::Tensor topk_exact(const at::Tensor& scores, int64_t k) {
  const int64_t T = scores.size(0), C = scores.size(1);
  auto idx = at::empty({T, k}, scores.options().dtype(at::kInt));
  const float* sp = scores.data_ptr<float>();
  int32_t* ip = idx.data_ptr<int32_t>();
  at::parallel_for(0, T, kGrainRows, [&](int64_t t0, int64_t t1) {
    TopK top{k, {}};
    for (int64_t t = t0; t < t1; ++t) {
      top.reset();
      for (int64_t c = 0; c < C; ++c) top.offer(sp[t * C + c], int32_t(c));
      top.write(ip + t * k);
    }
  });
  return idx;
}

// ---------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> sparse_pool_attention(const at::Tensor& q, const c10::optional<at::Tensor>& entries,
                                                         const at::Tensor& codes,
                                                         const at::Tensor& scales, const at::Tensor& entry_rows,
                                                         const at::Tensor& cu_c, const at::Tensor& q_req,
                                                         const at::Tensor& indices, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), K = indices.size(1);
  auto [out, lse] = empty_partials(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const int64_t* er = entry_rows.data_ptr<int64_t>();
  const int64_t* cu = cu_c.data_ptr<int64_t>();
  const int64_t* qr = q_req.data_ptr<int64_t>();
  const int32_t* ip = indices.data_ptr<int32_t>();
  const float* ep = entries.has_value() ? entries->data_ptr<float>() : nullptr;
  const int64_t CB = codes.size(1), SB = scales.size(1), group = D / SB;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, T, kGrainRows, [&](int64_t t0, int64_t t1) {
    std::vector<float> keys(K * D), logits(H * K), scratch(H);
    std::vector<const float*> rows(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = qr[t], count = cu[b + 1] - cu[b];
      int64_t n = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t c = ip[t * K + j];
        if (c < 0 || c >= count) continue;
        if (ep) {
          std::copy(ep + (cu[b] + c) * D, ep + (cu[b] + c + 1) * D, keys.data() + n * D);
        } else {
          const int64_t row = er[cu[b] + c];
          dequant_fp4(cp + row * CB, sp + row * SB, D, group, true, keys.data() + n * D);
        }
        ++n;
      }
      for (int64_t j = 0; j < n; ++j) rows[j] = keys.data() + j * D;
      attend(qp + t * H * D, H, D, rows.data(), n, nullptr, float(scale), logits.data(), scratch.data(), op + t * H * D,
             lp + t * H);
    }
  });
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------
// One FP8 group of 32 values, bit-identical to fp8_ref.fp8_quantize: codes c[32], returns the scale byte.
inline uint8_t fp8_group(const float* xg, uint8_t* c) {
  bool poisoned = false;
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) {
    poisoned |= !std::isfinite(xg[j]);
    amax = std::max(amax, std::fabs(xg[j]));
  }
  if (poisoned) {
    std::fill(c, c + 32, 0);
    return 0xFF;
  }
  int exp = 0;
  const float mant = std::frexp(amax, &exp);  // 448 = 0.875 * 2**9
  int e = amax > 0.f ? exp - 9 + (mant > 0.875f ? 1 : 0) : -127;
  e = std::min(127, std::max(-127, e));
  const float s = std::ldexp(1.f, e);
  for (int j = 0; j < 32; ++j) {
    const float mag = std::min(std::fabs(xg[j]) / s, 448.f);
    c[j] = c10::Float8_e4m3fn(mag).x | (xg[j] < 0.f ? 0x80 : 0);
  }
  return uint8_t(e + 127);
}

// FP8 window rows into the rings: row t goes to ring row pos[t] % S of slot[t] (its tag too).
void fp8_ring_store(const at::Tensor& rows, const at::Tensor& slot, const at::Tensor& pos, at::Tensor& codes,
                    at::Tensor& scales, at::Tensor& ring_pos) {
  const int64_t T = rows.size(0), D = rows.size(1), S = codes.size(1), G = D / 32;
  const float* xp = rows.data_ptr<float>();
  const int64_t* slp = slot.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  int64_t* rp = ring_pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t dst = slp[t] * S + pp[t] % S;
    for (int64_t g = 0; g < G; ++g) sp[dst * G + g] = fp8_group(xp + t * D + g * 32, cp + dst * D + g * 32);
    rp[dst] = pp[t];
  }
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize(const at::Tensor& x) {
  const int64_t N = x.size(0), D = x.size(1), G = D / 32;
  auto codes = at::empty({N, D}, x.options().dtype(at::kByte));
  auto scales = at::empty({N, G}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) sp[n * G + g] = fp8_group(xp + n * D + g * 32, cp + n * D + g * 32);
  });
  return {codes, scales};
}

// A multi-row forward's window keys (PoolKeys.window_keys off a decode step), in one call: the
// new rows FP8-encoded and decoded (what a reader of the ring sees), each request's ring rows
// decoded with their positions (-1 where written at or after the request's first new position),
// both laid out by `perm` (key m is new row perm[m] if below T, else ring row ring_src[perm[m] - T]),
// then the kept new rows' codes stored in the rings (after every ring row was read). The same
// codes and values as fp8_quantize, fp8_ref.fp8_dequantize, cat and index: bit for bit.
// kv (T, D) f32, D % 32 == 0; ring_src / ring_first (B S,) int64; perm (N,) int64;
// write_src / write_dst (n,) int64; pos (T,) int64; rows (R, D) / scales (R, D / 32) uint8 and
// ring_pos (R,) int64 flat over the rings -> keys (N, D) f32, key_pos (N,) int64.
std::tuple<at::Tensor, at::Tensor> fp8_window_keys(const at::Tensor& kv, const at::Tensor& ring_src,
                                                   const at::Tensor& ring_first, const at::Tensor& perm,
                                                   const at::Tensor& write_src, const at::Tensor& write_dst,
                                                   const at::Tensor& pos, at::Tensor& rows, at::Tensor& scales,
                                                   at::Tensor& ring_pos) {
  const int64_t T = kv.size(0), D = kv.size(1), G = D / 32, N = perm.size(0), W = write_src.size(0);
  TORCH_CHECK(D % 32 == 0 && rows.size(1) == D && scales.size(1) == G, "fp8_window_keys: bad row widths");
  const auto [codes, cscales] = fp8_quantize(kv.contiguous());
  auto keys = at::empty({N, D}, kv.options());
  auto key_pos = at::empty({N}, pos.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* csp = cscales.data_ptr<uint8_t>();
  const int64_t* src = ring_src.data_ptr<int64_t>();
  const int64_t* first = ring_first.data_ptr<int64_t>();
  const int64_t* pm = perm.data_ptr<int64_t>();
  const int64_t* ws = write_src.data_ptr<int64_t>();
  const int64_t* wd = write_dst.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  uint8_t* rp = rows.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  int64_t* rpos = ring_pos.data_ptr<int64_t>();
  float* kp = keys.data_ptr<float>();
  int64_t* kpos = key_pos.data_ptr<int64_t>();
  // NOTE: up to a thousand key rows stay on the calling thread (cheaper than an OpenMP region)
  at::parallel_for(0, N, 1024, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t j = pm[m];
      if (j < T) {
        dequant_fp8(cp + j * D, csp + j * G, D, kp + m * D);
        kpos[m] = pp[j];
      } else {
        const int64_t r = src[j - T], at = rpos[r];
        dequant_fp8(rp + r * D, sp + r * G, D, kp + m * D);
        kpos[m] = at < first[j - T] ? at : -1;
      }
    }
  });
  for (int64_t i = 0; i < W; ++i) {  // NOTE: after every ring row was read
    std::memcpy(rp + wd[i] * D, cp + ws[i] * D, D);
    std::memcpy(sp + wd[i] * G, csp + ws[i] * G, G);
    rpos[wd[i]] = pp[ws[i]];
  }
  return {keys, key_pos};
}

// FP4 rows, bit-identical to fp4_ref.fp4_quantize (E4M3 or E8M0 group scales).
std::tuple<at::Tensor, at::Tensor> fp4_quantize(const at::Tensor& x, int64_t group, bool e4m3) {
  const int64_t N = x.size(0), D = x.size(1), G = D / group;
  auto packed = at::empty({N, D / 2}, x.options().dtype(at::kByte));
  auto scales = at::empty({N, G}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> codes(D);
    for (int64_t n = n0; n < n1; ++n) {
      const float* x_row = xp + n * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x_row + g * group;
        bool poisoned = false;
        float amax = 0.f;
        for (int64_t j = 0; j < group; ++j) {
          poisoned |= !std::isfinite(xg[j]);
          amax = std::max(amax, std::fabs(xg[j]));
        }
        uint8_t byte;
        float s;
        if (poisoned) {
          byte = e4m3 ? 0x7F : 0xFF;
          s = 0.f;
        } else if (e4m3) {
          const c10::Float8_e4m3fn q(std::min(amax / 6.f, 448.f));
          byte = q.x;
          s = static_cast<float>(q);
        } else {
          int exp = 0;
          const float mant = std::frexp(amax, &exp);  // 6 = 0.75 * 2**3
          int e = amax > 0.f ? exp - 3 + (mant > 0.75f ? 1 : 0) : -127;
          e = std::min(127, std::max(-127, e));
          byte = uint8_t(e + 127);
          s = std::ldexp(1.f, e);
        }
        sp[n * G + g] = byte;
        for (int64_t j = 0; j < group; ++j) {
          uint8_t c = 0;
          if (!poisoned && s > 0.f) {
            const float y = std::fabs(xg[j]) / s;
            c = (y > 0.25f) + (y >= 0.75f) + (y > 1.25f) + (y >= 1.75f) + (y > 2.5f) + (y >= 3.5f) + (y > 5.0f);
            c |= (xg[j] < 0.f ? 8 : 0);
          }
          codes[g * group + j] = c;
        }
      }
      for (int64_t j = 0; j < D / 2; ++j) pp[n * (D / 2) + j] = codes[2 * j] | (codes[2 * j + 1] << 4);
    }
  });
  return {packed, scales};
}

// merge_ref.merge_states in one pass: (out (T, H, D), lse (T, H)) of the union of two key sets.
std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                const at::Tensor& out_b, const at::Tensor& lse_b) {
  const int64_t TH = lse_a.numel(), D = out_a.size(2);
  auto out = at::empty_like(out_a);
  auto lse = at::empty_like(lse_a);
  const float *oa = out_a.data_ptr<float>(), *la = lse_a.data_ptr<float>();
  const float *ob = out_b.data_ptr<float>(), *lb = lse_b.data_ptr<float>();
  float *o = out.data_ptr<float>(), *l = lse.data_ptr<float>();
  for (int64_t i = 0; i < TH; ++i) {
    const float a = la[i], b = lb[i], m = std::max(a, b);
    float total, wa = 0.f, wb = 0.f;
    if (std::isinf(m) && m < 0) {
      total = kNegInf;
    } else {
      total = m + std::log1p(std::exp(std::min(a, b) - m));
      wa = std::exp(a - total);
      wb = std::exp(b - total);
    }
    l[i] = total;
    for (int64_t d = 0; d < D; ++d) o[i * D + d] = oa[i * D + d] * wa + ob[i * D + d] * wb;
  }
  return {out, lse};
}

// A projection weight (N, K) packed for a decode step (backend/serving/native_step.pack_rows):
// (N / 8, K / 8, 8, 8), block b's step s holding rows 8b..8b+8's values 8s..8s+8, output by
// output; N % 8 == 0, K % 8 == 0. A block's values are then one sequential stream, read in the
// order linear_packed uses them.
// NOTE: why: dots() reads one weight row at a time (a sequential stream, but the rows of a few-row
// call read again for every weight row, and a row alone is one add chain); 8 outputs at once
// from the unpacked weight read 8 rows side by side, which the hardware prefetch does not follow:
// measured slower than dots() over the model's 18 MB (1.87 against 1.12 ms a step's weights at 1
// row), where the packed stream is faster (README, docs/bench/bench_packed_ab.json).
constexpr int kTileRows = 4;  // rows a tile multiplies at once (tiles of 6 and 8 were slower at 8 rows)

// A few-row matmul's work split in two where the weight is worth an OpenMP region (256 KB: ~20 us
// to read), else left on the calling thread: the grain of a parallel_for over n items.
inline int64_t weight_grain(int64_t N, int64_t K, int64_t n) { return N * K < (int64_t(1) << 16) ? n : (n + 1) / 2; }

#ifdef __AVX512F__
// 8 outputs of MR rows: x rows m < MR (row stride K) times packed block pk -> out[m * ldo + o],
// o < 8. Each output keeps dots()'s sums: its 8 lane sums over the steps (a product, then an add),
// then reduce8's tree (reduce8x8), + 0.f; so an output is dots()'s bits whatever the tiling. A zmm
// holds two outputs' 8 lanes (the row's 8 values broadcast to both halves): one weight load
// serves MR rows, one row load 8 outputs, 4 * MR independent add chains.
template <int MR>
inline void linear_tile(const float* x, const float* pk, int64_t K, float* out, int64_t ldo) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < 4; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; i += 8, pk += 64) {
    __m512 wv[4];
    for (int p = 0; p < 4; ++p) wv[p] = _mm512_loadu_ps(pk + 16 * p);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + m * K + i))));
      for (int p = 0; p < 4; ++p) acc[m][p] = _mm512_add_ps(acc[m][p], _mm512_mul_ps(xv, wv[p]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    __m256 halves[8];
    for (int p = 0; p < 4; ++p) {
      halves[2 * p] = _mm512_castps512_ps256(acc[m][p]);
      halves[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][p]), 1));
    }
    _mm256_storeu_ps(out + m * ldo, reduce8x8(halves));
  }
}
#else
template <int MR>
inline void linear_tile(const float* x, const float* pk, int64_t K, float* out, int64_t ldo) {
  for (int m = 0; m < MR; ++m) {  // NOTE: the same sums one row at a time
    v8 acc[8];
    for (int o = 0; o < 8; ++o) acc[o] = v8{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < K; i += 8) {
      const v8 xv = load8(x + m * K + i);
      for (int o = 0; o < 8; ++o) acc[o] += xv * load8(pk + i * 8 + o * 8);
    }
    for (int o = 0; o < 8; ++o) out[m * ldo + o] = reduce8(acc[o]) + 0.f;
  }
}
#endif

// x (M, K) f32 times a packed weight (N / 8, K / 8, 8, 8) -> (M, N): blocks of 8 outputs, each
// for every row, kTileRows rows at a time; the same bits as row_linear over the unpacked weight.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& pw) {
  const int64_t M = x.size(0), K = pw.size(1) * 8, N = pw.size(0) * 8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && pw.scalar_type() == at::kFloat &&
                  pw.size(2) == 8 && pw.size(3) == 8 && pw.is_contiguous(),
              "linear: a packed weight takes (M, K) float32 rows against its (N / 8, K / 8, 8, 8) float32 blocks");
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = pw.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = N / 8;
  at::parallel_for(0, blocks, weight_grain(N, K, blocks), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* pk = wp + b * 8 * K;
      int64_t m = 0;
      for (; m + kTileRows <= M; m += kTileRows) linear_tile<kTileRows>(xp + m * K, pk, K, op + m * N + b * 8, N);
      switch (M - m) {
        case 1: linear_tile<1>(xp + m * K, pk, K, op + m * N + b * 8, N); break;
        case 2: linear_tile<2>(xp + m * K, pk, K, op + m * N + b * 8, N); break;
        case 3: linear_tile<3>(xp + m * K, pk, K, op + m * N + b * 8, N); break;
        default: break;
      }
    }
  });
  return out;
}

// x (M, K) f32 times w (N, K)^T f32 for the few rows of a decode step (M <= kLinearRows): each
// output one dot() in its fixed order, the weight rows split across the threads. Larger M, or
// shapes dot() does not vectorize, go to at::linear. A packed w (4-D, a decode step's:
// linear_packed) runs its tiles, the same bits as dots().
// A bfloat16 w: M <= kLinearRows widens each weight exactly (the float32 bits over the widened
// weight); more rows are a bf16 matmul: x rounded to bfloat16, products summed in float32 by
// at::linear over bfloat16 (AVX512-BF16 where the CPU has it, about twice float32's rate at a
// prefill's row counts here). Only `cedar serve --weights bf16-matmul` hands a prefill bf16
// weights (modules.matmul_weight); its tolerance is stated and tested.
// NOTE: why: a decode step's matmuls read every weight once and do little else (memory-bound);
// MKL's few-row GEMM read at about 6 GB/s on one core here and slower on two, where a plain read
// streams at 11 GB/s on one core and 19 on two (cedar bench linear). Deterministic: no output
// depends on the thread count. Up to 16 rows: a decode step of up to 16 requests (SGLang's
// --max-running-requests here) reads its weights packed (linear_packed), and a per-layer forward
// of as many rows must give its bits (at 12-16 rows the packed tiles took 2.8-3.2 ms for a step's
// projections where at::linear took 4.7-4.8: README).
constexpr int64_t kLinearRows = 16;

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& w) {
  static const bool mkl = std::getenv("CEDAR_MKL_LINEAR") != nullptr;  // NOTE: an A/B switch for benchmarks
  if (w.dim() == 4) return linear_packed(x, w);
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  const bool bf16 = w.scalar_type() == at::kBFloat16;  // NOTE: the f32 path's bits over the widened weight
  if (bf16 && x.dim() == 2 && M > kLinearRows && x.scalar_type() == at::kFloat)
    return at::linear(x.to(at::kBFloat16), w).to(at::kFloat);
  if (mkl || x.dim() != 2 || M > kLinearRows || K % 8 || x.scalar_type() != at::kFloat ||
      (w.scalar_type() != at::kFloat && !bf16))
    return at::linear(x, bf16 ? w.to(at::kFloat) : w);
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto out = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = bf16 ? nullptr : wc.data_ptr<float>();
  const uint16_t* hp = bf16 ? reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()) : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, weight_grain(N, K, N), [&](int64_t n0, int64_t n1) {
    float tmp[kLinearRows];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += 8) {  // NOTE: 8 rows at a time; each output's sums are its own
        const int64_t rows = std::min<int64_t>(8, M - m0);
        if (bf16)
          dots_bf16(xp + m0 * K, rows, hp + n * K, K, tmp + m0);
        else
          dots(xp + m0 * K, rows, wp + n * K, K, tmp + m0);
      }
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = tmp[m];
    }
  });
  return out;
}

// RMSNorm of the rows of x (N, D): x * rsqrt(mean(x^2) + eps) * w.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t D = x.size(-1), N = x.numel() / D;
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* r = xp + n * D;
      const float ss = dot(r, r, D);
      const float inv = 1.f / std::sqrt(ss / float(D) + float(eps));
      float* o = op + n * D;
      for (int64_t d = 0; d < D; ++d) o[d] = r[d] * inv * wp[d];
    }
  });
  return out;
}

// RoPE by tables: out[t, ..., d] = x[t, ..., d] cos[t, d] + x[t, ..., partner[d]] sin[t, d].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& partner) {
  const int64_t T = x.size(0), D = x.size(-1), R = x.numel() / (T * D);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = partner.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = xp + (t * R + r) * D;
        float* o = op + (t * R + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * cp[t * D + d] + xr[pp[d]] * sp[t * D + d];
      }
  });
  return out;
}

// One layer's projections from its input rows h (T, hidden) f32, in one call: the torch
// composition of CEDLayer.project (the same matmuls, norm and RoPE kernels, in the same order,
// so the results are bit-identical) without its ~15 Python-level calls.
// Returns q (T, H, D) RoPE'd; the window K = V rows kv (T, D) normed and RoPE'd (empty without
// wkv); the indexer's queries iq (T, Hi, Di) and head weights iw (T, Hi) / index_div (empty
// without wq_index).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_project(
    const at::Tensor& h, const at::Tensor& attn_norm, double eps, const at::Tensor& wq, int64_t heads,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& partner, const c10::optional<at::Tensor>& wkv,
    const c10::optional<at::Tensor>& kv_norm, const c10::optional<at::Tensor>& wq_index,
    const c10::optional<at::Tensor>& w_index, int64_t index_heads, double index_div) {
  const int64_t T = h.size(0);
  const auto hn = rms_norm(h.contiguous(), attn_norm, eps);
  auto q = rope(row_linear(hn, wq).view({T, heads, -1}), cos, sin, partner);
  at::Tensor kv = hn.new_empty({0}), iq = hn.new_empty({0}), iw = hn.new_empty({0});
  if (wkv.has_value()) kv = rope(rms_norm(row_linear(hn, *wkv), *kv_norm, eps), cos, sin, partner);
  if (wq_index.has_value()) {
    iq = row_linear(hn, *wq_index).view({T, index_heads, -1});
    iw = row_linear(hn, *w_index) / index_div;
  }
  return {q, kv, iq, iw};
}

// The rest of a layer after its attention, in one call: h + wo(RoPE^-1(o)), then that plus the
// SwiGLU MLP of its RMSNorm. h (T, hidden), o (T, H, D) f32 -> (T, hidden) f32; bit-identical to
// CEDLayer.tail's composition (the same ops in the same order).
at::Tensor layer_tail(const at::Tensor& h, const at::Tensor& o, const at::Tensor& cos, const at::Tensor& sin_inverse,
                      const at::Tensor& partner, const at::Tensor& wo, const at::Tensor& mlp_norm, double eps,
                      const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  const auto a = rope(o.contiguous(), cos, sin_inverse, partner);
  const auto h1 = h + row_linear(a.reshape({o.size(0), -1}), wo);
  const auto n = rms_norm(h1.contiguous(), mlp_norm, eps);
  return h1 + row_linear(at::silu(row_linear(n, gate)) * row_linear(n, up), down);
}

// RoPE tables of T rows, in one call: Rope.of's torch composition (angles in float64, cos and sin
// cast to float32, the plain dims cos 1 and sin 0), the same ATen ops so the same bits.
// pos (T,) int64, freqs (rope_dim / 2,) float64 -> cos, sin, sin_inverse (T, dim) float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_tables(const at::Tensor& pos, const at::Tensor& freqs, int64_t dim) {
  const int64_t T = pos.size(0), plain = dim - 2 * freqs.size(0);
  const auto ang = pos.to(at::kDouble).unsqueeze(1) * freqs.unsqueeze(0);
  const auto cos = ang.cos().to(at::kFloat), sin = ang.sin().to(at::kFloat), neg = -sin;
  const auto ones = at::ones({T, plain}, cos.options()), zeros = at::zeros({T, plain}, cos.options());
  return {at::cat({ones, cos, cos}, 1), at::cat({zeros, neg, sin}, 1), at::cat({zeros, sin, neg}, 1)};
}

// One layer's attention in a decode step (one row per request), in one call: store the rows' window
// K = V into the layer's FP8 ring (where kv is given; layer E's decoder pass stored them at the cut),
// the window attention over the ring, and, with a global source, the indexer's top-k (or the
// selection of the layer producing it, sel_in), the sparse attention over the FP4 pool and the
// merge of both partials. The same kernels the per-kernel path calls, on the same inputs (the
// same bits); what it saves is the Python between them (~10 calls a layer).
// q (T, H, D) f32; kv (T, D) f32; floor (T,) int64 lowest readable window position of each row;
// sink (H,) f32. Returns o (T, H, D) f32 and the top-k this layer computed (T, k) int32 (empty
// when it computed none).
std::tuple<at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& q, const c10::optional<at::Tensor>& kv, at::Tensor& codes, at::Tensor& scales,
    at::Tensor& ring_pos, const at::Tensor& slot, const at::Tensor& pos, const at::Tensor& floor,
    const at::Tensor& sink, int64_t window, double scale, const c10::optional<at::Tensor>& g_rows,
    const c10::optional<at::Tensor>& g_row_scales, const c10::optional<at::Tensor>& g_index_rows,
    const c10::optional<at::Tensor>& g_index_scales, const c10::optional<at::Tensor>& entry_rows,
    const c10::optional<at::Tensor>& cu_c, const c10::optional<at::Tensor>& row_req,
    const c10::optional<at::Tensor>& c_pos, const c10::optional<at::Tensor>& iq, const c10::optional<at::Tensor>& iw,
    int64_t topk, const c10::optional<at::Tensor>& sel_in) {
  if (kv.has_value()) fp8_ring_store(*kv, slot, pos, codes, scales, ring_pos);
  auto [o, lse] = window_ring_attention(q, codes, scales, ring_pos, slot, pos, floor, sink, window, scale);
  if (!g_rows.has_value()) return {o, q.new_empty({0}, q.options().dtype(at::kInt))};
  at::Tensor sel = iq.has_value() ? indexer_topk(*iq, *iw, c10::nullopt, *g_index_rows, *g_index_scales, *entry_rows,
                                                 *cu_c, *row_req, pos, *c_pos, topk)
                                  : *sel_in;
  auto [og, lg] = sparse_pool_attention(q, c10::nullopt, *g_rows, *g_row_scales, *entry_rows, *cu_c, *row_req, sel,
                                        scale);
  auto merged = std::get<0>(merge_states(o, lse, og, lg));
  return {merged, iq.has_value() ? sel : q.new_empty({0}, q.options().dtype(at::kInt))};
}

// A KV source's compressor in a decode step, in one call: the projection of the rows x (T, hidden)
// (RMSNorm, wkv, wgate), the groups this step completes pooled (rows src of [kv; the slots' pending
// tails], the gate's softmax over each group; ratio 1: the row itself), each entry normed and
// RoPE'd at its last position and its index key index_norm(wk_index(pooled)), both FP4-encoded into
// the pool rows dst; then the rows tail_src kept pending at tail_dst and each slot's tail length
// set. The torch composition of PoolKeys.write_global and Compressor.pool (the same ATen ops and
// kernels, the same bits). first_pos (G,) int64 the written groups' first positions; freqs
// (rope_dim / 2,) float64 and partner (D,) int64 the RoPE constants; tail_* undefined at ratio 1.
void compress_decode(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wkv,
                     const c10::optional<at::Tensor>& wgate, const at::Tensor& kv_norm_w, const at::Tensor& wk_index,
                     const at::Tensor& index_norm_w, int64_t ratio, const at::Tensor& freqs, const at::Tensor& partner,
                     const at::Tensor& src, const at::Tensor& first_pos, const at::Tensor& dst,
                     const c10::optional<at::Tensor>& tail_src, const c10::optional<at::Tensor>& tail_dst,
                     const c10::optional<at::Tensor>& tail_kv, const c10::optional<at::Tensor>& tail_gate,
                     const c10::optional<at::Tensor>& tail_len, const c10::optional<at::Tensor>& slots,
                     const c10::optional<at::Tensor>& new_tail_len, at::Tensor& rows, at::Tensor& row_scales,
                     at::Tensor& index_rows, at::Tensor& index_scales, int64_t global_group, bool global_e4m3,
                     int64_t index_group, bool index_e4m3) {
  const auto xn = rms_norm(x.contiguous(), norm_w, eps);
  const auto kv = row_linear(xn, wkv);
  const auto gate = wgate.has_value() ? row_linear(xn, *wgate) : at::Tensor();
  const int64_t L = kv.size(1);
  if (first_pos.numel() > 0) {
    const auto kv_all = ratio > 1 ? at::cat({kv, tail_kv->view({-1, L})}) : kv;
    const auto kvg = kv_all.index({src}).view({-1, ratio, L});
    at::Tensor pooled;
    if (gate.defined()) {
      const auto gate_all = ratio > 1 ? at::cat({gate, tail_gate->view({-1, L})}) : gate;
      pooled = (at::softmax(gate_all.index({src}).view({-1, ratio, L}), 1) * kvg).sum(1);
    } else {
      pooled = kvg.select(1, 0);
    }
    auto [cos, sin, sin_inverse] = rope_tables(first_pos + (ratio - 1), freqs, L);
    const auto entries = rope(rms_norm(pooled.contiguous(), kv_norm_w, eps), cos, sin, partner);
    const auto index = rms_norm(row_linear(pooled, wk_index).contiguous(), index_norm_w, eps);
    auto [codes, scales] = fp4_quantize(entries.contiguous(), global_group, global_e4m3);
    rows.index_put_({dst}, codes);
    row_scales.index_put_({dst}, scales);
    auto [icodes, iscales] = fp4_quantize(index.contiguous(), index_group, index_e4m3);
    index_rows.index_put_({dst}, icodes);
    index_scales.index_put_({dst}, iscales);
  }
  if (ratio > 1) {
    tail_kv->view({-1, L}).index_put_({*tail_dst}, kv.index({*tail_src}));
    tail_gate->view({-1, L}).index_put_({*tail_dst}, gate.index({*tail_src}));
    tail_len->index_put_({*slots}, *new_tail_len);
  }
}


// A whole served decode step in one call: every layer's compressor, projections, attention and
// tail, and the cut between them, as run_layers + PoolKeys' one-call path compose them (the same
// functions on the same inputs in the same order, so the same bits); what it saves is the Python
// between the ~4 calls a layer (module lookups, argument lists, the dispatcher). The CPU
// counterpart of a captured decode graph: the per-step tables are built before it, and nothing in
// it reads a value back to decide a shape.
//
// The lists are flat, in the layouts backend/serving/native_step.py writes (NW / NF / NI entries a
// layer, then NS step tensors and NL a layer). h (T, hidden) f32 embeddings of the step's rows ->
// the last layer's output on the decoder rows (T', hidden) f32. Writes the rings, the pools, the
// compressor tails and the stored encoder outputs, as the per-layer path does.
constexpr int64_t NW = 20, NF = 5, NI = 6, NS = 17, NL = 25;

at::Tensor decode_step(const at::Tensor& h_in, const std::vector<c10::optional<at::Tensor>>& w,
                       at::ArrayRef<double> f, at::ArrayRef<int64_t> ints,
                       const std::vector<c10::optional<at::Tensor>>& st) {
  const int64_t E = ints[0], window = ints[1], topk = ints[2], g_group = ints[3], i_group = ints[5];
  const bool g_e4m3 = ints[4] != 0, i_e4m3 = ints[6] != 0;
  const int64_t L = (int64_t)(ints.size() - 7) / NI;
  TORCH_CHECK((int64_t)w.size() == L * NW && (int64_t)f.size() == L * NF && (int64_t)st.size() == NS + L * NL,
              "decode_step: list sizes do not match ", L, " layers");
  auto W = [&](int64_t i, int64_t k) -> const c10::optional<at::Tensor>& { return w[i * NW + k]; };
  auto S = [&](int64_t k) -> const at::Tensor& { return *st[k]; };
  auto SL = [&](int64_t i, int64_t k) -> const c10::optional<at::Tensor>& { return st[NS + i * NL + k]; };
  auto I = [&](int64_t i, int64_t k) { return ints[7 + i * NI + k]; };
  const at::Tensor &partner = S(3), &slots = S(7), &pos = S(8), &dpos = S(9);
  std::vector<at::Tensor> sel(L);

  auto compress = [&](int64_t i, const at::Tensor& x) {
    const int64_t r = I(i, 2);
    auto m = [&](int64_t k) -> at::Tensor { return *SL(i, k); };
    auto o = [&](int64_t k) -> c10::optional<at::Tensor> { return r > 1 ? SL(i, k) : c10::nullopt; };
    at::Tensor rows = m(21), row_scales = m(22), index_rows = m(23), index_scales = m(24);
    c10::optional<at::Tensor> tail_kv = o(16), tail_gate = o(17), tail_len = o(18);
    compress_decode(x, *W(i, 12), f[i * NF + 4], *W(i, 13), r > 1 ? W(i, 14) : c10::nullopt, *W(i, 15), *W(i, 16),
                    *W(i, 17), r, *W(i, 18), *W(i, 19), m(11), m(12), m(13), o(14), o(15), tail_kv, tail_gate,
                    tail_len, o(19), o(20), rows, row_scales, index_rows, index_scales, g_group, g_e4m3, i_group,
                    i_e4m3);
  };
  // one layer from its projections on: the attention in one call, then the tail
  // (layer E's decoder pass runs on the decoder rows but reads the encoder's window floor)
  auto block = [&](int64_t i, const at::Tensor& h, bool dec) -> at::Tensor {
    const bool store = i != E, dec_floor = i > E;
    if (I(i, 2) > 0 && i != E) compress(i, h);
    const at::Tensor &cos = dec ? S(4) : S(0), &sin = dec ? S(5) : S(1), &sin_inv = dec ? S(6) : S(2);
    const int64_t source = I(i, 3), index_heads = I(i, 1);
    const bool has_idx = I(i, 5) != 0, idx = source >= 0 && has_idx;
    auto [q, kv, iq, iw] = layer_project(h, *W(i, 0), f[i * NF], *W(i, 1), I(i, 0), cos, sin, partner,
                                         store ? W(i, 2) : c10::nullopt, store ? W(i, 3) : c10::nullopt,
                                         has_idx ? W(i, 4) : c10::nullopt, has_idx ? W(i, 5) : c10::nullopt,
                                         has_idx ? index_heads : 0, has_idx ? f[i * NF + 2] : 1.0);
    at::Tensor codes = *SL(i, 0), scales = *SL(i, 1), ring_pos = *SL(i, 2);
    auto g = [&](int64_t k) -> c10::optional<at::Tensor> { return source >= 0 ? SL(i, 3 + k) : c10::nullopt; };
    c10::optional<at::Tensor> sel_in;
    if (source >= 0 && !idx) sel_in = sel[I(i, 4)];
    auto [o, s] = decode_attention(q, store ? c10::optional<at::Tensor>(kv) : c10::nullopt, codes, scales, ring_pos,
                                   slots, dec ? dpos : pos, dec_floor ? S(11) : S(10), *W(i, 6), window, f[i * NF + 3], g(0),
                                   g(1), g(2), g(3), g(4), g(5), g(6), g(7),
                                   idx ? c10::optional<at::Tensor>(iq) : c10::nullopt,
                                   idx ? c10::optional<at::Tensor>(iw) : c10::nullopt, topk, sel_in);
    if (idx) sel[i] = s;
    return layer_tail(h, o, cos, sin_inv, partner, *W(i, 7), *W(i, 8), f[i * NF + 1], *W(i, 9), *W(i, 10),
                      *W(i, 11));
  };

  at::Tensor h = h_in;
  for (int64_t i = 0; i < E; ++i) h = block(i, h, false);
  // the cut: layer E writes the global KV and its window rows for every row; its attention and
  // every later layer run on the decoder rows only
  compress(E, h);
  const auto kv = rope(rms_norm(row_linear(rms_norm(h.contiguous(), *W(E, 0), f[E * NF]), *W(E, 2)), *W(E, 3),
                                f[E * NF]),
                       S(0), S(1), partner);
  at::Tensor codes = *SL(E, 0), scales = *SL(E, 1), ring_pos = *SL(E, 2);
  fp8_ring_store(kv.contiguous(), slots, pos, codes, scales, ring_pos);
  at::Tensor enc_out = S(13), enc_pos = S(16);
  // read before this step's outputs are kept: rows_of_cut (backend/serving/pool_keys.py), the
  // rows S(12) of cat(h, enc_out) by two gathers (cat copied every slot's kept rows each step)
  const auto& src = S(12);
  const int64_t T = h.size(0);
  const auto kept = enc_out.index({(src - T).clamp_min(0)});
  auto dec = T == 0 ? kept : at::where(src.lt(T).unsqueeze(1), h.index({src.clamp_max(T - 1)}), kept);
  enc_out.index_put_({S(14)}, h.index({S(15)}));
  enc_pos.index_put_({S(14)}, pos.index({S(15)}));
  if (dec.size(0) == 0) return dec;
  std::fill(sel.begin(), sel.end(), at::Tensor());
  for (int64_t i = E; i < L; ++i) dec = block(i, dec, true);
  return dec;
}

}  // namespace

TORCH_LIBRARY(cedar_cpu, m) {
  m.def("window_ring_attention(Tensor q, Tensor codes, Tensor scales, Tensor ring_pos, Tensor slot, Tensor q_pos, "
        "Tensor floor, Tensor? sink, int window, float scale) -> (Tensor, Tensor)");
  m.def("window_ragged_attention(Tensor q, Tensor keys, Tensor key_pos, Tensor cu_k, Tensor k_first, "
        "Tensor row_req, Tensor q_pos, Tensor floor, Tensor? sink, int ring_size, int window, float scale) "
        "-> (Tensor, Tensor)");
  m.def("topk_exact(Tensor scores, int k) -> Tensor");
  m.def("indexer_topk(Tensor iq, Tensor iw, Tensor? keys, Tensor codes, Tensor scales, Tensor entry_rows, "
        "Tensor cu_c, Tensor row_req, Tensor q_pos, Tensor c_pos, int k) -> Tensor");
  m.def("sparse_pool_attention(Tensor q, Tensor? entries, Tensor codes, Tensor scales, Tensor entry_rows, Tensor cu_c, "
        "Tensor q_req, Tensor indices, float scale) -> (Tensor, Tensor)");
  m.def("fp8_quantize(Tensor x) -> (Tensor, Tensor)");
  m.def("fp4_quantize(Tensor x, int group, bool e4m3) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor partner) -> Tensor");
  m.def("merge_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def("layer_project(Tensor h, Tensor attn_norm, float eps, Tensor wq, int heads, Tensor cos, Tensor sin, "
        "Tensor partner, Tensor? wkv, Tensor? kv_norm, Tensor? wq_index, Tensor? w_index, int index_heads, "
        "float index_div) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("layer_tail(Tensor h, Tensor o, Tensor cos, Tensor sin_inverse, Tensor partner, Tensor wo, Tensor mlp_norm, "
        "float eps, Tensor gate, Tensor up, Tensor down) -> Tensor");
  m.def("rope_tables(Tensor pos, Tensor freqs, int dim) -> (Tensor, Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor? kv, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!) ring_pos, "
        "Tensor slot, Tensor pos, Tensor floor, Tensor sink, int window, float scale, Tensor? g_rows, "
        "Tensor? g_row_scales, Tensor? g_index_rows, Tensor? g_index_scales, Tensor? entry_rows, Tensor? cu_c, "
        "Tensor? row_req, Tensor? c_pos, Tensor? iq, Tensor? iw, int topk, Tensor? sel_in) -> (Tensor, Tensor)");
  m.def("compress_decode(Tensor x, Tensor norm_w, float eps, Tensor wkv, Tensor? wgate, Tensor kv_norm_w, "
        "Tensor wk_index, Tensor index_norm_w, int ratio, Tensor freqs, Tensor partner, Tensor src, Tensor first_pos, "
        "Tensor dst, Tensor? tail_src, Tensor? tail_dst, Tensor(a!)? tail_kv, Tensor(b!)? tail_gate, "
        "Tensor(c!)? tail_len, Tensor? slots, Tensor? new_tail_len, Tensor(d!) rows, Tensor(e!) row_scales, "
        "Tensor(f!) index_rows, Tensor(g!) index_scales, int global_group, bool global_e4m3, int index_group, "
        "bool index_e4m3) -> ()");
  // NOTE: writes pool, ring, tail and encoder-output tensors inside its step list (eager CPU only)
  m.def("decode_step(Tensor h, Tensor?[] weights, float[] floats, int[] ints, Tensor?[] step) -> Tensor");
  m.def("fp8_ring_store(Tensor rows, Tensor slot, Tensor pos, Tensor(a!) codes, Tensor(b!) scales, "
        "Tensor(c!) ring_pos) -> ()");
  m.def("fp8_window_keys(Tensor kv, Tensor ring_src, Tensor ring_first, Tensor perm, Tensor write_src, "
        "Tensor write_dst, Tensor pos, Tensor(a!) rows, Tensor(b!) scales, Tensor(c!) ring_pos) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cedar_cpu, CPU, m) {
  m.impl("window_ring_attention", &window_ring_attention);
  m.impl("window_ragged_attention", &window_ragged_attention);
  m.impl("topk_exact", &topk_exact);
  m.impl("indexer_topk", &indexer_topk);
  m.impl("sparse_pool_attention", &sparse_pool_attention);
  m.impl("fp8_ring_store", &fp8_ring_store);
  m.impl("fp8_window_keys", &fp8_window_keys);
  m.impl("fp8_quantize", &fp8_quantize);
  m.impl("fp4_quantize", &fp4_quantize);
  m.impl("merge_states", &merge_states);
  m.impl("rms_norm", &rms_norm);
  m.impl("linear", &row_linear);
  m.impl("rope", &rope);
  m.impl("layer_project", &layer_project);
  m.impl("layer_tail", &layer_tail);
  m.impl("rope_tables", &rope_tables);
  m.impl("decode_attention", &decode_attention);
  m.impl("compress_decode", &compress_decode);
  m.impl("decode_step", &decode_step);
}
