// Byte counts beyond what one MPI int count holds. MPI counts are int: a message above 2 GiB
// cannot be described as bytes (MPI_Get_count(MPI_BYTE) is MPI_UNDEFINED for it), yet the MPI
// backend sends tensors of up to INT_MAX elements, i.e. up to 16 GiB. Sizes are therefore read
// with MPI_Get_elements_x (64-bit), and a message is received as `count` units of `unit` bytes.
// Pure arithmetic, so it is unit-tested without MPI.
#pragma once

#include <climits>
#include <cstdint>

namespace loom::detail {

struct ByteUnits {
  int64_t unit = 1;  // bytes per unit: the smallest power of two that keeps count within int
  int count = 0;     // units; count * unit >= the bytes, by less than one unit
};

inline ByteUnits byte_units(int64_t bytes) {
  ByteUnits u;
  if (bytes <= 0) return u;
  while ((bytes - 1) / u.unit + 1 > INT_MAX) u.unit *= 2;
  u.count = static_cast<int>((bytes - 1) / u.unit + 1);
  return u;
}

}  // namespace loom::detail
