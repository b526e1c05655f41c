#include "train/checkpoint_io.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstring>
#include <set>

#include "loom/error.h"
#include "train/checkpoint_checksum.h"
#include "train/checkpoint_hooks.h"

namespace loom::detail::ckpt {

namespace {

// Chunks small enough to stay in cache between hashing and writing (or reading and hashing).
constexpr size_t kChunk = 8u << 20;

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

size_t nbytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// Feeds chunks to a Checksum in order on a thread of its own (started at the first chunk), so
// that hashing overlaps the next read. The chunks' memory must stay valid until drain().
class OrderedHasher {
 public:
  explicit OrderedHasher(Checksum& checksum) : checksum_(checksum) {}
  ~OrderedHasher() { drain(); stop(); }
  OrderedHasher(const OrderedHasher&) = delete;
  OrderedHasher& operator=(const OrderedHasher&) = delete;

  void push(const void* data, size_t bytes) {
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(data, bytes);
    wake_.notify_all();
  }
  // Returns once every pushed chunk is hashed.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      const auto [data, bytes] = queue_.front();
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      checksum_.update(data, bytes);
      lock.lock();
      busy_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      wake_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }

  Checksum& checksum_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::pair<const void*, size_t>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

// Faults in the pages of fresh buffers on a thread of its own (MADV_POPULATE_WRITE), ahead of the
// reads that fill them: the kernel then copies into mapped pages instead of taking a fault per
// 4 KiB page on the reading thread. Unsynchronised with the reads by design: populating a page the
// read has already filled changes nothing. The buffers must outlive the populator.
class Populator {
 public:
  ~Populator() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      wake_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }
  void push(void* data, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(static_cast<char*>(data), bytes);
    wake_.notify_all();
#else
    (void)data, (void)bytes;
#endif
  }

 private:
  void run() {
#ifdef MADV_POPULATE_WRITE
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      auto [data, bytes] = queue_.front();
      queue_.pop_front();
      lock.unlock();
      // Whole pages inside the buffer, a chunk at a time so that a stop is prompt.
      uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
      const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
      bool supported = true;
      while (begin < end && supported && !stopping_.load()) {
        const uintptr_t n = std::min<uintptr_t>(end - begin, kChunk);
        supported = ::madvise(reinterpret_cast<void*>(begin), n, MADV_POPULATE_WRITE) == 0 || errno != EINVAL;
        begin += n;
      }
      lock.lock();
      if (!supported) return;  // an older kernel: the reads fault as before
    }
#endif
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<char*, size_t>> queue_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace

at::Tensor host_empty(at::IntArrayRef shape, at::ScalarType dtype, bool pinned) {
  // No transparent-huge-page hint: with the kernel's default defrag policy ("madvise") a hinted
  // fault may compact memory synchronously, which made a 300 MB load take 0.6-1.1 s instead of
  // 0.21 s in one round of five (checkpoint_bench); 4 KiB faults cost the same every time.
  return at::empty(shape, at::TensorOptions().dtype(dtype).pinned_memory(pinned));
}

ShardWritten write_shard(ByteSink& sink, const ShardWrite& w, const std::string& where) {
  Checksum checksum;
  phase("write");
  checksum.update(w.header.data(), w.header.size());
  sink.write(w.header.data(), w.header.size());
  uint64_t bytes = w.header.size();
  if (w.inject_failure)
    throw CheckpointError(where + ": cannot write " + w.path + ": " + std::strerror(ENOSPC) + " [injected]");
  for (const Region& r : w.regions) {
    const char* p = static_cast<const char*>(r.data);
    for (size_t done = 0; done < r.bytes;) {
      const size_t n = std::min(kChunk, r.bytes - done);
      checksum.update(p + done, n);
      sink.write(p + done, n);
      done += n;
    }
    bytes += r.bytes;
  }
  sink.commit();
  return {bytes, checksum.digest()};
}

std::string read_manifest_text(CheckpointStorage& storage, const std::string& checkpoint, const std::string& where) {
  const std::unique_ptr<ByteSource> source = storage.open(checkpoint, kManifestName);
  const uint64_t size = source->size();
  if (size > kMaxManifestBytes)
    throw CheckpointError(where + ": manifest " + checkpoint + "/" + kManifestName + " has " + std::to_string(size) +
                          " bytes; a manifest has at most " + std::to_string(kMaxManifestBytes));
  std::string text(static_cast<size_t>(size), '\0');
  source->read(0, text.data(), text.size());
  return text;
}

std::vector<Region> Staging::stage(const std::vector<at::Tensor>& tensors) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += align_up(nbytes(t), 64);  // aligned: each copy viewable in its dtype
  // Pageable: device bytes arrive through the ring's few pinned slots, never a pinned whole shard.
  if (!buffer_.defined() || static_cast<uint64_t>(buffer_.numel()) < total)
    buffer_ = host_empty({static_cast<int64_t>(std::max<uint64_t>(total, 1))}, at::kByte);
  std::vector<Region> regions;
  std::vector<std::pair<at::Tensor, void*>> from_devices;
  uint8_t* base = buffer_.data_ptr<uint8_t>();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const size_t bytes = nbytes(t);
    uint8_t* dst = base + offset;
    if (bytes > 0) {
      if (!t.is_cpu()) {
        from_devices.emplace_back(t, dst);
      } else if (t.is_contiguous()) {
        std::memcpy(dst, t.data_ptr(), bytes);
      } else {
        at::from_blob(dst, t.sizes(), at::TensorOptions().dtype(t.scalar_type())).copy_(t);
      }
    }
    regions.push_back({dst, bytes});
    offset += align_up(bytes, 64);
  }
  ring_.copy(from_devices);  // returns once the bytes are in the buffer: the snapshot is taken
  return regions;
}

