// The model the fully sharded tests train: a root (input projection and head) around three blocks,
// each a unit; odd widths give padded shards.
#pragma once

#include <torch/nn.h>

#include <memory>
#include <string>
#include <vector>

#include "loom/parallel/fully_shard.h"

namespace loom::test {

struct ShardBlockImpl : torch::nn::Module {
  explicit ShardBlockImpl(int64_t width) {
    up = register_module("up", torch::nn::Linear(width, 2 * width + 1));
    down = register_module("down", torch::nn::Linear(2 * width + 1, width));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::tanh(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(ShardBlock);

// The root holds the input projection and the head; three blocks are units.
struct ShardNetImpl : torch::nn::Module {
  ShardNetImpl() {
    in = register_module("in", torch::nn::Linear(12, 17));
    for (int b = 0; b < 3; ++b) blocks.push_back(register_module("block" + std::to_string(b), ShardBlock(17)));
    head = register_module("head", torch::nn::Linear(17, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  std::vector<ShardBlock> blocks;
};
TORCH_MODULE(ShardNet);

inline std::vector<std::shared_ptr<torch::nn::Module>> units_of(ShardNet& net) {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (auto& b : net->blocks) units.push_back(b.ptr());
  return units;
}

// The model's forward with each block, and the whole, run as units.
inline at::Tensor sharded_forward(FullyShardedDataParallel& fsdp, ShardNet& net, const at::Tensor& x) {
  return fsdp.forward(*net, x, [&](const at::Tensor& x) {
    at::Tensor h = net->in(x);
    for (auto& b : net->blocks) h = fsdp.forward(*b, h, [&](const at::Tensor& h) { return b(h); });
    return net->head(h);
  });
}

}  // namespace loom::test
