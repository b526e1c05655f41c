// Gradient accumulation: k micro-batches, one all-reduce, the same update as one step on the
// k-times larger batch.
//
//   loom::GradientAccumulator accumulate(ddp.reducer(), /*micro_batches=*/4);
//   for (auto& micro : batch.split(4)) {
//     auto step = accumulate.next();                   // no_sync for all but the last
//     auto loss = loss_fn(ddp.forward(micro)) / accumulate.micro_batches();
//     loss.backward();
//   }
//   opt.step();                                        // after the last micro-batch
//
// Forward may run anywhere: whether a backward communicates is decided when its gradients are
// produced, not when forward ran.
#pragma once

#include <cstddef>

#include "loom/parallel/data_parallel.h"

namespace loom {

class GradientAccumulator {
 public:
  GradientAccumulator(GradientReducer& reducer, size_t micro_batches);

  // Scope of one micro-batch's backward: reductions are off unless it is the last one.
  class MicroBatch {
   public:
    MicroBatch(GradientReducer& reducer, bool last);
    ~MicroBatch();
    MicroBatch(MicroBatch&& other) noexcept;
    MicroBatch(const MicroBatch&) = delete;
    bool is_last() const { return last_; }

   private:
    GradientReducer* reducer_;
    bool last_;
    bool previous_;
  };

  // The next micro-batch; after the last one the count starts again.
  [[nodiscard]] MicroBatch next();
  size_t micro_batches() const { return micro_batches_; }
  // Micro-batches begun in the current accumulation window.
  size_t position() const { return position_; }
  // Restores a position (a resumed checkpoint): the next micro-batch is number `position` of the
  // window. loom::InvalidArgumentError unless position < micro_batches().
  void set_position(size_t position);

 private:
  GradientReducer& reducer_;
  size_t micro_batches_;
  size_t position_ = 0;
};

}  // namespace loom
