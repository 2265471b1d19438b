#include "cuda/fused/fused_tail.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#include "cuda/comm/p2p_group.hpp"
#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/fused/fused_decode_launch.hpp"
#include "cuda/fused/fused_ll_lines.hpp"
#include "cuda/fused/fused_tail_launch.hpp"
#include "cuda/runtime/alignment.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/rank_device.hpp"
#include "lmoe/error.hpp"
#include "lmoe/fused_defaults.hpp"

namespace lmoe::cuda {

namespace {

std::int64_t align256(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Work items of the stripe product: tiles of kFusedTileCols columns, each split over at most
// this many ranges of K (at least 4 chunks of kFusedTileK per split keep the cp.async pipeline
// full).
std::int64_t max_splits(std::int64_t l) {
  const std::int64_t chunks = (l + kFusedTileK - 1) / kFusedTileK;
  return std::max<std::int64_t>(1, chunks / 4);
}

// Compute 9.0, where the chained path's wgmma runs.
bool device_is_compute_90(int device) {
  int major = 0, minor = 0;
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

}  // namespace

std::optional<std::string> FusedTail::problem_limit(TailDims dims, DType dtype, int tp) {
  if (dtype != DType::bf16 && dtype != DType::f16) {
    return "fused runs bf16 and f16 (tensor-core inputs), not " + std::string(dtype_name(dtype));
  }
  if (tp > kP2pMaxRanks) {
    return "tp=" + std::to_string(tp) + " > " + std::to_string(kP2pMaxRanks) +
           " (fused's workspace)";
  }
  if (dims.d_model % (8 * tp) != 0) {
    return "d_model % (8·tp) != 0 (fused needs whole 8-column tiles per rank's stripe): d_model=" +
           std::to_string(dims.d_model) + ", tp=" + std::to_string(tp);
  }
  if (dims.d_latent % 16 != 0) {
    return "d_latent % 16 != 0 (fused's tensor-core k step): d_latent=" +
           std::to_string(dims.d_latent);
  }
  return std::nullopt;
}

std::optional<std::string> FusedTail::unavailable(Communicator& comm, TailDims dims, DType dtype) {
  const int tp = comm.size();
  if (auto limit = problem_limit(dims, dtype, tp)) return limit;
  if (comm.memory_space() != MemorySpace::device) return "fused needs a device communicator";
  if (tp > 1 && dynamic_cast<P2pPeerAccess*>(&comm) == nullptr) {
    return "fused with tp > 1 reads the peers' workspaces directly, which needs the p2p "
           "communicator (this one is '" +
           std::string(comm.backend_name()) + "')";
  }
  return std::nullopt;
}

FusedTail::FusedTail(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
                     const void* w_stripe, const float* gamma, std::int64_t max_tokens)
    : FusedTail(comm, dims, dtype, latent_norm, eps, w_stripe, gamma, max_tokens,
                fused_settings_from_environment(comm.size())) {}

FusedTail::FusedTail(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
                     const void* w_stripe, const float* gamma, std::int64_t max_tokens,
                     FusedSettings settings)
    : comm_(comm), dtype_(dtype), settings_(std::move(settings)) {
  if (auto reason = unavailable(comm, dims, dtype)) throw Error(*reason);
  const int tp = comm.size();
  peers_ = tp > 1 ? dynamic_cast<P2pPeerAccess*>(&comm) : nullptr;
  capacity_ = max_tokens > 0 ? std::min(max_tokens, kFusedMaxTokens) : kFusedMaxTokens;
  params_.rank = comm.rank();
  params_.tp = tp;
  params_.d = dims.d_model;
  params_.l = dims.d_latent;
  params_.stripe = dims.d_model / tp;
  params_.w_stripe = w_stripe;
  params_.gamma = gamma;
  params_.eps = eps;
  params_.latent_norm = latent_norm;
  params_.capacity = capacity_;
  // The stripe goes to L2 at the start of a call (it streams in while the norm runs and the peers
  // arrive) when it fits there with room to spare; K3's whole w_up (51 MB, tp = 1) does not.
  const std::int64_t stripe_bytes =
      params_.stripe * params_.l * static_cast<std::int64_t>(dtype_size(dtype));
  params_.prefetch_weights = stripe_bytes <= (std::int64_t{32} << 20);

  // Everything below is per device (kernel attributes, occupancy, the workspace): the rank's own
  // GPU, whatever the calling thread had current.
  const int device = make_rank_device_current(comm);
  check_weights_device(device, w_stripe, gamma);
  use_status_record();
  const FusedGrid g = choose_grid(device, dims, tp);
  const std::int64_t bytes = lay_out_workspace(dims, tp, device, g);
  allocate_workspace(bytes);

  const int grid = agree_grid(g.grid);
  params_.grid = grid;
  params_.col_tiles = g.col_tiles;
  params_.splits = g.splits_for(grid);
  if (settings_.trace) {
    trace_ =
        DeviceBuffer(static_cast<std::size_t>(grid) * kFusedTracePoints * sizeof(std::uint64_t));
    LMOE_CUDA_CHECK(cudaMemset(trace_.data(), 0, trace_.bytes()));
    params_.trace = static_cast<std::uint64_t*>(trace_.data());
  }
  choose_decode(g.sms, g.sharing);
  choose_chained(g.sms, g.sharing);
  if (settings_.trace && decode_max_tokens_ > 0) {
    decode_trace_ = DeviceBuffer(static_cast<std::size_t>(decode_plan_.grid) * kDecodeTracePoints *
                                 sizeof(std::uint64_t));
    LMOE_CUDA_CHECK(cudaMemset(decode_trace_.data(), 0, decode_trace_.bytes()));
  }
}

void FusedTail::check_weights_device(int device, const void* w_stripe, const float* gamma) {
  for (const auto& [name, pointer] : {std::pair{"w_up's stripe", w_stripe},
                                      std::pair{"gamma", static_cast<const void*>(gamma)}}) {
    cudaPointerAttributes attributes{};
    if (pointer != nullptr && cudaPointerGetAttributes(&attributes, pointer) == cudaSuccess &&
        attributes.type == cudaMemoryTypeDevice && attributes.device != device) {
      throw Error(std::string("fused: ") + name + " is on GPU " +
                  std::to_string(attributes.device) + ", this rank runs on GPU " +
                  std::to_string(device));
    }
    (void)cudaGetLastError();  // a pointer the runtime does not know is the caller's business
  }
}

FusedTail::FusedGrid FusedTail::choose_grid(int device, TailDims dims, int tp) const {
  FusedGrid g;
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 0;
  LMOE_CUDA_CHECK(fused_tail_blocks_per_sm(capacity_, dtype_, &per_sm));
  LMOE_CHECK(per_sm >= 1, "fused: the kernel does not fit on an SM");
  // Every block of every rank on this GPU must be resident at once: blocks wait for each other.
  // Ranks sharing a GPU leave one block slot per SM free (when there are several), so that a
  // peer's other work on the GPU (a copy, a memset) cannot keep a rank's last blocks out.
  g.sharing = peers_ ? peers_->ranks_on_my_gpu() : 1;
  const int slots = g.sharing > 1 ? std::max(1, per_sm - 1) : per_sm;
  // As many blocks as fit, up to one per work item when every tile takes the most splits; the
  // splits then fill the grid (a narrow stripe spreads over every SM by splitting K).
  const std::int64_t stripe = dims.d_model / tp;
  g.col_tiles = (stripe + kFusedTileCols - 1) / kFusedTileCols;
  g.most_splits = max_splits(dims.d_latent);
  g.grid = static_cast<int>(std::clamp<std::int64_t>(
      std::min<std::int64_t>(g.col_tiles * g.most_splits, std::int64_t{g.sms} * slots / g.sharing),
      1, 1 << 16));
  return g;
}

std::int64_t FusedTail::lay_out_workspace(TailDims dims, int tp, int device, const FusedGrid& g) {
  const std::int64_t d = dims.d_model, l = dims.d_latent, stripe = d / tp;
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(dtype_));
  const std::int64_t col_tiles = g.col_tiles;
  // Workspace: flags; the regions the peers read or write, laid out alike on every rank (from
  // capacity, d, l, tp and the dtype only: a peer addresses them with this rank's offsets): per
  // parity the staged routed, shared and stripe rows, then (tp > 1) per parity a line per sending
  // rank with its call's T, and the decode kernel's exchange, a slot per sending rank of its latent
  // rows, its columns of this rank's stripe of `shared` and its output stripe as LL lines (4 bytes
  // per element, cuda/fused_ll.cuh; K3 at tp 2: 2.8 MB, at tp 16: 9.2 MB); then this rank's own:
  // N, its stripe of the shared sum (tp > 1), the tiles' split counters and fp32 partials (sized by
  // this rank's grid, so they come last).
  params_.routed_offset = align256(sizeof(FusedFlags));
  params_.shared_offset = params_.routed_offset + align256(capacity_ * l * esize);
  params_.stripe_offset = params_.shared_offset + align256(capacity_ * d * esize);
  params_.parity_bytes =
      params_.stripe_offset + align256(capacity_ * stripe * esize) - params_.routed_offset;
  params_.ll_tokens_offset = params_.routed_offset + 2 * params_.parity_bytes;
  params_.ll_latent_offset = params_.ll_tokens_offset;
  if (tp > 1) {
    const std::int64_t rows = std::min(kFusedDecodeMaxTokens, capacity_), line_bytes = 4;
    params_.ll_rows = rows;
    // One line (4 elements) per sender with its call's T, then the decode kernel's slots.
    params_.ll_latent_offset = params_.ll_tokens_offset + align256(tp * 4 * line_bytes);
    params_.ll_shared_offset = params_.ll_latent_offset + align256(tp * rows * l * line_bytes);
    params_.ll_stripe_offset = params_.ll_shared_offset + align256(tp * rows * stripe * line_bytes);
    params_.ll_parity_bytes = params_.ll_stripe_offset + align256(tp * rows * stripe * line_bytes) -
                              params_.ll_tokens_offset;
  }
  // Then (tp > 1, where the chained path may run: compute 9.0, not turned off) per parity the
  // chained path's exchange as LL lines (cuda/fused_chained_exchange.cuh; K3 at 128 rows: ~11 MB).
  params_.cx_latent_offset = params_.ll_tokens_offset + 2 * params_.ll_parity_bytes;
  if (tp > 1 && !settings_.chained_off && device_is_compute_90(device)) {
    const std::int64_t rows = std::min(kFusedChainedMaxTokens, capacity_), line_bytes = 4;
    params_.cx_rows = rows;
    params_.cx_owner_rows = (rows + tp - 1) / tp;
    params_.cx_normed_offset =
        params_.cx_latent_offset + align256(tp * params_.cx_owner_rows * l * line_bytes);
    params_.cx_shared_offset = params_.cx_normed_offset + align256(rows * l * line_bytes);
    params_.cx_out_offset = params_.cx_shared_offset + align256(tp * rows * stripe * line_bytes);
    params_.cx_parity_bytes = params_.cx_out_offset + align256(tp * rows * stripe * line_bytes) -
                              params_.cx_latent_offset;
  }
  params_.normed_offset = params_.cx_latent_offset + 2 * params_.cx_parity_bytes;
  // The partials are sized for this rank's grid: the agreed grid is no larger, so its splits are
  // no more. With one rank the epilogue reads `shared` itself: no shared-sum stripe.
  params_.shared_sum_offset = params_.normed_offset + align256(capacity_ * l * esize);
  params_.tile_arrived_offset =
      params_.shared_sum_offset + (tp > 1 ? align256(capacity_ * stripe * esize) : 0);
  params_.partials_offset = params_.tile_arrived_offset +
                            align256(col_tiles * static_cast<std::int64_t>(sizeof(std::uint32_t)));
  const std::int64_t local_splits = g.splits_for(g.grid);
  const std::int64_t partial_bytes = local_splits > 1
                                         ? col_tiles * local_splits * capacity_ * kFusedTileCols *
                                               static_cast<std::int64_t>(sizeof(float))
                                         : 0;
  return params_.partials_offset + align256(partial_bytes);
}

void FusedTail::allocate_workspace(std::int64_t bytes) {
  if (peers_) {
    // Every rank's workspace as this rank's kernel addresses it (a peer's pointer between threads,
    // its CUDA IPC mapping between processes), zeroed before any peer can reach it.
    shared_workspace_ = peers_->share_buffer(static_cast<std::size_t>(bytes));
    for (int r = 0; r < params_.tp; ++r) params_.workspace[r] = shared_workspace_->base(r);
    // The LL lines' flags as they start (no line is taken before a peer wrote it, even once the
    // epochs wrap: cuda/fused/fused_ll_lines.hpp). Before the collective below, so before any
    // peer's call.
    std::byte* own = params_.workspace[comm_.rank()];
    LMOE_CUDA_CHECK(start_ll_lines(own + params_.ll_tokens_offset, params_.ll_parity_bytes));
    LMOE_CUDA_CHECK(start_ll_lines(own + params_.cx_latent_offset, params_.cx_parity_bytes));
    LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    workspace_ = DeviceBuffer(static_cast<std::size_t>(bytes));
    LMOE_CUDA_CHECK(cudaMemset(workspace_.data(), 0, workspace_.bytes()));
    LMOE_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed flags before the first call
    params_.workspace[0] = static_cast<std::byte*>(workspace_.data());
  }
}

// Where the kernels report a failure: the p2p group's record and abort flag with several ranks;
// with one rank (no group) a record of this rank's own.
void FusedTail::use_status_record() {
  if (peers_) {
    const P2pDeviceHandle h = peers_->device_handle();
    params_.status = h.status;
    params_.abort_flag = h.abort_flag;
    params_.timeout_ns = h.timeout_ns;
    return;
  }
  own_record_ = MappedHostBuffer(sizeof(P2pMappedStatus));
  auto* record = static_cast<P2pMappedStatus*>(own_record_.data());
  params_.status = &record->status[0];
  params_.abort_flag = &record->abort_flag;
  // The timeout a p2p communicator of one rank was given, else the settings'.
  const auto* p2p = dynamic_cast<const P2pPeerAccess*>(&comm_);
  params_.timeout_ns =
      p2p ? p2p->device_handle().timeout_ns
          : static_cast<std::uint64_t>(settings_.wait_timeout.count()) * 1000 * 1000;
}

// Ranks take the smallest grid, and must lay out alike what the peers address: a rank built with
// other rows (another max_tokens) or other regions (other dims, the chained path's lines on one
// rank only) would have the peers' stores land elsewhere. Every rank raises the same error, with
// every rank's value of what differs.
int FusedTail::agree_grid(int grid) {
  if (!peers_) return grid;
  const int tp = params_.tp;
  enum Field { kGrid, kRows, kLayoutEnd, kFields };
  const std::int64_t mine[kFields] = {grid, capacity_, params_.normed_offset};
  std::vector<std::int64_t> all(static_cast<std::size_t>(kFields * tp));
  comm_.control_all_gather(mine, all.data(), sizeof(mine));
  const auto value = [&](int rank, Field field) {
    return all[static_cast<std::size_t>(kFields * rank + field)];
  };
  const auto differs = [&](Field field) {
    for (int r = 1; r < tp; ++r) {
      if (value(r, field) != value(0, field)) return true;
    }
    return false;
  };
  // "rank 0: 16, rank 1: 32".
  const auto each_rank = [&](Field field, const char* unit) {
    std::string text;
    for (int r = 0; r < tp; ++r) {
      text += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + unit +
              std::to_string(value(r, field));
    }
    return text;
  };
  if (differs(kRows)) {
    throw Error("fused: the ranks' workspaces hold different rows (" + each_rank(kRows, "") +
                "): max_tokens must be the same on every rank");
  }
  if (differs(kLayoutEnd)) {
    throw Error(
        "fused: the ranks lay out the part of their workspaces that peers write "
        "differently (it ends at " +
        each_rank(kLayoutEnd, "byte ") +
        "): every rank needs the same d_model, d_latent, dtype and LMOE_FUSED_CHAINED, "
        "and GPUs of one compute capability");
  }
  for (int r = 0; r < tp; ++r) grid = std::min(grid, static_cast<int>(value(r, kGrid)));
  return grid;
}

// Calls of up to 16 rows (8 where 16 rows do not fit in shared memory) run the decode kernel, where
// its plan accepts the stripe on this device (fused_decode_plan's conditions). With several ranks
// its blocks wait for each other and for the peers', so every block of every rank on a GPU must be
// resident at once: one block per SM, and ranks sharing a GPU split its SMs (leaving one free for
// a peer's other work); the ranks then agree on the smallest bound and grid (collective).
void FusedTail::choose_decode(int sms, int sharing) {
  // LMOE_FUSED_DECODE=0 turns the decode kernel off (every call runs the general kernel).
  if (settings_.decode_off) {
    decode_limit_ = settings_.decode_off;
  } else if (!aligned16(params_.w_stripe) || !aligned16(params_.gamma)) {
    decode_limit_ = "the decode kernel's 16-byte loads need w_up and gamma 16-byte aligned";
  } else {
    const int max_grid = sharing > 1 ? std::max(1, (sms - 1) / sharing) : sms;
    for (std::int64_t bound : {kFusedDecodeMaxTokens, std::int64_t{8}}) {
      const std::int64_t tokens = std::min(bound, capacity_);
      const char* reason =
          fused_decode_plan(params_.stripe, params_.l, tokens, dtype_, &decode_plan_, max_grid);
      if (reason == nullptr) {
        decode_max_tokens_ = tokens;
        break;
      }
      if (!decode_limit_)
        decode_limit_ = std::string(reason) + " (d_model=" + std::to_string(params_.d) +
                        ", d_latent=" + std::to_string(params_.l) +
                        (params_.tp > 1 ? ", tp=" + std::to_string(params_.tp) : std::string()) +
                        ", T ≤ " + std::to_string(tokens) + ")";
    }
  }
  // The decode kernel is launched programmatically with one rank: it may start as the stream's
  // previous kernel's blocks leave (another call's decode kernel lets it), and gamma and 4 of each
  // warp's first weight items stream before it waits for that kernel to end; per tail in a graph
  // of layers that is faster, as a lone replay the early items delay the rows (docs/fused.md).
  // With several ranks only where LMOE_FUSED_DECODE_PROGRAMMATIC=1 asks and each rank has a GPU of
  // its own: ranks sharing a GPU need every rank's kernel resident at once, which a call's early
  // blocks, holding SMs while they wait, could prevent. LMOE_FUSED_DECODE_EARLY_ITEMS sets the
  // count, for measurements.
  const bool wanted = settings_.decode_programmatic.value_or(params_.tp == 1);
  const bool pair_wanted = settings_.decode_pair;
  decode_early_items_ = settings_.decode_early_items;
  if (params_.tp == 1) {
    decode_programmatic_ = wanted && decode_max_tokens_ > 0;
    // The pair instance (two blocks an SM) only where it is launched programmatically: its point
    // is that the next call's blocks enter while this one runs. One rank only: with several, every
    // block of a call must be resident at once and the grid is agreed after the plan.
    // LMOE_FUSED_DECODE_PAIR=0 turns it off. It is faster than the chained path for a narrow
    // stripe's calls of up to 4 rows (docs/fused.md); letting the next call in at its entry instead
    // was slower, since the call after it entered too and its weights queued ahead of the next
    // call's inputs.
    if (!decode_programmatic_ || !pair_wanted) decode_plan_.pair_tokens = 0;
    decode_plan_.pair_tokens = std::min(decode_plan_.pair_tokens, decode_max_tokens_);
    return;
  }
  decode_plan_.pair_tokens = 0;
  // Every rank must run the same kernel with the same grid for a call (the protocol's targets).
  const std::int64_t mine[2] = {decode_max_tokens_, decode_plan_.grid};
  std::vector<std::int64_t> all(static_cast<std::size_t>(2 * params_.tp));
  comm_.control_all_gather(mine, all.data(), sizeof(mine));
  std::int64_t bound = mine[0], grid = decode_max_tokens_ > 0 ? mine[1] : 0;
  for (int r = 0; r < params_.tp; ++r) {
    bound = std::min(bound, all[static_cast<std::size_t>(2 * r)]);
    if (all[static_cast<std::size_t>(2 * r)] > 0)
      grid = std::min(grid, all[static_cast<std::size_t>(2 * r + 1)]);
  }
  if (bound < decode_max_tokens_) {
    decode_limit_ = bound == 0 ? std::string("the decode kernel does not run on another rank")
                               : "another rank's decode kernel takes at most " +
                                     std::to_string(bound) + " rows";
  }
  decode_max_tokens_ = bound;
  decode_plan_.grid = static_cast<int>(bound > 0 ? grid : 0);
  decode_programmatic_ = wanted && sharing == 1 && bound > 0;
  // Calls every block normalizes itself (no grid barrier; each block then reads T rows of the
  // latent from every rank): at K3 tp 2 across two H200s up to 2 rows were faster that way (T = 1
  // 19.5 µs against 21.5 warm, 22.7 against 24.5 cold; T = 2 −0.5 / −0.8 µs) and from 4 slower
  // (T = 4 +2.3, T = 16 +20: every block's norm of every row). With more peers a row's lines grow,
  // so one row there (block 0 reads as many bytes when it normalizes T = 1 for the grid).
  decode_local_norm_rows_ = params_.tp == 2 ? 2 : 1;
}

int FusedTail::decode_resident_blocks(std::int64_t tokens) const {
  if (decode_max_tokens_ == 0 || tokens > decode_max_tokens_) return 0;
  return fused_decode_resident_blocks(params_.stripe, params_.l, tokens, dtype_, decode_plan_,
                                      decode_programmatic_);
}

// Calls the decode kernel does not take run the chained path up to 128 rows where its plan accepts
// the problem on this device (compute 9.0, a tensor-map encoder, …): with one rank a norm kernel
// and the up-projection, where N is normalized (without the norm N would be the caller's routed
// rows, which the copy engine's map cannot follow from call to call); with several, the exchange
// kernel, the up-projection of the rank's stripe and the gather (cuda/fused_chained_exchange.cuh),
// where every rank runs it (collective then).
void FusedTail::choose_chained(int sms, int sharing) {
  const int tp = params_.tp;
  chained_limit_ = chained_reason(sms, sharing);
  std::int64_t bound = chained_limit_ ? 0 : std::min(kFusedChainedMaxTokens, capacity_);
  if (tp > 1) {
    // Every rank must run the same kernels for a call (the lines' epochs and the gather).
    std::vector<std::int64_t> all(static_cast<std::size_t>(tp));
    comm_.control_all_gather(&bound, all.data(), sizeof(bound));
    const std::int64_t agreed = *std::min_element(all.begin(), all.end());
    if (agreed < bound) chained_limit_ = "the chained path does not run on another rank";
    bound = agreed;
  }
  chained_max_tokens_ = bound;
}

std::optional<std::string> FusedTail::chained_reason(int sms, int sharing) {
  const int tp = params_.tp;
  if (settings_.chained_off) return settings_.chained_off;
  if (tp == 1 && !params_.latent_norm)
    return "the chained path needs the latent norm (its first kernel)";
  if (tp > 1 && params_.cx_rows == 0) return "the chained path runs on compute 9.0 only (wgmma)";
  if (!aligned16(params_.w_stripe) || !aligned16(params_.gamma))
    return "the chained path's copies need w_up and gamma 16-byte aligned";
  const std::int64_t bound = std::min(kFusedChainedMaxTokens, capacity_);
  // LMOE_FUSED_CHAINED_TILE_ROWS: 64 or 128 asks for that tile (measurements); else the plan's.
  const int tile_rows = settings_.chained_tile_rows;
  if (const char* reason =
          fused_chained_plan(params_.stripe, params_.l, bound, dtype_, tile_rows, &chained_plan_)) {
    return std::string(reason) + " (d_model=" + std::to_string(params_.d) +
           ", d_latent=" + std::to_string(params_.l) +
           (tp > 1 ? ", tp=" + std::to_string(tp) : std::string()) + ")";
  }
  FusedChainedParams& p = chained_params_;
  p.l = params_.l;
  p.rows = params_.stripe;
  p.tiles = chained_plan_.tiles;
  p.splits = chained_plan_.splits;
  p.rank = params_.rank;
  p.tp = tp;
  p.out_pitch = params_.d;
  if (tp == 1) {
    p.shared_pitch = params_.d;  // the caller's `shared`, set per call
    p.status = params_.status;
    p.abort_flag = params_.abort_flag;
  } else {
    // The stripe's shared sum in this rank's workspace, and the output's lines to every peer.
    p.shared = params_.workspace[params_.rank] + params_.shared_sum_offset;
    p.shared_pitch = params_.stripe;
    for (int r = 0; r < tp; ++r) p.workspace[r] = params_.workspace[r];
    p.lines_offset = params_.cx_out_offset;
    p.lines_parity_bytes = params_.cx_parity_bytes;
    p.lines_slot = params_.cx_rows * params_.stripe;
    p.epoch = &reinterpret_cast<const FusedFlags*>(params_.workspace[params_.rank])->epoch;
    // The exchange and gather kernels' grid. Lines move fast only from many SMs at once (at K3
    // tp 2, T = 32, 20 blocks pushed ~0.7 MB of lines in ~3.7 µs and the whole exchange took ~14).
    // One rank per GPU: a block per SM, and the up-projection is launched while the exchange runs
    // (programmatic dependent launch), though most of its blocks enter only as the exchange's
    // leave their SMs (an SM keeps the small shared-memory configuration of the exchange kernel).
    // Letting them in earlier (the largest carveout for the exchange and gather kernels) measured
    // slower: the weight stream then delays the exchange's loads (K3 tp 2, T = 32: N ready at
    // 13.1 µs instead of 8.6). Ranks sharing a GPU: the up-projection starts after the exchange,
    // and every rank's exchange blocks must be resident at once beside the gathers that wait
    // (LMOE_FUSED_EXCHANGE_GRID sets it, for measurements).
    const int most = sharing == 1 ? sms : std::max(1, (sms - 1) / (2 * sharing));
    chained_exchange_grid_ = sharing == 1 ? sms : std::min(32, most);
    params_.cx_early_up = sharing == 1;
    if (const auto asked = settings_.exchange_grid) {
      if (*asked > most) {
        throw Error("LMOE_FUSED_EXCHANGE_GRID: expected a count of blocks on this GPU in [1, " +
                    std::to_string(most) + "], got \"" + std::to_string(*asked) + "\"");
      }
      chained_exchange_grid_ = static_cast<int>(*asked);
    }
  }
  std::byte* normed = params_.workspace[params_.rank] + params_.normed_offset;
  if (fused_chained_maps(&p, dtype_, params_.w_stripe, normed, capacity_,
                         chained_plan_.tile_rows) != cudaSuccess) {
    (void)cudaGetLastError();
    return "the chained path's tensor maps could not be encoded";
  }
  chained_workspace_ = DeviceBuffer(sizeof(std::uint32_t));  // the calls counted
  LMOE_CUDA_CHECK(cudaMemset(chained_workspace_.data(), 0, chained_workspace_.bytes()));
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  p.calls = static_cast<std::uint32_t*>(chained_workspace_.data());
  // The ring's first round is paced with one rank (docs/fused.md): a copy of weights per block
  // every `pace` ns, so that the whole grid asks for them at about the rate the memory serves
  // them. Asked for all at once, they fill its queue, and the norm kernel's reads of the rows —
  // issued only once the kernel before it has ended — wait behind them, and N with them. With
  // several ranks the exchange kernel comes before the up-projection, and it is not paced by
  // default. LMOE_FUSED_CHAINED_PACE_NS (0: all at once) and _BURST set it at any tp, for
  // measurements.
  const double grid_box_bytes = static_cast<double>(p.tiles) * p.splits * chained_plan_.tile_rows *
                                kChainedTileK * dtype_size(dtype_);
  // Both read at every tp (fused_settings_from_environment), so that a value they cannot take is
  // an error wherever it is set.
  double pace_ns = tp == 1 ? grid_box_bytes / kChainedStreamBytesPerNs : 0.0;
  if (const auto ns = settings_.chained_pace_ns) pace_ns = static_cast<double>(*ns);
  const auto burst = settings_.chained_pace_burst;
  if (pace_ns > 0) {
    int device = 0, khz = 0;
    LMOE_CUDA_CHECK(cudaGetDevice(&device));  // the rank's, made current at construction
    LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
    p.pace_cycles = std::max(1, static_cast<int>(pace_ns * khz / 1e6));  // the SM's peak clock
    p.pace_burst = static_cast<int>(burst.value_or(1));
  }
  if (settings_.trace) {
    chained_trace_ = DeviceBuffer(static_cast<std::size_t>(p.tiles) * p.splits *
                                  kChainedTracePoints * sizeof(std::uint64_t));
    LMOE_CUDA_CHECK(cudaMemset(chained_trace_.data(), 0, chained_trace_.bytes()));
    p.trace = static_cast<std::uint64_t*>(chained_trace_.data());
    if (tp > 1) {
      exchange_trace_ = DeviceBuffer(static_cast<std::size_t>(chained_exchange_grid_) *
                                     kCxTracePoints * sizeof(std::uint64_t));
      LMOE_CUDA_CHECK(cudaMemset(exchange_trace_.data(), 0, exchange_trace_.bytes()));
    }
  }
  return std::nullopt;
}

std::uint32_t FusedTail::chained_calls() const {
  if (chained_max_tokens_ == 0) return 0;
  std::uint32_t calls = 0;
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  LMOE_CUDA_CHECK(cudaMemcpy(&calls, chained_params_.calls, sizeof(calls), cudaMemcpyDeviceToHost));
  return calls;
}

FusedTail::~FusedTail() {
  if (trace_.bytes() || decode_trace_.bytes() || chained_trace_.bytes()) print_trace();
}

std::optional<std::string> FusedTail::buffers_limit(const void* routed, const void* shared,
                                                    const void* out) {
  for (const auto& [name, pointer] :
       {std::pair{"routed", routed}, std::pair{"shared", shared}, std::pair{"out", out}}) {
    if (!aligned16(pointer)) {
      return std::string(name) + " must be 16-byte aligned for fused's vector accesses";
    }
  }
  return std::nullopt;
}

std::uint32_t FusedTail::general_calls() const {
  FusedFlags flags{};
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  LMOE_CUDA_CHECK(
      cudaMemcpy(&flags, params_.workspace[params_.rank], sizeof(flags), cudaMemcpyDeviceToHost));
  return flags.general_calls;
}

std::chrono::milliseconds FusedTail::wait_timeout() const {
  return std::chrono::milliseconds(params_.timeout_ns / 1000000);
}

void FusedTail::throw_if_failed() {
  if (peers_) return peers_->throw_if_device_failed("fused");
  const volatile P2pStatus& record = *params_.status;
  if (record.code == kP2pOk) return;
  const std::string text = p2p_failure_text(params_.rank, record, wait_timeout());
  throw Error("fused: " + (text.empty() ? "a kernel of this rank was aborted" : text));
}

void FusedTail::run(const void* routed, const void* shared, void* out, std::int64_t tokens,
                    cudaStream_t stream, const std::int32_t* tokens_device) {
  throw_if_failed();
  if (peers_)
    LMOE_CUDA_CHECK(cudaSetDevice(peers_->device()));  // the launch goes to the rank's GPU
  LMOE_CHECK(tokens >= 1 && tokens <= capacity_,
             "fused: T=" + std::to_string(tokens) + " is outside [1, " + std::to_string(capacity_) +
                 "] (the workspace's rows)");
  if (auto limit = buffers_limit(routed, shared, out)) throw Error("fused: " + *limit);
  const FusedKernel kernel = kernel_for(tokens);
  if (kernel == FusedKernel::chained) {
    FusedChainedParams p = chained_params_;
    p.tokens = tokens;
    p.tokens_device = tokens_device;
    if (params_.tp == 1) {
      p.shared = shared;
      p.out = out;
      check(launch_fused_chained(p, routed, params_.gamma, params_.eps,
                                 params_.workspace[0] + params_.normed_offset, tokens, dtype_,
                                 chained_plan_, stream),
            "launch_fused_chained");
      return;
    }
    p.out = static_cast<std::byte*>(out) +
            params_.rank * params_.stripe * static_cast<std::int64_t>(dtype_size(dtype_));
    FusedTailParams x = call_params(routed, shared, out, tokens, tokens_device);
    x.trace = static_cast<std::uint64_t*>(exchange_trace_.data());
    check(launch_fused_chained_ranks(x, chained_exchange_grid_, p, tokens, dtype_, chained_plan_,
                                     stream),
          "launch_fused_chained_ranks");
    return;
  }
  if (kernel == FusedKernel::decode) {
    FusedDecodeParams p;
    p.tokens = tokens;
    p.tokens_device = tokens_device;
    p.d = params_.d;
    p.l = params_.l;
    p.rows = params_.stripe;
    p.col0 = params_.rank * params_.stripe;
    p.routed = routed;
    p.shared = shared;
    p.out = out;
    p.w_up = params_.w_stripe;
    p.gamma = params_.gamma;
    p.eps = params_.eps;
    p.latent_norm = params_.latent_norm;
    p.trace = static_cast<std::uint64_t*>(decode_trace_.data());
    p.programmatic = decode_programmatic_;
    p.early_items = decode_early_items_;
    // With one rank only its record is used (a T read on the device past the bound).
    p.protocol = call_params(routed, shared, out, tokens, tokens_device);
    p.protocol.trace = nullptr;
    if (params_.tp > 1) p.local_norm_rows = decode_local_norm_rows_;
    check(launch_fused_decode(p, tokens, dtype_, decode_plan_, stream), "launch_fused_decode");
    return;
  }
  check(launch_fused_tail(call_params(routed, shared, out, tokens, tokens_device), dtype_, stream),
        "launch_fused_tail");
}

FusedTailParams FusedTail::call_params(const void* routed, const void* shared, void* out,
                                       std::int64_t tokens,
                                       const std::int32_t* tokens_device) const {
  FusedTailParams p = params_;
  p.tokens = tokens;
  p.tokens_device = tokens_device;
  p.routed = routed;
  p.shared = shared;
  p.out = out;
  return p;
}

}  // namespace lmoe::cuda
