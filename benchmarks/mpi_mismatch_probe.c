// What Open MPI does when ranks call one collective with different element counts: rank 1 passes
// base * factor elements, the others base. Like torchloom, buffers of a failed call are never
// released and the process ends without MPI_Finalize. Run by benchmarks/mpi_mismatch_probe.sh,
// which looks for heap corruption and crashes in the output (docs/design.md, "Mismatched sizes").
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char** argv) {
  int provided; MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank, size; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const char* kind = argv[1];
  long base = atol(argv[2]);
  long factor = atol(argv[3]);   // rank 1's count = base * factor (others base)
  long count = rank == 1 ? base * factor : base;
  float* buf = malloc(sizeof(float) * count * size + 64);
  float* out = malloc(sizeof(float) * count * size + 64);
  for (long i = 0; i < count * size; ++i) buf[i] = 1;
  int rc = 0;
  if (!strcmp(kind, "allreduce")) rc = MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (!strcmp(kind, "bcast")) rc = MPI_Bcast(buf, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
  else if (!strcmp(kind, "allgather")) rc = MPI_Allgather(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
  else if (!strcmp(kind, "rscatter")) rc = MPI_Reduce_scatter_block(buf, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (!strcmp(kind, "alltoall")) rc = MPI_Alltoall(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
  char text[256]; int len = 0; if (rc) MPI_Error_string(rc, text, &len); text[len] = 0;
  printf("rank %d count %ld rc %d %s\n", rank, count, rc, text); fflush(stdout);
  /* Like torchloom: buffers of a failed operation are never released; the process ends without
     MPI_Finalize after a short while (the peers may still be inside the collective). */
  if (rc) { sleep(2); _exit(3); }
  free(buf); free(out);
  MPI_Finalize();
  return 0;
}
