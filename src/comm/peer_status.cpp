#include "comm/peer_status.h"

#include <map>
#include <mutex>
#include <sstream>

#include "comm/flight_recorder.h"
#include "loom/comm/agreement.h"

namespace loom::detail::peers {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<uint64_t, std::weak_ptr<FlightRecorder>> recorders;
  std::map<uint64_t, int> ordinals;  // per (name, members): communicators made so far
  Transport transport;
};

Registry& registry() {
  static Registry* r = new Registry();  // used by the watchdog thread until the process ends
  return *r;
}

}  // namespace

uint64_t register_communicator(const std::string& name, const std::vector<int>& members,
                               std::weak_ptr<FlightRecorder> recorder) {
  uint64_t identity = fnv1a(name);
  identity = fnv1a(members.data(), members.size() * sizeof(int), identity);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int ordinal = r.ordinals[identity]++;
  const uint64_t key = fnv1a(&ordinal, sizeof(ordinal), identity);
  r.recorders[key] = std::move(recorder);
  return key;
}

void unregister_communicator(uint64_t key) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.recorders.erase(key);
}

Answer answer(const Query& query) {
  std::shared_ptr<FlightRecorder> recorder;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.recorders.find(query.key);
    if (it != r.recorders.end()) recorder = it->second.lock();
  }
  Answer a;
  if (!recorder) return a;
  a.known = true;
  const auto progress = recorder->progress();
  a.last_called = query.internal ? progress.internal : progress.collective;
  a.called = recorder->find(query.internal, query.seq);
  return a;
}

std::vector<Reached> reached_by_communicator() {
  std::vector<std::pair<uint64_t, std::shared_ptr<FlightRecorder>>> recorders;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [key, weak] : r.recorders)
      if (auto recorder = weak.lock()) recorders.emplace_back(key, std::move(recorder));
  }
  std::vector<Reached> reached;
  for (const auto& [key, recorder] : recorders) {
    const auto done = recorder->completed();
    reached.push_back({key, done.collective, done.internal});
  }
  return reached;
}

void set_transport(Transport transport) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.transport = std::move(transport);
}

void clear_transport() { set_transport(nullptr); }

std::optional<std::vector<std::optional<Answer>>> ask(const std::vector<int>& ranks, const Query& query,
                                                      Clock::time_point deadline) {
  Transport transport;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    transport = r.transport;
  }
  if (!transport) return std::nullopt;
  return transport(ranks, query, deadline);
}

std::string conflicting_calls(const std::vector<int>& members, int self, const OpInfo& mine, uint64_t my_fingerprint,
                              const std::vector<std::optional<Answer>>& answers) {
  const SignatureWords own = signature_words(mine, my_fingerprint);
  std::ostringstream different;
  for (size_t r = 0; r < members.size() && r < answers.size(); ++r) {
    if (static_cast<int>(r) == self) continue;
    const auto& a = answers[r];
    if (!a || !a->known || a->last_called < static_cast<int64_t>(mine.seq) || !a->called) continue;
    // All but the rolling fingerprint: a different history with the same call still completes.
    if (std::equal(own.begin(), own.end() - 1, a->called->begin())) continue;
    different << (different.tellp() == 0 ? "" : ", ") << "rank " << members[r] << " called "
              << info_from_words(*a->called).signature();
  }
  return different.str();
}

std::string describe_laggards(const std::vector<int>& members, int self, const OpInfo& mine, uint64_t my_fingerprint,
                              const std::vector<std::optional<Answer>>& answers) {
  const SignatureWords own = signature_words(mine, my_fingerprint);
  std::ostringstream behind, silent, different;
  int silent_count = 0, behind_count = 0;
  auto add = [](std::ostringstream& s, const std::string& item) { s << (s.tellp() == 0 ? "" : ", ") << item; };
  const std::string numbering = mine.internal ? "#" : "seq=";
  for (size_t r = 0; r < members.size() && r < answers.size(); ++r) {
    if (static_cast<int>(r) == self) continue;
    const std::string who = std::to_string(members[r]);
    const auto& a = answers[r];
    if (!a) {
      add(silent, who);
      ++silent_count;
    } else if (!a->known) {
      add(behind, who + " (has not created group " + mine.group + ")");
      ++behind_count;
    } else if (a->last_called < static_cast<int64_t>(mine.seq)) {
      add(behind, who + (a->last_called < 0 ? std::string(" (called nothing on it yet)")
                                            : " (last called " + numbering + std::to_string(a->last_called) + ")"));
      ++behind_count;
    } else if (a->called && (*a->called)[7] != own[7] && std::equal(own.begin(), own.end() - 1, a->called->begin())) {
      add(different, "rank " + who + " made the same call after different earlier ones (fingerprints differ)");
    }
  }
  std::string text;
  if (behind_count > 0) text += std::string(behind_count == 1 ? "rank" : "ranks") + " not arrived: " + behind.str();
  if (silent_count > 0)
    text += (text.empty() ? "" : "; ") + std::string(silent_count == 1 ? "no answer from rank " : "no answer from ranks ") +
            silent.str() + " (stopped, dead, or not running torchloom)";
  const std::string conflicts = conflicting_calls(members, self, mine, my_fingerprint, answers);
  if (!conflicts.empty() || different.tellp() > 0)
    text += (text.empty() ? "" : "; ") + std::string("mismatch: this rank called ") + mine.signature() + " but " +
            conflicts + (conflicts.empty() || different.tellp() == 0 ? "" : ", ") + different.str();
  if (text.empty()) text = "every rank has called it (the operation itself is slow or stuck in the network)";
  return text;
}

}  // namespace loom::detail::peers
