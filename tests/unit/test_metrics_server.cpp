// The Prometheus endpoint's HTTP server (src/train/metrics_server.h) against real clients on
// loopback sockets: silent, slow (a byte a second), malformed, oversized and 100 at once. Each
// test is bounded in time; the server must never wait on a client, neither to serve another one
// nor to stop.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "loom/error.h"
#include "train/metrics_server.h"
#include "../time_scale.h"

namespace {

using Clock = std::chrono::steady_clock;
using loom::detail::ListenAddress;
using loom::detail::MetricsServer;
using loom::detail::MetricsServerLimits;
using loom::detail::parse_listen_address;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

const std::string kBody = "loom_steps_total{rank=\"0\"} 7\n";

// A connected client socket (blocking), with receive and send timeouts so no test can hang.
int connect_to(int port, double timeout_s = 10) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{static_cast<time_t>(timeout_s), static_cast<suseconds_t>((timeout_s - long(timeout_s)) * 1e6)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Everything the server sends until it closes (or the socket's receive timeout).
std::string read_all(int fd) {
  std::string out;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

std::string request(int port, const std::string& text) {
  const int fd = connect_to(port);
  if (fd < 0) return "connect failed";
  send_all(fd, text);
  std::string reply = read_all(fd);
  ::close(fd);
  return reply;
}

std::string status_line(const std::string& reply) { return reply.substr(0, reply.find("\r\n")); }

MetricsServerLimits quick_limits() {
  MetricsServerLimits l;
  l.request_timeout = std::chrono::milliseconds(1500);
  l.write_timeout = std::chrono::milliseconds(1500);
  l.linger = std::chrono::milliseconds(300);
  return l;
}

}  // namespace

TEST(MetricsAddress, AcceptsTheDocumentedForms) {
  auto a = parse_listen_address("9400", "LOOM_METRICS");
  EXPECT_EQ(a.host, "127.0.0.1");  // loopback unless an address is given
  EXPECT_EQ(a.port, 9400);
  a = parse_listen_address("0.0.0.0:9400", "LOOM_METRICS");
  EXPECT_EQ(a.host, "0.0.0.0");
  a = parse_listen_address("*:1", "LOOM_METRICS");
  EXPECT_EQ(a.host, "0.0.0.0");
  EXPECT_EQ(a.port, 1);
  a = parse_listen_address("10.1.2.3:65535", "LOOM_METRICS");
  EXPECT_EQ(a.host, "10.1.2.3");
  a = parse_listen_address("[::1]:9400", "LOOM_METRICS");
  EXPECT_EQ(a.host, "::1");
}

TEST(MetricsAddress, RefusesAnythingElseNamingTheVariable) {
  for (const char* bad : {"", "9400abc", "0", "65536", "99999999999999999999", "-1", " 9400", "localhost:9400",
                          "::1:9400", "[::1]9400", "[nonsense]:9400", "1.2.3.4:", ":9400", "1.2.3.4:94x0",
                          "300.1.1.1:9400", "[::1]:0"}) {
    try {
      parse_listen_address(bad, "LOOM_METRICS");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const loom::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("LOOM_METRICS"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("expected N, ADDR:N"), std::string::npos) << e.what();
    }
  }
}

TEST(MetricsServer, AnswersTheScrapeAndRefusesWhatIsNotOne) {
  MetricsServer server({"127.0.0.1", 0}, [] { return kBody; }, quick_limits());
  ASSERT_GT(server.port(), 0);
  const std::string ok = request(server.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  EXPECT_EQ(status_line(ok), "HTTP/1.1 200 OK");
  EXPECT_NE(ok.find("Content-Length: " + std::to_string(kBody.size()) + "\r\n"), std::string::npos) << ok;
  EXPECT_EQ(ok.substr(ok.size() - kBody.size()), kBody);
  EXPECT_EQ(status_line(request(server.port(), "GET /metrics?x=1 HTTP/1.0\n\n")), "HTTP/1.1 200 OK");
  const std::string head = request(server.port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(status_line(head), "HTTP/1.1 200 OK");
  EXPECT_EQ(head.find(kBody), std::string::npos);
  EXPECT_EQ(status_line(request(server.port(), "GET /other HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  EXPECT_EQ(status_line(request(server.port(), "POST /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_EQ(status_line(request(server.port(), "\x01\x02garbage\r\n\r\n")), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(status_line(request(server.port(), "GET  /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 400 Bad Request");
  // A request head that never ends: refused once it passes the limit, not buffered without bound.
  const auto start = Clock::now();
  const std::string huge = request(server.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(100000, 'a'));
  EXPECT_EQ(status_line(huge), "HTTP/1.1 431 Request Header Fields Too Large");
  EXPECT_LT(seconds_since(start), loom::test::time_bound(1.0)) << loom::test::time_scale_note();
  // The server still answers afterwards.
  EXPECT_EQ(status_line(request(server.port(), "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
}

TEST(MetricsServer, ASilentClientDelaysNoOtherScrapeAndIsClosedAtItsDeadline) {
  MetricsServer server({"127.0.0.1", 0}, [] { return kBody; }, quick_limits());
  const int silent = connect_to(server.port());
  ASSERT_GE(silent, 0);
  const auto start = Clock::now();
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(status_line(request(server.port(), "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
  EXPECT_LT(seconds_since(start), loom::test::time_bound(0.5)) << "five scrapes behind a silent client" << loom::test::time_scale_note();
  // The silent client is answered 408 and closed at the 1.5 s request deadline.
  const std::string reply = read_all(silent);
  const double closed_after = seconds_since(start);
  EXPECT_EQ(status_line(reply), "HTTP/1.1 408 Request Timeout");
  EXPECT_GT(closed_after, 1.0);
  EXPECT_LT(closed_after, 1.5 + loom::test::time_bound(1.5)) << loom::test::time_scale_note();
  ::close(silent);
}

TEST(MetricsServer, ASlowClientSendingAByteASecondIsCutOffAndDelaysNoOne) {
  MetricsServer server({"127.0.0.1", 0}, [] { return kBody; }, quick_limits());
  const int slow = connect_to(server.port());
  ASSERT_GE(slow, 0);
  std::atomic<bool> cut{false};
  std::atomic<int> bytes_sent{0};
  std::thread slowloris([&] {
    const std::string text = "GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaa\r\n\r\n";
    for (char c : text) {
      if (::send(slow, &c, 1, MSG_NOSIGNAL) != 1) {
        cut = true;
        return;
      }
      ++bytes_sent;
      pollfd p{slow, POLLIN, 0};
      if (::poll(&p, 1, 1000) > 0) {  // the server answered (408) or closed: stop
        cut = true;
        return;
      }
    }
  });
  const auto start = Clock::now();
  for (int i = 0; i < 4; ++i) {
    const auto t = Clock::now();
    EXPECT_EQ(status_line(request(server.port(), "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
    EXPECT_LT(seconds_since(t), loom::test::time_bound(0.2)) << "a scrape behind a slow client" << loom::test::time_scale_note();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  slowloris.join();
  EXPECT_TRUE(cut.load());
  EXPECT_LE(bytes_sent.load(), 3) << "the request deadline (1.5 s) should cut a byte-a-second client";
  EXPECT_LT(seconds_since(start), 1.5 + loom::test::time_bound(2.5)) << loom::test::time_scale_note();
  ::close(slow);
}

TEST(MetricsServer, HundredConcurrentScrapesAllAnswered) {
  std::atomic<int> renders{0};
  MetricsServer server({"127.0.0.1", 0}, [&] {
    ++renders;
    return kBody;
  });  // default limits: 64 at once, the rest wait in the backlog
  constexpr int kClients = 100;
  std::atomic<int> ok{0};
  std::vector<std::thread> clients;
  const auto start = Clock::now();
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&] {
      const std::string reply = request(server.port(), "GET /metrics HTTP/1.1\r\n\r\n");
      if (status_line(reply) == "HTTP/1.1 200 OK" && reply.size() >= kBody.size() &&
          reply.substr(reply.size() - kBody.size()) == kBody)
        ++ok;
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), kClients);
  EXPECT_EQ(renders.load(), kClients);
  EXPECT_LT(seconds_since(start), loom::test::time_bound(5.0)) << loom::test::time_scale_note();
}

TEST(MetricsServer, StopsAtOnceWhateverTheClientsDo) {
  auto server = std::make_unique<MetricsServer>(ListenAddress{"127.0.0.1", 0}, [] { return kBody; });
  const int port = server->port();
  const int silent = connect_to(port);
  const int slow = connect_to(port);
  ASSERT_GE(silent, 0);
  ASSERT_GE(slow, 0);
  ASSERT_TRUE(send_all(slow, "GET /met"));
  // A client that asks and then never reads: its response sits in the socket buffers.
  const int deaf = connect_to(port);
  ASSERT_TRUE(send_all(deaf, "GET /metrics HTTP/1.1\r\n\r\n"));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = Clock::now();
  server.reset();
  EXPECT_LT(seconds_since(start), loom::test::time_bound(0.1)) << "the destructor waited on a client" << loom::test::time_scale_note();
  // Every connection is closed: the silent one reads EOF (or a reset) at once.
  const auto t = Clock::now();
  read_all(silent);
  EXPECT_LT(seconds_since(t), loom::test::time_bound(1.0)) << loom::test::time_scale_note();
  for (int fd : {silent, slow, deaf}) ::close(fd);
}

TEST(MetricsServer, ABodyThatThrowsIsA500) {
  MetricsServer server({"127.0.0.1", 0}, []() -> std::string { throw std::runtime_error("no numbers"); });
  const std::string reply = request(server.port(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(status_line(reply), "HTTP/1.1 500 Internal Server Error");
  EXPECT_NE(reply.find("no numbers"), std::string::npos);
}

TEST(MetricsServer, ABusyPortIsAConfigErrorNamingTheAddress) {
  MetricsServer first({"127.0.0.1", 0}, [] { return kBody; });
  try {
    MetricsServer second({"127.0.0.1", first.port()}, [] { return kBody; });
    FAIL() << "bound a port in use";
  } catch (const loom::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(first.port())), std::string::npos) << e.what();
  }
}
