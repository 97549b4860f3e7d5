// GGUF block formats (llama.cpp's ggml types) read as stored, on any CPU.
//
// ISA paths: AVX-512 F + BW + VL + VNNI (and F16C) where the compiler targets them (-march=native
// on such a CPU): 64-byte vectors and vpdpbusd. AVX2 + FMA + F16C without AVX-512 (Zen 2/3,
// Intel client cores): the dot products in 32-byte vectors (vpmaddubsw, vpmaddwd), as llama.cpp's
// AVX2 kernels. Everywhere else (x86-64 baseline, aarch64): plain loops over the same block
// layouts that gcc -O3 vectorizes for the target. The same integer arithmetic on every path, only
// the fp32 summation order differs; dequantization is bit for bit the same on all.
//
// A weight is uint8 [N, row_bytes]: each row is K / block_size blocks of one ggml type
// (ggml-common.h's layouts; the `gguf` Python package's dequantize is the reference):
//   Q4_0 (18 B / 32): fp16 d, 16 B nibbles: w = d (q - 8); element j is byte j's low nibble,
//                     element 16 + j its high nibble;
//   Q4_1 (20 B / 32): fp16 d, fp16 m, 16 B nibbles: w = d q + m;
//   Q5_0 (22 B / 32): fp16 d, u32 high bits (bit j: element j), nibbles: w = d (q - 16);
//   Q5_1 (24 B / 32): fp16 d, fp16 m, u32 high bits, nibbles: w = d q + m;
//   Q8_0 (34 B / 32): fp16 d, 32 int8: w = d q;
//   Q4_K (144 B / 256): fp16 d, fp16 dmin, 12 B of 6-bit scales and mins for 8 sub-blocks of 32,
//                       128 B nibbles (bytes 32c..32c+31: low nibbles sub-block 2c, high 2c+1):
//                       w = d sc_i q - dmin m_i;
//   Q5_K (176 B / 256): Q4_K plus 32 B of high bits (byte l, bit i: element 32i + l);
//   Q6_K (210 B / 256): 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales (per 16), fp16 d:
//                       w = d sc_i (q - 32);
//   F32, F16, BF16 rows.
//
// Decode GEMV (ggml_gemv): x [M, K] is quantized to int8 inside the call as
// llama.cpp does: blocks of 32 with a scale and the scaled code sum (its Q8_0 / Q8_1) for the
// 32-blocks types, blocks of 256 with sums per 16 (its Q8_K) for the K-quants; the scales here
// are fp32 amax / 127 and codes round half to even. Every weight block's codes are unsigned (Q8_0:
// |q|, the sign moved onto the activation), so vpdpbusd sums 4 products per int32 lane exactly;
// the offsets (-8 d, m, -dmin m_i, -32 d sc_i) multiply the activation sums, and the blocks'
// partial sums are scaled and added in fp32. F32 and F16 rows multiply fp32 activations (fp16
// widened exactly); BF16 rows multiply x rounded to bf16 as llama.cpp does, in tiles that make
// them a GEMM at any row count ("BF16 rows" below). The op takes a list of weights sharing x,
// each of its own type (Q4_K_M files mix Q4_K and Q6_K in one q/k/v group), returns
// [M, N_0 + N_1 + ...] fp32, and quantizes x once per activation format the group needs. The
// dot products take up to MAX_ROWS (8) rows of x at a time; more rows are chunks of 8, run on
// each tile of weight rows in turn so the weights are read from memory once.
//
// Every type above but the float ones also runs interleaved (ggml type | X16, see "The
// interleaved layout"):
// the blocks of 16 rows side by side, so one vpdpbusd advances 16 rows and one fp32 multiply-add
// scales them; ggml_interleave converts either way (zcode/loader/interleaved.py caches a file's).
//
// ggml_dequantize: rows (all, or those of a list of ids: an embedding lookup) -> fp32, rounding exactly as the gguf package does (its products and
// sums in the same order, no fused multiply-adds: this file is built with -ffp-contract=off).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_dot.h"
#include "simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <optional>
#include <vector>

// The AVX-512 path: 64-byte vectors, byte masks (BW, VL), vpdpbusd (VNNI), fp16 loads (F16C).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define ZCODE_GGML_AVX512 1
// The AVX2 path (AVX-512 absent): 32-byte vectors, vpmaddubsw + vpmaddwd, fp16 loads (F16C), FMA.
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ZCODE_GGML_AVX2 1
#endif

namespace {

// ggml type ids (gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int64_t MAX_ROWS = 8;
constexpr int64_t QK = 32, QK_K = 256;
// A parallel_for task reads at least this many weight bytes: forking the second thread costs
// about as much as streaming ~64 KB (see gemv.cpp).
constexpr int64_t GRAIN_BYTES = 64 << 10;
// Weight rows are prefetched PREFETCH_BYTES ahead into L2 (float_dot.h says why).
using zcode_float_dot::prefetch_l2;

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // IEEE half -> float, exact (x86-64 without F16C, aarch64 builds without __fp16 assumptions).
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | mantissa << 13;  // inf, nan
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int shift = 0;
    while (!(mantissa & 0x400)) mantissa <<= 1, ++shift;
    bits = sign | static_cast<uint32_t>(113 - shift) << 23 | (mantissa & 0x3FF) << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// The 12 bytes of 6-bit scales and mins of Q4_K / Q5_K -> bytes sc[0..7], m[0..7]. Bytes 0-3 hold
// sc 0-3 (low 6 bits) and sc 4-7's top 2 bits, bytes 4-7 likewise m, bytes 8-11 the low nibbles
// of sc 4-7 and (high nibbles) m 4-7.
inline void scale_min_bytes(const uint8_t* p, uint8_t* sc_and_m) {
  uint32_t a[3], out[4];
  std::memcpy(a, p, 12);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  out[0] = a[0] & six;
  out[1] = (a[2] & four) | (((a[0] >> 6) & two) << 4);
  out[2] = a[1] & six;
  out[3] = ((a[2] >> 4) & four) | (((a[1] >> 6) & two) << 4);
  std::memcpy(sc_and_m, out, 16);
}

// ---- Activations quantized per block: x ~= scale * codes.

// The codes of 32-blocks are stored by pairs of blocks b, b + 1 in the order their weights' codes
// load as one 64-byte vector (pair_nibbles): b's elements 0-15, b + 1's 0-15, b's 16-31,
// b + 1's 16-31; an odd last block is paired with zeros.
struct Activations {
  int64_t M = 0, K = 0, block = 0, code_stride = 0;
  int64_t scale_stride = 0;   // blocks, rounded up to pairs for 32-blocks (the twin's are zeros)
  std::vector<int8_t> codes;  // [M, code_stride]: 32-blocks by pairs, 256-blocks in order
  std::vector<float> scale;   // [M, scale_stride]: amax / 127
  std::vector<float> sums;    // per block: 32-blocks: [M, scale_stride, 2] scale, and scale *
                              // sum of codes (the pair's four in one load);
                              // 256-blocks: [M, K / 256, 32]: scale * sums per 16 (16 lanes),
                              // then 8 zeros and scale * sums per 32 (8 lanes)
  int64_t blocks() const { return K / block; }
  // Where element k of block b (k a multiple of 16; b even for 32-blocks: the pair's start) is.
  int64_t code_offset(int64_t b, int64_t k) const {
    return block == QK ? b / 2 * 64 + k / 16 * 32 + b % 2 * 16 : b * block + k;
  }
  const int8_t* block_codes(int64_t m, int64_t b) const {
    return codes.data() + m * code_stride + code_offset(b, 0);
  }
  float block_scale(int64_t m, int64_t b) const { return scale[m * scale_stride + b]; }
};


// ---- The interleaved layout (ggml type | X16) of the 32-block types (the K-quants': x16_row_kq,
// x16_row_q6k), for decode GEMVs.
//
// A row-major block puts one row's 32 codes in a vector, so every block of every row needs its own
// scale multiply and a horizontal sum. Interleaved, the blocks b of 16 consecutive rows lie
// together: their 16 fp16 d (then 16 fp16 m for Q4_1 / Q5_1), and their codes as 64-byte vectors
// whose int32 lane i holds 4 codes of row i. Then one vpdpbusd against 4 activation codes
// (broadcast) advances 16 rows, and one fp32 multiply-add scales 16 rows' block sums. The same
// bytes as the file's rows, only reordered (the 16 rows' byte span holds their group: rows stay
// sliceable by 16), so it is lossless and takes no more memory (llama.cpp's CPU "repack" buffers
// do the like for Q4_0). Per block of 16 rows, at byte offsets:
//   Q4_0 / Q5_0 / Q8_0: 0: d[16]                 Q4_1 / Q5_1: 0: d[16], 32: m[16]
//   Q5_0 / Q5_1: then 4 x (u64 low mask, u64 high mask): the fifth bits of vector j's low and
//     high nibbles (bit 4i + t: row i's element 4j + t, resp. 16 + 4j + t);
//   then the codes: nibble types 4 vectors, vector j lane i = row i's nibble bytes 4j..4j+3 (low
//     nibbles: elements 4j..4j+3, high: 16 + 4j..); Q8_0 8 vectors, vector j lane i = row i's
//     elements 4j..4j+3, xor 0x80 (unsigned: q + 128, so w = d (q' - 128)).
constexpr int64_t X16 = 256, GROUP_ROWS = 16;
inline bool is_x16(int64_t type) { return (type & X16) != 0; }
inline int64_t base_type(int64_t type) { return type & ~X16; }

struct X16Layout {
  int64_t bytes = 0;                      // a row's block: the file's BYTES
  int64_t src_m = -1, src_qh = -1, src_codes = 2;  // where the file's block keeps them
  int64_t m = -1, high_bits = -1, codes = 32;     // where the group's block keeps them
  int64_t code_vectors = 4;
  bool flip = false;  // Q8_0: codes xor 0x80
};

constexpr X16Layout x16_layout(int64_t base) {
  X16Layout l;
  switch (base) {
    case 2: l.bytes = 18; break;                                                     // Q4_0
    case 3: l.bytes = 20, l.src_m = 2, l.src_codes = 4, l.m = 32, l.codes = 64; break;  // Q4_1
    case 6: l.bytes = 22, l.src_qh = 2, l.src_codes = 6, l.high_bits = 32, l.codes = 96; break;
    case 7:                                                                          // Q5_1
      l.bytes = 24, l.src_m = 2, l.src_qh = 4, l.src_codes = 8, l.m = 32, l.high_bits = 64,
      l.codes = 128;
      break;
    case 8: l.bytes = 34, l.code_vectors = 8, l.flip = true; break;                  // Q8_0
  }
  return l;
}
inline bool has_x16(int64_t base) {
  return x16_layout(base).bytes != 0 || base == 12 || base == 13 || base == 14;  // Q4_K Q5_K Q6_K
}

// Row i (0..15) of a group's blocks <-> the file's row bytes (K / 32 blocks): pack writes the
// group from the row, else the row from the group.
void x16_row(const X16Layout& l, uint8_t* group, uint8_t* row, int64_t i, int64_t num_blocks,
             bool pack) {
  const uint32_t flip = l.flip ? 0x80808080u : 0u;
  const auto move = [pack](uint8_t* g, uint8_t* r, size_t n) {
    pack ? std::memcpy(g, r, n) : std::memcpy(r, g, n);
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint8_t* g = group + b * GROUP_ROWS * l.bytes;
    uint8_t* r = row + b * l.bytes;
    move(g + 2 * i, r, 2);
    if (l.m >= 0) move(g + l.m + 2 * i, r + l.src_m, 2);
    for (int64_t j = 0; j < l.code_vectors; ++j) {
      uint8_t* to = pack ? g + l.codes + 64 * j + 4 * i : r + l.src_codes + 4 * j;
      const uint8_t* from = pack ? r + l.src_codes + 4 * j : g + l.codes + 64 * j + 4 * i;
      uint32_t codes;
      std::memcpy(&codes, from, 4);
      codes ^= flip;
      std::memcpy(to, &codes, 4);
    }
    if (l.high_bits < 0) continue;
    uint32_t qh;
    std::memcpy(&qh, r + l.src_qh, 4);  // unpack: overwritten bit by bit
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t half = 0; half < 2; ++half) {
        uint8_t* at = g + l.high_bits + 16 * j + 8 * half;
        uint64_t mask;
        std::memcpy(&mask, at, 8);
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t element = 16 * half + 4 * j + t, bit = 4 * i + t;
          if (pack)
            mask = (mask & ~(1ull << bit)) | static_cast<uint64_t>((qh >> element) & 1) << bit;
          else
            qh = (qh & ~(1u << element)) | static_cast<uint32_t>((mask >> bit) & 1) << element;
        }
        if (pack) std::memcpy(at, &mask, 8);
      }
    if (!pack) std::memcpy(r + l.src_qh, &qh, 4);
  }
}

// Q6_K interleaved, per block of 16 rows (3360 bytes, 16 x 210): 0: d[16] (fp16); 32: the
// int8 scales by group of 16 elements, [16 groups][16 rows]; 288: per group g of 16 elements,
// 192 bytes: A, B, H, 64 each, lane i (row i) byte t: A's low nibble the low 4 bits of element
// 16g + t, its high nibble those of 16g + 8 + t; B likewise 16g + 4 + t and 16g + 12 + t; H bits
// 2j, 2j + 1 the high 2 bits of element 16g + 4j + t. The file's block: ql[128], qh[64],
// scales[16], d; element 128h + 32s + l: low 4 bits nibble s / 2 of ql[64h + 32(s % 2) + l],
// high 2 bits (qh[32h + l] >> 2s) & 3.
constexpr int64_t Q6K_BYTES = 210, Q6K_CODES = 288;

void x16_row_q6k(uint8_t* group, uint8_t* row, int64_t i, int64_t num_blocks, bool pack) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint8_t* g = group + b * GROUP_ROWS * Q6K_BYTES;
    uint8_t* r = row + b * Q6K_BYTES;
    pack ? std::memcpy(g + 2 * i, r + 208, 2) : std::memcpy(r + 208, g + 2 * i, 2);
    for (int64_t sg = 0; sg < 16; ++sg) pack ? (g[32 + 16 * sg + i] = r[192 + sg])
                                              : (r[192 + sg] = g[32 + 16 * sg + i]);
    if (!pack) std::memset(r, 0, 192);  // ql, qh: or-ed together below
    for (int64_t e = 0; e < 256; ++e) {
      const int64_t h = e / 128, s = e / 32 % 4, l = e % 32;
      uint8_t& ql = r[64 * h + 32 * (s % 2) + l];
      uint8_t& qh = r[128 + 32 * h + l];
      const int64_t sg = e / 16, j = e % 16 / 4, t = e % 4;
      uint8_t* at = g + Q6K_CODES + 192 * sg + 4 * i + t;
      uint8_t& low_byte = at[j % 2 == 0 ? 0 : 64];
      const int low_shift = j < 2 ? 0 : 4;
      uint8_t& high_byte = at[128];
      const int ql_shift = s / 2 * 4, qh_shift = 2 * s;
      if (pack) {
        const int low = (ql >> ql_shift) & 0xF, high = (qh >> qh_shift) & 3;
        low_byte = static_cast<uint8_t>((low_byte & ~(0xF << low_shift)) | low << low_shift);
        high_byte = static_cast<uint8_t>((high_byte & ~(3 << 2 * j)) | high << 2 * j);
      } else {
        ql |= static_cast<uint8_t>(((low_byte >> low_shift) & 0xF) << ql_shift);
        qh |= static_cast<uint8_t>(((high_byte >> 2 * j) & 3) << qh_shift);
      }
    }
  }
}

// Q4_K / Q5_K interleaved, per block of 16 rows (16 x 144 / 16 x 176 bytes): 0: d[16], 32:
// dmin[16] (fp16); 64: the rows' 12 bytes of 6-bit scales and mins transposed, byte k of row i at
// 64 + 16k + i (byte k of the 16 rows is one 16-byte load); Q5_K: 256: per code vector v, the u64
// masks of the fifth bits of its low and its high nibbles at 256 + 16v, 264 + 16v (bit 4i + t:
// row i's element 64c + 4j + t, resp. 64c + 32 + 4j + t, for v = 8c + j); then (256 / 768) the
// codes: vector v = 8c + j at 64v, lane i = row i's nibble bytes 32c + 4j..4j+3 (low nibbles:
// sub-block 2c's elements 4j..4j+3, high nibbles: sub-block 2c + 1's).
constexpr int64_t Q4K_BYTES = 144, Q5K_BYTES = 176, KQ_SCALES = 64, Q5K_MASKS = 256;
constexpr int64_t kq_codes(bool five) { return five ? 768 : 256; }

void x16_row_kq(uint8_t* group, uint8_t* row, int64_t i, int64_t num_blocks, bool five, bool pack) {
  const int64_t bytes = five ? Q5K_BYTES : Q4K_BYTES, src_codes = five ? 48 : 16;
  const auto move = [pack](uint8_t* g, uint8_t* r, size_t n) {
    pack ? std::memcpy(g, r, n) : std::memcpy(r, g, n);
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint8_t* g = group + b * GROUP_ROWS * bytes;
    uint8_t* r = row + b * bytes;
    move(g + 2 * i, r, 2);
    move(g + 32 + 2 * i, r + 2, 2);
    for (int64_t k = 0; k < 12; ++k) move(g + KQ_SCALES + 16 * k + i, r + 4 + k, 1);
    for (int64_t v = 0; v < 32; ++v) move(g + kq_codes(five) + 64 * v + 4 * i, r + src_codes + 4 * v, 4);
    if (!five) continue;
    uint8_t* qh = r + 16;  // element 32s + l's fifth bit: bit s of qh[l]
    if (!pack) std::memset(qh, 0, 32);
    for (int64_t v = 0; v < 32; ++v)
      for (int64_t high = 0; high < 2; ++high) {
        uint8_t* at = g + Q5K_MASKS + 16 * v + 8 * high;
        const int64_t s = 2 * (v / 8) + high;  // the sub-block
        uint64_t mask;
        std::memcpy(&mask, at, 8);
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t l = 4 * (v % 8) + t, bit = 4 * i + t;
          if (pack)
            mask = (mask & ~(1ull << bit)) | static_cast<uint64_t>((qh[l] >> s) & 1) << bit;
          else
            qh[l] |= static_cast<uint8_t>(((mask >> bit) & 1) << s);
        }
        if (pack) std::memcpy(at, &mask, 8);
      }
  }
}

