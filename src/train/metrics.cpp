// Prometheus metrics: counters and gauges kept under a mutex, rendered as text exposition format
// (https://prometheus.io/docs/instrumenting/exposition_formats/), written to a file atomically or
// served over HTTP (train/metrics_server.h). GPU gauges come from a sampler thread
// (train/metrics_gpu_sampler.h), so neither sink calls NVML on the training thread.
#include "loom/train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "loom/error.h"
#include "loom/log.h"
#include "train/metrics_gpu_sampler.h"
#include "train/metrics_server.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

// Resident set of this process, in bytes (/proc/self/statm: pages).
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  long long total = 0, resident = 0;
  statm >> total >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// The NVML index of this process's GPU: CUDA's index through CUDA_VISIBLE_DEVICES when that lists
// numbers (NVML numbers every GPU of the machine; CUDA only the visible ones).
std::optional<unsigned> nvml_index(std::optional<int> cuda_device) {
  if (!cuda_device) return std::nullopt;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') return static_cast<unsigned>(*cuda_device);
  std::stringstream list(visible);
  std::string item;
  for (int i = 0; std::getline(list, item, ','); ++i)
    if (i == *cuda_device) {
      try {
        return static_cast<unsigned>(std::stoul(item));
      } catch (const std::exception&) {
        return std::nullopt;  // a UUID: NVML would need a lookup by UUID; no GPU gauges then
      }
    }
  return std::nullopt;
}

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// Writes `text` to `path` atomically: a temporary file made by mkstemp in the same directory
// (a fresh name no other process or planted symlink can share; node_exporter reads only *.prom),
// then rename. Throws loom::Error naming the file and the failing step.
void write_file_atomic(const std::filesystem::path& path, const std::string& text) {
  std::string tmp = (path.parent_path() / ("." + path.filename().string() + ".XXXXXX")).string();
  auto fail = [&](const std::string& step) {
    const std::string reason = std::strerror(errno);
    return Error(ErrorContext("LOOM_METRICS")(step + " " + tmp + " failed: " + reason));
  };
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) throw fail("creating");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const Error e = fail("writing");
      ::close(fd);
      ::unlink(tmp.c_str());
      throw e;
    }
    done += static_cast<size_t>(n);
  }
  // mkstemp makes the file 0600; the collector may run as another user.
  if (::fchmod(fd, 0644) != 0 || ::close(fd) != 0) {
    const Error e = fail("closing");
    ::unlink(tmp.c_str());
    throw e;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {  // the collector never reads half a file
    const Error e = fail("renaming to " + path.string() + ":");
    ::unlink(tmp.c_str());
    throw e;
  }
}

}  // namespace

struct MetricsExporter::Impl {
  std::string labels;  // rank="0",local_rank="0",host="h"
  int rank = 0;
  std::string file;
  double interval = 5;
  bool write_failing = false;  // the last write of the file failed (logged once per run of failures)

  mutable std::mutex mutex;
  StepMetrics last;
  uint64_t steps = 0, tokens = 0, bytes = 0;
  double step_seconds = 0, exposed = 0, checkpoint = 0;
  Clock::time_point last_write{};
  // Last, so they are destroyed first (the server renders, rendering reads the sampler).
  std::unique_ptr<detail::GpuSampler> gpu;
  std::unique_ptr<detail::MetricsServer> server;

  std::string render() const {
    std::ostringstream out;
    out.precision(17);
    auto metric = [&](const char* name, const char* type, const char* help, double value) {
      out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n'
          << name << '{' << labels << "} " << value << '\n';
    };
    {
      std::lock_guard<std::mutex> lock(mutex);
      metric("loom_step", "gauge", "The last optimizer step recorded.", double(last.step));
      metric("loom_steps_total", "counter", "Optimizer steps recorded.", double(steps));
      metric("loom_step_seconds", "gauge", "Wall time of the last step, in seconds.", last.step_seconds);
      metric("loom_step_seconds_total", "counter", "Wall time of all recorded steps, in seconds.", step_seconds);
      metric("loom_tokens_total", "counter", "Tokens this rank processed.", double(tokens));
      metric("loom_tokens_per_second", "gauge", "Tokens per second of the last step on this rank.",
             last.step_seconds > 0 ? double(last.tokens) / last.step_seconds : 0.0);
      metric("loom_loss", "gauge", "Training loss of the last step.", last.loss);
      metric("loom_exposed_communication_seconds_total", "counter",
             "Time blocked on communication (not hidden behind compute), in seconds.", exposed);
      metric("loom_communicated_bytes_total", "counter", "Bytes reduced or gathered by the steps' collectives.",
             double(bytes));
      metric("loom_checkpoint_stall_seconds_total", "counter", "Time steps spent in Checkpointer::save(), in seconds.",
             checkpoint);
    }
    metric("loom_host_memory_resident_bytes", "gauge", "Resident memory of this process, in bytes.", resident_bytes());
    if (gpu) {
      if (auto g = gpu->latest()) {
        metric("loom_gpu_utilization_percent", "gauge", "GPU utilisation (NVML), in percent.", g->utilization_percent);
        metric("loom_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML), in bytes.", g->memory_used_bytes);
        metric("loom_gpu_memory_total_bytes", "gauge", "GPU memory (NVML), in bytes.", g->memory_total_bytes);
        metric("loom_gpu_temperature_celsius", "gauge", "GPU temperature (NVML), in degrees Celsius.",
               g->temperature_celsius);
        metric("loom_gpu_pcie_tx_bytes_per_second", "gauge", "PCIe transmit throughput (NVML), in bytes per second.",
               g->pcie_tx_bytes_per_second);
        metric("loom_gpu_pcie_rx_bytes_per_second", "gauge", "PCIe receive throughput (NVML), in bytes per second.",
               g->pcie_rx_bytes_per_second);
      }
    }
    return out.str();
  }

