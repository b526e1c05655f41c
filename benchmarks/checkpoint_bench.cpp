// How fast are loom::Checkpointer's saves and loads, against what the disk and memory allow and
// against torch::save / torch::load? One process (world size 1, one shard), one intra-op thread,
// a model of three Linear layers (~25M float32 parameters, 100 MB) with Adam state (200 MB more),
// measured in rounds that interleave every variant (the machine's speed drifts between runs;
// medians of the rounds are reported):
//
//   save (durable)     Checkpointer::save, synchronous: shard written, checksummed and fsync'ed,
//                      manifest, rename, fsync of the directories, latest pointer
//   write+fdatasync    the same number of bytes written to one file of the same directory in 8 MB
//                      write() calls, then fdatasync (what `dd ... conv=fdatasync` measures)
//   torch::save        the same tensors (a std::vector<at::Tensor>) with torch::save, then fsync
//                      (durable, like ours) — and without the fsync, for information
//   load (cold)        Checkpointer::load, the checkpoint's files evicted from the page cache first
//                      (posix_fadvise DONTNEED): verify every checksum, copy into model and optimizer.
//                      It returns before the memory it replaced (the old Adam state, the data read)
//                      is unmapped on a thread of its own; an info row adds that (wait() joins it,
//                      untimed before the next variant starts, so it never overlaps another's timing)
//   read()             the same files read into memory, evicted first too: into one buffer reused
//                      every round (the disk's bandwidth, the target's reference) and, for
//                      information, into memory allocated for that read (at::empty, freed untimed):
//                      a load must put its data in memory nothing else uses yet, whose first touch
//                      costs a page fault and a zeroed page per 4 KiB
//   new memory         memory of the state's size allocated and its pages faulted in the cheapest
//                      way (MADV_POPULATE_WRITE, all at once; a memset where the kernel lacks it), no
//                      disk: what those page faults alone cost on this machine (information: the
//                      floor beside read() of a load that cannot write into live memory before its
//                      verdict)
//   torch::load        the torch::save file, evicted first (and, as a second row, with the parameters
//                      then copied into the model, which a resume from it also needs)
//   async stall        how long an asynchronous save() holds the training loop (host copy of the
//                      state into the reused staging buffer; the write runs in the background)
//   memory copy        a plain memcpy of every tensor into a preallocated buffer of the same size
//
// Targets: save >= 0.8 x write+fdatasync; save and load faster than torch::save / torch::load;
// async stall <= 1.2 x memory copy.
//
//   build/benchmarks/checkpoint_bench --dir build/checkpoint-bench --rounds 5 --json checkpoint.json
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <torch/nn.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/train/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Drops the files' clean pages from the page cache, so the next read comes from the disk.
void evict(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::recursive_directory_iterator(path))
      if (e.is_regular_file()) files.push_back(e.path());
  } else {
    files.push_back(path);
  }
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Sequential durable write of `bytes` from `buffer`, like dd conv=fdatasync bs=8M.
double write_fdatasync(const fs::path& path, const std::vector<char>& buffer, uint64_t bytes) {
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), bytes - done));
    const ssize_t w = ::write(fd, buffer.data(), n);
    if (w <= 0) {
      std::perror("write");
      std::exit(1);
    }
    done += static_cast<uint64_t>(w);
  }
  ::fdatasync(fd);
  ::close(fd);
  return since(start);
}

// Allocates `bytes` of new memory and faults its pages in: what a load's fresh tensors cost before
// any byte is read.
double fault_in_new_memory(uint64_t bytes) {
  const auto start = Clock::now();
  at::Tensor t = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data_ptr()) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data_ptr()) + bytes) & ~(page - 1);
#ifdef MADV_POPULATE_WRITE
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0)
#endif
    std::memset(t.data_ptr(), 1, bytes);
  return since(start);  // freed after the timing
}

