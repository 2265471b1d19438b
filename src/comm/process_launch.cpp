#include "comm/process_launch.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// A record: the tag, the world size and the payload's length (little-endian uint32 each), the
// payload.
constexpr std::array<char, 16> kTag = {'l', 'm', 'o', 'e', '-', 'l', 'a',  'u',
                                       'n', 'c', 'h', '-', 'v', '1', '\n', '\0'};
constexpr std::size_t kHeaderBytes = kTag.size() + 8;

void put_u32(std::vector<std::byte>& out, std::uint32_t value) {
  for (int shift = 0; shift < 32; shift += 8)
    out.push_back(static_cast<std::byte>((value >> shift) & 0xffu));
}

std::uint32_t get_u32(const std::byte* in) {
  std::uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return value;
}

std::optional<int> env_int(const EnvLookup& env, const std::string& name, int lowest) {
  const std::optional<std::string> text = env(name);
  if (!text) return std::nullopt;
  int value = 0;
  const char* end = text->data() + text->size();
  const auto [stop, error] = std::from_chars(text->data(), end, value);
  if (text->empty() || error != std::errc() || stop != end || value < lowest) {
    throw Error(name + "='" + *text + "': expected an integer >= " + std::to_string(lowest));
  }
  return value;
}

std::string system_error(const std::string& what, const std::string& path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

// The file's bytes, or nullopt when it does not exist (yet).
std::optional<std::vector<std::byte>> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  if (!chars.empty()) std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

}  // namespace

std::optional<LaunchRank> launch_rank_from_env(const EnvLookup& env) {
  const std::optional<int> rank = env_int(env, "RANK", 0);
  const std::optional<int> world_size = env_int(env, "WORLD_SIZE", 1);
  if (!rank && !world_size) return std::nullopt;
  if (!rank || !world_size) {
    throw Error(std::string(rank ? "WORLD_SIZE" : "RANK") + " is not set but " +
                (rank ? "RANK" : "WORLD_SIZE") + " is: a launcher sets both (torchrun does)");
  }
  if (*rank >= *world_size) {
    throw Error("RANK=" + std::to_string(*rank) +
                ": expected less than WORLD_SIZE=" + std::to_string(*world_size));
  }
  return LaunchRank{*rank, *world_size, env_int(env, "LOCAL_RANK", 0)};
}

void publish_launch_record(const std::string& path, int world_size,
                           std::span<const std::byte> payload) {
  std::vector<std::byte> record;
  for (char c : kTag) record.push_back(static_cast<std::byte>(c));
  put_u32(record, static_cast<std::uint32_t>(world_size));
  put_u32(record, static_cast<std::uint32_t>(payload.size()));
  record.insert(record.end(), payload.begin(), payload.end());

  // The temporary name is unique per process, so that two writers never share one.
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(system_error("cannot create", temporary));
  std::size_t written = 0;
  while (written < record.size()) {
    const ssize_t n = ::write(fd, record.data() + written, record.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string message = system_error("cannot write", temporary);
      ::close(fd);
      ::unlink(temporary.c_str());
      throw Error(message);
    }
    written += static_cast<std::size_t>(n);
  }
  // Flushed before the rename, so that a reader on another node never sees the name before the
  // bytes.
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string message = system_error("cannot flush", temporary);
    ::unlink(temporary.c_str());
    throw Error(message);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string message = system_error("cannot rename " + temporary + " to", path);
    ::unlink(temporary.c_str());
    throw Error(message);
  }
}

std::vector<std::byte> await_launch_record(const std::string& path, int world_size,
                                           std::size_t payload_size,
                                           std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last_seen = "no file there";
  for (auto pause = std::chrono::milliseconds(1);;
       pause = std::min(pause * 2, std::chrono::milliseconds(100))) {
    if (const std::optional<std::vector<std::byte>> bytes = read_file(path)) {
      const bool tagged = bytes->size() >= kHeaderBytes &&
                          std::memcmp(bytes->data(), kTag.data(), kTag.size()) == 0;
      if (!tagged) {
        throw Error("'" + path + "' is not an lmoe launch record (" +
                    std::to_string(bytes->size()) +
                    " bytes without its tag): point the variable at a path of its own");
      }
      const std::uint32_t size_in_file = get_u32(bytes->data() + kTag.size());
      const std::uint32_t payload_in_file = get_u32(bytes->data() + kTag.size() + 4);
      if (payload_in_file != payload_size || bytes->size() != kHeaderBytes + payload_size) {
        throw Error("'" + path + "' holds a payload of " + std::to_string(payload_in_file) +
                    " bytes, expected " + std::to_string(payload_size) +
                    " (written by another program, or another NCCL version?)");
      }
      if (size_in_file == static_cast<std::uint32_t>(world_size)) {
        return {bytes->begin() + static_cast<std::ptrdiff_t>(kHeaderBytes), bytes->end()};
      }
      last_seen = "a record for WORLD_SIZE=" + std::to_string(size_in_file) +
                  ", left by an earlier launch?";
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error("waited " + std::to_string(timeout.count()) + " ms for rank 0 to write '" + path +
                  "' (" + last_seen +
                  "): did rank 0 start, and is the path on a filesystem every node shares?");
    }
    std::this_thread::sleep_for(pause);
  }
}

void remove_launch_record(const std::string& path) noexcept { ::unlink(path.c_str()); }

}  // namespace lmoe
