#include "loom/train/accumulation.h"

#include "loom/error.h"

namespace loom {

GradientAccumulator::GradientAccumulator(GradientReducer& reducer, size_t micro_batches)
    : reducer_(reducer), micro_batches_(micro_batches) {
  if (micro_batches == 0)
    throw InvalidArgumentError(reducer.group().context("GradientAccumulator")("micro_batches must be at least 1, found 0"));
}

void GradientAccumulator::set_position(size_t position) {
  if (position >= micro_batches_)
    throw InvalidArgumentError(reducer_.group().context("GradientAccumulator")(
        "position must be below micro_batches " + std::to_string(micro_batches_) + "; found " + std::to_string(position)));
  position_ = position;
}

GradientAccumulator::MicroBatch GradientAccumulator::next() {
  const bool last = position_ + 1 == micro_batches_;
  position_ = last ? 0 : position_ + 1;
  return MicroBatch(reducer_, last);
}

GradientAccumulator::MicroBatch::MicroBatch(GradientReducer& reducer, bool last)
    : reducer_(&reducer), last_(last), previous_(reducer.sync_enabled()) {
  reducer.set_sync(last);
}

GradientAccumulator::MicroBatch::~MicroBatch() {
  if (reducer_) reducer_->set_sync(previous_);
}

GradientAccumulator::MicroBatch::MicroBatch(MicroBatch&& other) noexcept
    : reducer_(other.reducer_), last_(other.last_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

}  // namespace loom
