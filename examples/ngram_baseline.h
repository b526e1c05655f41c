// Byte-level n-gram baselines with interpolated Kneser-Ney smoothing (absolute discount 0.75, the
// standard choice): the held-out cross-entropy a count model of order 1, 2 or 3 reaches on the
// same bytes as the language model's held-out loss, to read that loss against.
//
//   KneserNey trigram(training_text, 3);
//   double nats = trigram.nats_per_byte(text, target_positions);  // mean -log p(byte | 2 before)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

class KneserNey {
 public:
  KneserNey(std::string_view train, int order) : order_(order), counts_(order + 1), totals_(order + 1), types_(order + 1) {
    // The highest order counts n-grams; the lower ones count distinct left extensions
    // (continuation counts), which is what makes Kneser-Ney's lower orders good back-offs.
    for (size_t i = 0; i + order <= train.size(); ++i) ++counts_[order][key(&train[i], order)];
    for (int k = order; k > 1; --k)
      for (const auto& [gram, count] : counts_[k]) ++counts_[k - 1][gram & mask(k - 1)];
    for (int k = 1; k <= order; ++k)
      for (const auto& [gram, count] : counts_[k]) {
        const uint32_t context = gram >> 8;
        totals_[k][context] += count;
        ++types_[k][context];
      }
  }

  // Mean -log p(text[p] | the order - 1 bytes before it) over `positions` (each >= order - 1).
  double nats_per_byte(std::string_view text, const std::vector<size_t>& positions) const {
    double nats = 0;
    for (size_t p : positions) nats -= std::log(probability(&text[p - (order_ - 1)], order_));
    return positions.empty() ? 0.0 : nats / static_cast<double>(positions.size());
  }

 private:
  static constexpr double kDiscount = 0.75;

  // k bytes as one key; the last byte in the low 8 bits, its context above.
  static uint32_t key(const char* bytes, int k) {
    uint32_t v = 0;
    for (int i = 0; i < k; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
    return v;
  }
  static uint32_t mask(int k) { return k >= 4 ? 0xffffffffu : (1u << (8 * k)) - 1; }

  // p(gram's last byte | its k - 1 bytes of context); `gram` points at the k bytes.
  double probability(const char* gram, int k) const {
    if (k == 0) return 1.0 / 256;
    const double lower = probability(gram + 1, k - 1);
    const uint32_t g = key(gram, k), context = g >> 8;
    auto total = totals_[k].find(context);
    if (total == totals_[k].end()) return lower;
    auto count = counts_[k].find(g);
    const double c = count == counts_[k].end() ? 0.0 : count->second;
    const double t = total->second, types = types_[k].at(context);
    return std::max(c - kDiscount, 0.0) / t + kDiscount * types / t * lower;
  }

  int order_;
  std::vector<std::unordered_map<uint32_t, uint32_t>> counts_, totals_, types_;
};
