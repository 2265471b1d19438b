// The host control path of the p2p communicator between processes (src/comm/shared_segment.*):
// forked processes meet in barriers, all-gather records larger than a slot, and fail with an
// error instead of hanging when a peer is missing or aborts. No GPU involved.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "comm/aborted_error.hpp"
#include "comm/shared_segment.hpp"
#include "lmoe/error.hpp"

namespace {

using lmoe::SharedControl;
using lmoe::SharedSegment;
using namespace std::chrono_literals;

// A segment holding an abort word and a control block, as the p2p group lays it out.
struct Group {
  Group() : segment(SharedSegment::create(64 + SharedControl::bytes())) {}
  std::int32_t* abort_word() { return reinterpret_cast<std::int32_t*>(segment.data()); }
  SharedControl control(int rank, int size, std::chrono::milliseconds timeout) {
    return SharedControl(segment.data() + 64, abort_word(), rank, size, timeout);
  }
  SharedSegment segment;
};

// Runs body(rank) in `size - 1` forked children and in this process as rank 0; the children's exit
// codes are returned (0: their checks passed).
std::vector<int> run_forked(int size, const std::function<int(int rank)>& body,
                            int& parent_result) {
  std::vector<pid_t> children;
  for (int rank = 1; rank < size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 3;
      try {
        code = body(rank);
      } catch (...) {
        code = 4;
      }
      ::_exit(code);
    }
    children.push_back(pid);
  }
  parent_result = body(0);
  std::vector<int> codes;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 100);
  }
  return codes;
}

// The error of a barrier ("barrier"), or empty when every rank came.
std::string barrier_failure(SharedControl& control) {
  try {
    control.barrier("barrier");
  } catch (const lmoe::CommunicatorAborted& error) {
    return error.message();
  }
  return {};
}

TEST(SharedControl, ProcessesMeetAndGatherRecordsLargerThanASlot) {
  Group group;
  const int size = 3;
  const std::size_t bytes = 2 * SharedControl::kSlotBytes + 123;  // three pieces, the last partial
  int parent = -1;
  const std::vector<int> children = run_forked(
      size,
      [&](int rank) {
        SharedControl control = group.control(rank, size, 10s);
        int wrong = 0;
        for (int repeat = 0; repeat < 20; ++repeat) {
          std::vector<unsigned char> mine(bytes), all(bytes * size, 0xee);
          for (std::size_t i = 0; i < bytes; ++i)
            mine[i] = static_cast<unsigned char>(i * 7 + rank * 31 + repeat);
          control.all_gather(mine.data(), all.data(), bytes, "test");
          for (int r = 0; r < size; ++r) {
            for (std::size_t i = 0; i < bytes; ++i) {
              if (all[r * bytes + i] != static_cast<unsigned char>(i * 7 + r * 31 + repeat))
                ++wrong;
            }
          }
          control.barrier("test");
        }
        return wrong == 0 ? 0 : 1;
      },
      parent);
  EXPECT_EQ(parent, 0);
  EXPECT_EQ(children, (std::vector<int>{0, 0}));
}

TEST(SharedControl, AMissingPeerFailsTheBarrierWithinTheTimeoutNamingIt) {
  Group group;
  int parent = -1;
  std::string message;
  const std::vector<int> children = run_forked(
      2,
      [&](int rank) {
        if (rank == 1) {
          std::this_thread::sleep_for(1s);  // never arrives; the parent's wait ends first
          return 0;
        }
        SharedControl control = group.control(0, 2, 200ms);
        message = barrier_failure(control);
        return message.empty() ? 1 : 0;
      },
      parent);
  EXPECT_EQ(parent, 0);
  EXPECT_EQ(message,
            "communicator aborted by rank 0: rank 0 waited more than 200 ms for rank 1 in barrier");
  EXPECT_EQ(*group.abort_word(), 1);  // the word the GPU rounds read
}

