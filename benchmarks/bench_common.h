// What every benchmark program shares: the median of timed samples and writing the JSON result.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom::bench {

// Machines are noisy: benchmarks report medians, never means.
// "4 B", "64 KB", "16 MB": a message size as the benchmarks' tables print it.
inline std::string human_bytes(int64_t bytes) {
  char text[32];
  if (bytes >= (1 << 20))
    std::snprintf(text, sizeof(text), "%lld MB", static_cast<long long>(bytes >> 20));
  else if (bytes >= 1024)
    std::snprintf(text, sizeof(text), "%lld KB", static_cast<long long>(bytes >> 10));
  else
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  return text;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return 0.0;
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Writes doc to path; false (and a message naming the program) when the file cannot be written.
inline bool write_json(const std::string& path, const nlohmann::json& doc, const char* program) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  if (!out) {
    std::fprintf(stderr, "%s: could not write %s\n", program, path.c_str());
    return false;
  }
  return true;
}

}  // namespace loom::bench
