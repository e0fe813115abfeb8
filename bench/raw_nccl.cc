#include "bench/raw_nccl.h"

#include <fmt/format.h>

#include "runtime/nccl/nccl_check.h"
#include "runtime/nccl/nccl_communicator.h"

namespace bulkhead::nccl {
namespace {

ncclComm_t handle(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t streamOf(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

RawNccl::RawNccl(Communicator& bootstrap, Deadline deadline)
    : comm_(nullptr),
      size_(bootstrap.size()),
      context_{.rank = bootstrap.members().at(bootstrap.rank()), .group = "raw-nccl"} {
  comm_ = bootstrapBounded(bootstrap, deadline, context_, "the raw NCCL reference");
}

RawNccl::~RawNccl() { ncclCommDestroy(handle(comm_)); }

void RawNccl::allReduceSum(const at::Tensor& tensor, void* stream) const {
  check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), datatype(tensor.scalar_type()), ncclSum,
                      handle(comm_), streamOf(stream)),
        "ncclAllReduce", context_);
}

void RawNccl::exchangeRows(const at::Tensor& send, const at::Tensor& recv, const std::vector<int64_t>& sendRows,
                           const std::vector<int64_t>& recvRows, void* stream) const {
  const ncclDataType_t type = datatype(send.scalar_type());
  const int64_t rowElements = send.dim() > 1 ? send.numel() / send.size(0) : 1;
  const int64_t rowBytes = rowElements * send.element_size();
  const auto* from = static_cast<const char*>(send.data_ptr());
  auto* to = static_cast<char*>(recv.data_ptr());
  check(ncclGroupStart(), "ncclGroupStart", context_);
  for (int peer = 0; peer < size_; ++peer) {
    check(ncclSend(from, sendRows[peer] * rowElements, type, peer, handle(comm_), streamOf(stream)), "ncclSend",
          context_);
    check(ncclRecv(to, recvRows[peer] * rowElements, type, peer, handle(comm_), streamOf(stream)), "ncclRecv",
          context_);
    from += sendRows[peer] * rowBytes;
    to += recvRows[peer] * rowBytes;
  }
  check(ncclGroupEnd(), "ncclGroupEnd", context_);
}

std::string RawNccl::version() {
  int code = 0;
  ncclGetVersion(&code);
  return fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100);
}

}  // namespace bulkhead::nccl