// Row i of a group <-> the file's row of K elements, any interleaved type.
void x16_rows(int64_t base, uint8_t* group, uint8_t* row, int64_t i, int64_t K, bool pack) {
  if (base == 12 || base == 13) return x16_row_kq(group, row, i, K / 256, base == 13, pack);
  if (base == 14) return x16_row_q6k(group, row, i, K / 256, pack);  // Q6_K
  x16_row(x16_layout(base), group, row, i, K / 32, pack);
}

#if defined(ZCODE_GGML_AVX512)

// 16 nibbles -> 32 codes in element order: the low nibbles, then the high.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

// 32 nibbles -> 64 codes: the low nibbles, then the high (a K-quant's sub-blocks 2c and 2c + 1).
inline __m512i nibbles64(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low4)),
                            _mm256_and_si256(_mm256_srli_epi16(b, 4), low4), 1);
}

// ---- The 32-element block types: codes q (unsigned, but Q8_0's signed) and w = d (q - ZERO) + m.
// decode: one block's codes in element order (dequantization); pair: blocks p0 and p1 (nullptr:
// none, zero codes) in the paired order of Activations.

// Two blocks' 16 nibble bytes -> 64 codes: low nibbles of both, then high nibbles of both.
inline __m512i pair_nibbles(const uint8_t* q0, const uint8_t* q1) {
  const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0));
  const __m128i b1 = q1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)) : _mm_setzero_si128();
  const __m256i b = _mm256_set_m128i(b1, b0);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

// Two blocks' fifth bits (bit j: element j) as a mask over pair_nibbles' bytes.
inline __m512i pair_add_high_bits(__m512i q, const uint8_t* qh0, const uint8_t* qh1) {
  uint32_t h0, h1 = 0;
  std::memcpy(&h0, qh0, 4);
  if (qh1) std::memcpy(&h1, qh1, 4);
  const uint64_t bits = (h0 & 0xFFFFull) | (h1 & 0xFFFFull) << 16 |
                        static_cast<uint64_t>(h0 >> 16) << 32 | static_cast<uint64_t>(h1 >> 16) << 48;
  return _mm512_mask_add_epi8(q, bits, q, _mm512_set1_epi8(16));
}

inline const uint8_t* plus(const uint8_t* p, int64_t n) { return p ? p + n : nullptr; }

inline uint32_t bits16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Two blocks' scales and offsets (w = d q + offset) as [d0, offset0, d1, offset1]: blocks with a
// min store (d, m) as adjacent fp16; the others' offset is -ZERO d.
inline __m128 d_and_min(const uint8_t* p0, const uint8_t* p1) {
  uint32_t dm0, dm1;
  std::memcpy(&dm0, p0, 4);
  std::memcpy(&dm1, p1, 4);
  return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(dm0)), dm1, 1));
}
template <int ZERO>
inline __m128 d_and_zero(const uint8_t* p0, const uint8_t* p1) {
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits16(p0) | bits16(p1) << 16)));
  return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.f, -ZERO, 1.f, -ZERO));
}

struct Block32 {
  __m256i q;
  float d, m;
};

struct BQ4_0 {
  static constexpr int64_t BYTES = 18, ZERO = 8;
  static constexpr bool HAS_MIN = false, SIGNED = false;
  static Block32 decode(const uint8_t* p) { return {nibbles32(p + 2), half(p), 0.f}; }
  static __m128 scales(const uint8_t* p0, const uint8_t* p1) { return d_and_zero<ZERO>(p0, p1); }
  static __m512i pair(const uint8_t* p0, const uint8_t* p1) {
    return pair_nibbles(p0 + 2, plus(p1, 2));
  }
};
struct BQ4_1 {
  static constexpr int64_t BYTES = 20, ZERO = 0;
  static constexpr bool HAS_MIN = true, SIGNED = false;
  static Block32 decode(const uint8_t* p) { return {nibbles32(p + 4), half(p), half(p + 2)}; }
  static __m128 scales(const uint8_t* p0, const uint8_t* p1) { return d_and_min(p0, p1); }
  static __m512i pair(const uint8_t* p0, const uint8_t* p1) {
    return pair_nibbles(p0 + 4, plus(p1, 4));
  }
};
inline __m256i add_high_bits(__m256i q, const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return _mm256_mask_add_epi8(q, bits, q, _mm256_set1_epi8(16));
}
struct BQ5_0 {
  static constexpr int64_t BYTES = 22, ZERO = 16;
  static constexpr bool HAS_MIN = false, SIGNED = false;
  static Block32 decode(const uint8_t* p) {
    return {add_high_bits(nibbles32(p + 6), p + 2), half(p), 0.f};
  }
  static __m128 scales(const uint8_t* p0, const uint8_t* p1) { return d_and_zero<ZERO>(p0, p1); }
  static __m512i pair(const uint8_t* p0, const uint8_t* p1) {
    return pair_add_high_bits(pair_nibbles(p0 + 6, plus(p1, 6)), p0 + 2, plus(p1, 2));
  }
};
struct BQ5_1 {
  static constexpr int64_t BYTES = 24, ZERO = 0;
  static constexpr bool HAS_MIN = true, SIGNED = false;
  static Block32 decode(const uint8_t* p) {
    return {add_high_bits(nibbles32(p + 8), p + 4), half(p), half(p + 2)};
  }
  static __m128 scales(const uint8_t* p0, const uint8_t* p1) { return d_and_min(p0, p1); }
  static __m512i pair(const uint8_t* p0, const uint8_t* p1) {
    return pair_add_high_bits(pair_nibbles(p0 + 8, plus(p1, 8)), p0 + 4, plus(p1, 4));
  }
};
struct BQ8_0 {
  static constexpr int64_t BYTES = 34, ZERO = 0;
  static constexpr bool HAS_MIN = false, SIGNED = true;
  static Block32 decode(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), half(p), 0.f};
  }
  static __m128 scales(const uint8_t* p0, const uint8_t* p1) { return d_and_zero<0>(p0, p1); }
  static __m512i pair(const uint8_t* p0, const uint8_t* p1) {
    const __m256i q1 = p1 ? decode(p1).q : _mm256_setzero_si256();
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(decode(p0).q), q1, 1);
    return _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 1, 2, 0));  // 16-byte quarters 0, 2, 1, 3
  }
};

// ---- The 256-element K-quants: per 64-element chunk c its codes (element order) and the scale of
// each int32 lane of a vpdpbusd over them; the offsets' coefficients per activation sum.

struct BlockK {
  __m512i q[4];
  __m512 lane_scale[4];  // integer-valued sub-block scales, per dot-product lane
  __m512 offset;         // per activation sum lane (Act256::sums16 or sums32): -dmin m_i, -32 d sc_i
  float d;
};

// scale_min_bytes as fp32 [sc_0..7, m_0..7].
inline __m512 scales_and_mins(const uint8_t* p) {
  alignas(16) uint8_t bytes[16];
  scale_min_bytes(p, bytes);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes))));
}

// Lane l of chunk c's dot covers elements 64c + 4l..4l+3: sub-block of 32 number 2c + l / 8.
inline __m512i lanes_per_32(int c) {
  return _mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                          2 * c + 1, 2 * c + 1, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,
                          2 * c);
}
// ... and of 16 number 4c + l / 4.
inline __m512i lanes_per_16(int c) {
  const int b = 4 * c;
  return _mm512_set_epi32(b + 3, b + 3, b + 3, b + 3, b + 2, b + 2, b + 2, b + 2, b + 1, b + 1,
                          b + 1, b + 1, b, b, b, b);
}

// The Q4_K / Q5_K header: fp16 d, fp16 dmin, the 12 bytes of scales and mins.
inline void k_header(const uint8_t* p, BlockK& k) {
  const __m512 scm = scales_and_mins(p + 4);
  for (int c = 0; c < 4; ++c) k.lane_scale[c] = _mm512_permutexvar_ps(lanes_per_32(c), scm);
  k.offset = _mm512_mul_ps(_mm512_set1_ps(-half(p + 2)), scm);  // lanes 8-15: -dmin m_i
  k.d = half(p);
}

// Dequantization of Q4_K / Q5_K: 16-element group g has d sc and dmin m of sub-block g / 2.
inline void k_group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
  alignas(64) float scm[16];
  _mm512_store_ps(scm, scales_and_mins(p + 4));
  const float d = half(p), dmin = half(p + 2);
  for (int g = 0; g < 16; ++g) {
    dsc[g] = d * scm[g / 2];
    dm[g] = dmin * scm[8 + g / 2];
  }
  *zero = 0;
}

struct BQ4_K {
  static constexpr int64_t BYTES = 144;
  static constexpr bool SUMS16 = false;
  static BlockK decode(const uint8_t* p) {
    BlockK k;
    k_header(p, k);
    for (int c = 0; c < 4; ++c) k.q[c] = nibbles64(p + 16 + 32 * c);
    return k;
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    k_group_scales(p, dsc, dm, zero);
  }
};

struct BQ5_K {
  static constexpr int64_t BYTES = 176;
  static constexpr bool SUMS16 = false;
  static BlockK decode(const uint8_t* p) {
    BlockK k;
    k_header(p, k);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int c = 0; c < 4; ++c) {
      const __m512i q = nibbles64(p + 48 + 32 * c);
      // Element 32i + l's fifth bit is bit i of qh byte l: i = 2c in the low half, 2c + 1 above.
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(1 << (2 * c)),
                                             _mm256_set1_epi8(1 << (2 * c + 1)), 1);
      k.q[c] = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh2, bit), q, sixteen);
    }
    return k;
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    k_group_scales(p, dsc, dm, zero);
  }
};

struct BQ6_K {
  static constexpr int64_t BYTES = 210;
  static constexpr bool SUMS16 = true;
  static BlockK decode(const uint8_t* p) {
    BlockK k;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    // Element 128h + 32s + l: low nibble (s < 2) or high nibble (s >= 2) of ql[64h + 32(s % 2) + l],
    // high 2 bits (qh[32h + l] >> 2s) & 3.
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(p + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      const __m512i qh2 =
          _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      k.q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                   _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45));
      k.q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                       _mm512_and_si512(qh2, bits45));
    }
    const __m512 sc = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192))));
    for (int c = 0; c < 4; ++c) k.lane_scale[c] = _mm512_permutexvar_ps(lanes_per_16(c), sc);
    k.d = half(p + 208);
    k.offset = _mm512_mul_ps(_mm512_set1_ps(-32.f * k.d), sc);
    return k;
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    const float d = half(p + 208);
    for (int g = 0; g < 16; ++g) {
      dsc[g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g]));
      dm[g] = 0.f;
    }
    *zero = 32;
  }
};

Activations quantize_activations(const float* x, int64_t M, int64_t K, int64_t block) {
  Activations a;
  a.M = M, a.K = K, a.block = block;
  a.code_stride = block == QK ? (K / QK + 1) / 2 * 64 : K;
  a.codes.assign(M * a.code_stride, 0);
  a.scale_stride = block == QK ? (K / QK + 1) / 2 * 2 : K / block;
  a.scale.assign(M * a.scale_stride, 0.f);
  a.sums.assign(M * a.scale_stride * (block == QK ? 2 : 32), 0.f);
  const __m512 qmax = _mm512_set1_ps(127.f), qmin = _mm512_set1_ps(-127.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + m * K + b * block;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < block; k += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + k)));
      const float scale = _mm512_reduce_max_ps(amax) / 127.f;
      const int64_t i = m * a.scale_stride + b;
      a.scale[i] = scale;
      if (scale == 0.f) continue;  // codes and sums stay zero
      int32_t sums16[16];
      for (int64_t k = 0; k < block; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xb + k), _mm512_set1_ps(scale)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, qmin), qmax));
        _mm512_mask_cvtepi32_storeu_epi8(a.codes.data() + m * a.code_stride + a.code_offset(b, k),
                                         0xFFFF, qi);
        sums16[k / 16] = _mm512_reduce_add_epi32(qi);
      }
      if (block == QK) {
        a.sums[2 * i] = scale;
        a.sums[2 * i + 1] = scale * static_cast<float>(sums16[0] + sums16[1]);
      } else {
        float* s = a.sums.data() + i * 32;
        for (int g = 0; g < 16; ++g) s[g] = scale * static_cast<float>(sums16[g]);
        for (int j = 0; j < 8; ++j)
          s[24 + j] = scale * static_cast<float>(sums16[2 * j] + sums16[2 * j + 1]);
      }
    }
  }
  return a;
}

// ---- Dot products of one weight row with M activation rows: out[m * N] += nothing; out[m * N] =.

// Blocks b and b + 1 of a row at once: their codes fill one 64-byte vector, so one vpdpbusd per
// activation row covers both. One product of [d0, offset0, d1, offset1] with x's [scale0, sum0,
// scale1, sum1] gives both blocks' scale products (lanes 0 and 2, permuted onto the dot's lanes)
// and offset terms (lanes 1 and 3, summed apart). A lone last block pairs with zero codes and
// zero activation scales.
// R rows at once (row stride `stride` bytes, outputs at out[r]) share each activation load: R
// independent accumulator chains, and each row sums exactly as it would alone.
template <typename B, int M, int R>
void dot_rows_32(const uint8_t* row, int64_t stride, const Activations& a, float* out, int64_t N) {
  const int64_t nb = a.blocks();
  // Lane l of a pair's dot covers 4 codes at byte 4l: block b's for l in 0-3 and 8-11.
  const __m512i lane_block = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
  __m512 acc[R][M];
  __m128 bias[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), bias[r][m] = _mm_setzero_ps();
  const auto step = [&](int64_t b, auto pair) {
    __m512i q[R];
    __mmask64 negative[R];
    __m128 scales[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p0 = row + r * stride + b * B::BYTES;
      const uint8_t* p1 = pair ? p0 + B::BYTES : p0;  // a lone block's twin is itself, times zeros
      prefetch_l2(p0);
      q[r] = B::pair(p0, pair ? p1 : nullptr);
      negative[r] = 0;
      if constexpr (B::SIGNED) negative[r] = _mm512_movepi8_mask(q[r]), q[r] = _mm512_abs_epi8(q[r]);
      scales[r] = B::scales(p0, p1);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i x = _mm512_loadu_si512(a.block_codes(m, b));
      const __m128 x_sums = _mm_loadu_ps(a.sums.data() + 2 * (m * a.scale_stride + b));
      for (int r = 0; r < R; ++r) {
        __m512i xq = x;
        if constexpr (B::SIGNED) xq = _mm512_mask_sub_epi8(x, negative[r], _mm512_setzero_si512(), x);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], xq);
        const __m128 products = _mm_mul_ps(scales[r], x_sums);
        const __m512 scale = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(products));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][m]);
        if constexpr (B::HAS_MIN || B::ZERO != 0) bias[r][m] = _mm_add_ps(bias[r][m], products);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) step(b, std::true_type{});
  if (b < nb) step(b, std::false_type{});
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      const __m128 odd = _mm_movehdup_ps(bias[r][m]);  // lanes 0, 2: the offset terms of 1, 3
      out[m * N + r] = _mm512_reduce_add_ps(acc[r][m]) +
                       _mm_cvtss_f32(_mm_add_ss(odd, _mm_movehl_ps(odd, odd)));
    }
}

template <typename B, int M>
void dot_row_32(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  dot_rows_32<B, M, 1>(row, 0, a, out, N);
}

template <typename B, int M>
void dot_row_k(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = row + b * B::BYTES;
    for (int64_t line = 0; line < B::BYTES; line += 64) prefetch_l2(p + line);
    const BlockK w = B::decode(p);
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.block_codes(m, b);
      __m512 sum = _mm512_setzero_ps();  // integer-valued, below 2^24: exact
      for (int c = 0; c < 4; ++c) {
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q[c], _mm512_loadu_si512(xq + 64 * c));
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), w.lane_scale[c], sum);
      }
      acc[m] = _mm512_fmadd_ps(sum, _mm512_set1_ps(w.d * a.block_scale(m, b)), acc[m]);
      const float* sums = a.sums.data() + (m * a.scale_stride + b) * 32 + (B::SUMS16 ? 0 : 16);
      acc[m] = _mm512_fmadd_ps(w.offset, _mm512_loadu_ps(sums), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m * N] = _mm512_reduce_add_ps(acc[m]);
}

// Float rows: 16 weights widened to fp32 per step.
struct RowF32 {
  static constexpr int64_t BYTES = 4;
  static __m512 load(const uint8_t* p, __mmask16 mask) {
    return _mm512_maskz_loadu_ps(mask, p);
  }
};
struct RowF16 {
  static constexpr int64_t BYTES = 2;
  static __m512 load(const uint8_t* p, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
};
struct RowBF16 {
  static constexpr int64_t BYTES = 2;
  static __m512 load(const uint8_t* p, __mmask16 mask) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

template <typename F, int M>
void dot_row_float(const uint8_t* row, const float* x, int64_t K, float* out, int64_t N) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1;
    prefetch_l2(row + k * F::BYTES);
    const __m512 w = F::load(row + k * F::BYTES, mask);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m * N] = _mm512_reduce_add_ps(acc[m]);
}

