// Whether a process named in a record another process left (an id file, a shared segment) is
// still there, for telling a record of a run that has exited from a live one.
#pragma once

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdint>

namespace lmoe {

// This process's pid namespace (the inode of /proc/self/ns/pid), 0 when unknown. A pid means the
// same process only to readers in the same namespace.
inline std::uint64_t pid_namespace() {
  struct stat info {};
  if (::stat("/proc/self/ns/pid", &info) != 0) return 0;
  return static_cast<std::uint64_t>(info.st_ino);
}

// True only when no process `pid` exists in this namespace (EPERM means one exists).
inline bool process_has_exited(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace lmoe
