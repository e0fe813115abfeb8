#include "runtime/nccl/nccl_check.h"

#include <fmt/format.h>

namespace bulkhead::nccl {

void check(ncclResult_t rc, const char* call, const ErrorContext& context) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  const char* detail = ncclGetLastError(nullptr);
  throw CommError(fmt::format("{} failed: {} ({}){}{}", call, ncclGetErrorString(rc), static_cast<int>(rc),
                              detail && *detail ? ": " : "", detail ? detail : ""),
                  context);
}

void check(cudaError_t rc, const char* call, const ErrorContext& context) {
  if (rc == cudaSuccess) return;
  throw CommError(fmt::format("{} failed: {} ({})", call, cudaGetErrorString(rc), static_cast<int>(rc)), context);
}

ncclDataType_t datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Long:
      return ncclInt64;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
      return ncclUint8;
    default:
      throw ConfigError(fmt::format("dtype {} has no NCCL datatype", dtypeName(dtype)));
  }
}

ncclRedOp_t reduceOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Prod:
      return ncclProd;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
  }
  return ncclSum;
}

}  // namespace bulkhead::nccl