// ---- Dequantization of one row.

template <typename B>
void dequantize_row_32(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const Block32 w = B::decode(row + b * B::BYTES);
    for (int half_ = 0; half_ < 2; ++half_) {
      const __m128i q8 = half_ ? _mm256_extracti128_si256(w.q, 1) : _mm256_castsi256_si128(w.q);
      const __m512i q = B::SIGNED ? _mm512_cvtepi8_epi32(q8) : _mm512_cvtepu8_epi32(q8);
      __m512 v = _mm512_mul_ps(_mm512_set1_ps(w.d),
                               _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(B::ZERO))));
      if constexpr (B::HAS_MIN) v = _mm512_add_ps(v, _mm512_set1_ps(w.m));
      _mm512_storeu_ps(out + b * QK + 16 * half_, v);
    }
  }
}

template <typename B>
void dequantize_row_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK_K; ++b) {
    const uint8_t* p = row + b * B::BYTES;
    const BlockK w = B::decode(p);
    float dsc[16], dm[16];
    int zero;
    B::group_scales(p, dsc, dm, &zero);
    for (int c = 0; c < 4; ++c) {
      for (int g = 0; g < 4; ++g) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w.q[c], g));
        const int i = 4 * c + g;
        __m512 v = _mm512_mul_ps(_mm512_set1_ps(dsc[i]),
                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(zero))));
        v = _mm512_sub_ps(v, _mm512_set1_ps(dm[i]));
        _mm512_storeu_ps(out + b * QK_K + 16 * i, v);
      }
    }
  }
}

template <typename F>
void dequantize_row_float(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1;
    _mm512_mask_storeu_ps(out + k, mask, F::load(row + k * F::BYTES, mask));
  }
}

// 16 interleaved rows (a group, ggml type BASE | X16) against M activation rows: out[m * N + i]
// = row i . x_m, i < 16. Per block, vector j of codes times 4 activation codes broadcast: int32
// lane i sums row i's products exactly (codes < 256 times |x| <= 127, 32 of them); then the
// block's 16 sums times d * scale, plus the offsets (m - ZERO d) times the activation's scaled sum.
template <int64_t BASE, int M>
void dot_group_x16(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  constexpr X16Layout L = x16_layout(BASE);
  constexpr float ZERO = BASE == Q4_0 ? 8.f : BASE == Q5_0 ? 16.f : BASE == Q8_0 ? 128.f : 0.f;
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * L.bytes;
    for (int64_t line = 0; line < GROUP_ROWS * L.bytes; line += 64) prefetch_l2(p + line);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512 offset = _mm512_mul_ps(d, _mm512_set1_ps(-ZERO));
    if constexpr (L.m >= 0)
      offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + L.m)));
    const int8_t* x[M];
    for (int m = 0; m < M; ++m) x[m] = a.block_codes(m, b);
    // Activation codes k..k + 3 of row m (the paired order: elements 16.. lie 32 bytes on).
    const auto x4 = [&](int m, int64_t k) {
      int32_t v;
      std::memcpy(&v, x[m] + k % 16 + k / 16 * 32, 4);
      return _mm512_set1_epi32(v);
    };
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    const uint8_t* q = p + L.codes;
    if constexpr (L.code_vectors == 8) {
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(q + 64 * j);
        for (int m = 0; m < M; ++m) dot[m] = _mm512_dpbusd_epi32(dot[m], w, x4(m, 4 * j));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(q + 64 * j);
        __m512i low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (L.high_bits >= 0) {
          uint64_t masks[2];
          std::memcpy(masks, p + L.high_bits + 16 * j, 16);
          low = _mm512_mask_add_epi8(low, _cvtu64_mask64(masks[0]), low, bit4);
          high = _mm512_mask_add_epi8(high, _cvtu64_mask64(masks[1]), high, bit4);
        }
        for (int m = 0; m < M; ++m) {
          dot[m] = _mm512_dpbusd_epi32(dot[m], low, x4(m, 4 * j));
          dot[m] = _mm512_dpbusd_epi32(dot[m], high, x4(m, 16 + 4 * j));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float* sums = a.sums.data() + 2 * (m * a.scale_stride + b);  // scale, scale * sum
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(sums[0])),
                               acc[m]);
      acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[1]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * N, acc[m]);
}

// 16 interleaved Q6_K rows against M activation rows (256-blocks): per group of 16 elements,
// 4 code vectors (6-bit codes from A, B and H) times 4 activation codes broadcast, exact in
// int32; scaled by d sc_g (per row) times the activation scale, plus -32 d sc_g times the
// activation's scaled sum over the group.
template <int M>
void dot_group_x16_q6k(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * Q6K_BYTES;
    for (int64_t line = 0; line < GROUP_ROWS * Q6K_BYTES; line += 64) prefetch_l2(p + line);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const int8_t* x[M];
    float x_scale[M];
    const float* x_sums[M];
    for (int m = 0; m < M; ++m) {
      x[m] = a.block_codes(m, b);
      x_scale[m] = a.block_scale(m, b);
      x_sums[m] = a.sums.data() + (m * a.scale_stride + b) * 32;  // scale * sum per 16
    }
    for (int64_t g = 0; g < 16; ++g) {
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * g))));
      const __m512 dsc = _mm512_mul_ps(d, sc);
      const uint8_t* q = p + Q6K_CODES + 192 * g;
      const __m512i A = _mm512_loadu_si512(q), B = _mm512_loadu_si512(q + 64),
                    H = _mm512_loadu_si512(q + 128);
      const __m512i v[4] = {
          _mm512_or_si512(_mm512_and_si512(A, low4), _mm512_and_si512(_mm512_slli_epi16(H, 4), bits45)),
          _mm512_or_si512(_mm512_and_si512(B, low4), _mm512_and_si512(_mm512_slli_epi16(H, 2), bits45)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), low4), _mm512_and_si512(H, bits45)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi16(H, 2), bits45)),
      };
      for (int m = 0; m < M; ++m) {
        __m512i dot = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          int32_t codes;
          std::memcpy(&codes, x[m] + 16 * g + 4 * j, 4);
          dot = _mm512_dpbusd_epi32(dot, v[j], _mm512_set1_epi32(codes));
        }
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(dsc, _mm512_set1_ps(x_scale[m])), acc[m]);
        acc[m] = _mm512_fmadd_ps(dsc, _mm512_set1_ps(-32.f * x_sums[m][g]), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * N, acc[m]);
}

// 16 interleaved Q4_K (FIVE: Q5_K) rows against M activation rows (256-blocks): per sub-block
// of 32, 8 code vectors times 4 activation codes broadcast, exact in int32; the 8 sub-block sums
// times their scales sc_s (per row), times d and the activation scale; minus dmin times the sum
// over sub-blocks of m_s and the activation's scaled code sum.
template <bool FIVE, int M>
void dot_group_x16_kq(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  constexpr int64_t BYTES = FIVE ? Q5K_BYTES : Q4K_BYTES, CODES = kq_codes(FIVE);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m128i six = _mm_set1_epi8(0x3F), nibble = _mm_set1_epi8(0x0F), bits45 = _mm_set1_epi8(0x30);
  const auto floats = [](__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); };
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * BYTES;
    for (int64_t line = 0; line < GROUP_ROWS * BYTES; line += 64) prefetch_l2(p + line);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    // ggml's get_scale_min_k4 on 16 rows at once: byte k of the rows is q[k].
    __m128i q[12];
    for (int k = 0; k < 12; ++k) q[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + KQ_SCALES + 16 * k));
    __m512 sc[8], mn[8];
    for (int s = 0; s < 4; ++s) {
      sc[s] = floats(_mm_and_si128(q[s], six));
      mn[s] = floats(_mm_and_si128(q[s + 4], six));
      sc[s + 4] = floats(_mm_or_si128(_mm_and_si128(q[s + 8], nibble),
                                      _mm_and_si128(_mm_srli_epi16(q[s], 2), bits45)));
      mn[s + 4] = floats(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(q[s + 8], 4), nibble),
                                      _mm_and_si128(_mm_srli_epi16(q[s + 4], 2), bits45)));
    }
    const int8_t* x[M];
    for (int m = 0; m < M; ++m) x[m] = a.block_codes(m, b);
    const auto x4 = [&](int m, int64_t k) {
      int32_t v;
      std::memcpy(&v, x[m] + k, 4);
      return _mm512_set1_epi32(v);
    };
    __m512 sum[M];  // per row: sum over sub-blocks of sc_s times the integer dot
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m512i dot_low[M], dot_high[M];  // sub-blocks 2c, 2c + 1
      for (int m = 0; m < M; ++m) dot_low[m] = dot_high[m] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const int64_t v = 8 * c + j;
        const __m512i codes = _mm512_loadu_si512(p + CODES + 64 * v);
        __m512i low = _mm512_and_si512(codes, low4);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
        if constexpr (FIVE) {
          uint64_t masks[2];
          std::memcpy(masks, p + Q5K_MASKS + 16 * v, 16);
          low = _mm512_mask_add_epi8(low, _cvtu64_mask64(masks[0]), low, bit4);
          high = _mm512_mask_add_epi8(high, _cvtu64_mask64(masks[1]), high, bit4);
        }
        for (int m = 0; m < M; ++m) {
          dot_low[m] = _mm512_dpbusd_epi32(dot_low[m], low, x4(m, 64 * c + 4 * j));
          dot_high[m] = _mm512_dpbusd_epi32(dot_high[m], high, x4(m, 64 * c + 32 + 4 * j));
        }
      }
      for (int m = 0; m < M; ++m) {
        sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_low[m]), sc[2 * c], sum[m]);
        sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_high[m]), sc[2 * c + 1], sum[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float* sums = a.sums.data() + (m * a.scale_stride + b) * 32 + 24;  // scale * sum per 32
      __m512 mins = _mm512_setzero_ps();
      for (int s = 0; s < 8; ++s) mins = _mm512_fmadd_ps(mn[s], _mm512_set1_ps(sums[s]), mins);
      acc[m] = _mm512_fmadd_ps(sum[m], _mm512_mul_ps(d, _mm512_set1_ps(a.block_scale(m, b))), acc[m]);
      acc[m] = _mm512_fnmadd_ps(dmin, mins, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * N, acc[m]);
}

#else  // ---- AVX2 and portable paths: the block decoders, dequantization and float rows as plain
       // loops gcc -O3 vectorizes for the target (SSE2, NEON); the dot products in AVX2
       // intrinsics where the target has them (ZCODE_GGML_AVX2), else plain loops too.
//
// The same arithmetic as the AVX-512 path: every block's weight codes (all of them fit int8:
// unsigned 4-6 bit codes, Q8_0's signed bytes) times the int8 activation codes summed exactly in
// int32, the offsets times the activations' code sums, the blocks scaled and added in fp32. Only
// the order of the fp32 sums differs. Float sums keep LANES independent partial sums so the loop
// vectorizes without reassociation (this file is built without -ffast-math).

constexpr int LANES = 16;

#if defined(ZCODE_GGML_AVX2)
// ---- AVX2: llama.cpp's AVX2 arithmetic. vpmaddubsw multiplies unsigned weight codes by signed
// activation codes and sums pairs in int16 (at most 2 * 128 * 127 < 2^15: exact), vpmaddwd sums
// pairs of those into int32, times 1 or a sub-block's integer scale; each block's int32 lanes are
// scaled in fp32 into 8 fp32 lanes kept until the row ends: one horizontal sum per row.

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Unsigned codes w times signed codes x: lane l sums the products of bytes 4l..4l+3, times the
// int16 scale of its pairs (lanes 0-7 of `scale`: bytes 0-15; 8-15: bytes 16-31).
inline __m256i dot_u8_i8(__m256i w, __m256i x, __m256i scale = _mm256_set1_epi16(1)) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale);
}
// Signed codes w (Q8_0): |w| times x with w's sign.
inline __m256i dot_i8_i8(__m256i w, __m256i x) {
  return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// 16 nibble bytes -> 32 codes in element order: the low nibbles, then the high.
inline __m256i nibbles_x32(const uint8_t* p) {
  const __m128i b = load128(p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
// 32 bits -> 32 bytes: byte j is 16 where bit j is set, else 0 (a fifth bit moved onto a code).
inline __m256i sixteen_where(uint32_t bits) {
  const __m256i bytes =  // byte j: bits byte j / 8
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                             0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));  // j % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit),
                          _mm256_set1_epi8(16));
}
// A 32-block's fifth bits (bit j of the u32 at qh: element j).
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return sixteen_where(bits);
}
#else
// int8 x int8 -> int32 over n codes: an integer sum, so gcc vectorizes it (pmaddwd, sdot).
template <int n>
inline int32_t dot_i8(const int8_t* w, const int8_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < n; ++i) sum += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  return sum;
}
// A 32-block's dot: w[0..15] . x0 + w[16..31] . x1 (the activation halves lie apart).
inline int32_t dot_block32(const int8_t* w, const int8_t* x0, const int8_t* x1) {
  return dot_i8<16>(w, x0) + dot_i8<16>(w + 16, x1);
}
// A K-quant block's sum_g scale[g] (w . x over group g of 16), exact in int32.
inline int32_t dot_block256(const int8_t* w, const int8_t* x, const int32_t* scale) {
  int32_t sum = 0;
  for (int g = 0; g < 16; ++g) sum += scale[g] * dot_i8<16>(w + 16 * g, x + 16 * g);
  return sum;
}
#endif

// A 32-element block: codes in element order and w = d q + offset (offset = m, or -ZERO d).
struct Block32 {
  int8_t q[QK];
  float d, offset;
};

// n bytes of nibbles -> their low nibbles, then their high ones, 8 bytes per 64-bit word (gcc
// turns a byte loop into byte inserts through the stack, 8x slower on Zen 3; little-endian).
template <int n>
inline void nibbles(const uint8_t* p, int8_t* low, int8_t* high) {
  constexpr uint64_t low4 = 0x0F0F0F0F0F0F0F0Full;
  uint64_t v[n / 8], lo[n / 8], hi[n / 8];
  std::memcpy(v, p, n);
  for (int i = 0; i < n / 8; ++i) lo[i] = v[i] & low4, hi[i] = (v[i] >> 4) & low4;
  std::memcpy(low, lo, n);
  std::memcpy(high, hi, n);
}
inline void nibbles32(const uint8_t* p, int8_t* q) { nibbles<16>(p, q, q + 16); }
inline void add_high_bits(const uint8_t* qh, int8_t* q) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  for (int j = 0; j < QK; ++j) q[j] |= ((bits >> j) & 1) << 4;
}

// A 32-block type's layout: fp16 d at byte 0, fp16 m at 2 (HAS_MIN), the u32 of fifth bits at
// HIGH_BITS (0: none), the codes at CODES: nibbles, or (SIGNED: Q8_0) 32 signed bytes.
template <int64_t BYTES_, int64_t ZERO_, bool HAS_MIN_, int64_t HIGH_BITS, int64_t CODES,
          bool SIGNED_ = false>
struct Block32Type {
  static constexpr int64_t BYTES = BYTES_, ZERO = ZERO_;
  static constexpr bool HAS_MIN = HAS_MIN_, SIGNED = SIGNED_;
  static float offset(const uint8_t* p, float d) { return HAS_MIN ? half(p + 2) : d * -ZERO; }
  static void decode(const uint8_t* p, Block32& b) {
    if constexpr (SIGNED) {
      std::memcpy(b.q, p + CODES, QK);
    } else {
      nibbles32(p + CODES, b.q);
      if constexpr (HIGH_BITS != 0) add_high_bits(p + HIGH_BITS, b.q);
    }
    b.d = half(p), b.offset = offset(p, b.d);
  }
#if defined(ZCODE_GGML_AVX2)
  static __m256i codes(const uint8_t* p) {
    if constexpr (SIGNED) return load256(p + CODES);
    if constexpr (HIGH_BITS != 0) return _mm256_or_si256(nibbles_x32(p + CODES), fifth_bits(p + HIGH_BITS));
    return nibbles_x32(p + CODES);
  }
#endif
};
using BQ4_0 = Block32Type<18, 8, false, 0, 2>;
using BQ4_1 = Block32Type<20, 0, true, 0, 4>;
using BQ5_0 = Block32Type<22, 16, false, 2, 6>;
using BQ5_1 = Block32Type<24, 0, true, 4, 8>;
using BQ8_0 = Block32Type<34, 0, false, 0, 2, true>;

// A K-quant block: codes in element order, the integer scale of each group of 16, and the
// offsets' coefficients per activation sum (per 16 for Q6_K: -32 d sc_g; per 32 for Q4_K and
// Q5_K: -dmin m_i).
struct BlockK {
  int8_t q[QK_K];
  int32_t scale[16];
  float offset[16];
  float d;
};

inline void k_header(const uint8_t* p, BlockK& k) {
  uint8_t scm[16];
  scale_min_bytes(p + 4, scm);
  const float dmin = half(p + 2);
  for (int g = 0; g < 16; ++g) k.scale[g] = scm[g / 2];
  for (int i = 0; i < 8; ++i) k.offset[i] = -dmin * static_cast<float>(scm[8 + i]);
  k.d = half(p);
}

// Dequantization of Q4_K / Q5_K: 16-element group g has d sc and dmin m of sub-block g / 2.
inline void k_group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
  uint8_t scm[16];
  scale_min_bytes(p + 4, scm);
  const float d = half(p), dmin = half(p + 2);
  for (int g = 0; g < 16; ++g) {
    dsc[g] = d * static_cast<float>(scm[g / 2]);
    dm[g] = dmin * static_cast<float>(scm[8 + g / 2]);
  }
  *zero = 0;
}

