#pragma once
// The kernel behind PeerAllReduce (peer_all_reduce.h), on raw pointers so this
// header needs neither CUDA's nor libtorch's. Every rank of a node exports one
// region of device memory; every other rank maps it (CUDA IPC) and reads and
// writes it directly.
//
// A region holds, from its start:
//   flags   kPhases x kMaxBlocks x kMaxRanks uint64: flags[phase][b][p] is the
//           last call number at which rank p's block b reached that phase's
//           barrier (written by p, read by the region's owner);
//   data    kEpochs areas of `capacity` bytes: the owner's input of a call;
//   result  kEpochs areas of `capacity` bytes: the owner's reduced share (two-shot).
// Call s uses epoch s % 2 of data and result. Call numbers only grow, so a flag
// is never reset, and a call never waits on a flag of another call; a rank
// writes epoch s % 2 only after every peer has started call s - 1 (the barrier
// of s - 1), which each peer does only after its call s - 2, the last reader
// of that epoch, has ended on its stream.

#include <cstdint>

namespace bulkhead::nccl::peer {

enum class Dtype { Float32, BFloat16, Float16 };

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kPhases = 2;
constexpr int kEpochs = 2;
constexpr int64_t kFlagBytes = 64 * 1024;  // kPhases * kMaxBlocks * kMaxRanks * 8, rounded up
static_assert(kPhases * kMaxBlocks * kMaxRanks * 8 <= kFlagBytes);

inline int64_t regionBytes(int64_t capacity) { return kFlagBytes + 2 * kEpochs * capacity; }

// Each rank's region as this process maps it (index: rank in the group).
struct Regions {
  char* base[kMaxRanks] = {};
};

// Where a kernel that gave up waiting writes why: (call << 8) | the peer it
// waited for; 0 while none did. Host memory mapped into the device.
struct Verdict {
  unsigned long long gaveUp = 0;
  int abort = 0;  // set by the host: waiting kernels give up at once
};

struct LaunchArgs {
  Dtype dtype = Dtype::Float32;
  int rank = 0;
  int size = 1;
  void* tensor = nullptr;  // summed in place
  int64_t numel = 0;
  int64_t capacity = 0;  // bytes of one data or result area
  bool twoShot = false;
  uint64_t* sequence = nullptr;        // device: the last call number this rank completed
  unsigned int* blocksDone = nullptr;  // device: blocks of the running call that ended
  Verdict* verdict = nullptr;          // mapped host memory, as the device sees it
  uint64_t giveUpNanoseconds = 0;      // how long a block waits for a peer before it gives up
  void* stream = nullptr;              // cudaStream_t
};

// Whether the kernel was built for the current device's architecture.
bool kernelRunsHere();

// Enqueues one all-reduce (sum) on the stream. Raises ConfigError where the
// kernel cannot run on this GPU, Error on any other launch failure.
void launchPeerAllReduce(const Regions& regions, const LaunchArgs& args);

}  // namespace bulkhead::nccl::peer
