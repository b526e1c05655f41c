// File-system steps of a checkpoint, each with the durability it needs: data written and
// fsync'ed before anything points at it, renames for every publication (a file or directory
// appears complete or not at all), and the parent directory fsync'ed after each rename so the
// new name survives a power cut. Every failure is a loom::CheckpointError naming the path and the
// system's reason; `where` is the message prefix ("[rank 1] Checkpointer").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::detail::ckpt {

// An owned file descriptor, closed on destruction.
class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;

  // Regular files only (a FIFO or device is a CheckpointError, never a blocking open).
  static File open_read(const std::string& path, const std::string& where);
  // Creates a new file; one that exists already (or a symlink) is an error.
  static File create(const std::string& path, const std::string& where);
  // Takes ownership of an open descriptor (e.g. from mkstemp).
  static File adopt(int fd, const std::string& path);

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  uint64_t size(const std::string& where) const;
  // Writes every byte (retrying short writes and EINTR).
  void write_all(const void* data, size_t bytes, const std::string& where);
  // Reads exactly `bytes` at `offset`; a file that ends first is reported as truncated.
  void read_exact(uint64_t offset, void* data, size_t bytes, const std::string& where) const;
  void sync(const std::string& where);
  // Closes now, reporting an error (close can report a deferred write error).
  void close(const std::string& where);

 private:
  int fd_ = -1;
  std::string path_;
};

void fsync_directory(const std::string& path, const std::string& where);
// Writes `content` to path.tmp, fsyncs it, renames it over `path` and fsyncs the directory.
void write_file_atomic(const std::string& path, std::string_view content, const std::string& where);
// The whole file, refused (before allocating) when larger than max_bytes.
std::string read_small_file(const std::string& path, uint64_t max_bytes, const std::string& where);

void make_directories(const std::string& path, const std::string& where);
void rename_path(const std::string& from, const std::string& to, const std::string& where);
// Atomically swaps two existing paths (renameat2 RENAME_EXCHANGE); false where the file system
// does not support it.
bool exchange_paths(const std::string& a, const std::string& b, const std::string& where);
// Best effort; returns false (and logs) on failure.
bool remove_tree(const std::string& path);
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// Names of the entries of a directory (not . and ..); empty when it does not exist.
std::vector<std::string> list_directory(const std::string& path);
std::string join_path(const std::string& directory, const std::string& name);
std::string parent_of(const std::string& path);
std::string system_error_text(int error);

}  // namespace loom::detail::ckpt
