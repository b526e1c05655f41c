# The library's layers, and the build that holds them to their order:
#
#   core <- topology <- comm <- (runtime, parallel, amp) ; (topology, comm, parallel, amp) <- train
#   (the scaler takes ZeRO's gradient shards through a concept, loom::ShardedOptimizer: amp sees no
#   header of parallel)
#
# Each layer is an object library compiled against an include directory of its own,
# build/layers/<layer>/, holding symbolic links to only what it may use: the public headers
# (include/loom/...) of itself and the layers below, and its own private headers (src/<module>/).
# An include of a layer above, or of another module's private header, is then "No such file" at
# compile time instead of a convention to remember. The third-party libraries follow the same rule:
# MPI and NCCL are comm's (the only layer given their include directories and definitions), spdlog
# is core's. tests/layering/check_layer_symbols.py holds the objects to it too: no layer's objects
# call a function only a layer it may not use defines (a hand-written declaration would get past
# the include directories), nor MPI, NCCL or CUDA outside comm, nor spdlog outside core.
# libtorchloom is the objects of every layer; the launcher (loomrun) has a directory of its own.

# The public headers of core, used by every layer.
set(LOOM_CORE_PUBLIC loom/config.h loom/env.h loom/error.h loom/log.h loom/trace.h loom/world.h)
# The parallel layout (named dimensions and their groups, no tensors) is core's too, though its
# header lives beside the parallel layer's: every layer from the placement planner to the checkpoint
# manifest takes it. Layers that see all of loom/parallel get it with that directory.
set(LOOM_LAYOUT_PUBLIC loom/parallel/layout.h)

# loom_layer_include_dir(<layer> <entry>...): makes build/layers/<layer>/ and sets
# LOOM_LAYER_INCLUDE_DIR_<layer> to it. Entries are paths under include/ (a file or a directory),
# or src:<module> for the layer's own private headers.
function(loom_layer_include_dir layer)
  set(root ${CMAKE_BINARY_DIR}/layers/${layer})
  set(wanted)
  foreach(entry IN LISTS ARGN)
    if(entry MATCHES "^src:(.+)$")
      list(APPEND wanted ${root}/${CMAKE_MATCH_1})
    else()
      list(APPEND wanted ${root}/${entry})
    endif()
  endforeach()
  # A link an older list made and this one does not (an entry taken away) must go, or the layer
  # would go on seeing what it no longer may. Links only: nothing they point to is touched.
  file(GLOB_RECURSE existing LIST_DIRECTORIES true ${root}/*)
  foreach(path IN LISTS existing)
    if(IS_SYMLINK ${path} AND NOT path IN_LIST wanted)
      file(REMOVE ${path})
    endif()
  endforeach()
  foreach(entry IN LISTS ARGN)
    if(entry MATCHES "^src:(.+)$")
      set(target ${PROJECT_SOURCE_DIR}/src/${CMAKE_MATCH_1})
      set(link ${root}/${CMAKE_MATCH_1})
    else()
      set(target ${PROJECT_SOURCE_DIR}/include/${entry})
      set(link ${root}/${entry})
    endif()
    if(NOT EXISTS ${target})
      message(FATAL_ERROR "layer ${layer}: ${target} does not exist")
    endif()
    get_filename_component(parent ${link} DIRECTORY)
    file(MAKE_DIRECTORY ${parent})
    # Only the link itself is ever removed (a stale one from an older source tree), never a target.
    if(IS_SYMLINK ${link})
      file(READ_SYMLINK ${link} current)
      if(NOT current STREQUAL target)
        file(REMOVE ${link})
      endif()
    endif()
    if(NOT IS_SYMLINK ${link})
      file(CREATE_LINK ${target} ${link} SYMBOLIC)
    endif()
  endforeach()
  set(LOOM_LAYER_INCLUDE_DIR_${layer} ${root} PARENT_SCOPE)
endfunction()

loom_layer_include_dir(core ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} src:core)
loom_layer_include_dir(topology ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} loom/topology src:topology)
loom_layer_include_dir(comm ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} loom/topology loom/comm src:comm)
loom_layer_include_dir(runtime ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} loom/topology loom/comm loom/runtime.h src:runtime)
loom_layer_include_dir(parallel ${LOOM_CORE_PUBLIC} loom/comm loom/parallel src:parallel)
loom_layer_include_dir(amp ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} loom/comm loom/amp src:amp)
loom_layer_include_dir(train ${LOOM_CORE_PUBLIC} loom/topology loom/comm loom/parallel loom/amp loom/train src:train)
loom_layer_include_dir(launcher ${LOOM_CORE_PUBLIC} ${LOOM_LAYOUT_PUBLIC} loom/topology src:launcher)

# loom_layer(<layer> <source>...): the layer's object library, loom_<layer>, with the settings every
# LibTorch-facing layer shares (third-party include directories are the same for all: the layering
# is about torchloom's own headers).
function(loom_layer layer)
  add_library(loom_${layer} OBJECT ${ARGN})
  loom_layer_settings(loom_${layer} ${layer})
endfunction()

function(loom_layer_settings target layer)
  target_include_directories(${target} PRIVATE ${LOOM_LAYER_INCLUDE_DIR_${layer}} ${LOOM_XXHASH_INCLUDE_DIR})
  target_link_libraries(${target} PRIVATE ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json)
  target_compile_features(${target} PRIVATE cxx_std_20)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  # MPI and NCCL are the communication layer's alone. (LibTorch's CUDA build puts the CUDA
  # toolkit's include directory, which may hold an nccl.h, on every layer's path: there the symbol
  # check is what holds NCCL and CUDA to comm.)
  if(NOT layer STREQUAL "comm")
    return()
  endif()
  target_link_libraries(${target} PRIVATE MPI::MPI_CXX)
  target_compile_definitions(${target} PRIVATE OMPI_SKIP_MPICXX=1)
  if(LOOM_NCCL_ENABLED)
    target_compile_definitions(${target} PRIVATE LOOM_WITH_NCCL=1)
    target_include_directories(${target} PRIVATE ${LOOM_NCCL_INCLUDE_DIR})
    if(LOOM_CUDART_LIBRARY)
      target_include_directories(${target} PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
    else()
      target_link_libraries(${target} PRIVATE CUDA::cudart)
    endif()
  endif()
endfunction()
