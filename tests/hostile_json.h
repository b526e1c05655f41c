// Hostile JSON values for the fuzz tests of what the project parses (checkpoint manifests): numbers
// at and beyond every range, the wrong types, empty containers. Shared by the unit and the
// distributed tests.
//
//   nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text);
//   loom::test::replace_random_leaf(doc["tensors"], rng);  // one value somewhere below
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

namespace loom::test {

inline const std::vector<nlohmann::ordered_json>& hostile_json_values() {
  static const std::vector<nlohmann::ordered_json> values = {
      -1,   0,     1,   0.5, -0.5, 1e308, -1e308, 1e-320, 2, 7, true, false, "x", "", int64_t(1) << 62,
      -(int64_t(1) << 62), uint64_t(UINT64_MAX), nullptr, nlohmann::ordered_json::array(),
      nlohmann::ordered_json::object()};
  return values;
}

// Replaces one of the non-null scalars below `j` (chosen by `rng`) with a hostile value. False
// when there is none.
inline bool replace_random_leaf(nlohmann::ordered_json& j, std::mt19937_64& rng) {
  std::vector<nlohmann::ordered_json*> leaves;
  std::function<void(nlohmann::ordered_json&)> walk = [&](nlohmann::ordered_json& node) {
    if (node.is_structured()) {
      for (auto& child : node) walk(child);
    } else if (!node.is_null()) {
      leaves.push_back(&node);
    }
  };
  walk(j);
  if (leaves.empty()) return false;
  const auto& values = hostile_json_values();
  *leaves[rng() % leaves.size()] = values[rng() % values.size()];
  return true;
}

}  // namespace loom::test
