// The packed layout of group-quantized weights (`kvpool.kernels.quant_matmul.pack` writes it),
// as the kernels that read it see it: rows in panels of 16 (N padded with zero rows), each
// panel a run of groups, each group one block of its codes followed by its float16 scales and
// mins:
//   block(p, g) = codes | scales[16] | mins[16]      G·16·bits/8 + 64 bytes
//   codes, 8-bit: [k/4][n%16][k%4]  (k within the group)
//   codes, 4-bit: [k/8][j], j = (n%16)·4 + k%4: the low nibble holds k/8·8 + k%4, the high
//                 nibble k/8·8 + 4 + k%4
// A weight is code · scale + min.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvpool_quant {

constexpr int64_t kPanel = 16;  // rows a panel

struct PackedLayout {
  const uint8_t* data;
  int64_t cols, group, rows;  // K, G, N (unpadded)
  int64_t code_bytes;         // a block's codes: G·16·bits/8
  int64_t groups() const { return cols / group; }
  int64_t panels() const { return (rows + kPanel - 1) / kPanel; }
  int64_t block_bytes() const { return code_bytes + 4 * kPanel; }
  const uint8_t* block(int64_t panel, int64_t g) const {
    return data + (panel * groups() + g) * block_bytes();
  }
};

// The layout of `data`, `rows` weights of `cols` in `bits`-bit codes and groups of `group`, for
// activations `x` [M, cols]; refuses what the kernels cannot read.
inline PackedLayout checked_layout(const at::Tensor& x, const at::Tensor& data, int64_t bits,
                                   int64_t group, int64_t rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D, contiguous in its last dimension");
  const int64_t cols = x.size(1);
  TORCH_CHECK(group % 8 == 0 && cols % group == 0, "the group must be a multiple of 8 dividing K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(), "data must be uint8");
  const PackedLayout w{data.data_ptr<uint8_t>(), cols, group, rows, group * kPanel * bits / 8};
  TORCH_CHECK(data.numel() == w.panels() * w.groups() * w.block_bytes(), "data does not hold ",
              rows, " rows of ", cols, " ", bits, "-bit codes in groups of ", group);
  return w;
}

// The code of row `lane` at k (within the group) in a block.
template <int Bits>
inline int code_at(const uint8_t* block, int64_t lane, int64_t k) {
  if constexpr (Bits == 4) {
    const uint8_t byte = block[(k / 8) * 64 + lane * 4 + k % 4];
    return (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
  } else {
    return block[(k / 4) * 64 + lane * 4 + k % 4];
  }
}

// The float16 at `lane` of the 16 that start at `at` (a block's scales or mins).
inline float half_at(const uint8_t* at, int64_t lane) {
  at::Half value;
  std::memcpy(&value, at + 2 * lane, sizeof(value));
  return static_cast<float>(value);
}

}  // namespace kvpool_quant