struct BQ4_K {
  static constexpr int64_t BYTES = 144;
  static constexpr bool SUMS16 = false;
  static void decode(const uint8_t* p, BlockK& k) {
    k_header(p, k);
    // Bytes 32c..32c+31: low nibbles sub-block 2c, high nibbles 2c + 1.
    for (int c = 0; c < 4; ++c) nibbles<32>(p + 16 + 32 * c, k.q + 64 * c, k.q + 64 * c + 32);
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    k_group_scales(p, dsc, dm, zero);
  }
};

struct BQ5_K {
  static constexpr int64_t BYTES = 176;
  static constexpr bool SUMS16 = false;
  static void decode(const uint8_t* p, BlockK& k) {
    k_header(p, k);
    // Element 32i + l's fifth bit is bit i of qh byte l.
    uint8_t qh[32];
    std::memcpy(qh, p + 16, 32);
    for (int c = 0; c < 4; ++c) {
      int8_t* q = k.q + 64 * c;
      nibbles<32>(p + 48 + 32 * c, q, q + 32);
      for (int l = 0; l < 32; ++l) {
        q[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
        q[32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
    }
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    k_group_scales(p, dsc, dm, zero);
  }
};

struct BQ6_K {
  static constexpr int64_t BYTES = 210;
  static constexpr bool SUMS16 = true;
  static void decode(const uint8_t* p, BlockK& k) {
    // Element 128h + 32s + l: low nibble (s < 2) or high nibble (s >= 2) of ql[64h + 32(s % 2) + l],
    // high 2 bits (qh[32h + l] >> 2s) & 3.
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const uint8_t ql = p[64 * h + 32 * (s % 2) + l];
          const int low = s < 2 ? ql & 0x0F : ql >> 4;
          k.q[128 * h + 32 * s + l] = low | ((p[128 + 32 * h + l] >> (2 * s)) & 3) << 4;
        }
    k.d = half(p + 208);
    for (int g = 0; g < 16; ++g) {
      k.scale[g] = static_cast<int8_t>(p[192 + g]);
      k.offset[g] = -32.f * k.d * static_cast<float>(k.scale[g]);
    }
  }
  static void group_scales(const uint8_t* p, float* dsc, float* dm, int* zero) {
    const float d = half(p + 208);
    for (int g = 0; g < 16; ++g) {
      dsc[g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g]));
      dm[g] = 0.f;
    }
    *zero = 32;
  }
};

#if defined(ZCODE_GGML_AVX2)
// A K-quant block as 8 vectors of 32 codes (elements 32v..32v+31), per vector the int16 scale of
// its pairs of codes (dot_u8_i8's `scale`: Q4_K / Q5_K one sub-block's, Q6_K two groups' of 16),
// and the offsets' coefficients per activation sum (offset[0]: -dmin m_i per 32 for Q4_K and
// Q5_K; offset[0..1]: -32 d sc_g per 16 for Q6_K).
struct BlockKx {
  __m256i q[8], scale[8];
  __m256 offset[2];
  float d;
};

// Q4_K / Q5_K (fifth bits: element 32v + l's is bit v of qh byte l): chunk c's 32 nibble bytes
// hold vector 2c in their low nibbles, 2c + 1 in their high.
template <bool FIVE>
BlockKx decode_kx(const uint8_t* p) {
  BlockKx k;
  alignas(16) uint8_t scm[16];
  scale_min_bytes(p + 4, scm);
  for (int v = 0; v < 8; ++v) k.scale[v] = _mm256_set1_epi16(scm[v]);
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(scm + 8))));
  k.offset[0] = _mm256_mul_ps(_mm256_set1_ps(-half(p + 2)), mins);
  k.d = half(p);
  const uint8_t* nibbles = p + (FIVE ? 48 : 16);
  const __m256i low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  for (int c = 0; c < 4; ++c) {
    const __m256i b = load256(nibbles + 32 * c);
    k.q[2 * c] = _mm256_and_si256(b, low4);
    k.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
  }
  if constexpr (FIVE) {
    const __m256i qh = load256(p + 16);
    for (int v = 0; v < 8; ++v) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << v));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
      k.q[v] = _mm256_or_si256(k.q[v], _mm256_and_si256(set, sixteen));
    }
  }
  return k;
}
inline BlockKx decode_kx(BQ4_K, const uint8_t* p) { return decode_kx<false>(p); }
inline BlockKx decode_kx(BQ5_K, const uint8_t* p) { return decode_kx<true>(p); }

// Q6_K: element 128h + 32s + l (vector 4h + s) as BQ6_K::decode reads it, high 2 bits moved to
// bits 4-5 by 16-bit shifts (the bits crossing a byte are masked off).
inline BlockKx decode_kx(BQ6_K, const uint8_t* p) {
  BlockKx k;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = load256(p + 64 * h), ql1 = load256(p + 64 * h + 32);
    const __m256i qh = load256(p + 128 + 32 * h);
    __m256i* q = k.q + 4 * h;
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                           _mm256_and_si256(qh, bits45));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
  }
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  for (int v = 0; v < 8; ++v)
    k.scale[v] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
  k.d = half(p + 208);
  const __m256 minus32d = _mm256_set1_ps(-32.f * k.d);
  const __m128i sc16 = load128(sc);
  k.offset[0] = _mm256_mul_ps(minus32d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16)));
  k.offset[1] = _mm256_mul_ps(minus32d,
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))));
  return k;
}

// 16 activations / scale, rounded half to even (vroundps), clamped to +-127 -> 16 int8 codes in
// order; returns their sum.
inline int32_t quantize16(const float* x, float scale, int8_t* codes) {
  const __m256 s = _mm256_set1_ps(scale);
  const auto codes8 = [&](const float* v) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v), s),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(
        _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
  };
  const __m256i q0 = codes8(x), q1 = codes8(x + 8);
  const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes),
                   _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(q0, q1)),
                              _mm256_extracti128_si256(_mm256_add_epi32(q0, q1), 1));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline float amax(const float* x, int64_t n) {  // n a multiple of 8
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), abs));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#endif

// Per block: scale = amax / 127, codes = round-half-even(x / scale) (IEEE division: the AVX-512
// path's codes exactly), and the scaled code sums Activations describes.
Activations quantize_activations(const float* x, int64_t M, int64_t K, int64_t block) {
  Activations a;
  a.M = M, a.K = K, a.block = block;
  a.code_stride = block == QK ? (K / QK + 1) / 2 * 64 : K;
  a.codes.assign(M * a.code_stride, 0);
  a.scale_stride = block == QK ? (K / QK + 1) / 2 * 2 : K / block;
  a.scale.assign(M * a.scale_stride, 0.f);
  a.sums.assign(M * a.scale_stride * (block == QK ? 2 : 32), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + m * K + b * block;
#if defined(ZCODE_GGML_AVX2)
      const float scale = amax(xb, block) / 127.f;
#else
      float amax = 0.f;
      for (int64_t k = 0; k < block; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float scale = amax / 127.f;
#endif
      const int64_t i = m * a.scale_stride + b;
      a.scale[i] = scale;
      if (scale == 0.f) continue;  // codes and sums stay zero
      int32_t sums16[16];
      for (int64_t k = 0; k < block; k += 16) {
        int8_t* codes = a.codes.data() + m * a.code_stride + a.code_offset(b, k);
#if defined(ZCODE_GGML_AVX2)
        sums16[k / 16] = quantize16(xb + k, scale, codes);
#else
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) {
          const float q = std::min(std::max(std::nearbyint(xb[k + j] / scale), -127.f), 127.f);
          codes[j] = static_cast<int8_t>(q);
          sum += codes[j];
        }
        sums16[k / 16] = sum;
#endif
      }
      if (block == QK) {
        a.sums[2 * i] = scale;
        a.sums[2 * i + 1] = scale * static_cast<float>(sums16[0] + sums16[1]);
      } else {
        float* s = a.sums.data() + i * 32;
        for (int g = 0; g < 16; ++g) s[g] = scale * static_cast<float>(sums16[g]);
        for (int j = 0; j < 8; ++j)
          s[24 + j] = scale * static_cast<float>(sums16[2 * j] + sums16[2 * j + 1]);
      }
    }
  }
  return a;
}

#if defined(ZCODE_GGML_AVX2)
// R rows at once (row stride `stride` bytes, outputs at out[r]) share each activation load; each
// row's block terms go into its own 8 fp32 lanes and one bias sum (the offset terms).
template <typename B, int M, int R>
void dot_rows_32(const uint8_t* row, int64_t stride, const Activations& a, float* out, int64_t N) {
  __m256 acc[R][M];
  float bias[R][M] = {};
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    __m256i q[R];
    float d[R], offset[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row + r * stride + b * B::BYTES;
      prefetch_l2(p);
      q[r] = B::codes(p), d[r] = half(p), offset[r] = B::offset(p, d[r]);
    }
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.codes.data() + m * a.code_stride;
      const __m256i x = _mm256_set_m128i(load128(xq + a.code_offset(b, 16)),
                                         load128(xq + a.code_offset(b, 0)));
      const float* sums = a.sums.data() + 2 * (m * a.scale_stride + b);  // scale, scale * sum
      for (int r = 0; r < R; ++r) {
        const __m256i dot = B::SIGNED ? dot_i8_i8(q[r], x) : dot_u8_i8(q[r], x);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[r] * sums[0]),
                                    acc[r][m]);
        if constexpr (B::HAS_MIN || B::ZERO != 0) bias[r][m] += offset[r] * sums[1];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * N + r] = zcode_simd::hsum(acc[r][m]) + bias[r][m];
}

template <typename B, int M>
void dot_row_32(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  dot_rows_32<B, M, 1>(row, 0, a, out, N);
}

template <typename B, int M>
void dot_row_k(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  __m256 acc[M], bias[M];
  for (int m = 0; m < M; ++m) acc[m] = bias[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = row + b * B::BYTES;
    for (int64_t line = 0; line < B::BYTES; line += 64) prefetch_l2(p + line);
    const BlockKx w = decode_kx(B{}, p);
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.block_codes(m, b);
      __m256i sum = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v)
        sum = _mm256_add_epi32(sum, dot_u8_i8(w.q[v], load256(xq + 32 * v), w.scale[v]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(w.d * a.block_scale(m, b)),
                               acc[m]);
      const float* sums = a.sums.data() + (m * a.scale_stride + b) * 32 + (B::SUMS16 ? 0 : 24);
      bias[m] = _mm256_fmadd_ps(w.offset[0], _mm256_loadu_ps(sums), bias[m]);
      if constexpr (B::SUMS16) bias[m] = _mm256_fmadd_ps(w.offset[1], _mm256_loadu_ps(sums + 8), bias[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m * N] = zcode_simd::hsum(_mm256_add_ps(acc[m], bias[m]));
}

// ---- The interleaved layout on AVX2: each 64-byte vector of 16 rows' lanes as two 32-byte
// halves, h = 0 rows 0-7 and h = 1 rows 8-15, each half's block worked through on its own (8
// fp32 accumulators per activation row and half); vpdpbusd becomes vpmaddubsw + vpmaddwd. The
// int16 pair sums stay below 2^15, so exact: two products of a code and |x| <= 127, and up to four
// such pair sums added for nibble codes (5 bits: 4 x 2 x 31 x 127 = 31496), two for Q6_K's 6-bit
// codes (2 x 2 x 63 x 127 = 32004). Q8_0's stored
// codes are flipped (q + 128, unsigned) for vpdpbusd: here they are flipped back and multiplied
// signed (|q| times x with q's sign), as its rows are.

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
// bytes 8h..8h+7 of 16 -> 8 fp32 (unsigned or signed bytes).
inline __m256 u8x8(__m128i bytes, int h) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(bytes, 8) : bytes));
}
inline __m256 i8x8(__m128i bytes, int h) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(bytes, 8) : bytes));
}

// 16 interleaved rows of a 32-block type against M activation rows (see the AVX-512 kernel).
template <int64_t BASE, int M>
void dot_group_x16(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  constexpr X16Layout L = x16_layout(BASE);
  constexpr float ZERO = BASE == Q4_0 ? 8.f : BASE == Q5_0 ? 16.f : 0.f;  // Q8_0: signed again
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * L.bytes;
    for (int64_t line = 0; line < GROUP_ROWS * L.bytes; line += 64) prefetch_l2(p + line);
    const int8_t* x[M];
    for (int m = 0; m < M; ++m) x[m] = a.block_codes(m, b);
    // Activation codes k..k + 3 of row m (the paired order: elements 16.. lie 32 bytes on).
    const auto x4 = [&](int m, int64_t k) { return broadcast4(x[m] + k % 16 + k / 16 * 32); };
    for (int h = 0; h < 2; ++h) {
      const __m256 d = fp16x8(p + 16 * h);
      const __m256 offset =
          L.m >= 0 ? fp16x8(p + L.m + 16 * h) : _mm256_mul_ps(d, _mm256_set1_ps(-ZERO));
      __m256i dot[M];
      for (int m = 0; m < M; ++m) dot[m] = _mm256_setzero_si256();
      const uint8_t* q = p + L.codes + 32 * h;
      if constexpr (L.code_vectors == 8) {
        for (int j = 0; j < 8; ++j) {
          const __m256i w = _mm256_xor_si256(load256(q + 64 * j), _mm256_set1_epi8(-128));
          for (int m = 0; m < M; ++m) dot[m] = _mm256_add_epi32(dot[m], dot_i8_i8(w, x4(m, 4 * j)));
        }
      } else {
        for (int j = 0; j < 4; j += 2) {  // two code vectors' four pair sums added in int16
          __m256i low[2], high[2];
          for (int t = 0; t < 2; ++t) {
            const __m256i v = load256(q + 64 * (j + t));
            low[t] = _mm256_and_si256(v, low4);
            high[t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (L.high_bits >= 0) {
              uint64_t masks[2];
              std::memcpy(masks, p + L.high_bits + 16 * (j + t), 16);
              low[t] = _mm256_or_si256(low[t], sixteen_where(static_cast<uint32_t>(masks[0] >> 32 * h)));
              high[t] = _mm256_or_si256(high[t], sixteen_where(static_cast<uint32_t>(masks[1] >> 32 * h)));
            }
          }
          for (int m = 0; m < M; ++m) {
            const __m256i low_pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(low[0], x4(m, 4 * j)),
                                 _mm256_maddubs_epi16(low[1], x4(m, 4 * j + 4)));
            const __m256i high_pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(high[0], x4(m, 16 + 4 * j)),
                                 _mm256_maddubs_epi16(high[1], x4(m, 20 + 4 * j)));
            dot[m] = _mm256_add_epi32(
                dot[m], _mm256_madd_epi16(_mm256_add_epi16(low_pairs, high_pairs), ones));
          }
        }
      }
      for (int m = 0; m < M; ++m) {
        const float* sums = a.sums.data() + 2 * (m * a.scale_stride + b);  // scale, scale * sum
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                                    _mm256_mul_ps(d, _mm256_set1_ps(sums[0])), acc[m][h]);
        if constexpr (L.m >= 0 || ZERO != 0.f)
          acc[m][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[1]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * N + 8 * h, acc[m][h]);
}

// 16 interleaved Q6_K rows against M activation rows (see the AVX-512 kernel).
template <int M>
void dot_group_x16_q6k(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * Q6K_BYTES;
    for (int64_t line = 0; line < GROUP_ROWS * Q6K_BYTES; line += 64) prefetch_l2(p + line);
    const int8_t* x[M];
    float x_scale[M];
    const float* x_sums[M];
    for (int m = 0; m < M; ++m) {
      x[m] = a.block_codes(m, b);
      x_scale[m] = a.block_scale(m, b);
      x_sums[m] = a.sums.data() + (m * a.scale_stride + b) * 32;  // scale * sum per 16
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = fp16x8(p + 16 * h);
      for (int64_t g = 0; g < 16; ++g) {
        const __m256 dsc = _mm256_mul_ps(d, i8x8(load128(p + 32 + 16 * g), h));
        const uint8_t* q = p + Q6K_CODES + 192 * g + 32 * h;
        const __m256i A = load256(q), B = load256(q + 64), H = load256(q + 128);
        const __m256i v0 = _mm256_or_si256(_mm256_and_si256(A, low4),
                                           _mm256_and_si256(_mm256_slli_epi16(H, 4), bits45));
        const __m256i v1 = _mm256_or_si256(_mm256_and_si256(B, low4),
                                           _mm256_and_si256(_mm256_slli_epi16(H, 2), bits45));
        const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low4),
                                           _mm256_and_si256(H, bits45));
        const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(H, 2), bits45));
        for (int m = 0; m < M; ++m) {
          const int8_t* xg = x[m] + 16 * g;
          const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(v0, broadcast4(xg)),
                                               _mm256_maddubs_epi16(v1, broadcast4(xg + 4)));
          const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(v2, broadcast4(xg + 8)),
                                               _mm256_maddubs_epi16(v3, broadcast4(xg + 12)));
          const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                      _mm256_mul_ps(dsc, _mm256_set1_ps(x_scale[m])), acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(dsc, _mm256_set1_ps(-32.f * x_sums[m][g]), acc[m][h]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * N + 8 * h, acc[m][h]);
}

