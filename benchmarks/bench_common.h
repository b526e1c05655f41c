// What every benchmark program shares: the median of timed samples and writing the JSON result.
#pragma once

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom::bench {

// Machines are noisy: benchmarks report medians, never means.
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
