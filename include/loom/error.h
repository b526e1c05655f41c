// Typed errors raised by torchloom.
//
// Every error derives from loom::Error, and its message says which rank, which operation
// (collective, file, environment variable) and what was expected against what was found, e.g.
//
//   [rank 3/8] all_reduce seq=78 group=world shape=[80] dtype=float32 timed out after 600.1 s (timeout 600 s)
//
// Catch the base class to handle any torchloom failure, or a derived one for a specific cause:
//
//   try { comm->all_reduce(t)->wait(); }
//   catch (const loom::TimeoutError& e) { save_and_exit(e.what()); }
#pragma once

#include <stdexcept>
#include <string>

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

// The launch environment (rank/size variables, MPI) is missing, malformed or inconsistent.
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

// Ranks disagree (collective fingerprint, model layout, ...); the message shows both sides.
class MismatchError : public Error {
 public:
  using Error::Error;
};

// A checkpoint could not be written, read or verified.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

}  // namespace loom
