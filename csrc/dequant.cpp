// Scalar dequantization of one row (ggml-quants.c layouts), used by the transposed product.
#include <c10/util/Exception.h>

#include "quant_blocks.h"

namespace hs {

void dequant_row(const uint8_t* row, int64_t qtype, int64_t K, float* out) {
  switch (qtype) {
    case F16: {
      const c10::Half* w = reinterpret_cast<const c10::Half*>(row);
      for (int64_t i = 0; i < K; ++i) out[i] = static_cast<float>(w[i]);
      return;
    }
    case BF16: {
      const c10::BFloat16* w = reinterpret_cast<const c10::BFloat16*>(row);
      for (int64_t i = 0; i < K; ++i) out[i] = static_cast<float>(w[i]);
      return;
    }
    case Q4_0: {
      const BlockQ4_0* w = reinterpret_cast<const BlockQ4_0*>(row);
      for (int64_t b = 0; b < K / QK; ++b, out += QK) {
        const float d = fp16_to_float(w[b].d);
        for (int i = 0; i < 16; ++i) {
          out[i] = ((w[b].qs[i] & 0xF) - 8) * d;
          out[i + 16] = ((w[b].qs[i] >> 4) - 8) * d;
        }
      }
      return;
    }
    case Q5_0: {
      const BlockQ5_0* w = reinterpret_cast<const BlockQ5_0*>(row);
      for (int64_t b = 0; b < K / QK; ++b, out += QK) {
        const float d = fp16_to_float(w[b].d);
        uint32_t qh; std::memcpy(&qh, w[b].qh, 4);
        for (int i = 0; i < 16; ++i) {
          out[i] = (static_cast<int>((w[b].qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - 16) * d;
          out[i + 16] = (static_cast<int>((w[b].qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16) * d;
        }
      }
      return;
    }
    case Q8_0: {
      const BlockQ8_0* w = reinterpret_cast<const BlockQ8_0*>(row);
      for (int64_t b = 0; b < K / QK; ++b, out += QK) {
        const float d = fp16_to_float(w[b].d);
        for (int i = 0; i < QK; ++i) out[i] = w[b].qs[i] * d;
      }
      return;
    }
    default:
      TORCH_CHECK(false, "qmatmul_t: weight type id ", qtype, " is not supported for transposed rows "
                  "(use F16, BF16, Q4_0, Q5_0 or Q8_0)");
  }
}

}  // namespace hs
