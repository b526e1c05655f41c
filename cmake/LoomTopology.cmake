# The topology layer, the placement planner and the loomrun launcher: torch-free code that builds in
# seconds, so `cmake --build build --target loom_topology_tests loomrun placement_bench` never waits
# for LibTorch. Included from the top-level CMakeLists.txt after tests/examples/benchmarks (so
# enable_testing() has run when tests are on); it re-finds what it needs because targets imported
# inside those subdirectories are not visible here.
#
# Targets:
#   loom_topology        object library (-fPIC): model, parsers, detection, planner, rendering; its
#                        objects are also part of libtorchloom (loom::init plans with them)
#   loom_launcher        static library: loomrun's argument parsing, mpirun argv, process control
#   loomrun              the launcher
#   loom_topology_tests  single-process GoogleTest (parsers, planner, launcher arguments)
#   placement_bench      modelled planned-vs-naive all-reduce times and planner run time
# CTest: topology_unit, loomrun_processes and loomrun_options (real mpirun jobs), placement_bench_smoke.

include(GNUInstallDirs)
find_package(PkgConfig REQUIRED)
pkg_check_modules(LOOM_HWLOC REQUIRED IMPORTED_TARGET hwloc)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)

set(LOOM_TOPOLOGY_DIR ${CMAKE_CURRENT_LIST_DIR}/..)
# GCC 12 reports -Wrestrict false positives inside std::string concatenation (GCC bug 105651).
set(LOOM_TOPOLOGY_WARNINGS -Wall -Wextra -Wno-unused-parameter $<$<CXX_COMPILER_ID:GNU>:-Wno-restrict>)

add_library(loom_topology OBJECT
  ${LOOM_TOPOLOGY_DIR}/src/topology/model.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/cpu_list.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/link_costs.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/text_lines.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/parse_nvidia_smi.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/xml_scan.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/pcie_path.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/parse_nccl_xml.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/json_io.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/load_file.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/merge.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/nvml_loader.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/detect.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/cost_model.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/ordering.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/grouping.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/placement.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/cpu_share.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/explain.cpp
  ${LOOM_TOPOLOGY_DIR}/src/topology/render.cpp
)
target_compile_features(loom_topology PUBLIC cxx_std_20)
set_target_properties(loom_topology PROPERTIES POSITION_INDEPENDENT_CODE ON)
# Its own sources see only core's public headers, the topology's and its private ones (the layer's
# include directory, cmake/LoomLayers.cmake); what links it sees the public headers.
target_include_directories(loom_topology
  INTERFACE $<BUILD_INTERFACE:${LOOM_TOPOLOGY_DIR}/include> $<INSTALL_INTERFACE:include>
  PRIVATE ${LOOM_LAYER_INCLUDE_DIR_topology})
target_link_libraries(loom_topology PRIVATE PkgConfig::LOOM_HWLOC nlohmann_json::nlohmann_json ${CMAKE_DL_LIBS})
target_compile_options(loom_topology PRIVATE ${LOOM_TOPOLOGY_WARNINGS})
if(TARGET torchloom)
  target_sources(torchloom PRIVATE $<TARGET_OBJECTS:loom_topology>)
  target_link_libraries(torchloom PRIVATE PkgConfig::LOOM_HWLOC ${CMAKE_DL_LIBS})
endif()

add_library(loom_launcher STATIC
  $<TARGET_OBJECTS:loom_core_base>
  ${LOOM_TOPOLOGY_DIR}/src/launcher/launcher_args.cpp
  ${LOOM_TOPOLOGY_DIR}/src/launcher/hosts.cpp
  ${LOOM_TOPOLOGY_DIR}/src/launcher/slurm.cpp
  ${LOOM_TOPOLOGY_DIR}/src/launcher/mpirun_command.cpp
  ${LOOM_TOPOLOGY_DIR}/src/launcher/launcher_exec.cpp
  ${LOOM_TOPOLOGY_DIR}/src/launcher/host_probe.cpp
)
target_compile_features(loom_launcher PUBLIC cxx_std_20)
# The launcher's own private headers and the topology's public ones (cmake/LoomLayers.cmake).
target_include_directories(loom_launcher PUBLIC ${LOOM_LAYER_INCLUDE_DIR_launcher})
target_link_libraries(loom_launcher PUBLIC loom_topology PRIVATE CLI11::CLI11)
target_compile_options(loom_launcher PRIVATE ${LOOM_TOPOLOGY_WARNINGS})

