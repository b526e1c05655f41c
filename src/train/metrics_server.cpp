#include "train/metrics_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "loom/error.h"
#include "loom/log.h"

namespace loom::detail {
namespace {

using Clock = std::chrono::steady_clock;

ConfigError bad_address(const std::string& what, const std::string& text, const std::string& why) {
  return ConfigError(ErrorContext(what)(
      "\"" + text + "\": " + why +
      "; expected N, ADDR:N (IPv4), [ADDR]:N (IPv6) or *:N (every interface), with N a port from 1 to 65535"));
}

int parse_port(const std::string& digits, const std::string& what, const std::string& text) {
  if (digits.empty() || digits.size() > 5 || !std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      }))
    throw bad_address(what, text, "the port is not a number");
  const int port = std::stoi(digits);
  if (port < 1 || port > 65535) throw bad_address(what, text, "port " + digits + " is out of range");
  return port;
}

// The HTTP response for a complete request head (request line and headers, without body).
std::string respond(const std::string& head, const std::function<std::string()>& body) {
  auto reply = [](const char* status, const std::string& content, bool with_body, const char* extra = "") {
    return std::string("HTTP/1.1 ") + status + "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n" +
           "Content-Length: " + std::to_string(content.size()) + "\r\n" + extra + "Connection: close\r\n\r\n" +
           (with_body ? content : std::string());
  };
  const size_t eol = head.find_first_of("\r\n");
  const std::string line = head.substr(0, eol);
  // METHOD SP TARGET SP HTTP/x.y, nothing else (RFC 9112 section 3).
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos || line.find(' ', sp2 + 1) != std::string::npos ||
      line.compare(sp2 + 1, 5, "HTTP/") != 0)
    return reply("400 Bad Request", "bad request\n", true);
  const std::string method = line.substr(0, sp1);
  const std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) return reply("405 Method Not Allowed", "GET or HEAD only\n", true, "Allow: GET, HEAD\r\n");
  const std::string path = target.substr(0, target.find('?'));
  if (path != "/metrics" && path != "/") return reply("404 Not Found", "the metrics are at /metrics\n", !head_only);
  try {
    return reply("200 OK", body(), !head_only);
  } catch (const std::exception& e) {
    return reply("500 Internal Server Error", std::string(e.what()) + "\n", !head_only);
  }
}

// End of the request head: an empty line ("\r\n\r\n", or "\n\n" from a hand-typed request).
bool head_complete(const std::string& in) {
  return in.find("\r\n\r\n") != std::string::npos || in.find("\n\n") != std::string::npos;
}

struct Connection {
  enum class State { reading, writing, lingering } state = State::reading;
  int fd = -1;
  Clock::time_point deadline;
  std::string in, out;
  size_t sent = 0;
};

}  // namespace

ListenAddress parse_listen_address(const std::string& text, const std::string& what) {
  ListenAddress a;
  if (text.find_first_of(":[]") == std::string::npos) {
    a.host = "127.0.0.1";
    a.port = parse_port(text, what, text);
    return a;
  }
  const size_t colon = text.rfind(':');
  std::string host = text.substr(0, colon);
  a.port = parse_port(text.substr(colon + 1), what, text);
  if (host == "*") {
    a.host = "0.0.0.0";
  } else if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    in6_addr v6{};
    if (inet_pton(AF_INET6, host.c_str(), &v6) != 1) throw bad_address(what, text, "not an IPv6 address");
    a.host = host;
  } else {
    in_addr v4{};
    if (host.find(':') != std::string::npos) throw bad_address(what, text, "an IPv6 address needs brackets");
    if (inet_pton(AF_INET, host.c_str(), &v4) != 1) throw bad_address(what, text, "not a numeric IPv4 address");
    a.host = host;
  }
  return a;
}

struct MetricsServer::Impl {
  MetricsServerLimits limits;
  std::function<std::string()> body;
  std::string host;
  int port = 0;
  int listen_fd = -1;
  int wake[2] = {-1, -1};  // the destructor writes to wake[1]; the loop polls wake[0]
  std::thread thread;

  ~Impl() {
    for (int fd : {listen_fd, wake[0], wake[1]})
      if (fd >= 0) ::close(fd);
  }

