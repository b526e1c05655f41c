// Crash safety of checkpoint saves: SIGKILL a writer at random moments, many times, and check
// every time that the newest complete checkpoint loads and equals what was saved at its step.
//
// The parent forks a writer process per round (it never touches torch itself, so forking is
// safe, and a round costs milliseconds instead of a program start). Each writer first verifies
// the directory: the checkpoint find_latest() names must load without error, be at least as new
// as the last save the previous writer saw published, and hold exactly the state of its step
// (every value is a function of the step). Then it saves step after step (asynchronously, keeping
// 3, changing the weights while the writer thread works) until the parent kills it. Every other
// kill comes a random delay after the writer started saving; the others aim at one step of a save
// in turn (the parent waits until the writer enters it, from the checkpointer's phase hook in
// shared memory, then kills within 200 us), so that every step is hit whatever the disk's speed:
// the shard being written, its fsync, the manifest, the rename, the latest pointer, rotation. The
// run fails unless the kills landed in each of them. A last writer verifies, saves once more, and
// checks that no temporary or half-deleted directory is left.
//
//   loom_checkpoint_crash --dir /tmp/crash --kills 60 --seed 1
#include <ATen/ATen.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <torch/nn.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/error.h"
#include "loom/train/checkpoint.h"
#include "train/checkpoint_hooks.h"

namespace {

const char* const kPhases[] = {"(none)",   "snapshot", "write",  "fsync",  "agree",
                               "manifest", "rename",   "latest", "rotate", "done"};
constexpr int kPhaseCount = sizeof(kPhases) / sizeof(kPhases[0]);

struct Shared {
  std::atomic<int> phase;
  std::atomic<int64_t> entered[kPhaseCount];  // how often each phase was entered
  std::atomic<int> ready;                     // the writer has verified the directory and is saving
  std::atomic<int64_t> published;             // the last step whose save() + wait() returned
  std::atomic<int64_t> saves;                 // completed saves, all writers together
  std::atomic<int64_t> verified_step;         // what the last verification loaded
  char error[2048];
};

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    // ~4 MB: long enough in the page cache (a few ms) for kills to land inside the shard's write.
    a = register_module("a", torch::nn::Linear(1024, 768));
    b = register_module("b", torch::nn::Linear(768, 512));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Model);

// The state saved at `step`: every value is a function of the step alone.
void set_state(Model& model, at::Tensor& extra, int64_t step) {
  at::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : model->parameters()) {
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat).reshape(p.sizes()) * 0.001 + double(step) + i));
    ++i;
  }
  extra.fill_(step);
}

bool holds_state(Model& model, at::Tensor& extra, int64_t step) {
  Model expected;
  at::Tensor expected_extra = at::zeros_like(extra);
  set_state(expected, expected_extra, step);
  auto got = model->parameters(), want = expected->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    if (!at::equal(got[i], want[i])) return false;
  return at::equal(extra, expected_extra);
}

[[noreturn]] void fail(Shared& shared, const std::string& message) {
  std::snprintf(shared.error, sizeof(shared.error), "%s", message.c_str());
  std::fprintf(stderr, "writer %d: %s\n", ::getpid(), message.c_str());
  std::_Exit(2);
}

// Returns the step loaded (0: none yet).
int64_t verify(const std::string& dir, Shared& shared, Model& model, at::Tensor& extra) {
  loom::Checkpointer checkpointer(nullptr, {.directory = dir});
  checkpointer.model(model).tensor("extra", extra);
  std::optional<loom::CheckpointInfo> info;
  try {
    info = checkpointer.load_latest();
  } catch (const loom::Error& e) {
    fail(shared, std::string("the newest complete checkpoint does not load: ") + e.what());
  }
  const int64_t published = shared.published.load();
  if (!info) {
    if (published > 0) fail(shared, "no checkpoint found, but step " + std::to_string(published) + " was published");
    return 0;
  }
  const int64_t step = info->progress.step;
  if (step < published)
    fail(shared,
         "loaded step " + std::to_string(step) + " but step " + std::to_string(published) + " had been published");
  auto recorded = info->user.find("step");
  if (recorded == info->user.end() || recorded->second != std::to_string(step) || !holds_state(model, extra, step))
    fail(shared, "the checkpoint of step " + std::to_string(step) + " (" + info->path +
                     ") does not hold the state saved at that step");
  shared.verified_step = step;
  return step;
}