  void write_file() {
    write_file_atomic(file, render());
    last_write = Clock::now();
  }

  // record()'s write: a failure (a full or unmounted disk) is logged, not thrown into the training
  // loop; it is logged again only after a write has succeeded in between.
  bool write_file_logged() {
    try {
      write_file();
    } catch (const Error& e) {
      last_write = Clock::now();  // retry at the next interval, not at every step
      if (!write_failing) LOOM_LOG(warn, e.what() << "; training goes on, the metrics file is retried every "
                                                  << interval << " s");
      write_failing = true;
      return false;
    }
    if (write_failing) LOOM_LOG(warn, "metrics: " << file << " written again");
    write_failing = false;
    return true;
  }
};

MetricsExporter::MetricsExporter(const MetricsOptions& options) : impl_(std::make_unique<Impl>()) {
  const World& w = options.world;
  const std::string& target = options.target;
  impl_->rank = w.rank;
  impl_->labels = "rank=\"" + std::to_string(w.rank) + "\",local_rank=\"" + std::to_string(w.local_rank) +
                  "\",host=\"" + escape_label(w.hostname) + "\"";
  impl_->interval = options.interval_seconds;
  if (target.empty()) return;
  if (target.rfind("file:", 0) == 0) {
    const std::string dir = target.substr(5);
    if (dir.empty()) throw ConfigError(ErrorContext("LOOM_METRICS")("expected file:DIR; found \"" + target + "\""));
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    impl_->file = (std::filesystem::path(dir) / ("torchloom_rank" + std::to_string(w.rank) + ".prom")).string();
    try {
      impl_->write_file();  // an unwritable directory is reported now, not after the run
    } catch (const Error& e) {
      throw ConfigError(e.what());
    }
  } else if (target.rfind("port:", 0) == 0) {
    detail::ListenAddress where = detail::parse_listen_address(target.substr(5), "LOOM_METRICS");
    if (where.port + w.local_rank > 65535)
      throw ConfigError(ErrorContext("LOOM_METRICS")("port " + std::to_string(where.port) + " + local rank " +
                                                     std::to_string(w.local_rank) + " is above 65535 (\"" + target +
                                                     "\")"));
    where.port += w.local_rank;
    impl_->server = std::make_unique<detail::MetricsServer>(where, [impl = impl_.get()] { return impl->render(); });
  } else {
    throw ConfigError(ErrorContext("LOOM_METRICS")("expected file:DIR or port:[ADDR:]N; found \"" + target + "\""));
  }
  // Started last: a target refused above leaves no thread behind.
  if (auto index = nvml_index(options.cuda_device)) {
    const double seconds = std::clamp(impl_->interval, 1.0, 10.0);
    impl_->gpu = std::make_unique<detail::GpuSampler>(*index, std::chrono::milliseconds(long(seconds * 1000)));
  }
}

MetricsExporter::~MetricsExporter() {
  impl_->server.reset();  // stops at once, whatever the clients do
  if (!impl_->file.empty()) impl_->write_file_logged();
  impl_->gpu.reset();
}

void MetricsExporter::record(const StepMetrics& step) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->last = step;
    ++impl_->steps;
    impl_->tokens += static_cast<uint64_t>(step.tokens);
    impl_->bytes += step.bytes_communicated;
    impl_->step_seconds += step.step_seconds;
    impl_->exposed += step.exposed_communication_seconds;
    impl_->checkpoint += step.checkpoint_stall_seconds;
  }
  if (!impl_->file.empty() &&
      std::chrono::duration<double>(Clock::now() - impl_->last_write).count() >= impl_->interval)
    impl_->write_file_logged();
}

bool MetricsExporter::flush() { return impl_->file.empty() || impl_->write_file_logged(); }

std::string MetricsExporter::render() const { return impl_->render(); }
std::string MetricsExporter::path() const { return impl_->file; }
int MetricsExporter::port() const { return impl_->server ? impl_->server->port() : 0; }

}  // namespace loom
