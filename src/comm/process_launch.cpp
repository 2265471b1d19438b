#include "comm/process_launch.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>

#include "comm/process_liveness.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// A record: the tag, the world size, the payload's length and the writer's pid (little-endian
// uint32 each), its pid namespace (uint64), its host name (NUL-padded), the payload. They let a
// reader that sees the writer's pids tell a record left by a launch that has exited.
constexpr std::array<char, 16> kTag = {'l', 'm', 'o', 'e', '-', 'l', 'a',  'u',
                                       'n', 'c', 'h', '-', 'v', '2', '\n', '\0'};
constexpr std::size_t kHostBytes = 64;
constexpr std::size_t kPidAt = kTag.size() + 8, kNamespaceAt = kPidAt + 4,
                      kHostAt = kNamespaceAt + 8, kHeaderBytes = kHostAt + kHostBytes;

std::string host_name() {
  char name[kHostBytes + 1] = {};
  if (::gethostname(name, kHostBytes) != 0) return {};
  return std::string(name, strnlen(name, kHostBytes));
}

void put_u32(std::vector<std::byte>& out, std::uint32_t value) {
  for (int shift = 0; shift < 32; shift += 8)
    out.push_back(static_cast<std::byte>((value >> shift) & 0xffu));
}

std::uint32_t get_u32(const std::byte* in) {
  std::uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return value;
}

std::uint64_t get_u64(const std::byte* in) {
  return get_u32(in) | (static_cast<std::uint64_t>(get_u32(in + 4)) << 32);
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

// The file's bytes, or nullopt when it does not exist (yet). A symlink there is refused: the
// record is read from the plain file rank 0 renamed into place, never from where a link leads.
std::optional<std::vector<std::byte>> read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    if (errno == ELOOP) {
      throw Error("'" + path +
                  "' is a symbolic link: a launch record is read only from a plain file (point "
                  "the variable at a path of its own)");
    }
    throw Error(system_error("cannot read", path));
  }
  std::vector<std::byte> bytes;
  std::array<std::byte, 4096> buffer{};
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string message = system_error("cannot read", path);
      ::close(fd);
      throw Error(message);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), buffer.begin(), buffer.begin() + n);
  }
  ::close(fd);
  return bytes;
}

// True when the record was written on this node, in this pid namespace, by a process that has
// since exited.
bool writer_has_exited(const std::byte* header) {
  const auto pid = static_cast<pid_t>(get_u32(header + kPidAt));
  const char* host = reinterpret_cast<const char*>(header + kHostAt);
  if (std::string(host, strnlen(host, kHostBytes)) != host_name() || pid <= 0) return false;
  return get_u64(header + kNamespaceAt) == pid_namespace() && process_has_exited(pid);
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
  put_u32(record, static_cast<std::uint32_t>(::getpid()));
  put_u32(record, static_cast<std::uint32_t>(pid_namespace() & 0xffffffffu));
  put_u32(record, static_cast<std::uint32_t>(pid_namespace() >> 32));
  std::array<char, kHostBytes> host{};
  const std::string name = host_name();
  std::memcpy(host.data(), name.data(), std::min(name.size(), host.size()));
  for (char c : host) record.push_back(static_cast<std::byte>(c));
  record.insert(record.end(), payload.begin(), payload.end());

  // The temporary name is unique per process, so that two writers never share one. It is made
  // new (O_EXCL, and no symlink followed), so that nothing planted there is written through.
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  const int fd =
      ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
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
      if (writer_has_exited(bytes->data())) {
        last_seen = "a record written by pid " + std::to_string(get_u32(bytes->data() + kPidAt)) +
                    " on this node, which has exited: left by an earlier launch?";
      } else if (size_in_file == static_cast<std::uint32_t>(world_size)) {
        return {bytes->begin() + static_cast<std::ptrdiff_t>(kHeaderBytes), bytes->end()};
      } else {
        last_seen = "a record for WORLD_SIZE=" + std::to_string(size_in_file) +
                    ", left by an earlier launch?";
      }
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