// 16 interleaved Q4_K (FIVE: Q5_K) rows against M activation rows (see the AVX-512 kernel).
template <bool FIVE, int M>
void dot_group_x16_kq(const uint8_t* group, const Activations& a, float* out, int64_t N) {
  constexpr int64_t BYTES = FIVE ? Q5K_BYTES : Q4K_BYTES, CODES = kq_codes(FIVE);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m128i six = _mm_set1_epi8(0x3F), nibble = _mm_set1_epi8(0x0F), bits45 = _mm_set1_epi8(0x30);
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = group + b * GROUP_ROWS * BYTES;
    for (int64_t line = 0; line < GROUP_ROWS * BYTES; line += 64) prefetch_l2(p + line);
    // ggml's get_scale_min_k4 on 16 rows at once: byte k of the rows is q[k].
    __m128i q[12], sc[8], mn[8];
    for (int k = 0; k < 12; ++k) q[k] = load128(p + KQ_SCALES + 16 * k);
    for (int s = 0; s < 4; ++s) {
      sc[s] = _mm_and_si128(q[s], six);
      mn[s] = _mm_and_si128(q[s + 4], six);
      sc[s + 4] = _mm_or_si128(_mm_and_si128(q[s + 8], nibble),
                               _mm_and_si128(_mm_srli_epi16(q[s], 2), bits45));
      mn[s + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q[s + 8], 4), nibble),
                               _mm_and_si128(_mm_srli_epi16(q[s + 4], 2), bits45));
    }
    const int8_t* x[M];
    for (int m = 0; m < M; ++m) x[m] = a.block_codes(m, b);
    for (int h = 0; h < 2; ++h) {
      __m256 sum[M];  // per row: sum over sub-blocks of sc_s times the integer dot
      for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        __m256i dot_low[M], dot_high[M];  // sub-blocks 2c, 2c + 1
        for (int m = 0; m < M; ++m) dot_low[m] = dot_high[m] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {  // two code vectors' pair sums added in int16
          __m256i low[2], high[2];
          for (int t = 0; t < 2; ++t) {
            const int64_t v = 8 * c + j + t;
            const __m256i codes = load256(p + CODES + 64 * v + 32 * h);
            low[t] = _mm256_and_si256(codes, low4);
            high[t] = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4);
            if constexpr (FIVE) {
              uint64_t masks[2];
              std::memcpy(masks, p + Q5K_MASKS + 16 * v, 16);
              low[t] = _mm256_or_si256(low[t], sixteen_where(static_cast<uint32_t>(masks[0] >> 32 * h)));
              high[t] = _mm256_or_si256(high[t], sixteen_where(static_cast<uint32_t>(masks[1] >> 32 * h)));
            }
          }
          for (int m = 0; m < M; ++m) {
            const int8_t* xc = x[m] + 64 * c + 4 * j;
            const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(low[0], broadcast4(xc)),
                                                _mm256_maddubs_epi16(low[1], broadcast4(xc + 4)));
            const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(high[0], broadcast4(xc + 32)),
                                                _mm256_maddubs_epi16(high[1], broadcast4(xc + 36)));
            dot_low[m] = _mm256_add_epi32(dot_low[m], _mm256_madd_epi16(pl, ones));
            dot_high[m] = _mm256_add_epi32(dot_high[m], _mm256_madd_epi16(ph, ones));
          }
        }
        const __m256 sc_low = u8x8(sc[2 * c], h), sc_high = u8x8(sc[2 * c + 1], h);
        for (int m = 0; m < M; ++m) {
          sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_low[m]), sc_low, sum[m]);
          sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_high[m]), sc_high, sum[m]);
        }
      }
      const __m256 d = fp16x8(p + 16 * h), dmin = fp16x8(p + 32 + 16 * h);
      __m256 min_lanes[8];
      for (int s = 0; s < 8; ++s) min_lanes[s] = u8x8(mn[s], h);
      for (int m = 0; m < M; ++m) {
        const float* sums = a.sums.data() + (m * a.scale_stride + b) * 32 + 24;  // scale * sum per 32
        __m256 mins = _mm256_setzero_ps();
        for (int s = 0; s < 8; ++s) mins = _mm256_fmadd_ps(min_lanes[s], _mm256_set1_ps(sums[s]), mins);
        acc[m][h] = _mm256_fmadd_ps(sum[m], _mm256_mul_ps(d, _mm256_set1_ps(a.block_scale(m, b))),
                                    acc[m][h]);
        acc[m][h] = _mm256_fnmadd_ps(dmin, mins, acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * N + 8 * h, acc[m][h]);
}
#else
template <typename B, int M>
void dot_row_32(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  float acc[M] = {}, bias[M] = {};
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = row + b * B::BYTES;
    prefetch_l2(p);
    Block32 w;
    B::decode(p, w);
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.codes.data() + m * a.code_stride;
      const int32_t dot = dot_block32(w.q, xq + a.code_offset(b, 0), xq + a.code_offset(b, 16));
      const float* sums = a.sums.data() + 2 * (m * a.scale_stride + b);  // scale, scale * sum
      acc[m] += w.d * sums[0] * static_cast<float>(dot);
      bias[m] += w.offset * sums[1];
    }
  }
  for (int m = 0; m < M; ++m) out[m * N] = acc[m] + bias[m];
}

template <typename B, int M>
void dot_row_k(const uint8_t* row, const Activations& a, float* out, int64_t N) {
  constexpr int NUM_OFFSETS = B::SUMS16 ? 16 : 8;
  float acc[M] = {};
  for (int64_t b = 0; b < a.blocks(); ++b) {
    const uint8_t* p = row + b * B::BYTES;
    for (int64_t line = 0; line < B::BYTES; line += 64) prefetch_l2(p + line);
    BlockK w;
    B::decode(p, w);
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.block_codes(m, b);
      const int32_t sum = dot_block256(w.q, xq, w.scale);  // |codes| < 64, |sc| <= 128: exact
      acc[m] += w.d * a.block_scale(m, b) * static_cast<float>(sum);
      const float* sums = a.sums.data() + (m * a.scale_stride + b) * 32 + (B::SUMS16 ? 0 : 24);
      for (int j = 0; j < NUM_OFFSETS; ++j) acc[m] += w.offset[j] * sums[j];
    }
  }
  for (int m = 0; m < M; ++m) out[m * N] = acc[m];
}

#endif

// Float rows: element k of a row widened exactly to fp32.
struct RowF32 {
  static constexpr int64_t BYTES = 4;
  static float load(const uint8_t* p, int64_t k) {
    float f;
    std::memcpy(&f, p + 4 * k, 4);
    return f;
  }
};
struct RowF16 {
  static constexpr int64_t BYTES = 2;
  static float load(const uint8_t* p, int64_t k) { return half(p + 2 * k); }
};
struct RowBF16 {
  static constexpr int64_t BYTES = 2;
  static float load(const uint8_t* p, int64_t k) {
    uint16_t h;
    std::memcpy(&h, p + 2 * k, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

template <typename F, int M>
void dot_row_float(const uint8_t* row, const float* x, int64_t K, float* out, int64_t N) {
  float acc[M][LANES] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    prefetch_l2(row + k * F::BYTES);
    float w[LANES];
    for (int l = 0; l < LANES; ++l) w[l] = F::load(row, k + l);
    for (int m = 0; m < M; ++m)
      for (int l = 0; l < LANES; ++l) acc[m][l] += w[l] * x[m * K + k + l];
  }
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) acc[m][0] += F::load(row, k) * x[m * K + k];
  for (int m = 0; m < M; ++m) {
    float sum = 0.f;
    for (int l = 0; l < LANES; ++l) sum += acc[m][l];
    out[m * N] = sum;
  }
}

// Dequantization: the gguf package's products and sums, in its order.
template <typename B>
void dequantize_row_32(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    Block32 w;
    B::decode(row + b * B::BYTES, w);
    const float m = B::HAS_MIN ? w.offset : 0.f;
    for (int j = 0; j < QK; ++j) {
      const float v = w.d * static_cast<float>(w.q[j] - B::ZERO);
      out[b * QK + j] = B::HAS_MIN ? v + m : v;
    }
  }
}

template <typename B>
void dequantize_row_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK_K; ++b) {
    const uint8_t* p = row + b * B::BYTES;
    BlockK w;
    B::decode(p, w);
    float dsc[16], dm[16];
    int zero;
    B::group_scales(p, dsc, dm, &zero);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j)
        out[b * QK_K + 16 * i + j] = dsc[i] * static_cast<float>(w.q[16 * i + j] - zero) - dm[i];
  }
}

template <typename F>
void dequantize_row_float(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = F::load(row, k);
}

#endif

// ---- BF16 rows: x rounded to bf16, as llama.cpp rounds the activations of a BF16 weight (its
// vec_dot_type) and gemv.cpp those of a bf16 nn.Linear; each product of two bf16 is exact in fp32,
// so only the order of the fp32 sums differs between paths. A weight of BF16 rows against M rows
// of x is a GEMM (a prompt's prefill, a MoE expert's tokens) as much as a GEMV: tiles of 4 x
// rows by 4 weight rows, 16 sums in registers, the x rows blocked to stay in L2 while each
// quadruple of weight rows, read from memory once per block, stays in L1.

// x [n] fp32 -> bf16 bits, round to nearest even; NaN stays NaN (quieted), as ggml rounds.
std::vector<uint16_t> round_to_bf16(const float* x, int64_t n) {
  std::vector<uint16_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    out[i] = (u & 0x7FFFFFFF) > 0x7F800000 ? (u >> 16) | 0x40 : (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  }
  return out;
}

constexpr int64_t BF16_TILE = 4;                  // x rows and weight rows per tile
constexpr int64_t BF16_X_BLOCK_BYTES = 256 << 10;  // x rows kept in L2 per pass over the weights

#if defined(ZCODE_GGML_AVX512) && defined(__AVX512BF16__)

// v[16] -> one vector whose lane i is the sum of v[i]'s lanes: 15 adds and 30 shuffles instead of
// 16 horizontal reductions (each ~4 adds, 4 shuffles and a dependency chain).
inline __m512 lane_sums(const __m512 (&v)[16]) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit quarter: v[2i], v[2i + 1] partials alternating
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per quarter: v[4i..4i + 3]'s partials
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // quarters: u[2i] halves 0, 1, u[2i + 1] halves 0, 1
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[i * N + j] = x[i] . w[j] for MR x rows (row stride K) and NR weight rows (w[j] pointers; a
// tile past the last row repeats it), storing the first `nr`; vdpbf16ps sums 32 products a step.
template <int MR, int NR, bool PREFETCH>
void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* const (&w)[NR], int64_t nr,
               float* out, int64_t N) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  // Whole vectors load unmasked, only the K tail masked (a masked load costs more, gemv.cpp).
  const auto step = [&](int64_t k, auto load) {
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load(x + i * K + k);
    for (int j = 0; j < NR; ++j) {
      if constexpr (PREFETCH) prefetch_l2(reinterpret_cast<const uint8_t*>(w[j] + k));
      const __m512bh wv = load(w[j] + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[i]);
    }
  };
  int64_t k = 0;
  const auto whole = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (; k + 32 <= K; k += 32) step(k, whole);
  if (const __mmask32 tail = (__mmask32{1} << (K - k)) - 1; k < K)
    step(k, [tail](const uint16_t* p) { return (__m512bh)_mm512_maskz_loadu_epi16(tail, p); });
  if constexpr (MR * NR == 16) {
    __m512 v[16];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) v[i * NR + j] = acc[i][j];
    alignas(64) float sums[16];
    _mm512_store_ps(sums, lane_sums(v));
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < nr; ++j) out[i * N + j] = sums[i * NR + j];
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < nr; ++j) out[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}
#else
// Elsewhere float_dot.h's bf16 dot products (AVX-512 without BF16, AVX2: both operands widened
// exactly, FMA; portable loops otherwise).
template <int MR, int NR, bool PREFETCH>
void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* const (&w)[NR], int64_t nr,
               float* out, int64_t N) {
  float sums[NR][MR];
  zcode_float_dot::dot_rows<zcode_float_dot::Bf16, MR, NR, PREFETCH>(x, w, sums, K);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) out[i * N + j] = sums[j][i];
}
#endif

// fn(std::integral_constant<int, n>) for 1 <= n <= BF16_TILE rows of x: a tile's row count as a
// template argument.
template <typename Fn>
void with_tile_rows(int64_t n, const Fn& fn) {
  switch (n) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
  }
}

// Weight rows r0..r1 (BF16, row stride `stride` bytes) against all M rows of x (bf16 bits
// [M, K]) -> out[m * N + r].
void bf16_rows(const uint8_t* w, int64_t stride, int64_t r0, int64_t r1, const uint16_t* x,
               int64_t M, int64_t K, float* out, int64_t N) {
  const auto row = [&](int64_t r) { return reinterpret_cast<const uint16_t*>(w + r * stride); };
  if (M < BF16_TILE) {
    // Decode: streaming the weights is the work, one row after another (a single stream, as
    // the prefetchers like it; 4 rows at once: 42 against 50 GB/s, 2 threads).
    return with_tile_rows(M, [&](auto rows_of_x) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* one[1] = {row(r)};
        bf16_tile<decltype(rows_of_x)::value, 1, true>(x, K, one, 1, out + r, N);
      }
    });
  }
  const int64_t x_block = std::max(BF16_TILE, BF16_X_BLOCK_BYTES / (2 * K) / BF16_TILE * BF16_TILE);
  for (int64_t m0 = 0; m0 < M; m0 += x_block) {
    const int64_t m1 = std::min(M, m0 + x_block);
    for (int64_t r = r0; r < r1; r += BF16_TILE) {
      const int64_t nr = std::min(BF16_TILE, r1 - r);
      const uint16_t* rows[BF16_TILE];
      for (int64_t j = 0; j < BF16_TILE; ++j) rows[j] = row(r + std::min(j, nr - 1));
      for (int64_t m = m0; m < m1; m += BF16_TILE)
        with_tile_rows(std::min(BF16_TILE, m1 - m), [&](auto rows_of_x) {
          constexpr int MR = decltype(rows_of_x)::value;
          // The first tile of a block streams the weight rows from memory: it prefetches them.
          if (m == m0)
            bf16_tile<MR, BF16_TILE, true>(x + m * K, K, rows, nr, out + m * N + r, N);
          else
            bf16_tile<MR, BF16_TILE, false>(x + m * K, K, rows, nr, out + m * N + r, N);
        });
    }
  }
}

// ---- Dispatch.

struct Input {
  const float* x;                 // [M, K] fp32
  int64_t K;
  const Activations* act32;       // for the 32-block types
  const Activations* act256;      // for the K-quants
};

template <int M>
void rows_of(int64_t type, const uint8_t* w, int64_t stride, int64_t r0, int64_t r1,
             const Input& in, float* out, int64_t N);

// Rows r0..r1 (multiples of 16) of an interleaved weight: each group by the AVX-512 or AVX2
// kernel, or (other ISAs) put back in the file's row order and run as rows.
template <int M>
void groups_of(int64_t type, const uint8_t* w, int64_t stride, int64_t r0, int64_t r1,
               const Input& in, float* out, int64_t N) {
#if defined(ZCODE_GGML_AVX512) || defined(ZCODE_GGML_AVX2)
  const auto each = [&](auto dot) {
    for (int64_t r = r0; r < r1; r += GROUP_ROWS) dot(w + r * stride, out + r);
  };
  const Activations& a = *in.act32;  // the 32-block types'
  switch (base_type(type)) {
    case Q4_0: return each([&](auto g, auto o) { dot_group_x16<Q4_0, M>(g, a, o, N); });
    case Q4_1: return each([&](auto g, auto o) { dot_group_x16<Q4_1, M>(g, a, o, N); });
    case Q5_0: return each([&](auto g, auto o) { dot_group_x16<Q5_0, M>(g, a, o, N); });
    case Q5_1: return each([&](auto g, auto o) { dot_group_x16<Q5_1, M>(g, a, o, N); });
    case Q8_0: return each([&](auto g, auto o) { dot_group_x16<Q8_0, M>(g, a, o, N); });
    case Q4_K: return each([&](auto g, auto o) { dot_group_x16_kq<false, M>(g, *in.act256, o, N); });
    case Q5_K: return each([&](auto g, auto o) { dot_group_x16_kq<true, M>(g, *in.act256, o, N); });
    case Q6_K: return each([&](auto g, auto o) { dot_group_x16_q6k<M>(g, *in.act256, o, N); });
  }
  TORCH_CHECK(false, "ggml type ", type, " has no interleaved kernel");
#else
  thread_local std::vector<uint8_t> rows;
  rows.resize(GROUP_ROWS * stride);
  for (int64_t r = r0; r < r1; r += GROUP_ROWS) {
    for (int64_t i = 0; i < GROUP_ROWS; ++i)
      x16_rows(base_type(type), const_cast<uint8_t*>(w + r * stride), rows.data() + i * stride, i,
               in.K, false);
    rows_of<M>(base_type(type), rows.data(), stride, 0, GROUP_ROWS, in, out + r, N);
  }
#endif
}

