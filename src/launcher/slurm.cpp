#include "launcher/slurm.h"

#include <cctype>
#include <charconv>
#include <set>

#include "launcher/launcher_args.h"

namespace loom::launcher {

namespace {

// Digits only, at most 9 of them (no overflow); -1 otherwise.
long long number(const std::string& text) {
  if (text.empty() || text.size() > 9) return -1;
  for (char c : text)
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  long long value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t pos = 0;
  for (;;) {
    size_t end = text.find(separator, pos);
    parts.push_back(text.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
    if (end == std::string::npos) return parts;
    pos = end + 1;
  }
}

struct Range {
  long long low, high;
  size_t width;
};

// One name of the list: literal text and bracket groups, alternating ("r", [1-2], "n", [1-2], "").
struct Pattern {
  std::vector<std::string> literals;      // one more than groups
  std::vector<std::vector<Range>> groups;
};

// The entries of a node list: split at the commas outside brackets (inside, they separate ranges).
std::vector<std::string> split_entries(const std::string& text, const std::string& where) {
  std::vector<std::string> items(1);
  int depth = 0;
  for (char c : text) {
    if (c == '[' && ++depth > 1) throw UsageError(where + "nested '[': expected name[ranges]");
    if (c == ']' && --depth < 0) throw UsageError(where + "']' without '['");
    if (c == ',' && depth == 0)
      items.emplace_back();
    else
      items.back() += c;
  }
  if (depth != 0) throw UsageError(where + "'[' without ']'");
  return items;
}

// One entry as literals and bracket groups; `count` is how many names it expands to (more than
// kMaxHosts stops the parse: "n[0-999999999]" is refused, not expanded).
Pattern parse_entry(const std::string& item, const std::string& where, size_t& count) {
  Pattern p;
  p.literals.emplace_back();
  for (size_t i = 0; i < item.size(); ++i) {
    if (item[i] != '[') {
      p.literals.back() += item[i];
      continue;
    }
    const size_t close = item.find(']', i);
    const std::string body = item.substr(i + 1, close - i - 1);
    std::vector<Range> group;
    size_t group_size = 0;
    for (const auto& part : split(body, ',')) {
      const size_t dash = part.find('-');
      const std::string low_text = part.substr(0, dash);
      const std::string high_text = dash == std::string::npos ? low_text : part.substr(dash + 1);
      Range r{number(low_text), number(high_text), low_text.size()};
      if (r.low < 0 || r.high < 0 || r.high < r.low)
        throw UsageError(where + "'[" + shown(body) + "]': expected ranges like 01-03,07 (found '" +
                         shown(part) + "')");
      group_size += static_cast<size_t>(r.high - r.low + 1);
      if (group_size > kMaxHosts) break;  // the check below says so
      group.push_back(r);
    }
    // Counted before anything is built: "n[0-999999999]" is refused, not expanded.
    if (group_size > kMaxHosts || count * group_size > kMaxHosts)
      count = kMaxHosts + 1;
    else
      count *= group_size;
    if (count > kMaxHosts) break;
    p.groups.push_back(std::move(group));
    p.literals.emplace_back();
    i = close;
  }
  return p;
}

// Every name of a pattern, appended to `names`.
void expand_entry(const Pattern& p, const std::string& where, std::vector<std::string>& names) {
  std::vector<std::string> partial = {p.literals[0]};
  for (size_t g = 0; g < p.groups.size(); ++g) {
    std::vector<std::string> longer;
    for (const auto& prefix : partial)
      for (const auto& r : p.groups[g])
        for (long long n = r.low; n <= r.high; ++n) {
          std::string digits = std::to_string(n);
          if (digits.size() < r.width) digits.insert(0, r.width - digits.size(), '0');
          longer.push_back(prefix + digits + p.literals[g + 1]);
        }
    partial = std::move(longer);
  }
  for (auto& name : partial) {
    if (!valid_host_name(name)) throw UsageError(where + "'" + shown(name) + "' is not a host name");
    names.push_back(std::move(name));
  }
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& text, const std::string& variable) {
  const std::string where = variable + "='" + shown(text) + "': ";
  if (text.size() > kMaxSlurmVariableBytes)
    throw UsageError(variable + ": more than " + std::to_string(kMaxSlurmVariableBytes) +
                     " bytes: exceeds the limit (docs/limits.md)");
  std::vector<Pattern> patterns;
  size_t total = 0;
  for (const auto& item : split_entries(text, where)) {
    if (item.empty()) throw UsageError(where + "an empty entry: expected host or host[ranges] between commas");
    size_t count = 1;
    patterns.push_back(parse_entry(item, where, count));
    total += count;
    if (total > kMaxHosts)
      throw UsageError(where + "more than " + std::to_string(kMaxHosts) + " hosts: exceeds the limit (docs/limits.md)");
  }
  std::vector<std::string> names;
  names.reserve(total);
  for (const auto& p : patterns) expand_entry(p, where, names);
  return names;
}

std::vector<int> expand_slurm_counts(const std::string& text, const std::string& variable) {
  const std::string where = variable + "='" + shown(text) + "': ";
  if (text.size() > kMaxSlurmVariableBytes)
    throw UsageError(variable + ": more than " + std::to_string(kMaxSlurmVariableBytes) +
                     " bytes: exceeds the limit (docs/limits.md)");
  std::vector<int> counts;
  for (const auto& item : split(text, ',')) {
    const size_t paren = item.find('(');
    long long each = number(item.substr(0, paren)), times = 1;
    if (paren != std::string::npos) {
      const std::string repeat = item.substr(paren);
      times = repeat.size() > 3 && repeat.compare(0, 2, "(x") == 0 && repeat.back() == ')'
                  ? number(repeat.substr(2, repeat.size() - 3))
                  : -1;
    }
    if (each < 1 || each > 1000000 || times < 1)
      throw UsageError(where + "'" + shown(item) + "': expected N or N(xM), N from 1 to 1000000");
    if (counts.size() + static_cast<size_t>(times) > kMaxHosts)
      throw UsageError(where + "more than " + std::to_string(kMaxHosts) + " nodes: exceeds the limit (docs/limits.md)");
    counts.insert(counts.end(), static_cast<size_t>(times), static_cast<int>(each));
  }
  return counts;
}

std::optional<SlurmHosts> hosts_from_slurm(const std::map<std::string, std::string>& environment) {
  auto find = [&](const char* name) -> const std::string* {
    auto it = environment.find(name);
    return it == environment.end() ? nullptr : &it->second;
  };
  const char* list_name = find("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
  const std::string* list = find(list_name);
  if (!list) return std::nullopt;
  // Open MPI's Slurm support takes the tasks per node; an allocation made without --ntasks has
  // only its CPUs per node.
  const char* counts_name = find("SLURM_TASKS_PER_NODE") ? "SLURM_TASKS_PER_NODE" : "SLURM_JOB_CPUS_PER_NODE";
  const std::string* counts_text = find(counts_name);
  if (!counts_text)
    throw UsageError(std::string(list_name) +
                     " is set but neither SLURM_TASKS_PER_NODE nor SLURM_JOB_CPUS_PER_NODE is: cannot tell the slots "
                     "of the allocation's hosts; give -H host:slots,...");
  std::vector<std::string> names = expand_slurm_nodelist(*list, list_name);
  std::vector<int> counts = expand_slurm_counts(*counts_text, counts_name);
  if (counts.size() != names.size())
    throw UsageError(std::string(list_name) + " names " + std::to_string(names.size()) + " host(s) but " +
                     counts_name + "='" + shown(*counts_text) + "' gives slots for " +
                     std::to_string(counts.size()) + ": expected one count per host");
  SlurmHosts out;
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!seen.insert(names[i]).second)
      throw UsageError(std::string(list_name) + ": host '" + names[i] + "' is listed twice");
    out.hosts.push_back({names[i], counts[i]});
  }
  out.note = "hosts from the Slurm allocation (" + std::string(list_name) + ", " + counts_name + "): " +
             std::to_string(out.hosts.size()) + " host(s)";
  return out;
}

}  // namespace loom::launcher
