// MPI return codes as loom errors (the MPI backend's communicators return errors, not abort).
#pragma once

#include <mpi.h>

#include <string>

#include "comm/op.h"
#include "loom/error.h"

namespace loom::detail {

// Throws CommError "<operation>: <call> failed: <MPI's text>" unless `rc` is MPI_SUCCESS.
inline void check_mpi(int rc, const Op& op, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(op.info.describe() + ": " + call + " failed: " + std::string(text, len));
}

}  // namespace loom::detail
