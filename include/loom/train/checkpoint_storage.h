// Where checkpoints live: the storage seam under the checkpoint format.
//
// The Checkpointer decides what is written and read, by whom, and when every rank agrees; the
// format code (shard headers, checksums, row reads) turns that into bytes; a storage only moves
// bytes and makes a checkpoint visible all at once. A storage hands out a ByteSink per object it
// stores and a ByteSource per object it reads, and publishes a staged checkpoint atomically: a
// checkpoint is visible with every shard and its manifest, or not at all.
//
// Storages are chosen by CheckpointOptions::directory: a plain path (or file://path) is POSIX
// files on a shared file system; "mem://name" is this process's memory (one process only: a
// fast test, or a copy kept for recovery); other schemes are registered:
//
//   class ObjectStore final : public loom::checkpoint::CheckpointStorage { ... };
//   loom::checkpoint::register_checkpoint_storage("s3", [](const loom::checkpoint::StorageOptions& o) {
//     return std::make_unique<ObjectStore>(o.location, o.keep_last, o.where);
//   });
//   loom::Checkpointer ckpt(rt->world_comm(), {.directory = "s3://bucket/run7"});
//
// Names: a checkpoint is step_<step> (at least 6 digits) inside the storage's location; its
// objects are the manifest (manifest.json) and one shard per rank (docs/checkpoint-format.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom::checkpoint {

// The bytes of one stored object (a shard, a manifest), read at offsets.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Exactly `bytes` at `offset`; loom::CheckpointError (naming the object) when it ends first.
  virtual void read(uint64_t offset, void* data, size_t bytes) const = 0;
  // A hint: the whole object is about to be read in order (a file starts reading ahead).
  virtual void expect_sequential() const {}
};

// The bytes of a new object, appended; seen only once the checkpoint holding it is published.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void write(const void* data, size_t bytes) = 0;
  // Everything written is durable on return (a file is fsync'ed and closed). Called once, last.
  virtual void commit() = 0;
};

class CheckpointStorage {
 public:
  virtual ~CheckpointStorage() = default;

  // Whether an object one process writes is seen by the others (a shared file system): a
  // Checkpointer over several processes refuses a storage that is not.
  virtual bool shared_between_processes() const = 0;

  // ---- Save: rank 0 creates the staging location, every rank writes its shard into it ----
  virtual std::string staging_location(const std::string& step_name, const std::string& nonce) const = 0;
  virtual void create_staging(const std::string& staging) = 0;
  virtual std::unique_ptr<ByteSink> create(const std::string& staging, const std::string& object) = 0;
  // Rank 0, once every shard is written and committed: stores the manifest and makes the
  // checkpoint visible as `step_name`, replacing one of that name, then keeps only the newest
  // keep_last (never the one just published). Returns "" on success, otherwise what went wrong
  // and the state that leaves (the previous checkpoint intact, or published but not the latest).
  virtual std::string publish(const std::string& staging, const std::string& step_name,
                              const std::string& manifest_text, const std::string& nonce) = 0;
  // Removes what a refused save staged (best effort).
  virtual void abandon(const std::string& staging) = 0;

  // ---- Load ----
  // The latest published checkpoint when complete, otherwise the complete one of highest step.
  virtual std::optional<std::string> find_latest() const = 0;
  virtual std::string location(const std::string& step_name) const = 0;
  // loom::CheckpointError naming the object when it is missing or unreadable.
  virtual std::unique_ptr<ByteSource> open(const std::string& checkpoint, const std::string& object) = 0;
};

struct StorageOptions {
  std::string url;       // as CheckpointOptions::directory gave it
  std::string location;  // the URL after "scheme://" (the path, for files)
  int keep_last = 3;     // complete checkpoints kept after a publish (0: all)
  std::string where;     // the prefix of every error (the rank and the operation)
};
using StorageFactory = std::function<std::unique_ptr<CheckpointStorage>(const StorageOptions& options)>;

// Every Checkpointer opened on "scheme://..." afterwards uses this factory. "file" and "mem" are
// built in. InvalidArgumentError for a scheme that is registered already or not [a-z0-9+.-]+.
void register_checkpoint_storage(const std::string& scheme, StorageFactory factory);
// The storage `url` names; InvalidArgumentError (prefixed by `where`) for an unknown scheme.
std::unique_ptr<CheckpointStorage> open_storage(const std::string& url, int keep_last, const std::string& where);

}  // namespace loom::checkpoint
