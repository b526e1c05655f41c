#include "train/checkpoint_storage.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>

#include "loom/error.h"
#include "loom/log.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_hooks.h"
#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

namespace {

constexpr const char* kLatest = "latest";
constexpr const char* kStepPrefix = "step_";

bool is_complete(const std::string& path) { return path_exists(join_path(path, kManifestName)); }

// A shard or manifest file, read at offsets (regular files only: a FIFO is refused, never waited on).
class FileSource final : public ByteSource {
 public:
  FileSource(File file, std::string where) : file_(std::move(file)), where_(std::move(where)), size_(file_.size(where_)) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* data, size_t bytes) const override { file_.read_exact(offset, data, bytes, where_); }
  void expect_sequential() const override {
    ::posix_fadvise(file_.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
    ::posix_fadvise(file_.fd(), 0, 0, POSIX_FADV_WILLNEED);
  }

 private:
  File file_;
  std::string where_;
  uint64_t size_;
};

// A new file in the staging directory: written through, the kernel asked to start writing each
// chunk back at once (so the closing fsync finds most of it on disk), fsync'ed and closed on commit.
class FileSink final : public ByteSink {
 public:
  FileSink(File file, std::string where) : file_(std::move(file)), where_(std::move(where)) {}
  void write(const void* data, size_t bytes) override {
    file_.write_all(data, bytes, where_);
#if defined(__linux__)
    // Only a hint: an error here is reported by the fsync.
    (void)::sync_file_range(file_.fd(), static_cast<off64_t>(written_), static_cast<off64_t>(bytes),
                            SYNC_FILE_RANGE_WRITE);
#endif
    written_ += bytes;
  }
  void commit() override {
    phase("fsync");
    file_.sync(where_);
    file_.close(where_);
  }

 private:
  File file_;
  std::string where_;
  uint64_t written_ = 0;
};

struct StorageRegistry {
  std::mutex mutex;
  std::map<std::string, checkpoint::StorageFactory> factories{
      {"file",
       [](const StorageOptions& o) { return std::make_unique<PosixStorage>(o.location, o.keep_last, o.where); }},
      {"mem", memory_storage},
  };
};

StorageRegistry& storage_registry() {
  static StorageRegistry registry;
  return registry;
}

bool valid_scheme(const std::string& scheme) {
  return !scheme.empty() && std::all_of(scheme.begin(), scheme.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '.' || c == '-';
  });
}

}  // namespace

std::string step_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof(name), "step_%06lld", static_cast<long long>(step));
  return name;
}

