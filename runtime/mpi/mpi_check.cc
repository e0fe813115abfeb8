#include "runtime/mpi/mpi_check.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>

#include <algorithm>

#include "runtime/diagnosis/ledger.h"

namespace bulkhead::mpi {

void check(int rc, const char* call, const ErrorContext& context) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw CommError(fmt::format("{} failed with MPI error {}: {}", call, rc, std::string(text, length)), context);
}

std::mutex& callLock() {
  static std::mutex lock;
  return lock;
}

MPI_Datatype datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    case c10::ScalarType::Char:
      return MPI_INT8_T;
    case c10::ScalarType::Byte:
      return MPI_UINT8_T;
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Half:
      return MPI_UINT16_T;
    default:
      throw ConfigError(fmt::format("dtype {} has no MPI datatype", dtypeName(dtype)));
  }
}

namespace {

// Reduces in float and rounds once per pair, as NCCL does for 16-bit floats.
template <typename T, typename Combine>
void reduce16(void* in, void* inout, int* length, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = T(Combine{}(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct Add {
  float operator()(float a, float b) const { return a + b; }
};
struct Mul {
  float operator()(float a, float b) const { return a * b; }
};
struct Lo {
  float operator()(float a, float b) const { return std::min(a, b); }
};
struct Hi {
  float operator()(float a, float b) const { return std::max(a, b); }
};

// [dtype: 0 bf16, 1 fp16][op: sum, prod, min, max]
MPI_Op ops16[2][4] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                      {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};

template <typename T>
void create(MPI_Op* row) {
  MPI_User_function* fns[4] = {&reduce16<T, Add>, &reduce16<T, Mul>, &reduce16<T, Lo>, &reduce16<T, Hi>};
  for (int i = 0; i < 4; ++i) check(MPI_Op_create(fns[i], 1, &row[i]), "MPI_Op_create", {});
}

int opIndex(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return 0;  // avg divides after the sum
    case ReduceOp::Prod:
      return 1;
    case ReduceOp::Min:
      return 2;
    case ReduceOp::Max:
      return 3;
  }
  return 0;
}

}  // namespace

void createReduceOps() {
  if (ops16[0][0] != MPI_OP_NULL) return;
  create<c10::BFloat16>(ops16[0]);
  create<c10::Half>(ops16[1]);
}

void freeReduceOps() {
  for (auto& row : ops16)
    for (auto& op : row)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
}

MPI_Op reduceOp(ReduceOp op, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::BFloat16) return ops16[0][opIndex(op)];
  if (dtype == c10::ScalarType::Half) return ops16[1][opIndex(op)];
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return MPI_SUM;
    case ReduceOp::Prod:
      return MPI_PROD;
    case ReduceOp::Min:
      return MPI_MIN;
    case ReduceOp::Max:
      return MPI_MAX;
  }
  return MPI_SUM;
}

}  // namespace bulkhead::mpi
