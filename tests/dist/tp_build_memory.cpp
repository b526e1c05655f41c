// Peak host memory of building a GPT-shaped stack of tensor-parallel layers (a large vocabulary-
// parallel embedding, transformer blocks, a column-parallel head), as each rank sees it: the rise of
// VmHWM (the resident high-water mark) across construction. check_tp_memory.py runs it at TP 1 and
// TP 2 and compares; --master builds with the master-weight initialisation instead of the sharded one.
//
//   mpirun -np 2 tp_build_memory [--master]    -> "rank 0 build peak MB 123.4" per rank
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "loom/loom.h"

namespace {

// VmHWM of /proc/self/status, in bytes.
double high_water_mark() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool master = argc > 1 && std::string(argv[1]) == "--master";
  torch::set_num_threads(1);
  auto rt = loom::init();
  auto world = rt->world_comm();
  loom::ParallelState ps(world, world->size());
  ps.seed(5);
  loom::ParallelInit init;
  if (master) init.mode = loom::ParallelInit::Mode::Master;
  const int64_t vocab = 32768, hidden = 1024;

  const double before = high_water_mark();
  {
    torch::nn::Sequential model;
    loom::VocabParallelEmbeddingOptions embedding;
    embedding.initialization = init;
    model->push_back(loom::VocabParallelEmbedding(vocab, hidden, ps.tp_group(), embedding));
    for (int l = 0; l < 2; ++l) {
      loom::ParallelTransformerBlockOptions block;
      block.initialization = init;
      model->push_back(loom::ParallelTransformerBlock(hidden, 8, ps.tp_group(), block));
    }
    loom::ColumnParallelLinearOptions head;
    head.bias = false;
    head.initialization = init;
    model->push_back(loom::ColumnParallelLinear(hidden, vocab, ps.tp_group(), head));
    const double peak = high_water_mark() - before;
    std::printf("rank %d build peak MB %.1f\n", world->rank(), peak / 1e6);
    std::fflush(stdout);
  }
  rt.reset();
  loom::finalize();
  return 0;
}
