# install() rules and an exported package: a custom trainer does
#   find_package(Bulkhead REQUIRED)
#   target_link_libraries(trainer PRIVATE bulkhead::bulkhead)
include(CMakePackageConfigHelpers)

install(TARGETS bulkhead bulkhead_runtime bulkhead_data bulkhead_parallel bulkhead_moe bulkhead_optim bulkhead_checkpoint
                bulkhead_models bulkhead_launch
        EXPORT BulkheadTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The public API: the headers a trainer may include, each of which compiles on
# its own (tests/package checks both). Every other header is internal to its
# library (a backend's error conversion, a kernel's launcher, a save's steps)
# and is not installed: runtime/nccl/nccl_communicator.h, nccl_check.h, peer_all_reduce.h, peer_reduce_kernels.h,
# runtime/mpi/mpi_check.h, runtime/gloo/gloo_check.h, gloo_context.h, gloo_communicator.h,
# runtime/cuda/cuda_device.h, parallel/layout_grid.h, tensor_parallel_detail.h,
# moe/kernel_support.h, moe/router_noise.h, moe/cuda/*, optim/parameter_checks.h,
# checkpoint/save_job.h, box.h.
set(BULKHEAD_PUBLIC_HEADERS
  runtime/backoff.h runtime/diagnosis/checked_region.h runtime/communicator.h runtime/cpu_share.h runtime/cuda/cuda_graph.h
  runtime/deadline.h runtime/parallel_for.h runtime/diagnosis/diagnosis.h runtime/dtype.h runtime/env.h runtime/errors.h runtime/diagnosis/fatal_exit.h
  runtime/diagnosis/fault.h runtime/diagnosis/fault_spec.h runtime/fd.h runtime/store/file_store.h runtime/gloo/gloo_backend.h
  runtime/cuda/host_copy.h runtime/host_staged.h runtime/cuda/stream_timer.h runtime/diagnosis/ledger.h runtime/log.h runtime/diagnosis/monitor.h
  runtime/diagnosis/monitor_record.h runtime/mpi/mpi_backend.h
  runtime/nccl/nccl_backend.h runtime/diagnosis/node_relay.h runtime/diagnosis/op_checks.h runtime/store/prefix_store.h
  runtime/progress_bar.h runtime/store/socket.h runtime/store/store.h runtime/store/store_protocol.h runtime/store/tcp_store.h
  data/indexed_dataset.h data/mapped_file.h data/npy.h data/numpy_random.h data/gpt_dataset.h data/blend.h
  parallel/grad_sync.h parallel/layout.h parallel/linear.h parallel/parameter.h parallel/pipeline.h
  parallel/pipeline_schedule.h parallel/process_groups.h parallel/shard_init.h parallel/tensor_parallel.h
  parallel/topology_checks.h parallel/vocab_parallel.h
  moe/all_to_all_autograd.h moe/dispatch_routes.h moe/dispatcher.h moe/experts.h moe/gather_sum.h moe/moe_layer.h
  moe/router.h moe/router_scores.h moe/static_dispatch.h moe/static_exchange.h moe/swiglu.h
  optim/adamw.h optim/clip.h optim/distributed_optimizer.h optim/fused_update.h optim/grad_buckets.h optim/lr_schedule.h
  optim/shard_layout.h
  checkpoint/checkpointer.h checkpoint/checksum.h checkpoint/chunking.h checkpoint/commit.h checkpoint/convert.h
  checkpoint/dtype.h checkpoint/fault.h checkpoint/folder.h checkpoint/fs.h checkpoint/hdf5.h checkpoint/inspect.h
  checkpoint/key_map.h checkpoint/manifest.h checkpoint/parallel_for.h checkpoint/rank_file.h checkpoint/reader.h
  checkpoint/safetensors.h checkpoint/safetensors_source.h checkpoint/staging.h checkpoint/state_dict.h
  checkpoint/tensor_reader.h
  models/config.h models/decoder.h models/hf_export.h models/hf_weights.h models/layers.h
  launch/bootstrap.h launch/cli.h launch/init.h launch/recovery.h launch/rendezvous.h launch/snapshot.h launch/world.h)
foreach(header ${BULKHEAD_PUBLIC_HEADERS})
  get_filename_component(folder ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bulkhead/${folder})
endforeach()
install(EXPORT BulkheadTargets NAMESPACE bulkhead:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/BulkheadConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/BulkheadConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/BulkheadConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/BulkheadConfig.cmake ${PROJECT_BINARY_DIR}/BulkheadConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Bulkhead)
