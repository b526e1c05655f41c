#include "runtime/agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "core/env.h"
#include "loom/error.h"

namespace loom::detail {
namespace {

constexpr size_t kValueBytes = 120;  // values longer than this are compared by hash, shown truncated

int64_t hash_of(const std::optional<std::string>& value) {
  uint64_t h = value ? 14695981039346656037ull : 1;
  if (value)
    for (unsigned char c : *value) {
      h ^= c;
      h *= 1099511628211ull;
    }
  return static_cast<int64_t>(h);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

}  // namespace

void agree_on_configuration(Communicator& world, const Environment& env) {
  const auto& variables = env::all_variables();
  const int64_t v = static_cast<int64_t>(variables.size());
  const int n = world.size();
  std::vector<std::optional<std::string>> mine;
  at::Tensor hashes = at::empty({v}, at::kLong);
  for (int64_t i = 0; i < v; ++i) {
    // A per-process variable counts as unset everywhere: its values may differ.
    mine.push_back(variables[i].per_process ? std::nullopt : env::raw(env, variables[i].name));
    hashes.data_ptr<int64_t>()[i] = hash_of(mine.back());
  }
  at::Tensor all = at::empty({n * v}, at::kLong);
  {
    InternalOperations internal("configuration agreement");
    world.all_gather(all, hashes)->wait();
  }
  const int64_t* h = all.data_ptr<int64_t>();
  std::vector<int64_t> differing;
  for (int64_t i = 0; i < v; ++i)
    for (int r = 1; r < n; ++r)
      if (h[r * v + i] != h[i]) {
        differing.push_back(i);
        break;
      }
  if (differing.empty()) return;

  // Every rank found the same differences: all of them now exchange those values to name them.
  const int64_t d = static_cast<int64_t>(differing.size());
  at::Tensor values = at::zeros({d * static_cast<int64_t>(kValueBytes)}, at::kByte);
  for (int64_t k = 0; k < d; ++k) {
    const auto& value = mine[differing[k]];
    char* slot = reinterpret_cast<char*>(values.data_ptr<uint8_t>()) + k * kValueBytes;
    if (value) std::memcpy(slot + 1, value->data(), std::min(value->size(), kValueBytes - 1));
    slot[0] = value ? 1 : 0;  // set or unset
  }
  at::Tensor gathered = at::empty({n * d * static_cast<int64_t>(kValueBytes)}, at::kByte);
  {
    InternalOperations internal("configuration agreement");
    world.all_gather(gathered, values)->wait();
  }
  std::string text;
  for (int64_t k = 0; k < d; ++k) {
    std::map<std::string, std::vector<int>> by_value;
    for (int r = 0; r < n; ++r) {
      const char* slot = reinterpret_cast<const char*>(gathered.data_ptr<uint8_t>()) + (r * d + k) * kValueBytes;
      const std::string shown = slot[0] ? "'" + std::string(slot + 1, strnlen(slot + 1, kValueBytes - 1)) + "'" : "unset";
      by_value[shown].push_back(r);
    }
    const char* name = variables[differing[k]].name;
    text += std::string(text.empty() ? "" : "; ") + name + " is not the same on every rank:";
    bool first = true;
    for (const auto& [shown, ranks] : by_value) {
      text += std::string(first ? " " : ", ") + shown + " on " + ranks_text(ranks);
      first = false;
    }
  }
  text += " (set every LOOM_ variable on every rank: with mpirun pass -x NAME, or start with loomrun, which forwards "
          "them)";
  throw ConfigError(ErrorContext("init")(text));
}

std::vector<std::string> gather_strings(Communicator& world, const std::string& mine, const char* purpose) {
  const int n = world.size();
  InternalOperations internal(purpose);
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({n}, at::kLong);
  world.all_gather(lengths, length)->wait();
  int64_t longest = 1;
  for (int r = 0; r < n; ++r) longest = std::max(longest, lengths.data_ptr<int64_t>()[r]);
  at::Tensor text = at::zeros({longest}, at::kByte);
  std::memcpy(text.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  world.all_gather(all, text)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest,
                     static_cast<size_t>(lengths.data_ptr<int64_t>()[r]));
  return out;
}

void agree_all_ok(Communicator& world, const std::string& my_problem, const std::string& what) {
  at::Tensor mine = at::full({1}, my_problem.empty() ? 0 : 1, at::kInt);
  at::Tensor all = at::empty({world.size()}, at::kInt);
  {
    InternalOperations internal(what.c_str());
    world.all_gather(all, mine)->wait();
  }
  std::vector<int> failing;
  for (int r = 0; r < world.size(); ++r)
    if (all.data_ptr<int32_t>()[r] != 0) failing.push_back(r);
  if (failing.empty()) return;
  if (!my_problem.empty()) throw ConfigError(my_problem);
  throw ConfigError(ErrorContext("init")(what + " failed on " + ranks_text(failing) + " (see their messages)"));
}

}  // namespace loom::detail
