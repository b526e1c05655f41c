// What the module wrapper needs beyond the reducer: the module's parameters with their names and
// trainability, frozen parameters broadcast at construction, the check that nothing changed since,
// buffer broadcast, and the cross-rank shape check the reducer shares.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "loom/comm/agreement.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"

namespace loom::detail {

void broadcast_tensors(Communicator& group, const std::vector<at::Tensor>& tensors, const char* purpose) {
  if (group.size() == 1 || tensors.empty()) return;
  at::NoGradGuard no_grad;
  InternalOperations internal(purpose);
  // Coalesced as c10d does: tensors of one dtype, in order, packed into buckets of at most 250 MB,
  // one broadcast per bucket (a ResNet's ~160 BatchNorm buffers are one or two collectives, not 160,
  // each paying a device backend's launch cost). A bucket of one contiguous tensor goes in place.
  constexpr int64_t kBucketBytes = int64_t{250} << 20;
  std::vector<std::vector<at::Tensor>> buckets;
  std::map<at::ScalarType, size_t> open;  // dtype -> the bucket being filled
  std::map<at::ScalarType, int64_t> filled;
  for (const auto& t : tensors) {
    at::Tensor data = t.detach();
    const at::ScalarType dtype = data.scalar_type();
    auto it = open.find(dtype);
    if (it == open.end() || filled[dtype] + static_cast<int64_t>(data.nbytes()) > kBucketBytes) {
      buckets.emplace_back();
      it = open.insert_or_assign(dtype, buckets.size() - 1).first;
      filled[dtype] = 0;
    }
    buckets[it->second].push_back(data);
    filled[dtype] += static_cast<int64_t>(data.nbytes());
  }
  // One bucket in flight at a time: the packed copy never holds more than one bucket of the model.
  for (auto& bucket : buckets) {
    if (bucket.size() == 1 && bucket[0].is_contiguous()) {
      group.broadcast(bucket[0], {0})->wait();
      continue;
    }
    std::vector<at::Tensor> flat;
    flat.reserve(bucket.size());
    for (const auto& t : bucket) flat.push_back(t.reshape({-1}));
    at::Tensor packed = at::cat(flat);
    group.broadcast(packed, {0})->wait();
    if (group.rank() == 0) continue;  // the root's tensors are what was sent
    int64_t offset = 0;
    for (auto& t : bucket) {
      t.copy_(packed.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void check_same_tensors_across_ranks(Communicator& group, const std::vector<at::Tensor>& tensors,
                                     const std::vector<std::string>& names, const char* kind, const std::string& where) {
  const int n = group.size();
  if (n == 1) return;
  const int64_t count_here = static_cast<int64_t>(tensors.size());
  const std::vector<int64_t> counts = all_gather_values(group, {count_here}, {"model check"});
  for (int r = 0; r < n; ++r)
    if (counts[r] != count_here)
      throw MismatchError(where + ": ranks hold different models: this rank has " + std::to_string(count_here) + " " +
                          kind + "s, rank " + std::to_string(r) + " has " + std::to_string(counts[r]));
  if (count_here == 0) return;
  // A row per tensor: dtype, rank, the first kShownDims sizes, and a hash of every size (so a
  // difference past the shown ones is caught too).
  constexpr int kShownDims = 7;
  constexpr int kRow = kShownDims + 3;
  std::vector<int64_t> mine(static_cast<size_t>(count_here * kRow), -1);
  for (int64_t i = 0; i < count_here; ++i) {
    const at::Tensor& t = tensors[i];
    int64_t* row = mine.data() + i * kRow;
    row[0] = static_cast<int64_t>(t.scalar_type());
    row[1] = t.dim();
    for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kShownDims); ++d) row[2 + d] = t.size(d);
    row[kRow - 1] = static_cast<int64_t>(fnv1a(t.sizes().data(), t.sizes().size() * sizeof(int64_t)));
  }
  const std::vector<int64_t> all = all_gather_values(group, mine, {"model check"});
  auto describe = [&](const int64_t* r) {
    std::ostringstream s;
    s << c10::toString(static_cast<c10::ScalarType>(r[0])) << " [";
    for (int64_t d = 0; d < std::min<int64_t>(r[1], kShownDims); ++d) s << (d ? ", " : "") << r[2 + d];
    if (r[1] > kShownDims) s << ", ...";
    s << "]";
    return s.str();
  };
  const int64_t* own = mine.data();
  const int64_t* theirs = all.data();
  for (int64_t i = 0; i < count_here; ++i)
    for (int r = 0; r < n; ++r) {
      const int64_t* row = theirs + (r * count_here + i) * kRow;
      if (!std::equal(row, row + kRow, own + i * kRow))
        throw MismatchError(where + ": ranks hold different models: " + kind + " " +
                            (i < static_cast<int64_t>(names.size()) ? names[i] : std::to_string(i)) + " is " +
                            describe(own + i * kRow) + " on this rank but " + describe(row) + " on rank " +
                            std::to_string(r));
    }
}

std::vector<at::Tensor> ModuleParameters::trainable_tensors() const {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < all.size(); ++i)
    if (trainable[i]) out.push_back(all[i]);
  return out;
}

std::vector<std::string> ModuleParameters::trainable_names() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < all.size(); ++i)
    if (trainable[i]) out.push_back(names[i]);
  return out;
}

ModuleParameters module_parameters(const torch::nn::Module& module) {
  ModuleParameters p;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    p.all.push_back(item.value());
    p.names.push_back(item.key());
    p.trainable.push_back(item.value().requires_grad());
  }
  return p;
}

void prepare_frozen_parameters(Communicator& group, const ModuleParameters& parameters) {
  std::vector<at::Tensor> frozen;
  std::vector<std::string> names;
  for (size_t i = 0; i < parameters.all.size(); ++i)
    if (!parameters.trainable[i]) {
      frozen.push_back(parameters.all[i]);
      names.push_back(parameters.names[i]);
    }
  check_same_tensors_across_ranks(group, frozen, names, "frozen parameter",
                                  group.context("DistributedDataParallel").prefix());
  broadcast_tensors(group, frozen, "frozen parameter broadcast");
}

void check_module_unchanged(const Communicator& group, const ModuleParameters& at_construction,
                            const torch::nn::Module& module) {
  check_parameters_unchanged(group, at_construction, module_parameters(module));
}

void check_parameters_unchanged(const Communicator& group, const ModuleParameters& at_construction,
                                const ModuleParameters& now) {
  const ErrorContext where = group.context("DistributedDataParallel forward");
  const std::string rebuild = " (build the DistributedDataParallel wrapper again after changing the model)";
  if (now.all.size() != at_construction.all.size())
    throw InvalidArgumentError(where("the module has " + std::to_string(now.all.size()) +
                                     " parameters but had " + std::to_string(at_construction.all.size()) +
                                     " when it was wrapped: parameters added or removed since are not reduced" +
                                     rebuild));
  for (size_t i = 0; i < now.all.size(); ++i) {
    const std::string& name = at_construction.names[i];
    if (!now.all[i].is_same(at_construction.all[i]))
      throw InvalidArgumentError(where("parameter " + name + " was replaced after construction" + rebuild));
    if (now.trainable[i] != at_construction.trainable[i])
      throw InvalidArgumentError(where("parameter " + name + " was " + (now.trainable[i] ? "unfrozen" : "frozen") +
                                       " after construction (requires_grad is now " +
                                       (now.trainable[i] ? "true" : "false") + ")" + rebuild));
  }
}

bool grad_enabled() { return at::GradMode::is_enabled(); }

}  // namespace loom::detail