std::vector<Region> regions_in_place(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& keep_alive) {
  std::vector<Region> regions;
  for (const auto& t : tensors) {
    at::Tensor host = t.is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
    regions.push_back({host.data_ptr(), nbytes(host)});
    keep_alive.push_back(std::move(host));
  }
  return regions;
}

void check_header_against_manifest(const ShardHeader& header, const Manifest& manifest, int index,
                                   const std::string& where) {
  // What the shard says of itself (written from format version 2): its step, and where each of its
  // split slices starts. A shard of another step, or slices the manifest places elsewhere, is refused
  // even when the manifest's checksum holds (a shard copied in from another checkpoint).
  // Every version-2 shard says both; a version-1 shard says neither (a version-2 shard under a
  // manifest claiming version 1 is a manifest whose version was edited to skip its checksum).
  for (const char* key : {kShardStepKey, kShardSlicesKey}) {
    const bool has = header.metadata.count(key) != 0;
    if (manifest.version >= 2 && !has)
      throw CheckpointError(where + ": the shard has no " + key + " metadata, which every shard of format version " +
                            std::to_string(manifest.version) + " carries");
    if (manifest.version < 2 && has)
      throw CheckpointError(where + ": the shard carries " + key + " metadata (format version 2 or later) under a "
                            "manifest of format version " + std::to_string(manifest.version) +
                            ": the manifest's version was edited");
  }
  if (auto step = header.metadata.find(kShardStepKey); step != header.metadata.end() &&
                                                        step->second != std::to_string(manifest.step))
    throw CheckpointError(where + ": the shard was written at step " + step->second + "; the manifest is of step " +
                          std::to_string(manifest.step));
  nlohmann::json offsets = nullptr;
  if (auto slices = header.metadata.find(kShardSlicesKey); slices != header.metadata.end()) {
    offsets = nlohmann::json::parse(slices->second, nullptr, /*allow_exceptions=*/false);
    if (!offsets.is_object()) throw CheckpointError(where + ": its " + kShardSlicesKey + " metadata is not a JSON object");
  }
  // Both ways: every entry of the shard is a slice the manifest places here (an entry the manifest
  // does not list is state a damaged manifest forgot).
  for (const auto& entry : header.tensors) {
    auto it = manifest.tensors.find(entry.name);
    const bool placed = it != manifest.tensors.end() &&
                        std::any_of(it->second.slices.begin(), it->second.slices.end(),
                                    [&](const SliceRecord& slice) { return slice.shard == index; });
    if (!placed)
      throw CheckpointError(where + ": holds tensor " + entry.name + ", which the manifest does not place in it");
  }
  for (const auto& [name, record] : manifest.tensors) {
    for (const auto& slice : record.slices) {
      if (slice.shard != index) continue;
      const TensorEntry* entry = header.find(name);
      if (entry == nullptr)
        throw CheckpointError(where + ": tensor " + name + " is missing (the manifest places a slice of it here)");
      const auto expected = record.slice_shape(slice);
      if (entry->dtype != record.dtype || entry->shape != expected)
        throw CheckpointError(where + ": tensor " + name + " is " + std::string(c10::toString(entry->dtype)) + " " +
                              shape_to_string(entry->shape) + "; the manifest says " +
                              std::string(c10::toString(record.dtype)) + " " + shape_to_string(expected));
      if (offsets.is_object() && record.split_dim >= 0) {
        const auto it = offsets.find(name);
        if (it == offsets.end() || !it->is_number_integer() || it->get<int64_t>() != slice.offset)
          throw CheckpointError(where + ": tensor " + name + " holds the slice at offset " +
                                (it == offsets.end() ? std::string("(not recorded)") : it->dump()) +
                                " along dim " + std::to_string(record.split_dim) + "; the manifest says offset " +
                                std::to_string(slice.offset));
      }
    }
  }
}

