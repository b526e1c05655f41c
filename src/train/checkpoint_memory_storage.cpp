// "mem://name": checkpoints held in this process's memory, in exactly the format files hold them
// (the same shards, checksums and manifest, read back through the same verification). For one
// process: fast tests, and a copy of the last checkpoint kept at hand for recovery. Stores are
// named: every Checkpointer of this process opened on mem://name sees the same checkpoints, until
// the process ends. Publication is atomic under the store's lock (a reader sees the whole
// checkpoint or none), and rotation keeps the newest keep_last like the file storage.
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "loom/error.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_storage.h"

namespace loom::detail::ckpt {

namespace {

using Bytes = std::shared_ptr<const std::string>;

// Objects by their full name ("<checkpoint>/<object>"); a checkpoint is complete when it has a manifest.
struct MemoryStore {
  std::mutex mutex;
  std::map<std::string, Bytes> objects;
  std::string latest;  // a step name
};

std::shared_ptr<MemoryStore> store_named(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<MemoryStore>> stores;
  std::lock_guard<std::mutex> lock(mutex);
  auto& store = stores[name];
  if (!store) store = std::make_shared<MemoryStore>();
  return store;
}

std::string without_trailing_slashes(std::string text) {
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

class MemorySource final : public ByteSource {
 public:
  MemorySource(Bytes bytes, std::string name, std::string where)
      : bytes_(std::move(bytes)), name_(std::move(name)), where_(std::move(where)) {}
  uint64_t size() const override { return bytes_->size(); }
  void read(uint64_t offset, void* data, size_t bytes) const override {
    if (offset > bytes_->size() || bytes > bytes_->size() - offset)
      throw CheckpointError(where_ + ": " + name_ + " is truncated: expected " + std::to_string(bytes) +
                            " bytes at offset " + std::to_string(offset) + " of an object of " +
                            std::to_string(bytes_->size()));
    std::copy_n(bytes_->data() + offset, bytes, static_cast<char*>(data));
  }

 private:
  Bytes bytes_;  // held: a rotation meanwhile does not pull the bytes from under a reader
  std::string name_, where_;
};

class MemorySink final : public ByteSink {
 public:
  MemorySink(std::shared_ptr<MemoryStore> store, std::string name)
      : store_(std::move(store)), name_(std::move(name)) {}
  void write(const void* data, size_t bytes) override { bytes_.append(static_cast<const char*>(data), bytes); }
  void commit() override {
    auto bytes = std::make_shared<const std::string>(std::move(bytes_));
    std::lock_guard<std::mutex> lock(store_->mutex);
    store_->objects[name_] = std::move(bytes);
  }

 private:
  std::shared_ptr<MemoryStore> store_;
  std::string name_;
  std::string bytes_;
};

class MemoryStorage final : public CheckpointStorage {
 public:
  // Named by the URL as given (a scheme that wraps this storage keeps its own name in paths).
  explicit MemoryStorage(const StorageOptions& options)
      : url_(without_trailing_slashes(options.url)), keep_last_(options.keep_last), where_(options.where),
        store_(store_named(without_trailing_slashes(options.location))) {}

  bool shared_between_processes() const override { return false; }

  std::string staging_location(const std::string& step_name, const std::string& nonce) const override {
    return url_ + "/." + step_name + ".tmp-" + nonce;
  }
  void create_staging(const std::string& /*staging*/) override {}
  std::unique_ptr<ByteSink> create(const std::string& staging, const std::string& object) override {
    return std::make_unique<MemorySink>(store_, staging + "/" + object);
  }

  std::string publish(const std::string& staging, const std::string& step_name, const std::string& manifest_text,
                      const std::string& /*nonce*/) override {
    std::lock_guard<std::mutex> lock(store_->mutex);
    auto& objects = store_->objects;
    erase_under(location(step_name));  // a checkpoint of the same step is replaced
    const std::string from = staging + "/";
    for (auto it = objects.lower_bound(from); it != objects.end() && it->first.rfind(from, 0) == 0;) {
      objects[location(step_name) + "/" + it->first.substr(from.size())] = std::move(it->second);
      it = objects.erase(it);
    }
    objects[location(step_name) + "/" + kManifestName] = std::make_shared<const std::string>(manifest_text);
    store_->latest = step_name;
    rotate(step_name);
    return "";
  }

  void abandon(const std::string& staging) override {
    std::lock_guard<std::mutex> lock(store_->mutex);
    erase_under(staging);
  }

  std::optional<std::string> find_latest() const override {
    std::lock_guard<std::mutex> lock(store_->mutex);
    const auto complete = complete_steps();
    if (complete.empty()) return std::nullopt;
    for (const auto& [step, name] : complete)
      if (name == store_->latest) return location(name);
    return location(complete.rbegin()->second);
  }

  std::string location(const std::string& step_name) const override { return url_ + "/" + step_name; }

  std::unique_ptr<ByteSource> open(const std::string& checkpoint, const std::string& object) override {
    const std::string name = checkpoint + "/" + object;
    std::lock_guard<std::mutex> lock(store_->mutex);
    auto it = store_->objects.find(name);
    if (it == store_->objects.end())
      throw CheckpointError(where_ + ": cannot open " + name + ": no such object in memory storage " + url_);
    return std::make_unique<MemorySource>(it->second, name, where_);
  }

 private:
  // Under the lock: every object of `prefix` (a checkpoint or a staging location).
  void erase_under(const std::string& prefix) {
    const std::string from = prefix + "/";
    auto& objects = store_->objects;
    for (auto it = objects.lower_bound(from); it != objects.end() && it->first.rfind(from, 0) == 0;)
      it = objects.erase(it);
  }
  // Under the lock: step -> name of the checkpoints with a manifest.
  std::map<int64_t, std::string> complete_steps() const {
    std::map<int64_t, std::string> steps;
    const std::string from = url_ + "/";
    for (auto it = store_->objects.lower_bound(from); it != store_->objects.end() && it->first.rfind(from, 0) == 0;
         ++it) {
      const std::string rest = it->first.substr(from.size());
      const auto slash = rest.find('/');
      if (slash == std::string::npos || rest.substr(slash + 1) != kManifestName) continue;
      if (auto step = parse_step_name(rest.substr(0, slash))) steps[*step] = rest.substr(0, slash);
    }
    return steps;
  }
  void rotate(const std::string& keep) {
    if (keep_last_ <= 0) return;
    auto complete = complete_steps();
    size_t excess = complete.size() > static_cast<size_t>(keep_last_) ? complete.size() - keep_last_ : 0;
    for (auto it = complete.begin(); excess > 0 && it != complete.end(); ++it, --excess)
      if (it->second != keep) erase_under(location(it->second));  // never the newest
  }

  std::string url_;
  int keep_last_;
  std::string where_;
  std::shared_ptr<MemoryStore> store_;
};

}  // namespace

std::unique_ptr<CheckpointStorage> memory_storage(const StorageOptions& options) {
  return std::make_unique<MemoryStorage>(options);
}

}  // namespace loom::detail::ckpt