add_executable(loomrun ${LOOM_TOPOLOGY_DIR}/src/launcher/loomrun.cpp)
target_link_libraries(loomrun PRIVATE loom_launcher)
target_compile_options(loomrun PRIVATE ${LOOM_TOPOLOGY_WARNINGS})
set_target_properties(loomrun PROPERTIES INSTALL_RPATH "")  # system libraries only
install(TARGETS loomrun RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

if(LOOM_BUILD_BENCHMARKS)
  add_executable(placement_bench ${LOOM_TOPOLOGY_DIR}/benchmarks/placement_bench.cpp)
  target_sources(placement_bench PRIVATE $<TARGET_OBJECTS:loom_core_base>)
  target_link_libraries(placement_bench PRIVATE loom_topology nlohmann_json::nlohmann_json CLI11::CLI11)
  target_compile_definitions(placement_bench PRIVATE LOOM_SOURCE_DIR="${LOOM_TOPOLOGY_DIR}")
  set_target_properties(placement_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/benchmarks)
endif()

if(LOOM_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(Python3 REQUIRED COMPONENTS Interpreter)

  # A stand-in libnvidia-ml.so.1 (a simulated 4-GPU machine) so the NVML loader and its
  # translation into the model run on machines without a GPU.
  add_library(loom_fake_nvml SHARED ${LOOM_TOPOLOGY_DIR}/tests/unit/fake_nvml.cpp)
  set_target_properties(loom_fake_nvml PROPERTIES OUTPUT_NAME fake_nvidia_ml LIBRARY_OUTPUT_DIRECTORY
                        ${CMAKE_CURRENT_BINARY_DIR}/tests/fake_nvml)
  # The same library under the driver's name, for whole programs that load "libnvidia-ml.so.1".
  add_custom_command(TARGET loom_fake_nvml POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/tests/fake_nvml_as_driver
    COMMAND ${CMAKE_COMMAND} -E create_symlink $<TARGET_FILE:loom_fake_nvml>
            ${CMAKE_BINARY_DIR}/tests/fake_nvml_as_driver/libnvidia-ml.so.1)

  add_executable(loom_topology_tests
    ${LOOM_TOPOLOGY_DIR}/tests/unit/topology_test_util.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_model.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_nvidia_smi.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_xml.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_json.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_detect.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_topology_fuzz.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_placement.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_placement_render.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_loomrun.cpp
    ${LOOM_TOPOLOGY_DIR}/tests/unit/test_input_limits.cpp
  )
  target_link_libraries(loom_topology_tests PRIVATE loom_launcher loom_topology nlohmann_json::nlohmann_json
                        GTest::gtest GTest::gtest_main)
  target_include_directories(loom_topology_tests PRIVATE ${LOOM_TOPOLOGY_DIR}/src ${LOOM_TOPOLOGY_DIR}/tests/unit)
  target_compile_definitions(loom_topology_tests PRIVATE
    LOOM_SOURCE_DIR="${LOOM_TOPOLOGY_DIR}"
    LOOM_FAKE_NVML="$<TARGET_FILE:loom_fake_nvml>")
  add_dependencies(loom_topology_tests loom_fake_nvml)
  target_compile_options(loom_topology_tests PRIVATE ${LOOM_TOPOLOGY_WARNINGS})

  add_test(NAME topology_unit COMMAND loom_topology_tests)
  set_tests_properties(topology_unit PROPERTIES TIMEOUT 300)

  # Real processes under mpirun: arguments arrive verbatim, exit codes propagate, SIGINT (sent by
  # a process and typed at a terminal) leaves no rank behind, plan binding reaches the ranks.
  add_test(NAME loomrun_processes
           COMMAND ${Python3_EXECUTABLE} ${LOOM_TOPOLOGY_DIR}/tests/launcher/check_loomrun.py
                   --loomrun $<TARGET_FILE:loomrun>)
  set_tests_properties(loomrun_processes PROPERTIES TIMEOUT 240
    ENVIRONMENT "OMP_NUM_THREADS=1;OMPI_MCA_btl=self,vader,tcp;OMPI_MCA_pml=ob1")
  # -x and the variables a remote host needs, --mca, --mpi-arg, --output-dir, --tag-output,
  # --max-restarts and Slurm allocations, with real mpirun jobs (fake hosts where root allows).
  add_test(NAME loomrun_options
           COMMAND ${Python3_EXECUTABLE} ${LOOM_TOPOLOGY_DIR}/tests/launcher/check_loomrun_options.py
                   --loomrun $<TARGET_FILE:loomrun>)
  set_tests_properties(loomrun_options PROPERTIES TIMEOUT 240
    ENVIRONMENT "OMP_NUM_THREADS=1;OMPI_MCA_btl=self,vader,tcp;OMPI_MCA_pml=ob1")

  if(TARGET placement_bench)
    add_test(NAME placement_bench_smoke COMMAND placement_bench --quick --json ${CMAKE_CURRENT_BINARY_DIR}/placement_bench_smoke.json)
    set_tests_properties(placement_bench_smoke PROPERTIES TIMEOUT 120)
  endif()
endif()
