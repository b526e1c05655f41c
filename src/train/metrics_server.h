// A small HTTP/1.1 server for the Prometheus endpoint (LOOM_METRICS=port:...): one thread, one
// poll() loop over non-blocking sockets, so that no client, however slow, silent or malformed, can
// hold up another scrape, the training thread or the process's exit.
//
// Every connection has a deadline: the request must arrive within `request_timeout` of the
// accept, the response must be taken within `write_timeout`; a connection past its deadline is
// closed. At most `max_connections` are served at once; further clients wait in the listen backlog
// (they are not refused). A request head above `max_request_bytes` is answered 431 and closed.
// GET and HEAD of /metrics (or /) are answered 200 with body(); other paths 404, other methods
// 405, anything unparsable 400; every response closes the connection. After a response the
// server reads and discards what the client still sends for up to `linger`, so the kernel does not
// reset the connection before the client has read the response.
//
// The destructor wakes the loop through a pipe and joins it at once: it never waits on a client.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace loom::detail {

struct MetricsServerLimits {
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds write_timeout{5000};
  std::chrono::milliseconds linger{1000};
  size_t max_connections = 64;
  size_t max_request_bytes = 8192;
};

// Where to listen: a numeric IPv4 or IPv6 address ("" means 127.0.0.1) and a port (0: any free
// port; MetricsServer::port() says which).
struct ListenAddress {
  std::string host;
  int port = 0;
};

// "N" (127.0.0.1:N), "ADDR:N" with ADDR an IPv4 address, "[ADDR]:N" with ADDR an IPv6 address, or
// "*:N" (every interface, 0.0.0.0). N: 1 to 65535, digits only. Throws loom::ConfigError naming
// `what` (the variable) and the accepted forms.
ListenAddress parse_listen_address(const std::string& text, const std::string& what);

class MetricsServer {
 public:
  // Binds and starts serving; throws loom::ConfigError when the address cannot be bound. `body` is
  // called on the server thread for each scrape and must not block (an exception makes a 500).
  MetricsServer(const ListenAddress& where, std::function<std::string()> body, MetricsServerLimits limits = {});
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const;                  // the bound port
  const std::string& host() const;   // the bound address, numeric

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::detail