std::optional<int64_t> parse_step_name(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

PosixStorage::PosixStorage(std::string directory, int keep_last, std::string where)
    : directory_(std::move(directory)), keep_last_(keep_last), where_(std::move(where)) {}

std::vector<std::pair<int64_t, std::string>> PosixStorage::complete_checkpoints(const std::string& directory) {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& name : list_directory(directory)) {
    auto step = parse_step_name(name);
    if (step && is_complete(join_path(directory, name))) found.emplace_back(*step, name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::optional<std::string> PosixStorage::find_latest(const std::string& directory) {
  const std::string pointer = join_path(directory, kLatest);
  if (path_exists(pointer)) {
    try {
      std::string name = read_small_file(pointer, 4096, "latest");
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
      if (parse_step_name(name) && is_complete(join_path(directory, name))) return join_path(directory, name);
    } catch (const CheckpointError&) {
      // An unreadable pointer: fall back to scanning.
    }
  }
  auto found = complete_checkpoints(directory);
  if (found.empty()) return std::nullopt;
  return join_path(directory, found.back().second);
}

std::string PosixStorage::staging_location(const std::string& step_name, const std::string& nonce) const {
  return join_path(directory_, "." + step_name + ".tmp-" + nonce);
}

void PosixStorage::create_staging(const std::string& staging) {
  make_directories(directory_, where_);
  make_directories(staging, where_);
}

std::unique_ptr<ByteSource> open_file(const std::string& path, const std::string& where) {
  return std::make_unique<FileSource>(File::open_read(path, where), where);
}

std::unique_ptr<ByteSink> create_file(const std::string& path, const std::string& where) {
  return std::make_unique<FileSink>(File::create(path, where), where);
}

std::unique_ptr<ByteSink> PosixStorage::create(const std::string& staging, const std::string& object) {
  return create_file(join_path(staging, object), where_);
}

void PosixStorage::abandon(const std::string& staging) { remove_tree(staging); }

std::string PosixStorage::location(const std::string& step_name) const { return join_path(directory_, step_name); }

std::string PosixStorage::publish(const std::string& staging, const std::string& final_name,
                                  const std::string& manifest_text, const std::string& nonce) {
  const std::string final_path = join_path(directory_, final_name);
  try {
    fsync_directory(staging, where_);  // the shards' directory entries
    phase("manifest");
    write_file_atomic(join_path(staging, kManifestName), manifest_text, where_);
    phase("rename");
    install(staging, final_path, final_name, nonce);
  } catch (const std::exception& e) {
    remove_tree(staging);
    return std::string("not published (the previous one is intact):\n  ") + e.what();
  }
  try {
    phase("latest");
    write_file_atomic(join_path(directory_, kLatest), final_name + "\n", where_);
  } catch (const std::exception& e) {
    // Complete, but `latest` still names the previous checkpoint, which a resume would pick.
    return std::string("was written, but the latest pointer still names the previous one:\n  ") + e.what();
  }
  phase("rotate");
  try {
    rotate(final_name, nonce);
  } catch (const std::exception& e) {
    LOOM_LOG(warn, "checkpoint " << final_path << " published; removing old checkpoints failed: " << e.what());
  }
  return "";
}

void PosixStorage::install(const std::string& staging, const std::string& final_path, const std::string& final_name,
                           const std::string& nonce) {
  if (path_exists(final_path)) {
    // A checkpoint of the same step is replaced in one step where the file system can swap two
    // directories; otherwise it is moved aside first (a crash in between leaves the older steps).
    if (exchange_paths(staging, final_path, where_)) {
      fsync_directory(directory_, where_);
      remove_tree(staging);
    } else {
      const std::string trash = join_path(directory_, ".trash-" + final_name + "-" + nonce);
      rename_path(final_path, trash, where_);
      rename_path(staging, final_path, where_);
      fsync_directory(directory_, where_);
      remove_tree(trash);
    }
  } else {
    rename_path(staging, final_path, where_);
  }
  fsync_directory(directory_, where_);
}

void PosixStorage::rotate(const std::string& keep, const std::string& nonce) {
  // Leftovers of saves that crashed or were refused, and of interrupted deletions.
  for (const auto& name : list_directory(directory_))
    if ((name.rfind(".step_", 0) == 0 && name.find(".tmp-") != std::string::npos) || name.rfind(".trash-", 0) == 0 ||
        name.rfind("latest.tmp-", 0) == 0)
      remove_tree(join_path(directory_, name));
  if (keep_last_ <= 0) return;
  auto found = complete_checkpoints(directory_);
  if (found.size() <= static_cast<size_t>(keep_last_)) return;
  for (size_t i = 0; i + keep_last_ < found.size(); ++i) {
    const std::string& name = found[i].second;
    if (name == keep) continue;  // the newest, even when older steps sort after it
    // Renamed first, so that a crash halfway through a deletion leaves no manifest-bearing remains.
    const std::string trash = join_path(directory_, ".trash-" + name + "-" + nonce);
    rename_path(join_path(directory_, name), trash, where_);
    remove_tree(trash);
  }
  fsync_directory(directory_, where_);
}

std::unique_ptr<ByteSource> PosixStorage::open(const std::string& checkpoint, const std::string& object) {
  return open_file(join_path(checkpoint, object), where_);
}

}  // namespace loom::detail::ckpt

namespace loom::checkpoint {

void register_checkpoint_storage(const std::string& scheme, StorageFactory factory) {
  const std::string where = ErrorContext("register_checkpoint_storage").prefix();
  if (!detail::ckpt::valid_scheme(scheme) || !factory)
    throw InvalidArgumentError(where + ": expected a scheme of [a-z0-9+.-] and a factory; found scheme \"" + scheme +
                               "\"" + (factory ? "" : " and no factory"));
  auto& registry = detail::ckpt::storage_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (!registry.factories.emplace(scheme, std::move(factory)).second)
    throw InvalidArgumentError(where + ": a checkpoint storage for \"" + scheme + "://\" is registered already");
}

std::unique_ptr<CheckpointStorage> open_storage(const std::string& url, int keep_last, const std::string& where) {
  StorageOptions options{url, url, keep_last, where};
  std::string scheme = "file";
  if (const auto colon = url.find("://"); colon != std::string::npos && detail::ckpt::valid_scheme(url.substr(0, colon))) {
    scheme = url.substr(0, colon);
    options.location = url.substr(colon + 3);
  }
  StorageFactory factory;
  std::string known;
  {
    auto& registry = detail::ckpt::storage_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    if (auto it = registry.factories.find(scheme); it != registry.factories.end()) factory = it->second;
    for (const auto& [name, _] : registry.factories) known += (known.empty() ? "" : ", ") + name + "://";
  }
  if (!factory)
    throw InvalidArgumentError(where + ": no checkpoint storage is registered for \"" + scheme + "://\" (in \"" + url +
                               "\"); registered: " + known);
  if (options.location.empty())
    throw InvalidArgumentError(where + ": the checkpoint location \"" + url + "\" names no directory");
  return factory(options);
}

}  // namespace loom::checkpoint
