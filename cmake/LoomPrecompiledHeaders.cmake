# Precompiled LibTorch headers for executables: built once per build tree and reused by every test
# program, example and benchmark that compiles against LibTorch.
#
# Why: parsing <ATen/ATen.h>, <torch/nn.h> and <torch/optim.h> costs each translation unit that
# includes them the same ~17 s (train_ddp's unity batch: 60.6 s without, 43.5 s with), and there are
# about 35 such executables' batches; CI builds three trees from scratch on 2 cores within its 90
# minutes. Loading the header costs a translation unit about 10 s too, which is why the library's
# layers (comm and runtime include far less of LibTorch; a clean build with them on it was no
# faster) and programs that include little of it (the Python module, LibTorch-free tools) go
# without.
#
# How: GCC takes a precompiled header only where it was built with the same -fpie setting and every
# macro defined then is defined alike now (-Winvalid-pch says when one is refused, and the compile
# then parses the headers as usual: slower, never wrong). The owner defines nothing but LibTorch's
# own macros, so programs may add macros of their own (those do not appear in LibTorch's headers).
# Every source of a program sees the precompiled headers: -DLOOM_PRECOMPILED_HEADERS=OFF (with
# -DLOOM_UNITY_BUILD=OFF) finds a source that forgot an include.
option(LOOM_PRECOMPILED_HEADERS "Precompile LibTorch's headers once per build for the executables" ON)

if(LOOM_PRECOMPILED_HEADERS)
  set(anchor ${CMAKE_BINARY_DIR}/loom_precompiled_headers_anchor.cpp)
  if(NOT EXISTS ${anchor})
    file(WRITE ${anchor} "// Compiled only so that its target owns the precompiled LibTorch headers.\n")
  endif()
  # CMake compiles executables' sources with -fPIE, which an object library gets only by hand.
  add_library(loom_pch_executable OBJECT ${anchor})
  target_link_libraries(loom_pch_executable PRIVATE ${TORCH_LIBRARIES})
  set_target_properties(loom_pch_executable PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(loom_pch_executable PRIVATE -fPIE)
  target_precompile_headers(loom_pch_executable PRIVATE <ATen/ATen.h> <torch/nn.h> <torch/optim.h>)
endif()

# Every executable defined so far in the calling directory that links torchloom or LibTorch reuses
# the precompiled headers (called at the end of tests/, examples/ and benchmarks/, so that a new
# program gets them without asking).
function(loom_precompiled_torch_headers_in_directory)
  if(NOT LOOM_PRECOMPILED_HEADERS)
    return()
  endif()
  get_property(targets DIRECTORY PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    get_target_property(libraries ${target} LINK_LIBRARIES)
    if(type STREQUAL "EXECUTABLE" AND ("torchloom" IN_LIST libraries OR "torch" IN_LIST libraries))
      target_precompile_headers(${target} REUSE_FROM loom_pch_executable)
    endif()
  endforeach()
endfunction()
