// Per-rank training metrics in Prometheus' text exposition format, for the Prometheus + Grafana
// setups that already watch GPU servers (a dashboard: docs/grafana-dashboard.json).
//
// Where they go is LOOM_METRICS:
//   file:DIR   DIR/torchloom_rank<r>.prom, replaced atomically (write, rename) at most every
//              LOOM_METRICS_INTERVAL seconds and at flush(): node_exporter's textfile collector
//              (--collector.textfile.directory=DIR) publishes them with the node's other metrics.
//   port:N     an HTTP endpoint on 127.0.0.1, port N + local rank (/metrics), served by a thread,
//              for a Prometheus scrape job listing each rank's port. Loopback only unless an address
//              is given: port:ADDR:N (a numeric IPv4 address), port:[ADDR]:N (IPv6) or port:*:N
//              (every interface). Clients are served concurrently, each with a deadline (5 s for the
//              request, 5 s for the response): a silent or slow client never delays another scrape,
//              the training or the process's exit (docs/monitoring.md).
//   (unset)    off: record() only keeps the numbers (render() still gives the text).
//
//   auto rt = loom::init();
//   loom::MetricsExporter metrics({.world = rt->world(), .cuda_device = rt->cuda_device(),
//                                  .target = rt->config().metrics,              // LOOM_METRICS
//                                  .interval_seconds = rt->config().metrics_interval});
//   for (...) {
//     ... one optimizer step ...
//     metrics.record({.step = step, .step_seconds = dt, .tokens = tokens, .loss = loss,
//                     .exposed_communication_seconds = comm, .bytes_communicated = bytes});
//   }
//   metrics.flush();
//
// Every sample carries the labels rank, local_rank and host. Counters (_total) add up what each
// record() reported; gauges hold the last value. Host memory is this process's resident set; where
// NVML is present (a GPU driver) and a sink is set, the process's GPU adds utilisation, memory,
// temperature and PCIe throughput, sampled by a thread of the exporter every LOOM_METRICS_INTERVAL
// seconds (clamped to 1..10 s), never on the training thread.
//
// A failed write of the file (full or unmounted disk) is logged, once until a write succeeds again,
// and never thrown out of record() or flush(): metrics do not end a training run.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "loom/world.h"

namespace loom {

// What one optimizer step did, on this rank.
struct StepMetrics {
  int64_t step = 0;
  double step_seconds = 0;                   // wall time of the step
  int64_t tokens = 0;                        // tokens this rank processed in the step
  double loss = 0;                           // the step's training loss
  double exposed_communication_seconds = 0;  // time blocked on communication in the step
  uint64_t bytes_communicated = 0;           // bytes the step's collectives reduced or gathered
  double checkpoint_stall_seconds = 0;       // time the step spent in Checkpointer::save()
};

// Who this rank is and where its metrics go; the runtime has every value (see the example above).
// The exporter is given them rather than asking the runtime, so that making one never starts it.
struct MetricsOptions {
  World world;                     // rank, local rank and host: the labels, the file name, the port
  std::optional<int> cuda_device;  // the GPU whose gauges are sampled; none: no GPU gauges
  std::string target;              // "file:DIR", "port:[ADDR:]N" or "" (off)
  double interval_seconds = 5;     // the file's rewrite interval and the GPU sampling period
};

class MetricsExporter {
 public:
  // Throws loom::ConfigError for a target of another form, a directory that cannot be written or a
  // port that cannot be bound.
  explicit MetricsExporter(const MetricsOptions& options);
  ~MetricsExporter();  // stops the endpoint at once (open connections are closed); writes the file a last time
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  void record(const StepMetrics& step);
  // Writes the file now (file:), whatever the interval. false when the write failed (logged).
  bool flush();
  // The exposition text of everything recorded so far, with a fresh memory reading and the last GPU
  // sample.
  std::string render() const;
  // The file written (file:), or "" .
  std::string path() const;
  // The port served (port:), or 0.
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
