#include "runtime/agreement.h"

#include <algorithm>
#include <map>
#include <optional>

#include "loom/env.h"
#include "loom/comm/agreement.h"
#include "loom/error.h"

namespace loom::detail {
namespace {

constexpr size_t kValueBytes = 119;  // values longer than this are compared by hash, shown truncated

int64_t hash_of(const std::optional<std::string>& value) {
  return value ? static_cast<int64_t>(fnv1a(*value)) : 1;
}

}  // namespace

void agree_on_configuration(Communicator& world, const Environment& env) {
  const auto& variables = env::all_variables();
  const int64_t v = static_cast<int64_t>(variables.size());
  const int n = world.size();
  std::vector<std::optional<std::string>> mine;
  std::vector<int64_t> hashes;
  for (int64_t i = 0; i < v; ++i) {
    // A per-process variable counts as unset everywhere: its values may differ.
    mine.push_back(variables[i].per_process ? std::nullopt : env::raw(env, variables[i].name));
    hashes.push_back(hash_of(mine.back()));
  }
  const std::vector<int64_t> h = all_gather_values(world, hashes, {"configuration agreement"});
  std::vector<int64_t> differing;
  for (int64_t i = 0; i < v; ++i)
    for (int r = 1; r < n; ++r)
      if (h[r * v + i] != h[i]) {
        differing.push_back(i);
        break;
      }
  if (differing.empty()) return;

  // Every rank found the same differences: all of them now exchange those values to name them, one
  // string per rank: per differing variable, '1' and the value (cut) when set, '0' when unset, each
  // ended by a NUL (which no environment value contains).
  std::string values;
  for (int64_t k : differing) {
    const auto& value = mine[k];
    values += value ? "1" + value->substr(0, kValueBytes) : "0";
    values += '\0';
  }
  const std::vector<std::string> gathered = all_gather_strings(world, values, {"configuration agreement"});
  std::string text;
  for (size_t k = 0; k < differing.size(); ++k) {
    std::map<std::string, std::vector<int>> by_value;
    for (int r = 0; r < n; ++r) {
      // The k-th NUL-ended field of rank r's string.
      size_t begin = 0;
      for (size_t skip = 0; skip < k; ++skip) begin = gathered[r].find('\0', begin) + 1;
      const std::string field = gathered[r].substr(begin, gathered[r].find('\0', begin) - begin);
      const std::string shown = field.size() && field[0] == '1' ? "'" + field.substr(1) + "'" : "unset";
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

void agree_all_ok(Communicator& world, const std::string& my_problem, const std::string& what) {
  const std::vector<int> failing = ranks_reporting(world, !my_problem.empty(), {what.c_str()});
  if (failing.empty()) return;
  if (!my_problem.empty()) throw ConfigError(my_problem);
  throw ConfigError(ErrorContext("init")(what + " failed on " + ranks_text(failing) + " (see their messages)"));
}

}  // namespace loom::detail
