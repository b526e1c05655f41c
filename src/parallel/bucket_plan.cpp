#include "parallel/bucket_plan.h"

#include <map>
#include <tuple>

namespace loom::detail {

std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& parameters,
                                              const std::vector<size_t>& order, size_t first_cap_bytes,
                                              size_t cap_bytes) {
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    bool closed_one = false;  // a bucket of this kind was already closed: later ones use cap_bytes
  };
  using Key = std::tuple<int, int, int>;  // dtype, device type, device index
  std::map<Key, Open> open;
  std::vector<Key> kinds_in_order;
  std::vector<std::vector<size_t>> buckets;
  for (size_t index : order) {
    const at::Tensor& p = parameters[index];
    Key key{static_cast<int>(p.scalar_type()), static_cast<int>(p.device().type()), p.device().index()};
    auto [it, inserted] = open.try_emplace(key);
    if (inserted) kinds_in_order.push_back(key);
    Open& bucket = it->second;
    bucket.members.push_back(index);
    bucket.bytes += p.numel() * p.element_size();
    const size_t cap = bucket.closed_one ? cap_bytes : first_cap_bytes;
    if (bucket.bytes >= cap) {
      buckets.push_back(std::move(bucket.members));
      bucket.members.clear();
      bucket.bytes = 0;
      bucket.closed_one = true;
    }
  }
  for (const Key& key : kinds_in_order) {
    Open& bucket = open[key];
    if (!bucket.members.empty()) buckets.push_back(std::move(bucket.members));
  }
  return buckets;
}

}  // namespace loom::detail