// Rows r0..r1 of one weight (row stride `stride` bytes) into out columns (out points at column 0
// of the matrix, row stride N).
template <int M>
void rows_of(int64_t type, const uint8_t* w, int64_t stride, int64_t r0, int64_t r1,
             const Input& in, float* out, int64_t N) {
  const auto each = [&](auto dot) {
    for (int64_t r = r0; r < r1; ++r) dot(w + r * stride, out + r);
  };
  if (is_x16(type)) return groups_of<M>(type, w, stride, r0, r1, in, out, N);
#if defined(ZCODE_GGML_AVX512) || defined(ZCODE_GGML_AVX2)
  // A 32-block row's dot is a chain of dependent accumulations: at 1-2 activation rows, four
  // nibble rows at once keep the vector units busy (AVX-512, one core, M = 1, median of 5
  // alternating runs: Q4_1 18.6 -> 22.4 GB/s, Q5_0 13.0 -> 16.6, Q4_0 13.1 -> 13.7). Q8_0's
  // sign fix-ups per row make four rows slower there (12.1 -> 10.6): it stays one row at a time.
  const auto rows32 = [&](auto block) {
    using B = decltype(block);
    constexpr int R = M <= 2 && !B::SIGNED ? 4 : 1;
    int64_t r = r0;
    for (; r + R <= r1; r += R) dot_rows_32<B, M, R>(w + r * stride, stride, *in.act32, out + r, N);
    for (; r < r1; ++r) dot_rows_32<B, M, 1>(w + r * stride, stride, *in.act32, out + r, N);
  };
  switch (type) {
    case Q4_0: return rows32(BQ4_0{});
    case Q4_1: return rows32(BQ4_1{});
    case Q5_0: return rows32(BQ5_0{});
    case Q5_1: return rows32(BQ5_1{});
    case Q8_0: return rows32(BQ8_0{});
  }
#endif
  switch (type) {
    case Q4_0: return each([&](auto p, auto o) { dot_row_32<BQ4_0, M>(p, *in.act32, o, N); });
    case Q4_1: return each([&](auto p, auto o) { dot_row_32<BQ4_1, M>(p, *in.act32, o, N); });
    case Q5_0: return each([&](auto p, auto o) { dot_row_32<BQ5_0, M>(p, *in.act32, o, N); });
    case Q5_1: return each([&](auto p, auto o) { dot_row_32<BQ5_1, M>(p, *in.act32, o, N); });
    case Q8_0: return each([&](auto p, auto o) { dot_row_32<BQ8_0, M>(p, *in.act32, o, N); });
    case Q4_K: return each([&](auto p, auto o) { dot_row_k<BQ4_K, M>(p, *in.act256, o, N); });
    case Q5_K: return each([&](auto p, auto o) { dot_row_k<BQ5_K, M>(p, *in.act256, o, N); });
    case Q6_K: return each([&](auto p, auto o) { dot_row_k<BQ6_K, M>(p, *in.act256, o, N); });
    case F32: return each([&](auto p, auto o) { dot_row_float<RowF32, M>(p, in.x, in.K, o, N); });
    case F16: return each([&](auto p, auto o) { dot_row_float<RowF16, M>(p, in.x, in.K, o, N); });
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel");
}

// (elements, bytes) of one block; 0 for types without a kernel here.
std::pair<int64_t, int64_t> block_shape(int64_t type) {
  if (is_x16(type)) return has_x16(base_type(type)) ? block_shape(base_type(type))
                                                   : std::pair<int64_t, int64_t>{0, 0};
  switch (type) {
    case F32: return {1, 4};
    case F16: case BF16: return {1, 2};
    case Q4_0: return {QK, BQ4_0::BYTES};
    case Q4_1: return {QK, BQ4_1::BYTES};
    case Q5_0: return {QK, BQ5_0::BYTES};
    case Q5_1: return {QK, BQ5_1::BYTES};
    case Q8_0: return {QK, BQ8_0::BYTES};
    case Q4_K: return {QK_K, BQ4_K::BYTES};
    case Q5_K: return {QK_K, BQ5_K::BYTES};
    case Q6_K: return {QK_K, BQ6_K::BYTES};
  }
  return {0, 0};
}

int64_t row_bytes(int64_t type, int64_t K) {
  const auto [elements, bytes] = block_shape(type);
  TORCH_CHECK(elements > 0, "ggml type ", type, " has no kernel");
  TORCH_CHECK(K % elements == 0, "ggml type ", type, " rows hold whole blocks of ", elements,
              ", not ", K);
  return K / elements * bytes;
}

void check_rows(const torch::Tensor& w, int64_t type, int64_t K, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 &&
                  w.size(1) == row_bytes(type, K),
              what, ": weights must be uint8 [N, ", row_bytes(type, K), "] with rows of contiguous "
              "bytes for ggml type ", type, " and K = ", K, ", got ", w.sizes(), " ",
              w.scalar_type());
  TORCH_CHECK(!is_x16(type) || (w.size(0) % GROUP_ROWS == 0 && w.is_contiguous()), what,
              ": an interleaved weight (type ", type, ") is contiguous and has a multiple of ",
              GROUP_ROWS, " rows, got ", w.sizes());
}

bool is_k_quant(int64_t type) {
  const int64_t base = base_type(type);
  return base == Q4_K || base == Q5_K || base == Q6_K;
}
bool is_block32(int64_t type) { return block_shape(type).first == QK; }

// x [M, K] fp32 (contiguous, any M) quantized once per block size its weights need, in chunks
// of up to MAX_ROWS rows (chunk c: rows c * MAX_ROWS..), as `Input` reads each; rounded to bf16
// (all rows at once) where a weight has BF16 rows.
struct QuantizedInput {
  int64_t M, K;
  std::vector<Activations> act32, act256;
  std::vector<Input> chunks;
  std::vector<uint16_t> bf16;  // [M, K]
  QuantizedInput(const float* x, int64_t M, int64_t K, at::IntArrayRef types) : M(M), K(K) {
    bool needs32 = false, needs256 = false, needs_bf16 = false;
    for (const int64_t type : types)
      needs32 |= is_block32(type), needs256 |= is_k_quant(type), needs_bf16 |= type == BF16;
    if (needs_bf16) bf16 = round_to_bf16(x, M * K);
    const int64_t num_chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
    act32.resize(num_chunks), act256.resize(num_chunks);  // not resized again: Input points here
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float* rows = x + c * MAX_ROWS * K;
      const int64_t num_rows = std::min(MAX_ROWS, M - c * MAX_ROWS);
      if (needs32) act32[c] = quantize_activations(rows, num_rows, K, QK);
      if (needs256) act256[c] = quantize_activations(rows, num_rows, K, QK_K);
      chunks.push_back(Input{rows, K, &act32[c], &act256[c]});
    }
  }
  QuantizedInput(const QuantizedInput&) = delete;
};

// One weight of a GEMV over several: its rows, ggml type, the activations it reads and where
// its outputs go: out [M, out_stride], its rows as columns 0..N.
struct Matrix {
  const uint8_t* data;
  int64_t rows, stride;  // stride: bytes from one row to the next
  int64_t bytes;         // rows * row bytes
};

Matrix matrix_of(const torch::Tensor& w) {
  return {w.data_ptr<uint8_t>(), w.size(0), w.stride(0), w.numel()};
}

struct Segment {
  Matrix w;
  int64_t type;
  const QuantizedInput* in;
  float* out;
  int64_t out_stride;
};

// Weight rows per tile when x has several chunks: a tile (~9 KB of Q4_0 at K = 1024) is read
// from memory once, then again from L1 for each further chunk.
constexpr int64_t TILE_ROWS = GROUP_ROWS;  // and an interleaved weight's group

template <int M>
void chunk_rows(const Segment& s, int64_t c, int64_t r0, int64_t r1) {
  rows_of<M>(s.type, s.w.data, s.w.stride, r0, r1, s.in->chunks[c],
             s.out + c * MAX_ROWS * s.out_stride, s.out_stride);
}

void segment_rows(const Segment& s, int64_t r0, int64_t r1) {
  if (s.type == BF16)
    return bf16_rows(s.w.data, s.w.stride, r0, r1, s.in->bf16.data(), s.in->M, s.in->K, s.out,
                     s.out_stride);
  const int64_t num_chunks = static_cast<int64_t>(s.in->chunks.size());
  const int64_t tile = num_chunks > 1 ? TILE_ROWS : r1 - r0;
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = std::min(r1, t0 + tile);
    for (int64_t c = 0; c < num_chunks; ++c) switch (std::min(MAX_ROWS, s.in->M - c * MAX_ROWS)) {
        case 1: chunk_rows<1>(s, c, t0, t1); break;
        case 2: chunk_rows<2>(s, c, t0, t1); break;
        case 3: chunk_rows<3>(s, c, t0, t1); break;
        case 4: chunk_rows<4>(s, c, t0, t1); break;
        case 5: chunk_rows<5>(s, c, t0, t1); break;
        case 6: chunk_rows<6>(s, c, t0, t1); break;
        case 7: chunk_rows<7>(s, c, t0, t1); break;
        case 8: chunk_rows<8>(s, c, t0, t1); break;
      }
  }
}

// Every segment's rows in one parallel region, in units of 16 rows (an interleaved weight's
// groups stay whole), each thread an equal share of the work: a unit's bytes times its rows of x,
// at least MAX_ROWS (a few rows stream the weights: bytes take the time; many rows multiply them:
// bytes x rows). By bytes alone, a prefill's shared expert, on every token, and the routed ones
// on a few each left one of two threads waiting (a GLM-shaped layer of bf16 experts, 512 tokens:
// 1.3x on 2 threads against 1; 1.76x split so).
void gemv_segments(const std::vector<Segment>& segments) {
  std::vector<int64_t> offsets{0};  // in units
  std::vector<double> work{0.};     // before each segment
  for (const auto& s : segments) {
    const int64_t units = s.in->M > 0 ? (s.w.rows + GROUP_ROWS - 1) / GROUP_ROWS : 0;
    offsets.push_back(offsets.back() + units);
    work.push_back(work.back() + (units ? static_cast<double>(s.w.bytes) * std::max(s.in->M, MAX_ROWS) : 0.));
  }
  const int64_t units = offsets.back();
  if (units == 0) return;
  // A task streams at least GRAIN_BYTES (at MAX_ROWS rows); one task per thread at most.
  const double total = work.back();
  const int64_t tasks = std::clamp<int64_t>(
      static_cast<int64_t>(total / (static_cast<double>(GRAIN_BYTES) * MAX_ROWS)), 1,
      at::get_num_threads());
  const auto first_unit = [&](int64_t task) -> int64_t {  // of the task, by its share of work
    if (task >= tasks) return units;
    const double at = total * static_cast<double>(task) / static_cast<double>(tasks);
    const size_t s = std::upper_bound(work.begin(), work.end(), at) - work.begin() - 1;
    const int64_t n = offsets[s + 1] - offsets[s];
    return offsets[s] + std::min<int64_t>(n, static_cast<int64_t>((at - work[s]) / (work[s + 1] - work[s]) * n));
  };
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    int64_t u0 = first_unit(t0);
    const int64_t u1 = first_unit(t1);
    size_t s = std::upper_bound(offsets.begin(), offsets.end(), u0) - offsets.begin() - 1;
    for (; u0 < u1; ++s) {
      const int64_t end = std::min(u1, offsets[s + 1]), rows = segments[s].w.rows;
      if (end > u0)
        segment_rows(segments[s], (u0 - offsets[s]) * GROUP_ROWS,
                     std::min(rows, (end - offsets[s]) * GROUP_ROWS));
      u0 = end;
    }
  });
}

void dequantize_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  switch (type) {
    case Q4_0: return dequantize_row_32<BQ4_0>(row, K, out);
    case Q4_1: return dequantize_row_32<BQ4_1>(row, K, out);
    case Q5_0: return dequantize_row_32<BQ5_0>(row, K, out);
    case Q5_1: return dequantize_row_32<BQ5_1>(row, K, out);
    case Q8_0: return dequantize_row_32<BQ8_0>(row, K, out);
    case Q4_K: return dequantize_row_k<BQ4_K>(row, K, out);
    case Q5_K: return dequantize_row_k<BQ5_K>(row, K, out);
    case Q6_K: return dequantize_row_k<BQ6_K>(row, K, out);
    case F32: return dequantize_row_float<RowF32>(row, K, out);
    case F16: return dequantize_row_float<RowF16>(row, K, out);
    case BF16: return dequantize_row_float<RowBF16>(row, K, out);
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel");
}


}  // namespace

namespace {

using zcode_simd::silu_mul;

// out[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (PyTorch's approximate="tanh"):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (exp(2y) + 1).
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  int64_t i = 0;
#if defined(ZCODE_GGML_AVX512)
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(0.5f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 inner = _mm512_mul_ps(
        _mm512_set1_ps(kBeta),
        _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kKappa), _mm512_mul_ps(g, _mm512_mul_ps(g, g)))));
    const __m512 e = zcode_simd::exp_ps(_mm512_mul_ps(two, inner));
    const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(gelu, _mm512_loadu_ps(up + i)));
  }
#elif defined(ZCODE_GGML_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 inner = _mm256_mul_ps(
        _mm256_set1_ps(kBeta),
        _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kKappa), _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
    const __m256 e = zcode_simd::exp_ps(_mm256_mul_ps(two, inner));
    const __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, tanh));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], inner = kBeta * (g + kKappa * (g * (g * g)));
    out[i] = 0.5f * g * (1.f + std::tanh(inner)) * up[i];
  }
}

// fn(i) for i in [0, n): on every thread where the step has many tokens (a prefill's gathers,
// activations and sums, a few ms serial), inline at a decode step's few.
template <typename Fn>
void for_each_pass(int64_t n, bool parallel, const Fn& fn) {
  at::parallel_for(0, n, parallel ? 1 : std::max<int64_t>(n, 1), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i);
  });
}

// x [M, K] times weights ws of types `types`, checked by the caller -> out [M, sum N_s].
void gemv_into(const float* xp, int64_t M, int64_t K, const std::vector<torch::Tensor>& ws,
               at::IntArrayRef types, float* out) {
  const QuantizedInput x(xp, M, K, types);
  int64_t N = 0;
  for (const auto& w : ws) N += w.size(0);
  std::vector<Segment> segments;
  for (size_t s = 0, column = 0; s < ws.size(); column += ws[s].size(0), ++s)
    segments.push_back({matrix_of(ws[s]), types[s], &x, out + column, N});
  gemv_segments(segments);
}

}  // namespace

torch::Tensor ggml_gemv(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                        at::IntArrayRef ggml_types) {
  // x: [M, K] float; ws[s]: uint8 [N_s, row_bytes] of ggml type ggml_types[s]
  // -> [M, sum N_s] fp32
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "ggml_gemv: x must be 2-D float");
  TORCH_CHECK(!ws.empty() && ws.size() == ggml_types.size(),
              "ggml_gemv: one ggml type per weight, and at least one weight");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  for (size_t s = 0; s < ws.size(); ++s) {
    check_rows(ws[s], ggml_types[s], K, "ggml_gemv");
    N += ws[s].size(0);
  }
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const auto xf = x.to(at::kFloat).contiguous();
  gemv_into(xf.data_ptr<float>(), M, K, ws, ggml_types, out.data_ptr<float>());
  return out;
}

// The experts of a projection, one matrix and type each: entry i of `ws` is one expert's rows
// [N, row_bytes] or a stack of experts [E_i, N, row_bytes] (a GGUF file's stacked tensor: a
// step of the compiled graph passes one tensor, not a list of E), of ggml type types[i]; K of
// entry i is in_features(i).
struct Experts {
  std::vector<Matrix> w;
  std::vector<int64_t> type;
  std::vector<int64_t> entry_size;  // experts per entry of ws
};

template <typename InFeatures>
Experts experts_of(const std::vector<torch::Tensor>& ws, at::IntArrayRef types, InFeatures in_features,
                   const char* what) {
  TORCH_CHECK(types.size() == ws.size(), what, ": one ggml type per weight or stack of weights");
  Experts experts;
  for (size_t i = 0; i < ws.size(); ++i) {
    const torch::Tensor& w = ws[i];
    TORCH_CHECK(w.dim() == 2 || w.dim() == 3, what, ": weights are [N, row_bytes] or stacks [E, N, "
                "row_bytes], got ", w.sizes());
    const torch::Tensor first = w.dim() == 3 ? w.select(0, 0) : w;
    check_rows(first, types[i], in_features(i), what);
    const int64_t count = w.dim() == 3 ? w.size(0) : 1, step = w.dim() == 3 ? w.stride(0) : 0;
    for (int64_t j = 0; j < count; ++j) {
      Matrix m = matrix_of(first);
      m.data += j * step;
      experts.w.push_back(m);
      experts.type.push_back(types[i]);
    }
    experts.entry_size.push_back(count);
  }
  return experts;
}

// A MoE layer's experts as ggml_moe reads them: gate/up/down (see Experts) and how many are
// routed, and the tensors they point into (held); built and checked once per call of the op,
// or once per layer by a DecodeStack (~15 us a layer at 58 experts).
struct MoeExperts {
  Experts gate, up, down;
  int64_t num_routed;
  std::vector<torch::Tensor> held;
};

MoeExperts moe_experts_of(const std::vector<torch::Tensor>& gate,
                          const std::vector<torch::Tensor>& up,
                          const std::vector<torch::Tensor>& down, at::IntArrayRef gate_types,
                          at::IntArrayRef up_types, at::IntArrayRef down_types, int64_t D,
                          int64_t num_routed) {
  // D: the model's hidden size (gate/up's input features, down's rows)
  TORCH_CHECK(up.size() == gate.size() && down.size() == gate.size(),
              "ggml_moe: as many gate, up and down entries");
  const auto model_dim = [D](size_t) { return D; };
  MoeExperts m{experts_of(gate, gate_types, model_dim, "ggml_moe gate"),
               experts_of(up, up_types, model_dim, "ggml_moe up"),
               experts_of(down, down_types, [&](size_t i) { return gate[i].size(gate[i].dim() - 2); },
                          "ggml_moe down"),
               num_routed,
               {}};
  for (const auto* ws : {&gate, &up, &down}) m.held.insert(m.held.end(), ws->begin(), ws->end());
  const Experts &G = m.gate, &U = m.up, &Dn = m.down;
  const int64_t E = static_cast<int64_t>(G.w.size());
  TORCH_CHECK(U.entry_size == G.entry_size && Dn.entry_size == G.entry_size &&
                  0 <= num_routed && num_routed <= E,
              "ggml_moe: one gate, up and down weight per expert, ", E, " experts, ", num_routed,
              " of them routed");
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(U.w[e].rows == G.w[e].rows && Dn.w[e].rows == D, "ggml_moe: expert ", e,
                " has gate/up of ", G.w[e].rows, " and ", U.w[e].rows, " rows, down of ", Dn.w[e].rows);
  return m;
}

