// A kind of checkpoint state of the user's own, in one file: a data loader's position.
//
// ShuffledOrder hands out sample indices in a shuffled order, reshuffling each epoch. Its position
// (the seed of its shuffles, the epoch, how far into it, the epoch's order itself) is what a resumed run needs to see the
// samples it has not seen yet, in the same order an uninterrupted run would. DataPosition is the
// loom::checkpoint::StateProvider that saves it: a "data" section in the manifest and the order as
// the tensor "data/order" (saved once, however many ranks hold it). Registering it is one line:
//
//   ShuffledOrder loader(samples, seed);
//   ckpt.state("data", std::make_shared<DataPosition>(loader));
//
// A load refuses (and changes nothing) when the checkpoint has no data position, was taken over
// another number of samples, or holds an order that is not a permutation of them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/train/checkpoint_state.h"

class ShuffledOrder {
 public:
  ShuffledOrder(int64_t samples, uint64_t seed) : samples_(samples), seed_(seed) { shuffle(); }

  // The next sample's index; after the last of an epoch, the first of the next (reshuffled).
  int64_t next() {
    if (position_ == samples_) {
      ++epoch_;
      position_ = 0;
      shuffle();
    }
    return order_[position_++].item<int64_t>();
  }
  int64_t samples() const { return samples_; }
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }
  const at::Tensor& order() const { return order_; }

  uint64_t seed() const { return seed_; }

  // Where a checkpoint says the loader was (the seed decides the later epochs' orders).
  void restore(uint64_t seed, int64_t epoch, int64_t position, const at::Tensor& order) {
    seed_ = seed;
    epoch_ = epoch;
    position_ = position;
    order_.copy_(order);
  }

 private:
  void shuffle() {
    at::Generator generator = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    order_ = at::randperm(samples_, generator, at::kLong);
  }

  int64_t samples_;
  uint64_t seed_;
  int64_t epoch_ = 0, position_ = 0;
  at::Tensor order_;
};

class DataPosition final : public loom::checkpoint::StateProvider {
 public:
  explicit DataPosition(ShuffledOrder& loader) : loader_(loader) {}

  void collect(int /*rank*/, loom::checkpoint::SaveState& out) override {
    out.sections["data"] = nlohmann::json({{"seed", loader_.seed()},
                                           {"epoch", loader_.epoch()},
                                           {"position", loader_.position()},
                                           {"samples", loader_.samples()}})
                               .dump();
    out.tensors.push_back(loom::checkpoint::describe_slice("data/order", loader_.order(), -1, {}, 0));
  }

  // Nothing live changes here: what is wrong goes to `problems`, the position is kept for apply.
  void plan(const loom::checkpoint::LoadContext& context, std::vector<loom::checkpoint::Need>& needs,
            std::vector<std::string>& problems) override {
    const std::string text = context.section("data");
    if (text.empty()) return problems.push_back("the checkpoint holds no data position (section \"data\")");
    const nlohmann::json saved = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    for (const char* key : {"seed", "epoch", "position", "samples"})
      if (!saved.is_object() || !saved.contains(key) || !saved[key].is_number_unsigned())
        return problems.push_back("data position: \"" + std::string(key) + "\" is missing or not a count in " + text);
    seed_ = saved["seed"].get<uint64_t>();
    epoch_ = saved["epoch"].get<int64_t>();
    position_ = saved["position"].get<int64_t>();
    if (saved["samples"].get<int64_t>() != loader_.samples())
      return problems.push_back("data position: saved over " + saved["samples"].dump() + " samples; the loader has " +
                                std::to_string(loader_.samples()));
    if (position_ > loader_.samples())
      return problems.push_back("data position: position " + std::to_string(position_) + " is past the epoch's " +
                                std::to_string(loader_.samples()) + " samples");
    const loom::checkpoint::TensorRecord* record = context.record("data/order");
    if (record == nullptr) return problems.push_back("data position: the checkpoint holds no data/order");
    if (auto mismatch = loom::checkpoint::need_for(*context.live.find("data/order"), *record, needs))
      problems.push_back("data position: " + *mismatch);
  }

  void verify(const loom::checkpoint::LoadContext& /*context*/, const loom::checkpoint::LoadedTensors& data,
              std::vector<std::string>& problems) override {
    const at::Tensor& order = data.at("data/order");
    if (!at::equal(std::get<0>(order.sort()), at::arange(loader_.samples(), at::kLong)))
      problems.push_back("data position: data/order is not a permutation of the " +
                         std::to_string(loader_.samples()) + " samples");
  }

  void apply(const loom::checkpoint::LoadContext& /*context*/, const loom::checkpoint::LoadedTensors& data) override {
    loader_.restore(seed_, epoch_, position_, data.at("data/order"));
  }

 private:
  ShuffledOrder& loader_;
  uint64_t seed_ = 0;  // from plan
  int64_t epoch_ = 0, position_ = 0;
};
