// The C++ side of the cross-language data-position check (tests/python/test_checkpoint_state.py):
// the docs' example provider (examples/data_position.h) saving or loading a loader's position in
// one process, so that Python can load what C++ saved and the other way round.
//   data_position_tool save DIR        a loader (10 samples, seed 5) after 13 samples, saved as step 13
//   data_position_tool load DIR N      a loader (10 samples, seed 99) loaded from DIR: prints its epoch,
//                                      its position and its next N samples
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "data_position.h"
#include "loom/error.h"
#include "loom/train/checkpoint.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 2 ? argv[1] : "";
  if (mode != "save" && mode != "load") {
    std::fprintf(stderr, "usage: data_position_tool save DIR | load DIR N\n");
    return 2;
  }
  try {
    if (mode == "save") {
      ShuffledOrder loader(10, 5);
      for (int i = 0; i < 13; ++i) loader.next();
      loom::Checkpointer ckpt(nullptr, {.directory = argv[2], .async = false});
      ckpt.state("data", std::make_shared<DataPosition>(loader));
      ckpt.save({.step = 13});
      return 0;
    }
    ShuffledOrder loader(10, 99);
    loom::Checkpointer ckpt(nullptr, {.directory = argv[2]});
    ckpt.state("data", std::make_shared<DataPosition>(loader));
    if (!ckpt.load_latest()) throw loom::CheckpointError("no checkpoint in " + std::string(argv[2]));
    std::printf("%lld %lld", (long long)loader.epoch(), (long long)loader.position());
    for (int i = 0, n = argc > 3 ? std::atoi(argv[3]) : 0; i < n; ++i) std::printf(" %lld", (long long)loader.next());
    std::printf("\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_position_tool: %s\n", e.what());
    return 1;
  }
}
