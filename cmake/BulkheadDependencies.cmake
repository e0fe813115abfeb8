# Finds what every build needs; the CUDA Toolkit and NCCL only when present.
# Nothing is downloaded: install-deps.sh installs the system packages.

find_package(Torch REQUIRED)
find_package(MPI REQUIRED COMPONENTS C)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(fmt REQUIRED)
# libtorch 2.x ships its own fmt headers; the header-only target keeps one fmt
# in every translation unit, whichever the include path finds first.
set(BULKHEAD_FMT fmt::fmt-header-only)
# Command lines (CLI11) and JSON (nlohmann-json): header-only, from the
# distribution (libcli11-dev, nlohmann-json3-dev).
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json 3.9 CONFIG REQUIRED)

set(BULKHEAD_WITH_NCCL OFF)
if(NOT BULKHEAD_NCCL STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)
  endif()
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(BULKHEAD_WITH_NCCL ON)
    if(NOT TARGET bulkhead_nccl_library)
      add_library(bulkhead_nccl_library INTERFACE IMPORTED)
      target_include_directories(bulkhead_nccl_library INTERFACE ${NCCL_INCLUDE_DIR})
      target_link_libraries(bulkhead_nccl_library INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    endif()
  elseif(BULKHEAD_NCCL STREQUAL "ON")
    message(FATAL_ERROR "BULKHEAD_NCCL=ON but the CUDA Toolkit or NCCL was not found (set NCCL_HOME)")
  endif()
endif()

if(BULKHEAD_WITH_NCCL)
  message(STATUS "Bulkhead: CUDA ${CUDAToolkit_VERSION} and NCCL (${NCCL_LIBRARY}) found: GPU support is on")
else()
  message(STATUS "Bulkhead: no CUDA Toolkit or NCCL found: building the CPU (mpi) backend only")
endif()

# Gloo (the CPU backend of jobs started without MPI): the distribution's
# (libgloo-dev), else the copy libtorch carries (PyTorch's wheels ship its
# headers and export its symbols from libtorch_cpu).
set(BULKHEAD_GLOO AUTO CACHE STRING "Build the gloo backend: AUTO, ON or OFF")
set(BULKHEAD_WITH_GLOO OFF)
if(NOT BULKHEAD_GLOO STREQUAL "OFF")
  find_package(Gloo CONFIG QUIET)
  if(TARGET gloo)
    set(BULKHEAD_WITH_GLOO ON)
    message(STATUS "Bulkhead: Gloo ${GLOO_VERSION} found: the gloo backend is on")
  else()
    find_path(BULKHEAD_TORCH_GLOO_INCLUDE gloo/rendezvous/context.h HINTS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
    if(BULKHEAD_TORCH_GLOO_INCLUDE)
      include(CheckCXXSourceCompiles)
      set(CMAKE_REQUIRED_INCLUDES ${BULKHEAD_TORCH_GLOO_INCLUDE})
      set(CMAKE_REQUIRED_LIBRARIES ${TORCH_LIBRARIES})
      check_cxx_source_compiles([=[
        #include <gloo/transport/tcp/device.h>
        #include <gloo/rendezvous/context.h>
        int main() { auto d = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
                     gloo::rendezvous::Context c(0, 1); return d ? 0 : 1; }]=] BULKHEAD_TORCH_GLOO_LINKS)
      unset(CMAKE_REQUIRED_INCLUDES)
      unset(CMAKE_REQUIRED_LIBRARIES)
      if(BULKHEAD_TORCH_GLOO_LINKS)
        set(BULKHEAD_WITH_GLOO ON)
        message(STATUS "Bulkhead: using the Gloo inside libtorch: the gloo backend is on")
      endif()
    endif()
  endif()
  if(NOT BULKHEAD_WITH_GLOO AND BULKHEAD_GLOO STREQUAL "ON")
    message(FATAL_ERROR "BULKHEAD_GLOO=ON but Gloo was not found (install libgloo-dev)")
  endif()
endif()
if(NOT BULKHEAD_WITH_GLOO)
  message(STATUS "Bulkhead: no Gloo found: jobs need mpirun (install libgloo-dev for the gloo backend)")
endif()

# CUDA for Bulkhead's own kernels (runtime's peer all-reduce, moe's kernels), where libtorch has CUDA:
# nvcc from the toolkit found above, and Hopper (H100, H200) where no architecture is set or libtorch's
# CMake files left it OFF. A macro, so that the architectures are set in the caller's directory.
macro(bulkhead_enable_cuda)
  if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  if(NOT CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "OFF")
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
endmacro()

# A library's CUDA kernels of our own (where libtorch has CUDA): the sources, each compiled alone also
# in a unity build (CMake 3.31 batches CUDA sources too), `definition`=1 for the C++ side that launches
# them, and the CUDA runtime. A macro for the same reason as bulkhead_enable_cuda.
macro(bulkhead_target_kernels target definition)
  bulkhead_enable_cuda()
  target_sources(${target} PRIVATE ${ARGN})
  set_source_files_properties(${ARGN} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  target_compile_definitions(${target} PRIVATE ${definition}=1)
  target_link_libraries(${target} PRIVATE ${BULKHEAD_C10_CUDA} CUDA::cudart)
endmacro()