[[noreturn]] void writer(const std::string& dir, Shared& shared, bool last) {
  at::set_num_threads(1);
  loom::detail::ckpt::test_hooks().on_phase = [&shared](const char* phase) {
    for (int i = 0; i < kPhaseCount; ++i) {
      if (std::strcmp(phase, kPhases[i]) == 0) {
        shared.phase = i;
        ++shared.entered[i];
      }
    }
  };
  Model model;
  at::Tensor extra = at::zeros({1000});
  int64_t step = verify(dir, shared, model, extra);
  loom::Checkpointer checkpointer(nullptr, {.directory = dir, .keep_last = 3});
  checkpointer.model(model).tensor("extra", extra);
  shared.ready = 1;
  for (;;) {
    ++step;
    set_state(model, extra, step);
    checkpointer.save({.step = step}, {{"step", std::to_string(step)}});
    {
      at::NoGradGuard no_grad;  // training goes on while the shard is written
      for (auto& p : model->parameters()) p.add_(1.0);
    }
    try {
      checkpointer.wait();
    } catch (const loom::Error& e) {
      fail(shared, std::string("save failed: ") + e.what());
    }
    shared.published = step;
    ++shared.saves;
    if (last) break;
  }
  // The last writer: after a clean save, only complete checkpoints and the pointer remain.
  int checkpoints = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name == "latest") continue;
    if (name.rfind("step_", 0) != 0 || !std::filesystem::exists(entry.path() / "manifest.json"))
      fail(shared, "left behind after a clean save: " + entry.path().string());
    ++checkpoints;
  }
  if (checkpoints > 3) fail(shared, std::to_string(checkpoints) + " checkpoints kept; keep_last is 3");
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/loom_checkpoint_crash";
  int kills = 60;
  unsigned seed = 1;
  int max_delay_us = 100000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--dir")
      dir = argv[i + 1];
    else if (key == "--kills")
      kills = std::atoi(argv[i + 1]);
    else if (key == "--seed")
      seed = static_cast<unsigned>(std::atoi(argv[i + 1]));
    else if (key == "--max-delay-us")
      max_delay_us = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--dir D] [--kills N] [--seed S] [--max-delay-us U]\n", argv[0]);
      return 2;
    }
  }
  std::filesystem::remove_all(dir);
  auto* shared =
      static_cast<Shared*>(::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) return 2;
  new (shared) Shared{};
  shared->published = 0;
  std::mt19937 rng(seed);
  std::map<int, int> landed;
  const auto start = std::chrono::steady_clock::now();

  // The phases a targeted kill aims at, in turn.
  const std::vector<int> targets = {2, 3, 5, 6, 7, 8, 1};  // write fsync manifest rename latest rotate snapshot
  auto run = [&](bool last, bool kill, int target) -> bool {
    shared->ready = 0;
    shared->phase = 0;
    const pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) writer(dir, *shared, last);
    int status = 0;
    if (kill) {
      while (!shared->ready) {
        if (::waitpid(pid, &status, WNOHANG) == pid) {
          std::fprintf(stderr, "FAIL: writer ended before saving: %s\n", shared->error);
          return false;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (target > 0) {
        const int64_t before = shared->entered[target];
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (shared->entered[target] == before) {
          if (std::chrono::steady_clock::now() > give_up || ::waitpid(pid, &status, WNOHANG) == pid) {
            std::fprintf(stderr, "FAIL: the writer never entered phase %s: %s\n", kPhases[target], shared->error);
            ::kill(pid, SIGKILL);
            return false;
          }
        }
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % max_delay_us));
      }
      const int phase = shared->phase;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      if (!WIFSIGNALED(status)) {
        std::fprintf(stderr, "FAIL: writer exited with status %d before the kill: %s\n", WEXITSTATUS(status),
                     shared->error);
        return false;
      }
      ++landed[phase];
      return true;
    }
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "FAIL: final writer: %s\n", shared->error);
      return false;
    }
    return true;
  };

  for (int k = 0; k < kills; ++k)
    if (!run(false, true, k % 2 ? targets[(k / 2) % targets.size()] : 0)) return 1;
  // A busy machine can make short phases slip past the aim: aim again at those not hit yet.
  const std::vector<int> required = {2, 3, 5, 6, 7, 8};
  for (int extra = 0; extra < 60; ++extra) {
    int missing = -1;
    for (int phase : required)
      if (!landed.count(phase)) missing = phase;
    if (missing < 0) break;
    if (!run(false, true, missing)) return 1;
    ++kills;
  }
  if (!run(true, false, 0)) return 1;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::printf("%d writers killed, %lld saves published, newest step %lld verified, %.1f s\n", kills,
              static_cast<long long>(shared->saves.load()), static_cast<long long>(shared->verified_step.load()),
              seconds);
  std::printf("where the kills landed (the last phase a save had reached):");
  for (const auto& [phase, count] : landed) std::printf(" %s=%d", kPhases[phase], count);
  std::printf("\n");
  // The kills must have hit every step of the save, not only the gaps between saves.
  std::string missed;
  for (int phase : required)
    if (!landed.count(phase)) missed += std::string(" ") + kPhases[phase];
  if (!missed.empty()) {
    std::printf("FAIL: no kill landed in:%s\n", missed.c_str());
    return 1;
  }
  std::printf("OK\n");
  std::filesystem::remove_all(dir);
  return 0;
}
