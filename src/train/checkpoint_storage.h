// The checkpoint storages this build has (loom/train/checkpoint_storage.h is the seam): POSIX
// files, and the names of checkpoints inside a storage.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/train/checkpoint_storage.h"

namespace loom::detail::ckpt {

// The largest step a checkpoint name holds (18 digits): larger or negative steps are refused at save.
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999LL;
std::string step_name(int64_t step);
// The step of a name step_<digits>; nullopt for anything else.
std::optional<int64_t> parse_step_name(const std::string& name);

using checkpoint::ByteSink;
using checkpoint::ByteSource;
using checkpoint::CheckpointStorage;
using checkpoint::StorageOptions;

// The built-in storages (registered as "file" and "mem" in checkpoint_storage.cpp).
std::unique_ptr<CheckpointStorage> memory_storage(const StorageOptions& options);  // checkpoint_memory_storage.cpp

// A regular file to read (a FIFO or device is a CheckpointError, never a blocking open).
std::unique_ptr<ByteSource> open_file(const std::string& path, const std::string& where);
// A new file at `path` (one that exists is an error), fsync'ed and closed on commit.
std::unique_ptr<ByteSink> create_file(const std::string& path, const std::string& where);

// POSIX files: shards are written into a hidden staging directory and fsync'ed; publishing writes
// the manifest atomically, renames the directory into place, points `latest` at it and removes
// checkpoints beyond keep_last. A directory without a manifest is never a checkpoint, so a crash
// at any point leaves the previous one intact.
class PosixStorage final : public CheckpointStorage {
 public:
  // `where` prefixes every error (the rank and the operation).
  PosixStorage(std::string directory, int keep_last, std::string where);

  // Complete checkpoints of `directory` by ascending step (also usable without an instance).
  static std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& directory);
  static std::optional<std::string> find_latest(const std::string& directory);

  bool shared_between_processes() const override { return true; }
  std::string staging_location(const std::string& step_name, const std::string& nonce) const override;
  void create_staging(const std::string& staging) override;
  std::unique_ptr<ByteSink> create(const std::string& staging, const std::string& object) override;
  std::string publish(const std::string& staging, const std::string& step_name, const std::string& manifest_text,
                      const std::string& nonce) override;
  void abandon(const std::string& staging) override;

  std::optional<std::string> find_latest() const override { return find_latest(directory_); }
  std::string location(const std::string& step_name) const override;
  std::unique_ptr<ByteSource> open(const std::string& checkpoint, const std::string& object) override;

 private:
  void install(const std::string& staging, const std::string& final_path, const std::string& final_name,
               const std::string& nonce);
  void rotate(const std::string& keep, const std::string& nonce);

  std::string directory_;
  int keep_last_;
  std::string where_;
};

}  // namespace loom::detail::ckpt
