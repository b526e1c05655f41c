// Uses the installed library: an all_reduce and one data-parallel step over every rank.
#include <cstdio>
#include <torch/nn/modules/linear.h>

#include "loom/loom.h"

int main() {
  try {
    auto rt = loom::init();
    auto comm = rt->world_comm();
    at::Tensor t = at::full({4}, comm->rank() + 1.0);
    comm->all_reduce(t)->wait();
    torch::nn::Linear model(3, 2);
    loom::DistributedDataParallel<torch::nn::Linear> ddp(model, comm);
    ddp.forward(at::ones({2, 3})).sum().backward();
    const int n = comm->size();
    const bool ok = t[0].item<double>() == n * (n + 1) / 2.0 && model->weight.grad().defined();
    std::printf("consumer rank %d: %s\n", comm->rank(), ok ? "ok" : "WRONG");
    loom::finalize();
    return ok ? 0 : 1;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
