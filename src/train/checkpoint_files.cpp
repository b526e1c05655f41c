#include "train/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "loom/error.h"
#include "loom/log.h"

namespace loom::detail::ckpt {

std::string system_error_text(int error) {
  return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")";
}

namespace {
[[noreturn]] void fail(const std::string& where, const std::string& what, int error) {
  throw CheckpointError(where + ": " + what + ": " + system_error_text(error));
}
}  // namespace

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File File::open_read(const std::string& path, const std::string& where) {
  File f;
  f.path_ = path;
  // Non-blocking, so that a FIFO planted in the directory cannot hold the rank in open(), where no
  // timeout applies; anything but a regular file is refused (no effect on reads of regular files).
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd_ < 0) fail(where, "cannot open " + path, errno);
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0) fail(where, "cannot stat " + path, errno);
  if (!S_ISREG(st.st_mode))
    throw CheckpointError(where + ": " + path + " is not a regular file (" +
                          (S_ISFIFO(st.st_mode)  ? "a FIFO"
                           : S_ISDIR(st.st_mode) ? "a directory"
                           : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                          : "a socket or other special file") +
                          "); a checkpoint holds only regular files");
  return f;
}

File File::adopt(int fd, const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = fd;
  return f;
}

File File::create(const std::string& path, const std::string& where) {
  File f;
  f.path_ = path;
  // O_EXCL | O_NOFOLLOW: shards go into a staging directory of a fresh name; a file already there
  // (or a planted symlink) is an error, not something to truncate.
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (f.fd_ < 0) fail(where, "cannot create " + path, errno);
  return f;
}

uint64_t File::size(const std::string& where) const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) fail(where, "cannot stat " + path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

void File::write_all(const void* data, size_t bytes, const std::string& where) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Bounded chunks: Linux writes at most ~2 GiB per call anyway.
    const ssize_t n = ::write(fd_, p, bytes < (size_t(1) << 30) ? bytes : (size_t(1) << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(where, "cannot write " + path_, errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void File::read_exact(uint64_t offset, void* data, size_t bytes, const std::string& where) const {
  char* p = static_cast<char*>(data);
  const uint64_t start = offset;
  while (bytes > 0) {
    const ssize_t n =
        ::pread(fd_, p, bytes < (size_t(1) << 30) ? bytes : (size_t(1) << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(where, "cannot read " + path_, errno);
    }
    if (n == 0)
      throw CheckpointError(where + ": " + path_ + " is truncated: expected " + std::to_string(bytes) +
                            " more bytes at offset " + std::to_string(offset) + " (read from " + std::to_string(start) +
                            ")");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

void File::sync(const std::string& where) {
  if (::fsync(fd_) != 0) fail(where, "cannot fsync " + path_, errno);
}

void File::close(const std::string& where) {
  const int fd = fd_;
  fd_ = -1;
  if (fd >= 0 && ::close(fd) != 0) fail(where, "cannot close " + path_, errno);
}

void fsync_directory(const std::string& path, const std::string& where) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(where, "cannot open directory " + path, errno);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL): their renames are as durable as they get.
  if (rc != 0 && error != EINVAL) fail(where, "cannot fsync directory " + path, error);
}

std::string parent_of(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

void write_file_atomic(const std::string& path, std::string_view content, const std::string& where) {
  // A fresh name (mkstemp: O_EXCL, never a planted symlink, never another job's file), then rename.
  std::string tmp = path + ".tmp-XXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) fail(where, "cannot create a temporary file beside " + path, errno);
  ::fchmod(fd, 0644);  // mkstemp creates 0600; checkpoints are read by the other ranks' users too
  File f = File::adopt(fd, tmp);
  try {
    f.write_all(content.data(), content.size(), where);
    f.sync(where);
    f.close(where);
    rename_path(tmp, path, where);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(parent_of(path), where);
}

std::string read_small_file(const std::string& path, uint64_t max_bytes, const std::string& where) {
  File f = File::open_read(path, where);
  const uint64_t size = f.size(where);
  if (size > max_bytes)
    throw CheckpointError(where + ": " + path + " has " + std::to_string(size) + " bytes; expected at most " +
                          std::to_string(max_bytes));
  std::string content(size, '\0');
  f.read_exact(0, content.data(), size, where);
  return content;
}

void make_directories(const std::string& path, const std::string& where) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) throw CheckpointError(where + ": cannot create directory " + path + ": " + ec.message());
}

void rename_path(const std::string& from, const std::string& to, const std::string& where) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail(where, "cannot rename " + from + " to " + to, errno);
}

bool exchange_paths(const std::string& a, const std::string& b, const std::string& where) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  fail(where, "cannot exchange " + a + " and " + b, errno);
}

bool remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) {
    LOOM_LOG(warn, "checkpoint: cannot remove " << path << ": " << ec.message());
    return false;
  }
  return true;
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

std::string join_path(const std::string& directory, const std::string& name) {
  if (directory.empty()) return name;
  return directory.back() == '/' ? directory + name : directory + "/" + name;
}

}  // namespace loom::detail::ckpt