// Reads every file under `path` into one buffer.
double read_all(const fs::path& path, std::vector<char>& buffer) {
  const auto start = Clock::now();
  size_t offset = 0;
  for (const auto& e : fs::directory_iterator(path)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    const size_t size = static_cast<size_t>(e.file_size());
    if (buffer.size() < offset + size) buffer.resize(offset + size);
    for (size_t done = 0; done < size;) {
      const ssize_t r = ::read(fd, buffer.data() + offset + done, std::min<size_t>(size - done, size_t(1) << 30));
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    offset += size;
    ::close(fd);
  }
  return since(start);
}

// Reads every file under `path` into a tensor allocated for it (as a load must), freed after the
// timing.
double read_all_into_new_memory(const fs::path& path) {
  std::vector<at::Tensor> kept;
  const auto start = Clock::now();
  for (const auto& e : fs::directory_iterator(path)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    const size_t size = static_cast<size_t>(e.file_size());
    kept.push_back(at::empty({static_cast<int64_t>(size)}, at::kByte));
    char* data = static_cast<char*>(kept.back().data_ptr());
    for (size_t done = 0; done < size;) {
      const ssize_t r = ::read(fd, data + done, std::min<size_t>(size - done, size_t(1) << 30));
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    ::close(fd);
  }
  return since(start);
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t width) {
    a = register_module("a", torch::nn::Linear(width, 2 * width));
    b = register_module("b", torch::nn::Linear(2 * width, width));
    c = register_module("c", torch::nn::Linear(width, 2 * width));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom::Checkpointer save/load throughput against the disk, memory and torch::save/load"};
  std::string dir = "build/checkpoint-bench";
  std::string json_path;
  int rounds = 5;
  int64_t width = 2048;
  app.add_option("--dir", dir, "scratch directory on the disk to measure (emptied)");
  app.add_option("--rounds", rounds, "measured rounds (medians are reported)")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "layer width: 3 layers of width x 2*width (2048: 25M parameters)")
      ->check(CLI::PositiveNumber);
  app.add_option("--json", json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  fs::remove_all(dir);
  fs::create_directories(dir);

  torch::manual_seed(0);
  Net net(width);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  for (auto& p : net->parameters()) p.mutable_grad() = at::randn_like(p);
  adam.step();  // exp_avg and exp_avg_sq exist now
  std::vector<at::Tensor> tensors;
  uint64_t state_bytes = 0;
  for (auto& p : net->parameters()) {
    tensors.push_back(p.detach());
    auto& s = static_cast<torch::optim::AdamParamState&>(*adam.state().at(p.unsafeGetTensorImpl()));
    tensors.push_back(s.exp_avg());
    tensors.push_back(s.exp_avg_sq());
  }
  for (const auto& t : tensors) state_bytes += t.numel() * t.element_size();
  const double mb = state_bytes / 1e6;

  std::vector<char> pattern(8u << 20);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 2654435761u >> 13);
  std::vector<char> read_buffer(state_bytes + (1 << 20)), copy_buffer(state_bytes);
  std::memset(copy_buffer.data(), 1, copy_buffer.size());

  loom::Checkpointer sync(nullptr, {.directory = dir + "/sync", .keep_last = 0, .async = false});
  sync.model(net).optimizer(adam);
  loom::Checkpointer async(nullptr, {.directory = dir + "/async", .keep_last = 0, .async = true});
  async.model(net).optimizer(adam);
  async.save({.step = 0});  // the first save allocates the staging buffer the later ones reuse
  async.wait();
  fs::remove_all(dir + "/async/step_000000");

  std::vector<double> ours_save, dd, torch_save_sync, torch_save_cache, ours_load, ours_load_freed, raw_read, raw_read_new, touch, torch_load,
      torch_load_apply, stall, memcpy_s, async_total;
  uint64_t checkpoint_bytes = 0;
  std::printf("checkpoint_bench: %.1f MB of state (model %.1f MB + Adam %.1f MB), %d rounds, directory %s\n", mb,
              mb / 3, 2 * mb / 3, rounds, dir.c_str());
  for (int r = 1; r <= rounds; ++r) {
    const std::string step_dir = dir + "/sync/step_" + [&] {
      char b[16];
      std::snprintf(b, sizeof(b), "%06d", r);
      return std::string(b);
    }();
    // Durable writes, alternating which goes first.
    auto ours = [&] {
      auto t = Clock::now();
      sync.save({.step = r});
      ours_save.push_back(since(t));
      checkpoint_bytes = sync.wait().bytes;
    };
    auto reference = [&] { dd.push_back(write_fdatasync(dir + "/dd.bin", pattern, state_bytes)); };
    if (r % 2) {
      ours();
      reference();
    } else {
      reference();
      ours();
    }
    auto t = Clock::now();
    torch::save(tensors, dir + "/torch.pt");
    torch_save_cache.push_back(since(t));
    fsync_path(dir + "/torch.pt");
    torch_save_sync.push_back(since(t));

    // Cold loads, in a rotating order (the first read after the writes is slower on some disks).
    auto load_ours = [&] {
      evict(step_dir);
      auto t0 = Clock::now();
      sync.load(step_dir);
      ours_load.push_back(since(t0));
      sync.wait();  // the replaced state freed
      ours_load_freed.push_back(since(t0));
    };
    auto load_raw = [&] {
      evict(step_dir);
      raw_read.push_back(read_all(step_dir, read_buffer));
    };
    auto load_raw_new = [&] {
      evict(step_dir);
      raw_read_new.push_back(read_all_into_new_memory(step_dir));
    };
    auto load_torch = [&] {
      evict(dir + "/torch.pt");
      std::vector<at::Tensor> loaded;
      auto t0 = Clock::now();
      torch::load(loaded, dir + "/torch.pt");
      torch_load.push_back(since(t0));
      // What resuming from it also takes: the parameters copied into the live model (the Adam
      // state tensors could be adopted as loaded, as Checkpointer::load adopts its own).
      {
        torch::NoGradGuard no_grad;
        auto params = net->parameters();
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(loaded[3 * i]);
      }
      torch_load_apply.push_back(since(t0));
    };
    auto load_touch = [&] { touch.push_back(fault_in_new_memory(state_bytes)); };
    std::vector<std::function<void()>> loads = {load_ours, load_raw, load_torch, load_raw_new, load_touch};
    for (size_t i = 0; i < loads.size(); ++i) loads[(i + r) % loads.size()]();

    // The training stall of an asynchronous save, against a plain copy of the same bytes.
    t = Clock::now();
    size_t offset = 0;
    for (const auto& x : tensors) {
      const size_t n = x.numel() * x.element_size();
      std::memcpy(copy_buffer.data() + offset, x.data_ptr(), n);
      offset += n;
    }
    memcpy_s.push_back(since(t));
    t = Clock::now();
    async.save({.step = r});
    stall.push_back(since(t));
    async.wait();
    async_total.push_back(since(t));

    fs::remove_all(step_dir);
    fs::remove_all(dir + "/async/step_" + step_dir.substr(step_dir.size() - 6));
    fs::remove(dir + "/dd.bin");
    fs::remove(dir + "/torch.pt");
    std::printf(
        "  round %d: save %.3f s, write+fdatasync %.3f s, torch::save+fsync %.3f s, load %.3f s, read %.3f s "
        "(into new memory %.3f s, new memory faulted in %.3f s), torch::load %.3f s, stall %.4f s, memcpy %.4f s\n",
        r, ours_save.back(), dd.back(), torch_save_sync.back(), ours_load.back(), raw_read.back(), raw_read_new.back(),
        touch.back(), torch_load.back(),
        stall.back(), memcpy_s.back());
    std::fflush(stdout);
  }
  using loom::bench::median;
  const double gb = checkpoint_bytes / 1e9, state_gb = state_bytes / 1e9;
  struct Row {
    std::string what, ours_text, reference, reference_text;
    double ratio;
    std::string target;
    bool met;
  };
  auto rate = [](double gbytes, double s) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.3f GB/s", gbytes / s);
    return std::string(b);
  };
  auto secs = [](double s) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.4f s", s);
    return std::string(b);
  };
  const double s_ours = median(ours_save), s_dd = median(dd), s_ts = median(torch_save_sync),
               s_tc = median(torch_save_cache), l_ours = median(ours_load), l_raw = median(raw_read), l_raw_new = median(raw_read_new),
               l_torch = median(torch_load), l_torch_apply = median(torch_load_apply), st = median(stall),
               mc = median(memcpy_s);
  std::vector<Row> rows = {
      {"save, durable (bandwidth)", rate(gb, s_ours), "write+fdatasync", rate(state_gb, s_dd),
       (gb / s_ours) / (state_gb / s_dd), ">= 0.8", (gb / s_ours) / (state_gb / s_dd) >= 0.8},
      {"save, durable (time)", secs(s_ours), "torch::save + fsync", secs(s_ts), s_ours / s_ts, "< 1 (faster)",
       s_ours < s_ts},
      {"save, durable (time)", secs(s_ours), "torch::save, no fsync", secs(s_tc), s_ours / s_tc, "(info)", true},
      {"load, cold cache (bandwidth)", rate(gb, l_ours), "read() of the same files", rate(gb, l_raw),
       (gb / l_ours) / (gb / l_raw), ">= 0.8", (gb / l_ours) / (gb / l_raw) >= 0.8},
      {"load, cold cache (bandwidth)", rate(gb, l_ours), "read() into new memory", rate(gb, l_raw_new),
       (gb / l_ours) / (gb / l_raw_new), "(info)", true},
      {"load, cold cache (time)", secs(l_ours), "new memory, faulted in", secs(median(touch)),
       l_ours / median(touch), "(info)", true},
      {"load, cold cache (time)", secs(l_ours), "torch::load", secs(l_torch), l_ours / l_torch, "< 1 (faster)",
       l_ours < l_torch},
      {"load, cold cache (time)", secs(l_ours), "torch::load + param copy", secs(l_torch_apply),
       l_ours / l_torch_apply, "(info)", true},
      {"load + freeing the old", secs(median(ours_load_freed)), "torch::load + param copy", secs(l_torch_apply),
       median(ours_load_freed) / l_torch_apply, "(info)", true},
      {"async save: training stall", secs(st), "memcpy of the state", secs(mc), st / mc, "<= 1.2", st / mc <= 1.2},
  };
  std::printf("\n%-30s %-14s %-26s %-14s %-8s %s\n", "", "ours", "reference", "", "ratio", "target");
  for (const auto& row : rows)
    std::printf("%-30s %-14s %-26s %-14s %-8.3f %s%s\n", row.what.c_str(), row.ours_text.c_str(), row.reference.c_str(),
                row.reference_text.c_str(), row.ratio, row.target.c_str(),
                row.target == "(info)" ? "" : (row.met ? "  met" : "  MISSED"));
  std::printf(
      "(ratios: bandwidth rows ours/reference, higher is better; time rows ours/reference, lower is better;\n"
      " an asynchronous save's whole write took %.3f s in the background)\n",
      median(async_total));
  if (!json_path.empty()) {
    nlohmann::json doc;
    doc["state_bytes"] = state_bytes;
    doc["checkpoint_bytes"] = checkpoint_bytes;
    doc["rounds"] = rounds;
    doc["samples_s"] = {{"save", ours_save},
                        {"write_fdatasync", dd},
                        {"torch_save_fsync", torch_save_sync},
                        {"torch_save", torch_save_cache},
                        {"load_cold", ours_load},
                        {"load_cold_and_freed", ours_load_freed},
                        {"read_cold", raw_read},
                        {"read_cold_new_memory", raw_read_new},
                        {"first_touch_new_memory", touch},
                        {"torch_load_cold", torch_load},
                        {"torch_load_cold_and_copy", torch_load_apply},
                        {"async_stall", stall},
                        {"memcpy", memcpy_s},
                        {"async_total", async_total}};
    nlohmann::json table = nlohmann::json::array();
    for (const auto& row : rows)
      table.push_back({{"row", row.what},
                       {"ours", row.ours_text},
                       {"reference", row.reference},
                       {"reference_value", row.reference_text},
                       {"ratio", row.ratio},
                       {"target", row.target},
                       {"met", row.met}});
    doc["table"] = table;
    if (!loom::bench::write_json(json_path, doc, "checkpoint_bench")) return 1;
  }
  fs::remove_all(dir);
  return 0;
}