TEST(SharedControl, AnAbortInOneProcessWakesAWaitingPeerWithItsReason) {
  Group group;
  int parent = -1;
  std::string message;
  const std::vector<int> children = run_forked(
      2,
      [&](int rank) {
        SharedControl control = group.control(rank, 2, 30s);
        if (rank == 1) {
          std::this_thread::sleep_for(200ms);
          control.abort("bad input");
          return 0;
        }
        message =
            barrier_failure(control);  // rank 1 never arrives: only its abort can end this wait
        return message.empty() ? 1 : 0;
      },
      parent);
  EXPECT_EQ(parent, 0);
  EXPECT_EQ(children, (std::vector<int>{0}));
  EXPECT_EQ(message, "communicator aborted by rank 1: bad input");
  // Later waits fail at once with the same reason.
  SharedControl control = group.control(0, 2, 30s);
  EXPECT_THROW(control.barrier("again"), lmoe::CommunicatorAborted);
}

TEST(SharedControl, TeardownMeetsDespiteAnAbortAndReportsAMissingPeer) {
  Group group;
  int parent = -1;
  const std::vector<int> children = run_forked(
      3,
      [&](int rank) {
        SharedControl control = group.control(rank, 3, 5s);
        if (rank == 2) control.abort("failed");
        const bool met = control.teardown_barrier(1) && control.teardown_barrier(2);
        return met ? 0 : 1;
      },
      parent);
  EXPECT_EQ(parent, 0);
  EXPECT_EQ(children, (std::vector<int>{0, 0}));

  Group lonely;
  SharedControl control = lonely.control(0, 2, 100ms);
  EXPECT_FALSE(control.teardown_barrier(1));  // rank 1 never comes
}

TEST(SharedSegment, OpensByNameUntilUnlinkedAndNamesWhatIsMissing) {
  SharedSegment created = SharedSegment::create(4096);
  std::memcpy(created.data(), "hello", 6);
  {
    SharedSegment opened = SharedSegment::open(created.name(), 4096);
    EXPECT_STREQ(reinterpret_cast<const char*>(opened.data()), "hello");
    created.unlink();
    EXPECT_STREQ(reinterpret_cast<const char*>(opened.data()),
                 "hello");  // mappings outlive the name
  }
  std::string message;
  try {
    SharedSegment::open(created.name(), 4096);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message.rfind("shm_open '" + created.name() + "': No such file or directory", 0), 0u)
      << message;
}

std::string open_error(const std::string& name, std::size_t bytes) {
  try {
    SharedSegment::open(name, bytes);
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  return "(no error)";
}

// A segment whose creator exited without unlinking it (a run that died) is refused by name, and
// so is one made for another size.
TEST(SharedSegment, AStaleOrMismatchedSegmentIsRefused) {
  int channel[2];
  ASSERT_EQ(::pipe(channel), 0);
  const pid_t creator = ::fork();
  if (creator == 0) {
    ::close(channel[0]);
    try {
      SharedSegment segment = SharedSegment::create(4096);
      const std::string& name = segment.name();
      if (::write(channel[1], name.data(), name.size()) != static_cast<ssize_t>(name.size()))
        ::_exit(2);
      ::_exit(0);  // no destructors: the name stays, as after a crash
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(channel[1]);
  char buffer[256] = {};
  const ssize_t got = ::read(channel[0], buffer, sizeof(buffer) - 1);
  ::close(channel[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(creator, &status, 0), creator);
  ASSERT_GT(got, 0);
  const std::string name(buffer, static_cast<std::size_t>(got));
  EXPECT_EQ(open_error(name, 4096), "shared memory '" + name + "' was made by pid " +
                                        std::to_string(creator) +
                                        ", which has exited: left by an earlier run");
  ::shm_unlink(name.c_str());

  SharedSegment live = SharedSegment::create(8192);
  EXPECT_EQ(open_error(live.name(), 4096), "shared memory '" + live.name() +
                                               "' was made for 8192 bytes, expected 4096 "
                                               "(another lmoe version?)");
  EXPECT_EQ(open_error(live.name(), 8192), "(no error)");
}

// A segment of another owner under the name a rank was handed is refused. Only root can give a
// segment to another uid, so the test runs as root and skips otherwise.
TEST(SharedSegment, ASegmentOfAnotherOwnerIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a segment to another uid";
  SharedSegment segment = SharedSegment::create(4096);
  const std::string file = "/dev/shm" + segment.name();
  ASSERT_EQ(::chown(file.c_str(), 65534, 65534), 0) << file;
  EXPECT_EQ(
      open_error(segment.name(), 4096),
      "shared memory '" + segment.name() + "' is owned by uid 65534, not by this process's uid 0");
}

}  // namespace
