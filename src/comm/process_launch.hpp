// How a process started one per GPU without MPI (torchrun and launchers like it) learns its place
// in the job, and how rank 0 hands the others a small record (the NCCL unique id) through a file on
// a filesystem they all see. Plain host code: built and tested in every configuration.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lmoe/tier_policy.hpp"  // EnvLookup

namespace lmoe {

struct LaunchRank {
  int rank = 0;
  int world_size = 1;
  std::optional<int> local_rank;  // this process's index among those of its node
};

// RANK and WORLD_SIZE (both or neither) and LOCAL_RANK (optional), as torchrun sets them. nullopt
// when neither RANK nor WORLD_SIZE is set; lmoe::Error naming the variable when one is missing or
// a value is not an integer in range (0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK).
std::optional<LaunchRank> launch_rank_from_env(const EnvLookup& env);

// Writes a record (a tag, `world_size`, the writer's pid and host, and `payload`) to `path` so
// that a reader never sees part of it: into a new temporary file beside it (O_EXCL | O_NOFOLLOW,
// mode 0600, so a file or symlink planted there is refused), flushed, then renamed over `path`.
// Throws lmoe::Error naming the path and the system's reason when it cannot.
void publish_launch_record(const std::string& path, int world_size,
                           std::span<const std::byte> payload);

// Waits until `path` holds a record for `world_size` ranks with a payload of `payload_size` bytes
// and returns the payload. A file that is not such a record at all, or a symlink, fails at once; a
// record for another world size, or one written on this node by a process that has exited (left
// by an earlier launch), is waited past. After `timeout`, throws lmoe::Error saying what was (not)
// found and what to check.
std::vector<std::byte> await_launch_record(const std::string& path, int world_size,
                                           std::size_t payload_size,
                                           std::chrono::milliseconds timeout);

// Removes the record (once every rank has read it); a missing file is not an error.
void remove_launch_record(const std::string& path) noexcept;

}  // namespace lmoe
