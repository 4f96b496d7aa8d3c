// GGML block layouts (ggml-common.h) and the 8-bit activation blocks the CPU dot products use.
#pragma once
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace hs {

// ggml type ids (gguf.GGMLQuantizationType)
enum QType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int QK = 32;    // elements per block of the 32-element formats
constexpr int QK_K = 256; // elements per K-quant super-block

#pragma pack(push, 1)
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ8_0) == 34, "block size");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "block size");

// Activations as two 8-bit planes per block with one scale: x ~= d * (128 * qs[0] + qs[1]). The
// second plane quantizes what the first leaves (|rest| <= 64 steps of d), about 15 bits in all, so
// the integer dot products match an fp32 reference token for token; a single 8-bit plane (llama.cpp's
// Q8) flips top-1 tokens of Gemma 3. Combining the planes in int32 keeps one float FMA per block.
constexpr int PLANES = 2;
constexpr int PLANE_SHIFT = 128;
// dsum: d times the sum of 128 * qs[0] + qs[1] over the block, for the offset term of Q4_0/Q5_0:
// one scalar multiply and conversion per block and token fewer than d and an integer sum, and on
// Zen 4 scalar work shares the vector pipes (Q5_0 rows x 64 tokens, one thread: 22.1 -> 24.3 GMAC/s)
struct ActQ8 { float d; int8_t qs[PLANES][QK]; float dsum; };
// Per super-block of 256 (for K-quant weights), with combined sums per 16 for the min/offset terms.
struct ActQ8K { float d; int8_t qs[PLANES][QK_K]; int32_t bsums[QK_K / 16]; };

inline float fp16_to_float(uint16_t h) {
  c10::Half v; std::memcpy(&v, &h, 2); return static_cast<float>(v);
}

inline int block_elems(int64_t qtype) {
  switch (qtype) {
    case Q4_0: case Q5_0: case Q8_0: return QK;
    case Q4_K: case Q5_K: case Q6_K: return QK_K;
    default: return 1;
  }
}

inline int block_bytes(int64_t qtype) {
  switch (qtype) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return sizeof(BlockQ4_0);
    case Q5_0: return sizeof(BlockQ5_0);
    case Q8_0: return sizeof(BlockQ8_0);
    case Q4_K: return sizeof(BlockQ4_K);
    case Q5_K: return sizeof(BlockQ5_K);
    case Q6_K: return sizeof(BlockQ6_K);
    default: return 0;
  }
}

}  // namespace hs
