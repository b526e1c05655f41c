# Finds torchloom's dependencies. LibTorch comes from the pip `torch` wheel: pass
# -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
# (scripts/build.sh does).

find_package(Threads REQUIRED)
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(spdlog REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)
# xxHash (Debian libxxhash-dev) checksums checkpoint shards; it ships no CMake config.
find_path(LOOM_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(LOOM_XXHASH_LIBRARY NAMES xxhash REQUIRED)

# LibTorch's CMake config looks for the CUDA toolkit itself when LibTorch is a CUDA build.
if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
# torchloom compiles no CUDA kernels: name the architectures so LibTorch's config does not
# probe for a GPU (none on build machines).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)
if(Torch_VERSION VERSION_LESS 2.8)
  message(FATAL_ERROR "torchloom needs LibTorch 2.8 or newer, found ${Torch_VERSION}")
endif()
get_filename_component(LOOM_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
set(LOOM_RUNTIME_RPATH "${LOOM_TORCH_LIB_DIR}")
# The pip wheel's libtorch_cuda needs the NCCL shipped beside it (newer than the CUDA toolkit's);
# tell the linker where it is, or it resolves libnccl.so.2 to the toolkit's and misses symbols.
get_filename_component(LOOM_SITE_PACKAGES "${LOOM_TORCH_LIB_DIR}/../.." ABSOLUTE)
set(LOOM_TORCH_NCCL_DIR "${LOOM_SITE_PACKAGES}/nvidia/nccl/lib")
if(EXISTS "${LOOM_TORCH_NCCL_DIR}")
  set(LOOM_LINK_OPTIONS "LINKER:-rpath-link,${LOOM_TORCH_NCCL_DIR}")
  list(APPEND LOOM_RUNTIME_RPATH "${LOOM_TORCH_NCCL_DIR}")
endif()
# ... and the CUDA runtime it was built with (the wheel's, newer than the toolkit's): first on the
# run path, so that the process loads one libcudart, the one libtorch_cuda expects.
set(LOOM_TORCH_CUDART_DIR "${LOOM_SITE_PACKAGES}/nvidia/cu13/lib")
if(EXISTS "${LOOM_TORCH_CUDART_DIR}/libcudart.so.13")
  list(PREPEND LOOM_RUNTIME_RPATH "${LOOM_TORCH_CUDART_DIR}")
  set(LOOM_CUDART_LIBRARY "${LOOM_TORCH_CUDART_DIR}/libcudart.so.13")
endif()
message(STATUS "torchloom: LibTorch ${Torch_VERSION} in ${LOOM_TORCH_LIB_DIR}")

# NCCL: prefer the copy LibTorch itself loads (the pip wheel ships one next to its CUDA
# libraries) so that one libnccl.so.2 is in the process; else the CUDA toolkit's.
set(LOOM_NCCL_ENABLED OFF)
if(NOT LOOM_WITH_NCCL STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  set(_site_packages "${LOOM_SITE_PACKAGES}")
  find_path(LOOM_NCCL_INCLUDE_DIR nccl.h
            HINTS ${_site_packages}/nvidia/nccl/include ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include
            NO_DEFAULT_PATH)
  # NAMES_PER_DIR: the wheel's directory is searched first for every name (it has only
  # libnccl.so.2; the toolkit's unversioned, older libnccl.so must not win by name).
  find_library(LOOM_NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
               HINTS ${_site_packages}/nvidia/nccl/lib ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64
               NO_DEFAULT_PATH)
  set(_torch_has_cuda OFF)
  foreach(_lib IN LISTS TORCH_LIBRARIES)
    if(_lib MATCHES "c10_cuda")
      set(_torch_has_cuda ON)
    endif()
  endforeach()
  if(CUDAToolkit_FOUND AND LOOM_NCCL_INCLUDE_DIR AND LOOM_NCCL_LIBRARY AND _torch_has_cuda)
    set(LOOM_NCCL_ENABLED ON)
    message(STATUS "torchloom: NCCL backend ON (${LOOM_NCCL_LIBRARY}, headers ${LOOM_NCCL_INCLUDE_DIR})")
  elseif(LOOM_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "LOOM_WITH_NCCL=ON but CUDA toolkit, NCCL or a CUDA-enabled LibTorch was not found")
  else()
    message(STATUS "torchloom: NCCL backend OFF (CUDA toolkit, NCCL or CUDA LibTorch missing)")
  endif()
endif()
