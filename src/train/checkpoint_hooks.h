// Test seams of the checkpointer (library-internal; tests include src/).
#pragma once

#include <cstdint>
#include <functional>

namespace loom::detail::ckpt {

struct TestHooks {
  // Called on the thread that runs each step of a save: "snapshot", "write", "fsync", "agree",
  // "manifest", "rename", "latest", "rotate", "done". The crash test records where SIGKILL lands.
  std::function<void(const char* phase)> on_phase;
  // When >= 0, this rank's shard write fails (as a full disk would) for the next saves.
  int fail_write_rank = -1;
  // When > 0, the largest manifest a save publishes (instead of kMaxManifestBytes): a test of the
  // bound without building a 256 MB manifest.
  uint64_t max_manifest_bytes = 0;
};

TestHooks& test_hooks();

inline void phase(const char* name) {
  auto& hooks = test_hooks();
  if (hooks.on_phase) hooks.on_phase(name);
}

}  // namespace loom::detail::ckpt