torch::Tensor moe_forward(const torch::Tensor& x, const torch::Tensor& weights,
                          const torch::Tensor& expert_ids, const MoeExperts& experts) {
  // x: [T, D] float; weights, expert_ids: [T, k] (id -1: an expert not held here); experts
  // num_routed.. are the shared ones (every token, weight 1) -> [T, D] fp32:
  //   sum over routed e in ascending id of w_te down_e(silu(gate_e x_t) up_e x_t), then + shared.
  // A pass is an expert on its tokens (gathered): every pass's gate and up rows in one parallel
  // region, SiLU * up, every pass's down rows in a second one.
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "ggml_moe: x must be 2-D float");
  const int64_t T = x.size(0), D = x.size(1);
  const Experts &G = experts.gate, &U = experts.up, &Dn = experts.down;
  const int64_t E = static_cast<int64_t>(G.w.size()), num_routed = experts.num_routed;
  TORCH_CHECK(E == 0 || Dn.w[0].rows == D, "ggml_moe: experts of ", Dn.w[0].rows,
              " output features for x of ", D);
  TORCH_CHECK(weights.dim() == 2 && expert_ids.dim() == 2 && weights.size(0) == T &&
                  expert_ids.sizes() == weights.sizes(),
              "ggml_moe: weights and expert_ids must be [T, k]");
  const auto ids = expert_ids.to(at::kLong).contiguous();
  const auto w = weights.to(at::kFloat).contiguous();
  const int64_t k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* weight = w.data_ptr<float>();
  // Each expert's tokens in order, with their routing weights (the shared ones: all, weight 1).
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = id[t * k + j];
      TORCH_CHECK(-1 <= e && e < num_routed, "ggml_moe: expert id ", e, " outside [-1, ",
                  num_routed, ")");
      if (e < 0) continue;
      if (!routed[e].empty() && routed[e].back().first == t)
        routed[e].back().second += weight[t * k + j];  // an id twice in a row: weights add
      else
        routed[e].emplace_back(t, weight[t * k + j]);
    }
  for (int64_t e = num_routed; e < E; ++e)
    for (int64_t t = 0; t < T; ++t) routed[e].emplace_back(t, 1.f);
  struct Pass {
    int64_t e, M, I;
    const std::pair<int64_t, float>* tokens;  // routed[e]
    float *x, *h, *act, *y;                    // [M, D] (its tokens' rows), [M, 2 I], [M, I], [M, D]
    const QuantizedInput* x_in;
    std::unique_ptr<QuantizedInput> own_x_in, act_in;
  };
  std::vector<Pass> passes;
  for (int64_t e = 0; e < E; ++e)
    if (!routed[e].empty())
      passes.push_back(Pass{e, static_cast<int64_t>(routed[e].size()), G.w[e].rows, routed[e].data()});
  auto out = torch::zeros({T, D}, x.options().dtype(at::kFloat));
  if (passes.empty()) return out;
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const bool prefill = T >= 2 * MAX_ROWS;
  // A pass of every token (a shared expert; every pass of a one-token step) reads x quantized
  // once for all of them: rows quantize independently, so its codes are those of its own rows.
  std::unique_ptr<QuantizedInput> every_token;
  std::vector<int64_t> x_types;
  for (const Pass& p : passes) x_types.push_back(G.type[p.e]), x_types.push_back(U.type[p.e]);
  if (std::any_of(passes.begin(), passes.end(), [T](const Pass& p) { return p.M == T; }))
    every_token = std::make_unique<QuantizedInput>(xp, T, D, x_types);
  // One buffer for every pass's rows, kept between calls: a prefill's are tens of MB, which
  // malloc maps fresh (and the kernel zeroes page by page) at every call otherwise.
  size_t floats = 0;
  for (const Pass& p : passes) floats += p.M * (2 * D + 3 * p.I);
  thread_local std::vector<float> work;
  if (work.size() < floats) work.resize(floats);
  float* next = work.data();
  for (Pass& p : passes) {
    p.x = next, p.h = p.x + p.M * D, p.act = p.h + p.M * 2 * p.I, p.y = p.act + p.M * p.I;
    next = p.y + p.M * D;
  }
  const int64_t num_passes = static_cast<int64_t>(passes.size());
  // Gate and up of every pass, each on its tokens' rows quantized once.
  for_each_pass(num_passes, prefill, [&](int64_t i) {
    Pass& p = passes[i];
    if (p.M == T) {
      p.x_in = every_token.get();
      return;
    }
    for (int64_t m = 0; m < p.M; ++m) std::copy_n(xp + p.tokens[m].first * D, D, p.x + m * D);
    const int64_t types[] = {G.type[p.e], U.type[p.e]};
    p.own_x_in = std::make_unique<QuantizedInput>(p.x, p.M, D, types);
    p.x_in = p.own_x_in.get();
  });
  std::vector<Segment> segments;
  for (Pass& p : passes) {
    segments.push_back({G.w[p.e], G.type[p.e], p.x_in, p.h, 2 * p.I});
    segments.push_back({U.w[p.e], U.type[p.e], p.x_in, p.h + p.I, 2 * p.I});
  }
  gemv_segments(segments);
  // silu(gate) * up, quantized for the down projection; every pass's down rows.
  for_each_pass(num_passes, prefill, [&](int64_t i) {
    Pass& p = passes[i];
    const int64_t I = p.I;
    for (int64_t m = 0; m < p.M; ++m) silu_mul(p.h + m * 2 * I, p.h + m * 2 * I + I, I, p.act + m * I);
    p.act_in = std::make_unique<QuantizedInput>(p.act, p.M, I, at::IntArrayRef(&Dn.type[p.e], 1));
  });
  segments.clear();
  for (Pass& p : passes) segments.push_back({Dn.w[p.e], Dn.type[p.e], p.act_in.get(), p.y, D});
  gemv_segments(segments);
  // Each token's sum in pass order (routed experts by ascending id, then the shared ones), the
  // columns split over threads.
  float* o = out.data_ptr<float>();
  const int64_t column_grain = prefill ? 64 : D;
  at::parallel_for(0, D, column_grain, [&](int64_t d0, int64_t d1) {
    for (const Pass& p : passes)
      for (int64_t m = 0; m < p.M; ++m) {
        const auto [t, gain] = p.tokens[m];
        for (int64_t d = d0; d < d1; ++d) o[t * D + d] += gain * p.y[m * D + d];
      }
  });
  return out;
}

torch::Tensor ggml_moe(const torch::Tensor& x, const torch::Tensor& weights,
                       const torch::Tensor& expert_ids, const std::vector<torch::Tensor>& gate,
                       const std::vector<torch::Tensor>& up, const std::vector<torch::Tensor>& down,
                       at::IntArrayRef gate_types, at::IntArrayRef up_types,
                       at::IntArrayRef down_types, int64_t num_routed) {
  // gate/up/down: the experts' uint8 GGUF rows ([I_e, .], [I_e, .], [D, .]), one matrix or a
  // stack of them per entry, types per entry (see Experts) -> moe_forward
  TORCH_CHECK(x.dim() == 2, "ggml_moe: x must be 2-D float");
  return moe_forward(x, weights, expert_ids,
                     moe_experts_of(gate, up, down, gate_types, up_types, down_types, x.size(1),
                                    num_routed));
}

torch::Tensor ggml_dequantize(const torch::Tensor& data, int64_t ggml_type, int64_t in_features,
                              const std::optional<torch::Tensor>& row_ids) {
  // data: uint8 [R, row_bytes], row_ids: int64 [T] or None (all rows)
  // -> fp32 [T or R, in_features]: row t is data[row_ids[t]] (an embedding lookup)
  check_rows(data, ggml_type, in_features, "ggml_dequantize");
  const int64_t R = data.size(0), stride = data.stride(0);
  torch::Tensor ids;
  if (row_ids) {
    ids = row_ids->to(at::kLong).contiguous();
    TORCH_CHECK(ids.dim() == 1, "ggml_dequantize: row_ids must be 1-D");
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < ids.numel(); ++t)
      TORCH_CHECK(id[t] >= 0 && id[t] < R, "ggml_dequantize: row id ", id[t], " out of [0, ", R, ")");
  }
  const int64_t T = row_ids ? ids.numel() : R;
  const int64_t* id = row_ids ? ids.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({T, in_features}, data.options().dtype(at::kFloat));
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, GRAIN_BYTES / (in_features * 4));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> row(is_x16(ggml_type) ? stride : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = id ? id[t] : t;
      if (!is_x16(ggml_type)) {
        dequantize_row(ggml_type, w + r * stride, in_features, o + t * in_features);
        continue;
      }
      const int64_t i = r % GROUP_ROWS;
      x16_rows(base_type(ggml_type), const_cast<uint8_t*>(w + (r - i) * stride), row.data(), i,
               in_features, false);
      dequantize_row(base_type(ggml_type), row.data(), in_features, o + t * in_features);
    }
  });
  return out;
}

// ---- Decoder blocks at decode: a layer's attention half and its MLP or MoE half, one call each ----
//
// At a decode step the model's ops between the GEMVs are a few hundred floats each; run one
// PyTorch op at a time (eager) their dispatch costs several times their arithmetic (SmolLM2,
// eager: ~15 ms a step against 4.6 compiled; ~7.5 with these ops). Each op runs a pre-norm
// residual half whole:
//   attention: x + o(attn(rope(qkv(rms_norm(x))))), the new keys and values written to the cache;
//   MLP:       x + down(act(gate(rms_norm(x))) * up(rms_norm(x))), act SiLU or GELU (tanh);
//   MoE:       x + moe(rms_norm(x)), routed here, the experts by ggml_moe,
// with, where given, an RMSNorm of q and of k per head before RoPE (QK-norm) and of the half's
// output before the residual add (GLM-4's and Gemma 3's sandwich norms, same eps as the
// input's), and Gemma's norm weights as offsets from 1.
// Same math as zcode.layers (DecoderLayer, Attention, GatedMLP, MoE, RMSNorm, apply_rotary) in fp32,
// each product and sum rounded where PyTorch's eager ops round it (no fused multiply-adds: this
// file is built with -ffp-contract=off); the RMS sums its squares in another order.

namespace {

// out[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * w, rows of D; unit_offset (Gemma): * (1 + w).
void rms_norm_rows(const float* x, const float* w, int64_t T, int64_t D, double eps, float* out,
                   bool unit_offset = false) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * D;
    constexpr int64_t W = 16;  // independent lanes: a single float chain does not vectorize
    float lanes[W] = {};
    int64_t d = 0;
    for (; d + W <= D; d += W)
      for (int64_t j = 0; j < W; ++j) lanes[j] += row[d + j] * row[d + j];
    float sum = 0.f;
    for (; d < D; ++d) sum += row[d] * row[d];
    for (int64_t j = 0; j < W; ++j) sum += lanes[j];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
    if (unit_offset)
      for (d = 0; d < D; ++d) out[t * D + d] = row[d] * inv * (1.f + w[d]);
    else
      for (d = 0; d < D; ++d) out[t * D + d] = row[d] * inv * w[d];
  }
}

// RoPE on the first 2 * R features of each of `heads` heads of D at x (row stride D), in place,
// with cos/sin [R] of the token's position: NeoX halves, or adjacent pairs written de-interleaved
// ([rotated evens | rotated odds], as zcode.layers.rotary.apply_rotary).
void rotate_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin,
                  int64_t R, bool interleaved, float* scratch) {
  for (int64_t h = 0; h < heads; ++h) {
    float* head = x + h * D;
    for (int64_t i = 0; i < R; ++i) {
      const float x1 = interleaved ? head[2 * i] : head[i];
      const float x2 = interleaved ? head[2 * i + 1] : head[R + i];
      const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], e = x1 * sin[i];
      scratch[i] = a - b;
      scratch[R + i] = c + e;
    }
    std::copy(scratch, scratch + 2 * R, head);
  }
}

template <typename T>
void store_as(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The decode attention kernel (attention.cpp, a separate extension) through the dispatcher.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& context_slots,
                                     const std::optional<torch::Tensor>& mask, double scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("zcode::paged_decode_attention", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const std::optional<torch::Tensor>&, double)>();
  return op.call(q, kv_cache, context_slots, mask, scale);
}

void check_block_input(const torch::Tensor& x, const torch::Tensor& norm_weight, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              ": x must be contiguous fp32 [T, hidden]");
  TORCH_CHECK(norm_weight.scalar_type() == at::kFloat && norm_weight.is_contiguous() &&
                  norm_weight.numel() == x.size(1),
              what, ": norm weight must be fp32 [hidden]");
}

void check_post_norm(const std::optional<torch::Tensor>& post_norm, int64_t hidden, const char* what) {
  TORCH_CHECK(!post_norm.has_value() ||
                  (post_norm->numel() == hidden && post_norm->scalar_type() == at::kFloat &&
                   post_norm->is_contiguous()),
              what, ": post_norm must be contiguous fp32 [hidden]");
}

// x + post_norm(out) (or x + out), in out: [T, hidden].
torch::Tensor add_residual(torch::Tensor& out, const torch::Tensor& x,
                           const std::optional<torch::Tensor>& post_norm, double eps,
                           bool unit_offset) {
  if (post_norm.has_value())
    rms_norm_rows(out.data_ptr<float>(), post_norm->data_ptr<float>(), out.size(0), out.size(1),
                  eps, out.data_ptr<float>(), unit_offset);
  return out.add_(x);
}

// x [T, K] times ws (checked) -> [T, sum N] fp32.
torch::Tensor gemv(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                   at::IntArrayRef types, const char* what) {
  int64_t N = 0;
  for (size_t s = 0; s < ws.size(); ++s) {
    check_rows(ws[s], types[s], x.size(1), what);
    N += ws[s].size(0);
  }
  auto out = torch::empty({x.size(0), N}, x.options());
  gemv_into(x.data_ptr<float>(), x.size(0), x.size(1), ws, types, out.data_ptr<float>());
  return out;
}

}  // namespace

torch::Tensor ggml_attention_block(const torch::Tensor& x, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& kv_cache,
                                   const torch::Tensor& slot_mapping,
                                   const torch::Tensor& context_slots,
                                   const std::optional<torch::Tensor>& mask,
                                   const torch::Tensor& norm_weight, double eps,
                                   const std::vector<torch::Tensor>& qkv, at::IntArrayRef qkv_types,
                                   const std::optional<torch::Tensor>& qkv_bias,
                                   const std::optional<torch::Tensor>& q_norm,
                                   const std::optional<torch::Tensor>& k_norm, double qk_eps,
                                   bool interleaved, int64_t num_heads, int64_t num_kv_heads,
                                   double scale, const torch::Tensor& o, int64_t o_type,
                                   const std::optional<torch::Tensor>& post_norm,
                                   bool unit_offset) {
  // x: [T, hidden] fp32, one decode token per sequence (row t is sequence t); cos, sin: [T, R]
  // (RoPE on 2R features of a head); kv_cache: [blocks, block_size, 2, KVH, D] fp32, bf16 or
  // fp16; slot_mapping: int64 [T]; context_slots: int64 [T, L]; mask: bool [T or 1, 1, 1, L] or
  // None; qkv: the q, k and v weights (ggml rows, types qkv_types), qkv_bias [(H + 2 KVH) D] or
  // None; q_norm, k_norm: [D] fp32 or None; o: [hidden, H D] of type o_type; post_norm: [hidden]
  // fp32 or None; unit_offset: every norm's weight is an offset from 1 (Gemma)
  // -> x + post_norm(o(attention)) [T, hidden] fp32
  const char* what = "ggml_attention_block";
  check_block_input(x, norm_weight, what);
  TORCH_CHECK(qkv.size() == qkv_types.size() && !qkv.empty(), what, ": one type per q/k/v weight");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == 2 && kv_cache.size(3) == num_kv_heads &&
                  kv_cache.is_contiguous(),
              what, ": kv_cache must be contiguous [blocks, block_size, 2, KVH, D]");
  const int64_t T = x.size(0), hidden = x.size(1), D = kv_cache.size(4);
  const int64_t H = num_heads, KVH = num_kv_heads, R = cos.size(-1);
  const int64_t width = (H + 2 * KVH) * D;
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && 2 * R <= D &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              what, ": cos and sin must be fp32 [T, R] with 2R <= head dim");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  slot_mapping.scalar_type() == at::kLong && context_slots.size(0) == T,
              what, ": one slot and one context row per token");
  TORCH_CHECK(!qkv_bias.has_value() ||
                  (qkv_bias->numel() == width && qkv_bias->scalar_type() == at::kFloat),
              what, ": qkv_bias must be fp32 [(H + 2 KVH) D]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), what, ": QK-norm needs both weights");
  for (const auto* w : {&q_norm, &k_norm})
    TORCH_CHECK(!w->has_value() || ((*w)->numel() == D && (*w)->scalar_type() == at::kFloat &&
                                    (*w)->is_contiguous()),
                what, ": q_norm and k_norm must be contiguous fp32 [head dim]");
  check_post_norm(post_norm, hidden, what);
  const auto normed = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_weight.data_ptr<float>(), T, hidden, eps,
                normed.data_ptr<float>(), unit_offset);
  auto projected = gemv(normed, qkv, qkv_types, what);  // [T, (H + 2 KVH) D]
  TORCH_CHECK(projected.size(1) == width, what, ": q/k/v weights give ", projected.size(1),
              " features, expected ", width);
  if (qkv_bias.has_value()) projected.add_(qkv_bias->view({1, width}));
  const auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const auto slots = slot_mapping.contiguous();
  std::vector<float> scratch(2 * R);
  const int64_t slot_floats = 2 * KVH * D;
  for (int64_t t = 0; t < T; ++t) {
    float* row = projected.data_ptr<float>() + t * width;
    const float* c = cos_c.data_ptr<float>() + t * R;
    const float* s = sin_c.data_ptr<float>() + t * R;
    if (q_norm.has_value()) {  // each head's D features, in place
      rms_norm_rows(row, q_norm->data_ptr<float>(), H, D, qk_eps, row, unit_offset);
      rms_norm_rows(row + H * D, k_norm->data_ptr<float>(), KVH, D, qk_eps, row + H * D,
                    unit_offset);
    }
    rotate_heads(row, H, D, c, s, R, interleaved, scratch.data());  // q
    rotate_heads(row + H * D, KVH, D, c, s, R, interleaved, scratch.data());  // k
    // keys then values of every KV head: the cache slot's layout [2, KVH, D]
    const int64_t offset = slots.data_ptr<int64_t>()[t] * slot_floats;
    const float* kv = row + H * D;
    switch (kv_cache.scalar_type()) {
      case at::kFloat: store_as(kv, slot_floats, kv_cache.data_ptr<float>() + offset); break;
      case at::kBFloat16: store_as(kv, slot_floats, kv_cache.data_ptr<at::BFloat16>() + offset); break;
      case at::kHalf: store_as(kv, slot_floats, kv_cache.data_ptr<at::Half>() + offset); break;
      default: TORCH_CHECK(false, what, ": kv_cache must be fp32, bf16 or fp16");
    }
  }
  const auto q = projected.narrow(1, 0, H * D).reshape({T, H, D});
  std::optional<torch::Tensor> rows_mask;
  if (mask.has_value()) rows_mask = mask->expand({T, 1, 1, context_slots.size(1)});
  const auto attended = paged_decode_attention(q, kv_cache, context_slots, rows_mask, scale);
  auto out = gemv(attended.reshape({T, H * D}), {o}, {o_type}, what);  // [T, hidden]
  TORCH_CHECK(out.size(1) == hidden, what, ": o gives ", out.size(1), " features, hidden is ", hidden);
  return add_residual(out, x, post_norm, eps, unit_offset);
}