namespace {

std::string shard_where(const std::string& where, const std::string& path) {
  return where + ": shard " + path;
}

void check_size(const ByteSource& source, const ShardRecord& record, const std::string& where) {
  const uint64_t size = source.size();
  if (size != record.bytes)
    throw CheckpointError(where + " has " + std::to_string(size) + " bytes; the manifest says " +
                          std::to_string(record.bytes) +
                          (size < record.bytes ? " (truncated)" : " (mismatched shard)"));
}

}  // namespace

std::map<std::string, at::Tensor> read_verified_shard(CheckpointStorage& storage, const std::string& checkpoint,
                                                      const Manifest& manifest, int index,
                                                      const std::set<std::string>& wanted, const std::string& where) {
  const ShardRecord& record = manifest.shards.at(index);
  const std::string at_shard = shard_where(where, checkpoint + "/" + record.file);
  const std::unique_ptr<ByteSource> file = storage.open(checkpoint, record.file);
  check_size(*file, record, at_shard);
  // The whole shard is read in order: let the medium read ahead of the checksum and the copies.
  file->expect_sequential();
  Checksum checksum;
  const ShardHeader header = read_header(*file, record.bytes, at_shard, &checksum);
  check_header_against_manifest(header, manifest, index, at_shard);
  std::map<std::string, at::Tensor> out;
  std::vector<char> scratch;
  // Chunks read into the tensors are hashed on a second thread while the next one is read, and
  // the tensors' pages are faulted in on a third ahead of the reads.
  OrderedHasher hasher(checksum);
  Populator populator;
  for (const auto& entry : header.tensors) {
    const uint64_t start = header.data_start + entry.begin;
    if (wanted.count(entry.name)) {
      // Sized by a validated header entry, within a file whose size matched the manifest. Owned by
      // `out` from the start: `out` outlives the hasher, which may still read it when a read throws.
      const at::Tensor& t = out.emplace(entry.name, host_empty(entry.shape, entry.dtype)).first->second;
      char* dst = static_cast<char*>(t.data_ptr());
      if (entry.bytes() > kChunk) populator.push(dst + kChunk, entry.bytes() - kChunk);  // the first chunk is read at once
      for (uint64_t done = 0; done < entry.bytes();) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, entry.bytes() - done));
        file->read(start + done, dst + done, n);
        hasher.push(dst + done, n);
        done += n;
      }
    } else {
      // Entries this rank does not keep go through one reused buffer: hashed here, in order.
      hasher.drain();
      scratch.resize(static_cast<size_t>(std::min<uint64_t>(kChunk, std::max<uint64_t>(entry.bytes(), 1))));
      for (uint64_t done = 0; done < entry.bytes();) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, entry.bytes() - done));
        file->read(start + done, scratch.data(), n);
        checksum.update(scratch.data(), n);
        done += n;
      }
    }
  }
  hasher.drain();
  const uint64_t digest = checksum.digest();
  if (digest != record.xxh3)
    throw CheckpointError(at_shard + ": checksum mismatch: xxh3_64 of the file is " + to_hex(digest) +
                          ", the manifest says " + to_hex(record.xxh3) + " (corrupt or replaced)");
  return out;
}

OpenShard open_shard(CheckpointStorage& storage, const std::string& checkpoint, const Manifest& manifest, int index,
                     const std::string& where) {
  const ShardRecord& record = manifest.shards.at(index);
  OpenShard shard{storage.open(checkpoint, record.file), {}, shard_where(where, checkpoint + "/" + record.file)};
  check_size(*shard.source, record, shard.where);
  shard.header = read_header(*shard.source, record.bytes, shard.where, nullptr);
  check_header_against_manifest(shard.header, manifest, index, shard.where);
  return shard;
}

at::Tensor read_rows(const OpenShard& shard, const std::string& name, int64_t row_begin, int64_t rows) {
  const TensorEntry* entry = shard.header.find(name);
  const std::string& at_shard = shard.where;
  if (entry == nullptr) throw CheckpointError(at_shard + ": tensor " + name + " is missing");
  std::vector<int64_t> shape = entry->shape;
  uint64_t offset = shard.header.data_start + entry->begin;
  uint64_t bytes = entry->bytes();
  if (rows >= 0 && !shape.empty()) {
    const uint64_t row_bytes = shape[0] == 0 ? 0 : entry->bytes() / static_cast<uint64_t>(shape[0]);
    if (row_begin < 0 || row_begin + rows > shape[0])
      throw CheckpointError(at_shard + ": rows [" + std::to_string(row_begin) + ", " +
                            std::to_string(row_begin + rows) + ") of " + name + " are outside its " +
                            std::to_string(shape[0]) + " rows");
    offset += static_cast<uint64_t>(row_begin) * row_bytes;
    bytes = static_cast<uint64_t>(rows) * row_bytes;
    shape[0] = rows;
  }
  at::Tensor t = host_empty(shape, entry->dtype);
  shard.source->read(offset, t.data_ptr(), static_cast<size_t>(bytes));
  return t;
}

}  // namespace loom::detail::ckpt
