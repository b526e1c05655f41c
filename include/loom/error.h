// Typed errors raised by torchloom, and the one place their messages' prefixes are built.
//
// Every error derives from loom::Error. A message says which rank (the job rank, and where it
// matters the group and the rank in it), which operation (collective, file, environment
// variable), and what was expected against what was found, e.g.
//
//   [rank 3] all_reduce seq=78 group=tp1 (rank 1 of 2) shape=[80] dtype=Float op=sum timed out
//   after 600.1 s (timeout 600.0 s); ranks not arrived: 2 (last called seq=77)
//
// Catch the base class to handle any torchloom failure, or a derived one for a specific cause.
// With LOOM_ON_ERROR=raise every failure reaches the waiting thread as an exception:
//
//   try { comm->all_reduce(t)->wait(); }
//   catch (const loom::TimeoutError& e) { save_and_exit(e.what()); }
//
// With the default LOOM_ON_ERROR=abort the job is ended instead (after LOOM_ABORT_GRACE), so
// that no rank is left hanging; the error is logged on every rank first.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An argument or a tensor that an operation cannot accept (rejected before anything is sent).
class InvalidArgumentError : public Error {
 public:
  using Error::Error;
};

// An operation the communicator's backend cannot run (or not now, as a collective inside a CUDA
// graph capture on NCCL): refused by name before it is numbered, so the sequence is untouched.
class UnsupportedError : public InvalidArgumentError {
 public:
  using InvalidArgumentError::InvalidArgumentError;
};

// The launch environment (rank/size variables, LOOM_* variables, MPI) is missing, malformed or
// inconsistent across ranks.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A communication operation failed, or its communicator was aborted.
class CommError : public Error {
 public:
  using Error::Error;
};

// An operation did not complete within its timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Ranks disagree (collective fingerprint, model layout, configuration); the message shows both
// sides.
class MismatchError : public Error {
 public:
  using Error::Error;
};

// A checkpoint could not be written, read or verified.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// The prefix of every message torchloom writes: who is speaking, and about what.
//
//   loom::ErrorContext("ParallelState")("bad degree")         -> "[rank 3] ParallelState: bad degree"
//   loom::ErrorContext("GradientReducer", "dp0", 1, 2).prefix() -> "[rank 3] GradientReducer group=dp0 (rank 1 of 2)"
//
// The rank is the process's rank in the job (MPI's world rank, known from the launcher's
// environment even before loom::init()); "?" when not known yet.
class ErrorContext {
 public:
  explicit ErrorContext(std::string_view what);
  ErrorContext(std::string_view what, std::string_view group, int group_rank, int group_size);

  const std::string& prefix() const { return prefix_; }
  // prefix + ": " + detail
  std::string operator()(std::string_view detail) const;

 private:
  std::string prefix_;
};

// This process's rank in the job; -1 before it is known.
int job_rank();

namespace detail {
// Set from the launcher's environment, then confirmed by MPI at loom::init().
void set_job_rank(int rank);
}  // namespace detail

}  // namespace loom
