# install() rules and an exported package: a custom trainer does
#   find_package(Bulkhead REQUIRED)
#   target_link_libraries(trainer PRIVATE bulkhead::launch)
include(CMakePackageConfigHelpers)

install(TARGETS bulkhead_runtime bulkhead_parallel bulkhead_moe bulkhead_optim bulkhead_checkpoint bulkhead_launch
        EXPORT BulkheadTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(folder runtime parallel moe optim checkpoint launch)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bulkhead/${folder}
          FILES_MATCHING PATTERN "*.h")
endforeach()
install(EXPORT BulkheadTargets NAMESPACE bulkhead:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/BulkheadConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/BulkheadConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/BulkheadConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/BulkheadConfig.cmake ${PROJECT_BINARY_DIR}/BulkheadConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)
