# Unity builds: each target's sources compiled in batches of eight, one translation unit per batch
# (CMake's UNITY_BUILD). LibTorch's headers are most of every compile here: for one source of the
# parallel layer, parsing them took 59% of its time and instantiating their templates 15% more, and
# a batch does both once. A clean build of everything took 13.7 minutes on 2 cores against about 30
# file by file; the two sanitizer builds and the pip-installed module gain alike (CI builds all four
# from scratch within its time limit).
#
# What it asks of the sources: names in an anonymous namespace are unique within their target (two
# files of one batch share it), and a file includes what it uses (a batch may hide a missing include
# that the fuzz build's file-by-file compile, scripts/fuzz.sh, or -DLOOM_UNITY_BUILD=OFF finds).
# A source with compile options of its own is compiled alone (CMake leaves it out of the batches).
option(LOOM_UNITY_BUILD "Compile each target's sources in batches of eight (faster clean builds)" ON)
if(LOOM_UNITY_BUILD)
  set(CMAKE_UNITY_BUILD ON)
  set(CMAKE_UNITY_BUILD_BATCH_SIZE 8)
  # GCC exempts only the main file from -Wsubobject-linkage (a class whose base is in an anonymous
  # namespace, as every GoogleTest TEST_F on a fixture there is); in a batch every source is an
  # included file, though each class is still seen by one translation unit alone.
  add_compile_options($<$<CXX_COMPILER_ID:GNU>:-Wno-subobject-linkage>)
endif()
