#include "loom/amp/autocast.h"

#include <ATen/autocast_mode.h>

#include "loom/error.h"

namespace loom {

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled)
    : device_(device),
      previous_enabled_(at::autocast::is_autocast_enabled(device)),
      previous_dtype_(at::autocast::get_autocast_dtype(device)) {
  if (device == c10::DeviceType::CPU && dtype != c10::ScalarType::BFloat16 && dtype != c10::ScalarType::Half)
    throw InvalidArgumentError(std::string("AutocastGuard: CPU autocast runs in bfloat16 or float16, found ") +
                               c10::toString(dtype));
  if (device == c10::DeviceType::CUDA && dtype != c10::ScalarType::BFloat16 && dtype != c10::ScalarType::Half)
    throw InvalidArgumentError(std::string("AutocastGuard: CUDA autocast runs in float16 or bfloat16, found ") +
                               c10::toString(dtype));
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // The cache holds casts of the weights made inside the region; it must not outlive it.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
}

}  // namespace loom
