#include "cuda/comm/p2p_group.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>

#include "cuda/runtime/cuda_check.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"

namespace lmoe {

namespace {

constexpr std::size_t kDefaultRoundBytes = std::size_t{32} << 20;

std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

std::chrono::milliseconds p2p_default_timeout() {
  // The table bounds it (a day), so that ms · 10^6 ns fits the device's 64-bit timeout.
  if (const auto ms = setting_int("LMOE_P2P_TIMEOUT_MS")) return std::chrono::milliseconds(*ms);
  return std::chrono::seconds(10);
}

P2pLayout p2p_layout(const P2pOptions& options, bool shared_gpu) {
  P2pLayout layout;
  layout.blocks = options.blocks ? options.blocks : (shared_gpu ? 16 : cuda::kP2pMaxBlocks);
  LMOE_CHECK(layout.blocks >= 1 && layout.blocks <= cuda::kP2pMaxBlocks,
             "p2p: blocks must be in [1, " + std::to_string(cuda::kP2pMaxBlocks) + "], got " +
                 std::to_string(layout.blocks));
  // Each block stages into its own region of block_bytes (a multiple of 256, so every region is
  // aligned for vectors and holds a whole number of 8-element slices in every dtype).
  const std::size_t round_bytes = options.round_bytes ? options.round_bytes : kDefaultRoundBytes;
  layout.block_bytes =
      std::max<std::size_t>(256, round_bytes / static_cast<std::size_t>(layout.blocks) / 256 * 256);
  layout.timeout = options.timeout.count() > 0 ? options.timeout : p2p_default_timeout();
  return layout;
}

std::string p2p_layout_disagreement(std::span<const P2pLayout> layouts) {
  std::string differences;
  // One field: "blocks is 32 on rank 0 and 16 on rank 1 (hint)", when its values differ.
  const auto compare = [&](const char* field, const auto& value_of, const char* unit,
                           const char* hint) {
    const bool alike = std::all_of(layouts.begin(), layouts.end(), [&](const P2pLayout& layout) {
      return value_of(layout) == value_of(layouts.front());
    });
    if (alike) return;
    std::string text = std::string(field) + " is";
    for (std::size_t r = 0; r < layouts.size(); ++r) {
      text += r == 0 ? " " : (r + 1 == layouts.size() ? " and " : ", ");
      text += std::to_string(value_of(layouts[r])) + unit + " on rank " + std::to_string(r);
    }
    differences += (differences.empty() ? "" : "; ") + text + " (" + hint + ")";
  };
  compare(
      "blocks", [](const P2pLayout& layout) { return layout.blocks; }, "",
      "set P2pOptions::blocks alike on every rank");
  compare(
      "block_bytes", [](const P2pLayout& layout) { return layout.block_bytes; }, "",
      "round_bytes / blocks: set P2pOptions::round_bytes and blocks alike on every rank");
  compare(
      "timeout", [](const P2pLayout& layout) { return layout.timeout.count(); }, " ms",
      "set P2pOptions::timeout, or LMOE_P2P_TIMEOUT_MS, alike on every rank");
  return differences.empty() ? "" : "p2p: ranks disagree on the group's layout: " + differences;
}

std::string describe_p2p_collective(std::uint32_t tag) {
  std::string operation;
  switch (static_cast<cuda::P2pCollective>(tag & 3u)) {
    case cuda::P2pCollective::all_reduce: operation = "all_reduce"; break;
    case cuda::P2pCollective::reduce_scatter: operation = "reduce_scatter"; break;
    case cuda::P2pCollective::all_gather: operation = "all_gather"; break;
    case cuda::P2pCollective::none: return "no collective";
  }
  const std::uint32_t dtype = tag >> 2 & 3u;
  const std::string dtype_text = dtype <= static_cast<std::uint32_t>(DType::bf16)
                                     ? std::string(dtype_name(static_cast<DType>(dtype)))
                                     : "dtype-" + std::to_string(dtype);
  const std::string count =
      tag & 16u ? "at least " + std::to_string(cuda::kP2pTagExactCounts) : std::to_string(tag >> 5);
  return operation + " of " + count + " " + dtype_text + " elements";
}

std::size_t p2p_flags_bytes() { return round_up_256(sizeof(cuda::P2pFlags)); }

std::size_t p2p_workspace_bytes(const P2pLayout& layout) {
  return p2p_flags_bytes() + 2 * static_cast<std::size_t>(layout.blocks) * layout.block_bytes;
}

int P2pGroup::ranks_on_gpu_of(int rank) const {
  return static_cast<int>(
      std::count(gpu_ids_.begin(), gpu_ids_.end(), gpu_ids_[static_cast<std::size_t>(rank)]));
}

cuda::P2pDeviceHandle P2pGroup::handle(int rank) const {
  cuda::P2pDeviceHandle h{};
  h.rank = rank;
  h.size = size_;
  h.block_bytes = static_cast<std::int64_t>(layout_.block_bytes);
  h.max_blocks = layout_.blocks;
  for (int r = 0; r < size_; ++r) {
    h.data[r] = data_[static_cast<std::size_t>(r)];
    h.flags[r] = flags_[static_cast<std::size_t>(r)];
  }
  h.status = &mapped_device_->status[rank];
  h.abort_flag = &mapped_device_->abort_flag;
  h.timeout_ns = static_cast<std::uint64_t>(layout_.timeout.count()) * 1000000ull;
  return h;
}

// "rank r: entered/completed" per block, from the flags in device memory (read once the rounds have
// stopped, which a raised abort flag ensures). A stalled rank whose blocks never entered the round
// was not running at all (queued behind other work, or not resident); one that entered but did not
// complete was waiting. Then, for the block of the first timeout, the arrival each rank holds from
// every peer: a peer that completed the round while a rank still holds an older arrival from it
// points at the flags' visibility, not at scheduling. Ranks of other processes are read through
// their IPC mappings from this process's device.
std::string P2pGroup::block_progress() {
  std::string text;
  int timed_out_block = -1;
  for (int r = 0; r < size_ && timed_out_block < 0; ++r) {
    if (mapped_->status[r].code == cuda::kP2pTimeout) timed_out_block = mapped_->status[r].block;
  }
  const auto local =
      std::find_if(devices_.begin(), devices_.end(), [](int device) { return device >= 0; });
  if (local == devices_.end()) return "";
  std::vector<cuda::P2pFlags> flags(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    const int device =
        devices_[static_cast<std::size_t>(r)] >= 0 ? devices_[static_cast<std::size_t>(r)] : *local;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaMemcpy(&flags[r], flags_[static_cast<std::size_t>(r)], sizeof(cuda::P2pFlags),
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
      cudaGetLastError();
      return "";
    }
    text += "; rank " + std::to_string(r) + " blocks entered/completed:";
    for (int b = 0; b < layout_.blocks; ++b) {
      text += " " + std::to_string(flags[r].entered[b]) + "/" + std::to_string(flags[r].epoch[b]);
    }
  }
  if (timed_out_block >= 0 && timed_out_block < layout_.blocks) {
    text += "; arrivals held for block " + std::to_string(timed_out_block) + " (from rank 0 … " +
            std::to_string(size_ - 1) + "):";
    for (int r = 0; r < size_; ++r) {
      text += " rank " + std::to_string(r) + " [";
      for (int peer = 0; peer < size_; ++peer) {
        text += (peer ? " " : "") +
                std::to_string(static_cast<std::uint32_t>(flags[r].arrive[timed_out_block][peer]));
      }
      text += "]";
    }
  }
  return text;
}

void P2pGroup::raise_abort() { reinterpret_cast<volatile std::int32_t&>(mapped_->abort_flag) = 1; }

std::string p2p_failure_text(int rank, const volatile cuda::P2pStatus& status,
                             std::chrono::milliseconds timeout) {
  const std::int32_t peer = status.peer, block = status.block, round = status.round;
  const std::string waited = " waited more than " + std::to_string(timeout.count()) + " ms";
  switch (status.code) {
    case cuda::kP2pTimeout:
      // A fused kernel's grid barrier names the rank itself: its own blocks were not all running.
      if (peer == rank) {
        return "rank " + std::to_string(rank) + "'s block " + std::to_string(block) + waited +
               " for the other blocks of its grid (fused call " + std::to_string(round) +
               "); the GPU did not run all of the grid's blocks at once";
      }
      return "p2p: rank " + std::to_string(rank) + waited + " for rank " + std::to_string(peer) +
             " (round " + std::to_string(round) + ", block " + std::to_string(block) +
             "); the peer is stalled or never issued the same collective";
    case cuda::kP2pMismatch:
      return "p2p: rank " + std::to_string(rank) + " ran " +
             describe_p2p_collective(status.own_tag) + " while rank " + std::to_string(peer) +
             " ran " + describe_p2p_collective(status.peer_tag) + " in the same round (round " +
             std::to_string(round) + ", block " + std::to_string(block) +
             "); every rank must issue the same collectives, with the same sizes and dtypes, in "
             "the same order";
    case cuda::kP2pConcurrentUse:
      return "p2p: rank " + std::to_string(rank) +
             " ran two collectives at the same time on one workspace (issue them in one order, or "
             "order the streams with events)";
    case cuda::kFusedTokensMismatch:
      return "rank " + std::to_string(rank) + " ran T = " + std::to_string(status.tokens) +
             " and rank " + std::to_string(peer) +
             " T = " + std::to_string(status.compared_tokens) + " in the same fused call (call " +
             std::to_string(round) +
             "); every rank must run a call with the same T (a graph replayed with T on the "
             "device: the same T written on every rank)";
    case cuda::kFusedTokensOutOfRange:
      return "rank " + std::to_string(rank) + " read T = " + std::to_string(status.tokens) +
             " from tokens_device, outside [0, " + std::to_string(status.compared_tokens) +
             "] (the rows its fused call was launched for); its call wrote no output";
    default: return "";
  }
}

std::string P2pGroup::device_failure() const {
  std::string aborted;
  for (int r = 0; r < size_; ++r) {
    const volatile cuda::P2pStatus& s = mapped_->status[r];
    if (std::string text = p2p_failure_text(r, s, layout_.timeout); !text.empty()) return text;
    if (s.code == cuda::kP2pAborted && aborted.empty())
      aborted = "p2p: the group was aborted while rank " + std::to_string(r) + " was waiting";
  }
  return aborted;
}

}  // namespace lmoe
