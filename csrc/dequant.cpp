// Dequantization of rows (ggml-quants.c layouts): one row for the transposed product, and whole
// slices of rows to float32 for a long prompt's GEMM (dequantize_rows_cpu, parallel over rows; the
// torch twin in runtime/quants.py took ~15% of a 512-token Gemma 3 prefill on its own).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "check.h"
#include "quant_blocks.h"

namespace hs {

namespace {

// the j-th 6-bit scale and min of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int& d, int& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <bool FIVE_BIT, typename B>
void dequant_q45_k(const B* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* q = x[i].qs;
    const float d = fp16_to_float(x[i].d), dmin = fp16_to_float(x[i].dmin);
    int is = 0;
    for (int j = 0; j < QK_K; j += 64, q += 32, is += 2) {
      int sc, m;
      scale_min_k4(is, x[i].scales, sc, m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, x[i].scales, sc, m);
      const float d2 = d * sc, m2 = dmin * m;
      const int shift = j / 32;  // Q5_K: bit `shift` of qh for the low nibbles, shift + 1 for the high
      for (int l = 0; l < 32; ++l) {
        int lo = q[l] & 0xF, hi = q[l] >> 4;
        if constexpr (FIVE_BIT) {
          lo += ((x[i].qh[l] >> shift) & 1) << 4;
          hi += ((x[i].qh[l] >> (shift + 1)) & 1) << 4;
        }
        y[l] = d1 * lo - m1;
        y[l + 32] = d2 * hi - m2;
      }
      y += 64;
    }
  }
}

void dequant_q6_k(const BlockQ6_K* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_float(x[i].d);
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    const int8_t* sc = x[i].scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      // quarter k of the 128: the low (k < 2) or high nibbles of ql[0..32) (k even) or ql[32..64) (k
      // odd) and bits 2k..2k+1 of qh; one scale per 16 (loops of 16 with one scale vectorize)
      for (int k = 0; k < 4; ++k) {
        const uint8_t* src = ql + 32 * (k & 1);
        const int nib = 4 * (k >> 1), hb = 2 * k;
        for (int h = 0; h < 2; ++h) {
          const float s = d * sc[h + 2 * k];
          float* out = y + 32 * k + 16 * h;
          for (int l = 16 * h; l < 16 * h + 16; ++l)
            out[l - 16 * h] = s * static_cast<float>((((src[l] >> nib) & 0xF) | (((qh[l] >> hb) & 3) << 4)) - 32);
        }
      }
    }
  }
}

}  // namespace

constexpr const char* kDequantTypes = "(use F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K)";

static bool dequant_supported(int64_t qtype) {
  switch (qtype) {
    case F16: case BF16: case Q4_0: case Q5_0: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}

// compiled for AVX2 and for the baseline, picked at load time (the loops vectorize with AVX2: 2-4x)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HS_CLONES
#endif

HS_CLONES void dequant_row(const uint8_t* row, int64_t qtype, int64_t K, float* out) {
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
    case Q4_K:
      dequant_q45_k<false>(reinterpret_cast<const BlockQ4_K*>(row), K / QK_K, out);
      return;
    case Q5_K:
      dequant_q45_k<true>(reinterpret_cast<const BlockQ5_K*>(row), K / QK_K, out);
      return;
    case Q6_K:
      dequant_q6_k(reinterpret_cast<const BlockQ6_K*>(row), K / QK_K, out);
      return;
    default:
      HS_CHECK(false, "dequantize: weight type id ", qtype, " is not supported ", kDequantTypes);
  }
}

// w: uint8 [rows, row_bytes] in a block format (or float16/bfloat16 [rows, K]) -> float32 [rows, K]
// out: optional float32 storage of at least rows * K elements to write into (a reused buffer: a fresh
// one of a few MB is an mmap whose page faults cost as much as the dequantization)
at::Tensor dequantize_rows_cpu(const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& out_buf) {
  HS_CHECK(w.device().is_cpu() && w.dim() == 2, "dequantize: w must be a 2-D CPU tensor");
  HS_CHECK(dequant_supported(qtype), "dequantize: weight type id ", qtype, " is not supported ", kDequantTypes);
  const int64_t bb = block_bytes(qtype), be = block_elems(qtype);
  const int64_t row_bytes = w.size(1) * w.element_size();
  HS_CHECK(row_bytes % bb == 0, "dequantize: a row of ", row_bytes, " bytes is not a whole number of blocks of ",
           bb, " bytes for weight type id ", qtype);
  HS_CHECK(w.stride(1) == 1 && w.stride(0) * w.element_size() == row_bytes || w.size(0) <= 1,
           "dequantize: w must have contiguous rows");
  const int64_t rows = w.size(0), K = row_bytes / bb * be;
  at::Tensor out;
  if (out_buf.has_value() && out_buf->defined()) {
    HS_CHECK(out_buf->scalar_type() == at::kFloat && out_buf->is_contiguous() && out_buf->device().is_cpu() &&
                 out_buf->numel() >= rows * K, "dequantize: out must be a contiguous float32 CPU tensor of at least ",
             rows * K, " elements");
    out = out_buf->view(-1).narrow(0, 0, rows * K).view({rows, K});
  } else {
    out = at::empty({rows, K}, at::kFloat);
  }
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(wp + r * row_bytes, qtype, K, op + r * K);
  });
  return out;
}

}  // namespace hs