torch::Tensor ggml_mlp_block(const torch::Tensor& x, const torch::Tensor& norm_weight, double eps,
                             const std::vector<torch::Tensor>& gate_up, at::IntArrayRef gate_up_types,
                             const torch::Tensor& down, int64_t down_type,
                             const std::optional<torch::Tensor>& post_norm, bool unit_offset,
                             int64_t activation) {
  // x: [T, hidden] fp32; gate_up: the gate and up weights [I, hidden] (ggml rows), down
  // [hidden, I]; post_norm: [hidden] fp32 or None; unit_offset as ggml_attention_block's;
  // activation: 0 SiLU, 1 tanh-approximated GELU (Gemma's GeGLU)
  // -> x + post_norm(down(act(gate(n)) * up(n))), n = rms_norm(x): [T, hidden] fp32
  const char* what = "ggml_mlp_block";
  check_block_input(x, norm_weight, what);
  check_post_norm(post_norm, x.size(1), what);
  TORCH_CHECK(gate_up.size() == 2 && gate_up_types.size() == 2, what, ": a gate and an up weight");
  TORCH_CHECK(gate_up[0].size(0) == gate_up[1].size(0), what, ": gate and up of one width");
  const int64_t T = x.size(0), hidden = x.size(1), I = gate_up[0].size(0);
  const auto normed = torch::empty_like(x);
  TORCH_CHECK(activation == 0 || activation == 1, what, ": activation 0 (SiLU) or 1 (GELU tanh)");
  rms_norm_rows(x.data_ptr<float>(), norm_weight.data_ptr<float>(), T, hidden, eps,
                normed.data_ptr<float>(), unit_offset);
  const auto h = gemv(normed, gate_up, gate_up_types, what);  // [T, 2 I]: gate | up
  auto act = torch::empty({T, I}, x.options());
  for (int64_t t = 0; t < T; ++t) {
    const float* gate = h.data_ptr<float>() + t * 2 * I;
    if (activation == 0)
      silu_mul(gate, gate + I, I, act.data_ptr<float>() + t * I);
    else
      gelu_tanh_mul(gate, gate + I, I, act.data_ptr<float>() + t * I);
  }
  auto out = gemv(act, {down}, {down_type}, what);
  TORCH_CHECK(out.size(1) == hidden, what, ": down gives ", out.size(1), " features, hidden is ", hidden);
  return add_residual(out, x, post_norm, eps, unit_offset);
}

torch::Tensor moe_block(const torch::Tensor& x, const torch::Tensor& norm_weight, double eps,
                        const torch::Tensor& router, const torch::Tensor& correction_bias,
                        int64_t top_k, int64_t num_groups, int64_t topk_groups, bool norm_topk_prob,
                        double scaling, const MoeExperts& experts) {
  // x: [T, hidden] fp32; router: fp32 [E, hidden] (E = experts.num_routed), correction_bias:
  // fp32 [E] -> x + moe(rms_norm(x)) [T, hidden] fp32, routed as
  // zcode.layers.moe.TopkRouter routes: the top_k experts by sigmoid score + correction bias
  // among the topk_groups of num_groups groups whose two best such scores sum highest, weighed
  // by their sigmoid scores (normalized to sum 1 where norm_topk_prob) times scaling.
  const char* what = "ggml_moe_block";
  check_block_input(x, norm_weight, what);
  const int64_t T = x.size(0), hidden = x.size(1), E = experts.num_routed;
  TORCH_CHECK(router.dim() == 2 && router.size(0) == E && router.size(1) == hidden &&
                  router.scalar_type() == at::kFloat && router.is_contiguous(),
              what, ": router must be contiguous fp32 [experts, hidden]");
  TORCH_CHECK(correction_bias.numel() == E && correction_bias.scalar_type() == at::kFloat &&
                  correction_bias.is_contiguous(),
              what, ": correction bias must be fp32 [experts]");
  TORCH_CHECK(0 < top_k && top_k <= E, what, ": top_k must be in 1..", E);
  TORCH_CHECK(num_groups > 0 && E % num_groups == 0 && E / num_groups >= 2 && 0 < topk_groups &&
                  topk_groups <= num_groups && top_k <= topk_groups * (E / num_groups),
              what, ": ", E, " experts in ", num_groups, " groups, ", topk_groups, " kept, top ", top_k);
  const auto normed = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_weight.data_ptr<float>(), T, hidden, eps,
                normed.data_ptr<float>());
  // [T, hidden] x [hidden, E]: the router's product as F.linear computes it
  const auto scores = at::matmul(normed, router.t()).sigmoid_();  // [T, E]
  auto weights = torch::empty({T, top_k}, x.options());
  auto expert_ids = torch::empty({T, top_k}, x.options().dtype(at::kLong));
  const int64_t per_group = E / num_groups;
  std::vector<int64_t> order(E), groups(num_groups);
  std::vector<float> choice(E), group_score(num_groups);
  for (int64_t t = 0; t < T; ++t) {
    const float* score = scores.data_ptr<float>() + t * E;
    const float* bias = correction_bias.data_ptr<float>();
    for (int64_t e = 0; e < E; ++e) choice[e] = score[e] + bias[e];
    // best first, ties to the lower index
    const auto better = [](const std::vector<float>& v) {
      return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    };
    if (topk_groups < num_groups) {  // experts outside the best groups are not chosen
      for (int64_t g = 0; g < num_groups; ++g) {
        const float* c = choice.data() + g * per_group;
        const int64_t first = std::max_element(c, c + per_group) - c;
        float second = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < per_group; ++i)
          if (i != first) second = std::max(second, c[i]);
        group_score[g] = c[first] + second;
        groups[g] = g;
      }
      std::partial_sort(groups.begin(), groups.begin() + topk_groups, groups.end(), better(group_score));
      std::vector<bool> kept(num_groups, false);
      for (int64_t i = 0; i < topk_groups; ++i) kept[groups[i]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / per_group]) choice[e] = -std::numeric_limits<float>::infinity();
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), better(choice));
    float total = 0.f;
    for (int64_t k = 0; k < top_k; ++k) total += score[order[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      float w = score[order[k]];
      if (norm_topk_prob) w = w / (total + 1e-20f);
      weights.data_ptr<float>()[t * top_k + k] = w * static_cast<float>(scaling);
      expert_ids.data_ptr<int64_t>()[t * top_k + k] = order[k];
    }
  }
  return moe_forward(normed, weights, expert_ids, experts).add_(x);
}

torch::Tensor ggml_moe_block(const torch::Tensor& x, const torch::Tensor& norm_weight, double eps,
                             const torch::Tensor& router, const torch::Tensor& correction_bias,
                             int64_t top_k, int64_t num_groups, int64_t topk_groups,
                             bool norm_topk_prob, double scaling,
                             const std::vector<torch::Tensor>& gate,
                             const std::vector<torch::Tensor>& up,
                             const std::vector<torch::Tensor>& down, at::IntArrayRef gate_types,
                             at::IntArrayRef up_types, at::IntArrayRef down_types,
                             int64_t num_routed) {
  // the experts as ggml_moe takes them -> moe_block
  check_block_input(x, norm_weight, "ggml_moe_block");
  return moe_block(x, norm_weight, eps, router, correction_bias, top_k, num_groups, topk_groups,
                   norm_topk_prob, scaling,
                   moe_experts_of(gate, up, down, gate_types, up_types, down_types, x.size(1),
                                  num_routed));
}

// ---- A decode step's layers as one call ----
//
// Every layer's halves, each one of the blocks above with its arguments (weights, norms, its KV
// cache, the model's constants) kept when the model hands them over, so a step is one call: x
// through every half in layer order. Called one block at a time from Python, each half cost
// ~15-30 us of dispatch and argument checks around its op: eager SmolLM2 Q4_0 decoded at 7.8-8.9
// ms a token with the halves one by one against 6.8-7.2 as one stack (same process, alternated).
// A step passes what changes per step: the RoPE tables (a pair per kind: Gemma's local and
// global), the slots and each kind of mask (full, each sliding window); a half names its pair
// and its mask by index.
class DecodeStack : public torch::CustomClassHolder {
 public:
  void add_attention(int64_t rope, int64_t mask, torch::Tensor kv_cache, torch::Tensor norm_weight,
                     double eps, std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_types,
                     std::optional<torch::Tensor> qkv_bias, std::optional<torch::Tensor> q_norm,
                     std::optional<torch::Tensor> k_norm, double qk_eps, bool interleaved,
                     int64_t num_heads, int64_t num_kv_heads, double scale, torch::Tensor o,
                     int64_t o_type, std::optional<torch::Tensor> post_norm, bool unit_offset) {
    TORCH_CHECK(rope >= 0 && mask >= 0, "DecodeStack: rope and mask indices must be >= 0");
    ropes_ = std::max(ropes_, rope + 1), masks_ = std::max(masks_, mask + 1);
    halves_.push_back([=](const torch::Tensor& x, const Step& s) {
      return ggml_attention_block(x, s.ropes[2 * rope], s.ropes[2 * rope + 1], kv_cache,
                                  s.slot_mapping, s.context_slots, s.masks[mask], norm_weight, eps,
                                  qkv, qkv_types, qkv_bias, q_norm, k_norm, qk_eps, interleaved,
                                  num_heads, num_kv_heads, scale, o, o_type, post_norm, unit_offset);
    });
  }

  void add_mlp(torch::Tensor norm_weight, double eps, std::vector<torch::Tensor> gate_up,
               std::vector<int64_t> gate_up_types, torch::Tensor down, int64_t down_type,
               std::optional<torch::Tensor> post_norm, bool unit_offset, int64_t activation) {
    halves_.push_back([=](const torch::Tensor& x, const Step&) {
      return ggml_mlp_block(x, norm_weight, eps, gate_up, gate_up_types, down, down_type,
                            post_norm, unit_offset, activation);
    });
  }

  void add_moe(torch::Tensor norm_weight, double eps, torch::Tensor router,
               torch::Tensor correction_bias, int64_t top_k, int64_t num_groups,
               int64_t topk_groups, bool norm_topk_prob, double scaling,
               std::vector<torch::Tensor> gate, std::vector<torch::Tensor> up,
               std::vector<torch::Tensor> down, std::vector<int64_t> gate_types,
               std::vector<int64_t> up_types, std::vector<int64_t> down_types,
               int64_t num_routed) {
    auto experts = std::make_shared<const MoeExperts>(moe_experts_of(
        gate, up, down, gate_types, up_types, down_types, norm_weight.numel(), num_routed));
    halves_.push_back([=](const torch::Tensor& x, const Step&) {
      return moe_block(x, norm_weight, eps, router, correction_bias, top_k, num_groups,
                       topk_groups, norm_topk_prob, scaling, *experts);
    });
  }

  // x [T, hidden] fp32 through every half; ropes: cos, sin [T, R] of each kind in turn; masks:
  // each kind's bool [T or 1, 1, 1, L] or None -> [T, hidden] fp32
  torch::Tensor run(torch::Tensor x, std::vector<torch::Tensor> ropes, torch::Tensor slot_mapping,
                    torch::Tensor context_slots, std::vector<std::optional<torch::Tensor>> masks) {
    TORCH_CHECK(static_cast<int64_t>(ropes.size()) >= 2 * ropes_ &&
                    static_cast<int64_t>(masks.size()) >= masks_,
                "DecodeStack.run: ", ropes_, " RoPE pairs and ", masks_, " masks expected, got ",
                ropes.size(), " tables and ", masks.size(), " masks");
    const Step step{ropes, slot_mapping, context_slots, masks};
    for (const auto& half : halves_) x = half(x, step);
    return x;
  }

  int64_t num_halves() const { return static_cast<int64_t>(halves_.size()); }

 private:
  struct Step {
    const std::vector<torch::Tensor>& ropes;
    const torch::Tensor& slot_mapping;
    const torch::Tensor& context_slots;
    const std::vector<std::optional<torch::Tensor>>& masks;
  };
  std::vector<std::function<torch::Tensor(const torch::Tensor&, const Step&)>> halves_;
  int64_t ropes_ = 0, masks_ = 0;
};

torch::Tensor ggml_interleave(const torch::Tensor& data, int64_t ggml_type, int64_t in_features,
                              bool inverse) {
  // data: uint8 [N, row_bytes] of a quantized type (N a multiple of 16), the file's order
  // -> the same bytes interleaved (ggml type | X16); inverse: back to the file's order.
  const int64_t base = base_type(ggml_type);
  TORCH_CHECK(has_x16(base), "ggml_interleave: ggml type ", ggml_type, " has no interleaved layout");
  check_rows(data, base | X16, in_features, "ggml_interleave");
  auto out = torch::empty_like(data, at::MemoryFormat::Contiguous);
  const int64_t stride = data.stride(0), num_groups = data.size(0) / GROUP_ROWS;
  uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i = 0; i < GROUP_ROWS; ++i) {
        const int64_t group = g * GROUP_ROWS * stride, row = group + i * stride;
        if (inverse)
          x16_rows(base, src + group, dst + row, i, in_features, false);
        else
          x16_rows(base, dst + group, src + row, i, in_features, true);
      }
  });
  return out;
}

bool ggml_interleaved_kernels() {
#if defined(ZCODE_GGML_AVX512) || defined(ZCODE_GGML_AVX2)
  return true;
#else
  return false;
#endif
}

// Registered with the dispatcher: torch.ops.zcode.ggml_gemv / ggml_dequantize (a fragment of the
// zcode namespace, which gemv.cpp defines too).
TORCH_LIBRARY_FRAGMENT(zcode, m) {
  m.def("ggml_gemv(Tensor x, Tensor[] ws, int[] ggml_types) -> Tensor");
  m.def("ggml_moe(Tensor x, Tensor weights, Tensor expert_ids, Tensor[] gate, Tensor[] up, "
        "Tensor[] down, int[] gate_types, int[] up_types, int[] down_types, int num_routed) "
        "-> Tensor");
  m.def("ggml_dequantize(Tensor data, int ggml_type, int in_features, Tensor? row_ids=None) "
        "-> Tensor");
  m.def("ggml_interleave(Tensor data, int ggml_type, int in_features, bool inverse=False) "
        "-> Tensor");
  m.def("ggml_interleaved_kernels() -> bool");
  m.def("ggml_attention_block(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor context_slots, Tensor? mask, Tensor norm_weight, float eps, "
        "Tensor[] qkv, int[] qkv_types, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "float qk_eps, bool interleaved, int num_heads, int num_kv_heads, float scale, Tensor o, "
        "int o_type, Tensor? post_norm, bool unit_offset) -> Tensor");
  m.def("ggml_mlp_block(Tensor x, Tensor norm_weight, float eps, Tensor[] gate_up, "
        "int[] gate_up_types, Tensor down, int down_type, Tensor? post_norm, bool unit_offset, "
        "int activation) -> Tensor");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_attention", &DecodeStack::add_attention)
      .def("add_mlp", &DecodeStack::add_mlp)
      .def("add_moe", &DecodeStack::add_moe)
      .def("run", &DecodeStack::run)
      .def("num_halves", &DecodeStack::num_halves);
  m.def("ggml_moe_block(Tensor x, Tensor norm_weight, float eps, Tensor router, "
        "Tensor correction_bias, int top_k, int num_groups, int topk_groups, bool norm_topk_prob, "
        "float scaling, Tensor[] gate, "
        "Tensor[] up, Tensor[] down, int[] gate_types, int[] up_types, int[] down_types, "
        "int num_routed) -> Tensor");
}

TORCH_LIBRARY_IMPL(zcode, CPU, m) {
  m.impl("ggml_gemv", &ggml_gemv);
  m.impl("ggml_moe", &ggml_moe);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_interleave", &ggml_interleave);
  m.impl("ggml_attention_block", &ggml_attention_block);
  m.impl("ggml_mlp_block", &ggml_mlp_block);
  m.impl("ggml_moe_block", &ggml_moe_block);
}

TORCH_LIBRARY_IMPL(zcode, CatchAll, m) { m.impl("ggml_interleaved_kernels", &ggml_interleaved_kernels); }