  void bind_to(const ListenAddress& where) {
    sockaddr_storage storage{};
    socklen_t length = 0;
    const bool v6 = where.host.find(':') != std::string::npos;
    if (v6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
      a->sin6_family = AF_INET6;
      a->sin6_port = htons(static_cast<uint16_t>(where.port));
      if (inet_pton(AF_INET6, where.host.c_str(), &a->sin6_addr) != 1)
        throw ConfigError(ErrorContext("LOOM_METRICS")("not an IPv6 address: " + where.host));
      length = sizeof(sockaddr_in6);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&storage);
      a->sin_family = AF_INET;
      a->sin_port = htons(static_cast<uint16_t>(where.port));
      if (inet_pton(AF_INET, where.host.c_str(), &a->sin_addr) != 1)
        throw ConfigError(ErrorContext("LOOM_METRICS")("not an IPv4 address: " + where.host));
      length = sizeof(sockaddr_in);
    }
    const std::string shown = (v6 ? "[" + where.host + "]" : where.host) + ":" + std::to_string(where.port);
    auto fail = [&](const char* step) {
      return ConfigError(ErrorContext("LOOM_METRICS")(std::string("cannot serve metrics on ") + shown + " (" + step +
                                                      "): " + std::strerror(errno)));
    };
    listen_fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd < 0) throw fail("socket");
    const int one = 1;
    ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listen_fd, reinterpret_cast<sockaddr*>(&storage), length) != 0) throw fail("bind");
    if (::listen(listen_fd, 128) != 0) throw fail("listen");
    if (::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) throw fail("getsockname");
    port = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port
                    : reinterpret_cast<sockaddr_in*>(&storage)->sin_port);
    host = where.host;
    if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throw fail("pipe");
  }

  // Moves a connection forward as far as it can without blocking; false when it is finished.
  bool advance(Connection& c, short revents, Clock::time_point now) {
    if (c.state == Connection::State::reading && (revents & (POLLIN | POLLHUP | POLLERR))) {
      char buffer[4096];
      for (;;) {
        const ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
        if (n == 0) return false;  // closed before a whole request: nothing to answer
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          return false;
        }
        c.in.append(buffer, static_cast<size_t>(n));
        if (head_complete(c.in)) {
          c.out = respond(c.in, body);
          break;
        }
        if (c.in.size() > limits.max_request_bytes) {
          c.out = "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
          break;
        }
      }
      if (!c.out.empty()) {
        c.state = Connection::State::writing;
        c.deadline = now + limits.write_timeout;
        revents = POLLOUT;
      }
    }
    if (c.state == Connection::State::writing && (revents & (POLLOUT | POLLHUP | POLLERR))) {
      while (c.sent < c.out.size()) {
        const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
          return false;
        }
        c.sent += static_cast<size_t>(n);
      }
      ::shutdown(c.fd, SHUT_WR);  // the response is complete: FIN, then drain what the client still sends
      c.state = Connection::State::lingering;
      c.deadline = now + limits.linger;
      return true;
    }
    if (c.state == Connection::State::lingering && (revents & (POLLIN | POLLHUP | POLLERR))) {
      char buffer[4096];
      for (;;) {
        const ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
        if (n == 0) return false;
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      }
    }
    return true;
  }

  void loop() {
    std::vector<Connection> connections;
    std::vector<pollfd> fds;
    for (;;) {
      const auto now = Clock::now();
      // Connections past their deadline: a request that never came gets a 408 if the socket takes
      // it at once; any other state is simply closed.
      for (auto it = connections.begin(); it != connections.end();) {
        if (it->deadline > now) {
          ++it;
          continue;
        }
        if (it->state == Connection::State::reading) {
          static const char timeout[] = "HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
          (void)::send(it->fd, timeout, sizeof(timeout) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        ::close(it->fd);
        it = connections.erase(it);
      }
      fds.clear();
      fds.push_back({wake[0], POLLIN, 0});
      const bool accepting = connections.size() < limits.max_connections;
      fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});  // a negative fd is ignored by poll
      auto next = now + std::chrono::seconds(1);
      for (const auto& c : connections) {
        fds.push_back({c.fd, static_cast<short>(c.state == Connection::State::writing ? POLLOUT : POLLIN), 0});
        next = std::min(next, c.deadline);
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(wait, 0, 1000)));
      if (ready < 0 && errno != EINTR) {
        LOOM_LOG(error, "metrics server: poll failed (" << std::strerror(errno) << "); the endpoint stops");
        break;
      }
      if (ready <= 0) continue;
      if (fds[0].revents) break;  // the destructor asks the loop to end
      const auto at = Clock::now();
      for (size_t i = 0; i < connections.size(); ++i) {
        const short revents = fds[i + 2].revents;
        if (revents != 0 && !advance(connections[i], revents, at)) {
          ::close(connections[i].fd);
          connections[i].fd = -1;
        }
      }
      std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });
      if (accepting && (fds[1].revents & POLLIN)) {
        while (connections.size() < limits.max_connections) {
          const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) break;  // EAGAIN: none left; anything else (the client left, no descriptors): next round
          Connection c;
          c.fd = fd;
          c.deadline = at + limits.request_timeout;
          connections.push_back(std::move(c));
          // A client that sent its request with the connect is answered in this round.
          if (!advance(connections.back(), POLLIN, at)) {
            ::close(fd);
            connections.pop_back();
          }
        }
      }
    }
    for (const auto& c : connections) ::close(c.fd);
  }
};

MetricsServer::MetricsServer(const ListenAddress& where, std::function<std::string()> body, MetricsServerLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->limits = limits;
  impl_->body = std::move(body);
  impl_->bind_to(where);
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

MetricsServer::~MetricsServer() {
  const char stop = 1;
  (void)!::write(impl_->wake[1], &stop, 1);
  impl_->thread.join();
}

int MetricsServer::port() const { return impl_->port; }
const std::string& MetricsServer::host() const { return impl_->host; }

}  // namespace loom::detail
