// Where checkpoints live: the storage seam of the checkpoint protocol.
//
// The protocol decides what is written and read, by whom, and when every rank agrees; a storage
// decides how bytes reach the medium and how a checkpoint becomes visible all at once. The first
// (and so far only) implementation is POSIX files (PosixStorage): shards are written into a hidden
// staging directory and fsync'ed; publishing writes the manifest atomically, renames the directory
// into place, points `latest` at it and removes checkpoints beyond keep_last. A directory without
// a manifest is never a checkpoint, so a crash at any point leaves the previous one intact.
//
// Names: a checkpoint is step_<step> (at least 6 digits) inside the storage's directory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/checkpoint_io.h"
#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

// The largest step a checkpoint name holds (18 digits): larger or negative steps are refused at save.
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999LL;
std::string step_name(int64_t step);
// The step of a name step_<digits>; nullopt for anything else.
std::optional<int64_t> parse_step_name(const std::string& name);

// Reads entries of one shard that another rank verifies (header checked, no checksum).
class ShardReader {
 public:
  virtual ~ShardReader() = default;
  // Rows [row_begin, row_begin + rows) of entry `name` along dim 0 (all of it when rows < 0), as a
  // fresh host tensor.
  virtual at::Tensor read_rows(const std::string& name, int64_t row_begin, int64_t rows) = 0;
};

class CheckpointStorage {
 public:
  virtual ~CheckpointStorage() = default;

  // ---- Save (every rank writes its shard into the staging location rank 0 created) ----
  virtual std::string staging_location(const std::string& step_name, const std::string& nonce) const = 0;
  virtual void create_staging(const std::string& staging) = 0;
  virtual ShardWritten write_shard(const std::string& staging, const std::string& file, const ShardWrite& write) = 0;
  // Rank 0, once every shard is written: makes the checkpoint visible. Returns "" on success,
  // otherwise what went wrong and what state that leaves (the previous checkpoint intact, or
  // published but `latest` still naming the previous one).
  virtual std::string publish(const std::string& staging, const std::string& step_name,
                              const std::string& manifest_text, const std::string& nonce) = 0;
  virtual void abandon(const std::string& staging) = 0;

  // ---- Load ----
  // The checkpoint `latest` names when it is complete, otherwise the complete one of highest step.
  virtual std::optional<std::string> find_latest() const = 0;
  virtual std::string location(const std::string& step_name) const = 0;
  virtual std::string read_manifest(const std::string& checkpoint) = 0;
  // Reads the whole shard `index`, checking its size and XXH3 against the manifest; returns the
  // entries named in `wanted` as fresh host tensors.
  virtual std::map<std::string, at::Tensor> read_verified_shard(const std::string& checkpoint, const Manifest& manifest,
                                                                int index, const std::set<std::string>& wanted) = 0;
  virtual std::unique_ptr<ShardReader> open_shard(const std::string& checkpoint, const Manifest& manifest,
                                                  int index) = 0;
};

class PosixStorage final : public CheckpointStorage {
 public:
  // `where` prefixes every error (the rank and the operation).
  PosixStorage(std::string directory, int keep_last, std::string where);

  // Complete checkpoints of `directory` by ascending step (also usable without an instance).
  static std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& directory);
  static std::optional<std::string> find_latest(const std::string& directory);

  std::string staging_location(const std::string& step_name, const std::string& nonce) const override;
  void create_staging(const std::string& staging) override;
  ShardWritten write_shard(const std::string& staging, const std::string& file, const ShardWrite& write) override;
  std::string publish(const std::string& staging, const std::string& step_name, const std::string& manifest_text,
                      const std::string& nonce) override;
  void abandon(const std::string& staging) override;

  std::optional<std::string> find_latest() const override { return find_latest(directory_); }
  std::string location(const std::string& step_name) const override;
  std::string read_manifest(const std::string& checkpoint) override;
  std::map<std::string, at::Tensor> read_verified_shard(const std::string& checkpoint, const Manifest& manifest,
                                                        int index, const std::set<std::string>& wanted) override;
  std::unique_ptr<ShardReader> open_shard(const std::string& checkpoint, const Manifest& manifest, int index) override;

 private:
  void install(const std::string& staging, const std::string& final_path, const std::string& final_name,
               const std::string& nonce);
  void rotate(const std::string& keep, const std::string& nonce);

  std::string directory_;
  int keep_last_;
  std::string where_;
};

}  // namespace loom::detail::ckpt
