# Sourced by the run scripts: settings that let mpirun work in containers and as root.
# Every rank runs with one intra-op thread; more ranks than cores are allowed.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1
# Containers often lack a usable high-speed NIC; shared memory and TCP are all we need here.
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp}
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
export LOOM_MPIRUN_FLAGS=${LOOM_MPIRUN_FLAGS:---oversubscribe --bind-to none}
