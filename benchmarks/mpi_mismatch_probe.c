// What Open MPI does when ranks call one collective with different element counts: rank 1 passes
// base * factor elements, the others base. Every buffer is exactly as large as the call needs and
// is followed by a guard region filled with a pattern; after the call (and a pause, for writes by
// peers still inside it) the guards are checked, so a write past a buffer is seen even when it
// does not crash. Like torchloom, buffers of a failed call are never released and the process ends
// without MPI_Finalize. Run by benchmarks/mpi_mismatch_probe.sh (docs/design.md, "Mismatched sizes").
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { kGuardBytes = 1 << 16, kPattern = 0x5a };

// A buffer of `bytes` followed by its guard.
static char* guarded(long bytes) {
  char* p = malloc(bytes + kGuardBytes);
  memset(p, 0, bytes);
  memset(p + bytes, kPattern, kGuardBytes);
  return p;
}

// How many guard bytes were overwritten.
static long damage(const char* p, long bytes) {
  long bad = 0;
  for (long i = 0; i < kGuardBytes; ++i) bad += (unsigned char)p[bytes + i] != kPattern;
  return bad;
}

int main(int argc, char** argv) {
  int provided; MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank, size; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const char* kind = argv[1];
  long base = atol(argv[2]);
  long factor = atol(argv[3]);   // rank 1's count = base * factor (others base)
  long count = rank == 1 ? base * factor : base;
  long in_n = count, out_n = 0;  // elements each buffer holds for this call
  if (!strcmp(kind, "allgather")) out_n = count * size;
  else if (!strcmp(kind, "rscatter")) { in_n = count * size; out_n = count; }
  else if (!strcmp(kind, "alltoall")) { in_n = count * size; out_n = count * size; }
  float* buf = (float*)guarded(sizeof(float) * in_n);
  float* out = (float*)guarded(sizeof(float) * (out_n ? out_n : 1));
  for (long i = 0; i < in_n; ++i) buf[i] = 1;
  int rc = 0;
  if (!strcmp(kind, "allreduce")) rc = MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (!strcmp(kind, "bcast")) rc = MPI_Bcast(buf, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
  else if (!strcmp(kind, "allgather")) rc = MPI_Allgather(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
  else if (!strcmp(kind, "rscatter")) rc = MPI_Reduce_scatter_block(buf, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (!strcmp(kind, "alltoall")) rc = MPI_Alltoall(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
  char text[256]; int len = 0; if (rc) MPI_Error_string(rc, text, &len); text[len] = 0;
  usleep(500 * 1000);
  const long overrun = damage((char*)buf, sizeof(float) * in_n) + (out_n ? damage((char*)out, sizeof(float) * out_n) : 0);
  printf("rank %d count %ld rc %d %s%s\n", rank, count, rc, text, overrun ? " OVERRUN" : ""); fflush(stdout);
  if (overrun) printf("rank %d: %ld guard bytes overwritten\n", rank, overrun);
  /* Like torchloom: buffers of a failed operation are never released; the process ends without
     MPI_Finalize after a short while (the peers may still be inside the collective). */
  if (rc) { sleep(1); _exit(3); }
  free(buf); free(out);
  MPI_Finalize();
  return 0;
}
