// The MLP the data-parallel benchmarks train (ddp_bench, zero_bench): Linear+ReLU x layers, then a
// Linear to the classes; the same weights for every call with a seed.
#pragma once

#include <torch/torch.h>

namespace loom::bench {

struct MlpShape {
  int64_t input = 1024;
  int64_t hidden = 1024;
  int64_t layers = 4;
  int64_t classes = 10;
};

inline torch::nn::Sequential make_mlp(const MlpShape& shape, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net;
  int64_t in = shape.input;
  for (int64_t l = 0; l < shape.layers; ++l) {
    net->push_back(torch::nn::Linear(in, shape.hidden));
    net->push_back(torch::nn::ReLU());
    in = shape.hidden;
  }
  net->push_back(torch::nn::Linear(in, shape.classes));
  return net;
}

}  // namespace loom::bench
