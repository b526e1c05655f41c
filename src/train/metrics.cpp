// Prometheus metrics: counters and gauges kept under a mutex, rendered as text exposition format
// (https://prometheus.io/docs/instrumenting/exposition_formats/), written to a file atomically or
// served over HTTP by one thread.
#include "loom/train/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "loom/config.h"
#include "loom/error.h"
#include "loom/runtime.h"
#include "topology/nvml_loader.h"

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

}  // namespace

struct MetricsExporter::Impl {
  std::string labels;  // rank="0",local_rank="0",host="h"
  int rank = 0;
  std::string file;
  double interval = 5;
  std::optional<unsigned> gpu;
  int listen_fd = -1;
  int served_port = 0;
  std::atomic<bool> stop{false};
  std::thread server;

  mutable std::mutex mutex;
  StepMetrics last;
  uint64_t steps = 0, tokens = 0, bytes = 0;
  double step_seconds = 0, exposed = 0, checkpoint = 0;
  Clock::time_point last_write{};

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
      std::string why;
      if (auto g = topo::detail::read_nvml_gauges(*gpu, why)) {
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
    const std::string text = render();
    const std::string tmp = file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << text;
      if (!out.flush())
        throw Error(ErrorContext("LOOM_METRICS")("writing " + tmp + " failed: " + std::strerror(errno)));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, file, ec);  // the collector never reads half a file
    if (ec) throw Error(ErrorContext("LOOM_METRICS")("renaming " + tmp + " to " + file + " failed: " + ec.message()));
    last_write = Clock::now();
  }

  void serve() {
    while (!stop) {
      pollfd p{listen_fd, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      const int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd < 0) continue;
      char request[1024];
      (void)::recv(fd, request, sizeof(request), 0);  // any path answers: GET /metrics is what Prometheus sends
      const std::string body = render();
      const std::string response = "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: " +
                                   std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
      size_t sent = 0;
      while (sent < response.size()) {
        const ssize_t n = ::send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
      ::close(fd);
    }
  }

  void listen_on(int port) {
    listen_fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (listen_fd < 0 || ::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_fd, 16) != 0) {
      const std::string reason = std::strerror(errno);
      if (listen_fd >= 0) ::close(listen_fd);
      listen_fd = -1;
      throw ConfigError(ErrorContext("LOOM_METRICS")("cannot serve metrics on port " + std::to_string(port) + ": " +
                                                     reason));
    }
    served_port = port;
    server = std::thread([this] { serve(); });
  }
};

MetricsExporter::MetricsExporter() : MetricsExporter(config().metrics) {}

MetricsExporter::MetricsExporter(const std::string& target) : impl_(std::make_unique<Impl>()) {
  auto rt = init();
  const World& w = rt->world();
  impl_->rank = w.rank;
  impl_->labels = "rank=\"" + std::to_string(w.rank) + "\",local_rank=\"" + std::to_string(w.local_rank) +
                  "\",host=\"" + escape_label(w.hostname) + "\"";
  impl_->interval = config().metrics_interval;
  impl_->gpu = nvml_index(rt->cuda_device());
  if (target.empty()) return;
  if (target.rfind("file:", 0) == 0) {
    const std::string dir = target.substr(5);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    impl_->file = (std::filesystem::path(dir) / ("torchloom_rank" + std::to_string(w.rank) + ".prom")).string();
    impl_->write_file();  // an unwritable directory is reported now, not after the run
  } else if (target.rfind("port:", 0) == 0) {
    int port = 0;
    try {
      port = std::stoi(target.substr(5));
    } catch (const std::exception&) {
    }
    if (port <= 0 || port + w.local_rank > 65535)
      throw ConfigError(ErrorContext("LOOM_METRICS")("expected port:N with 1 <= N + local rank <= 65535; found \"" +
                                                     target + "\""));
    impl_->listen_on(port + w.local_rank);
  } else {
    throw ConfigError(ErrorContext("LOOM_METRICS")("expected file:DIR or port:N; found \"" + target + "\""));
  }
}

MetricsExporter::~MetricsExporter() {
  if (!impl_->file.empty()) {
    try {
      impl_->write_file();
    } catch (const std::exception&) {  // a destructor does not throw; flush() reports
    }
  }
  if (impl_->server.joinable()) {
    impl_->stop = true;
    impl_->server.join();
  }
  if (impl_->listen_fd >= 0) ::close(impl_->listen_fd);
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
    impl_->write_file();
}

void MetricsExporter::flush() {
  if (!impl_->file.empty()) impl_->write_file();
}

std::string MetricsExporter::render() const { return impl_->render(); }
std::string MetricsExporter::path() const { return impl_->file; }
int MetricsExporter::port() const { return impl_->served_port; }

}  // namespace loom
