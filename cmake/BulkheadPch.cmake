# Precompiled headers: libtorch's <ATen/ATen.h> and fmt take about 8 s to parse on a 2-core machine, where
# loading them precompiled takes under 3 (moe/moe_layer.cc compiles in 8.3 s instead of 13.4). Two targets
# precompile them once, one for position-independent code (the libraries) and one for the rest, and every
# C++ target that links a Bulkhead library reuses the one its code matches. A target whose sources mostly do
# not include ATen sets BULKHEAD_PCH OFF: loading the header would cost each of them about 3 s.
# -DBULKHEAD_PCH=OFF turns it off.
option(BULKHEAD_PCH "Precompile libtorch's and fmt's headers for every target that uses them" ON)

set(BULKHEAD_PCH_HEADERS "$<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>" "$<$<COMPILE_LANGUAGE:CXX>:<fmt/format.h$<ANGLE-R>>")

# bulkhead_pch_targets(<out> <dir>): the targets defined in <dir> and below.
function(bulkhead_pch_targets out dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    bulkhead_pch_targets(below "${sub}")
    list(APPEND targets ${below})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

# bulkhead_pch_uses_torch(<out> <target>): whether <target> links a Bulkhead library, which brings libtorch and fmt
# with the definitions the header was built with (a target with libtorch alone lacks FMT_HEADER_ONLY).
function(bulkhead_pch_uses_torch out target)
  get_target_property(links ${target} LINK_LIBRARIES)
  set(${out} OFF PARENT_SCOPE)
  foreach(link IN LISTS links)
    if(link MATCHES "^bulkhead(::[a-z]+|_[a-z_]+)$" AND NOT link STREQUAL "bulkhead_warnings")
      set(${out} ON PARENT_SCOPE)
    endif()
  endforeach()
endfunction()

# bulkhead_precompile_headers(): called once every target is defined.
function(bulkhead_precompile_headers)
  if(NOT BULKHEAD_PCH)
    return()
  endif()
  foreach(pic ON OFF)
    add_library(bulkhead_pch_${pic} OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cc)
    target_link_libraries(bulkhead_pch_${pic} PRIVATE torch ${BULKHEAD_FMT})
    target_precompile_headers(bulkhead_pch_${pic} PRIVATE ${BULKHEAD_PCH_HEADERS})
  endforeach()
  set_target_properties(bulkhead_pch_ON PROPERTIES POSITION_INDEPENDENT_CODE ON)
  bulkhead_pch_targets(targets "${PROJECT_SOURCE_DIR}")
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    get_target_property(wanted ${target} BULKHEAD_PCH)
    if(NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|OBJECT_LIBRARY)$" OR target MATCHES "^bulkhead_pch_"
       OR (NOT wanted STREQUAL "wanted-NOTFOUND" AND NOT wanted))
      continue()
    endif()
    bulkhead_pch_uses_torch(uses ${target})
    # A target with CUDA sources (on GPU machines, whose builds have the cores to spare) goes without.
    get_target_property(sources ${target} SOURCES)
    list(FILTER sources INCLUDE REGEX "\\.cu$")
    if(NOT uses OR sources)
      continue()
    endif()
    get_target_property(pic ${target} POSITION_INDEPENDENT_CODE)
    if(pic)
      target_precompile_headers(${target} REUSE_FROM bulkhead_pch_ON)
    else()
      target_precompile_headers(${target} REUSE_FROM bulkhead_pch_OFF)
    endif()
  endforeach()
endfunction()
