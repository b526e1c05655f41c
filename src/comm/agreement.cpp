#include "loom/comm/agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>

namespace loom {

namespace {

// The values as a tensor on the communicator's device (an NCCL group takes only its GPU's).
at::Tensor on_device(Communicator& comm, const at::Tensor& host) {
  return comm.device().is_cpu() ? host : host.to(comm.device());
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor host = t.cpu().contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

at::Tensor longs(c10::ArrayRef<int64_t> values) {
  return values.empty() ? at::empty({0}, at::kLong) : at::tensor(values, at::kLong);
}

}  // namespace

uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= kFnvPrime;
  }
  return hash;
}

std::vector<int64_t> all_gather_values(Communicator& comm, c10::ArrayRef<int64_t> mine, const AgreementOptions& options) {
  if (mine.empty()) return {};
  detail::InternalOperations internal(options.purpose);
  at::Tensor local = on_device(comm, longs(mine));
  at::Tensor all = at::empty({comm.size() * static_cast<int64_t>(mine.size())}, local.options());
  AllGatherOptions o;
  o.timeout = options.timeout;
  comm.all_gather(all, local, o)->wait();
  return to_vector(all);
}

std::vector<int64_t> all_reduce_values(Communicator& comm, c10::ArrayRef<int64_t> mine, ReduceOp op,
                                       const AgreementOptions& options) {
  if (mine.empty()) return {};
  detail::InternalOperations internal(options.purpose);
  at::Tensor values = on_device(comm, longs(mine));
  AllReduceOptions o;
  o.op = op;
  o.timeout = options.timeout;
  comm.all_reduce(values, o)->wait();
  return to_vector(values);
}

std::vector<int64_t> broadcast_values(Communicator& comm, c10::ArrayRef<int64_t> values, int root,
                                      const AgreementOptions& options) {
  if (values.empty()) return {};
  detail::InternalOperations internal(options.purpose);
  at::Tensor t = on_device(comm, longs(values));
  BroadcastOptions o;
  o.root = root;
  o.timeout = options.timeout;
  comm.broadcast(t, o)->wait();
  return to_vector(t);
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine, const AgreementOptions& options) {
  const int n = comm.size();
  const std::vector<int64_t> lengths = all_gather_values(comm, {static_cast<int64_t>(mine.size())}, options);
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  at::Tensor text = at::zeros({longest}, at::kByte);
  std::memcpy(text.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  {
    detail::InternalOperations internal(options.purpose);
    AllGatherOptions o;
    o.timeout = options.timeout;
    at::Tensor local = on_device(comm, text);
    at::Tensor gathered = comm.device().is_cpu() ? all : at::empty({n * longest}, local.options());
    comm.all_gather(gathered, local, o)->wait();
    if (!comm.device().is_cpu()) all.copy_(gathered);
  }
  std::vector<std::string> out;
  const char* base = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int r = 0; r < n; ++r) out.emplace_back(base + r * longest, static_cast<size_t>(lengths[r]));
  return out;
}

std::string broadcast_string(Communicator& comm, const std::string& from_root, int root,
                             const AgreementOptions& options) {
  const int64_t length = broadcast_values(comm, {static_cast<int64_t>(from_root.size())}, root, options).front();
  at::Tensor bytes = at::zeros({std::max<int64_t>(length, 1)}, at::kByte);
  if (comm.rank() == root) std::memcpy(bytes.data_ptr(), from_root.data(), from_root.size());
  {
    detail::InternalOperations internal(options.purpose);
    BroadcastOptions o;
    o.root = root;
    o.timeout = options.timeout;
    at::Tensor t = on_device(comm, bytes);
    comm.broadcast(t, o)->wait();
    if (!comm.device().is_cpu()) bytes.copy_(t);
  }
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(length));
}

std::vector<int> ranks_reporting(Communicator& comm, bool has_problem, const AgreementOptions& options) {
  const std::vector<int64_t> flags = all_gather_values(comm, {has_problem ? 1 : 0}, options);
  std::vector<int> reporting;
  for (int r = 0; r < comm.size(); ++r)
    if (flags[r] != 0) reporting.push_back(r);
  return reporting;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

}  // namespace loom
