// A p2p rank process killed (SIGKILL, not stalled) while its peers wait on it: the test starts
// the ranks itself, as torchrun would (lmoe_p2p_rank_process, bootstrapped by
// make_p2p_env_communicator: under mpirun a killed rank makes mpirun kill the others, and their
// own errors could not be read), kills one before or in the middle of a collective, and requires
// every survivor to fail with an lmoe::Error naming the killed rank and to exit, within a bound
// generous next to the group's timeout: a check that nothing hangs, not a timing. Ranks share a
// GPU where there are fewer GPUs than ranks, which needs LMOE_P2P_SHARED_GPU=1 (else it skips).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_support.hpp"
#include "p2p_test_support.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRanks = 3;
constexpr int kDieAt = 3;         // the killed rank's collective: three complete everywhere first
constexpr int kTimeoutMs = 1000;  // the group's: how long a round waits for a peer
constexpr double kExitBound = 30.0;  // seconds from the kill to a survivor's exit
constexpr double kRunBound = 300.0;  // seconds for the whole run, setup (up to 120 s) included

// One rank process: its pid, its log (stdout and stderr), and how and when it ended.
struct RankProcess {
  pid_t pid = -1;
  std::string log_path;
  bool ended = false;
  bool killed_by_the_test = false;  // still running at the run's bound
  int status = 0;                   // waitpid's
  Clock::time_point ended_at;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The rest of the line of `log` that starts with `prefix`, or "" where none does.
std::string line_after(const std::string& log, const std::string& prefix) {
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  }
  return {};
}

// Starts rank `rank` of kRanks with `role`, this process's environment plus the torchrun
// variables and the launch record's path, its output into `log_path`.
pid_t start_rank(int rank, const char* role, const std::string& id_file,
                 const std::string& log_path) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string variable = *entry;
    const std::string name = variable.substr(0, variable.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" &&
        name != "LMOE_P2P_ID_FILE") {
      env.push_back(variable);
    }
  }
  env.push_back("RANK=" + std::to_string(rank));
  env.push_back("WORLD_SIZE=" + std::to_string(kRanks));
  env.push_back("LOCAL_RANK=" + std::to_string(rank));
  env.push_back("LMOE_P2P_ID_FILE=" + id_file);
  std::vector<char*> envp;
  for (std::string& variable : env) envp.push_back(variable.data());
  envp.push_back(nullptr);
  std::string program = LMOE_P2P_RANK_PROCESS, role_arg = role, die_at = std::to_string(kDieAt),
              timeout = std::to_string(kTimeoutMs);
  char* argv[] = {program.data(), role_arg.data(), die_at.data(), timeout.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int error = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(error, 0) << "posix_spawn " << program << ": " << std::strerror(error);
  return error == 0 ? pid : -1;
}

// Waits until every rank has ended or the run's bound has passed; a rank still running then is
// killed (it hung) and marked so.
void wait_for_ranks(std::vector<RankProcess>& ranks, Clock::time_point started) {
  for (;;) {
    bool running = false;
    for (RankProcess& rank : ranks) {
      if (rank.ended || rank.pid < 0) continue;
      if (::waitpid(rank.pid, &rank.status, WNOHANG) == rank.pid) {
        rank.ended = true;
        rank.ended_at = Clock::now();
      } else {
        running = true;
      }
    }
    if (!running) return;
    if (Clock::now() - started > std::chrono::duration<double>(kRunBound)) {
      for (RankProcess& rank : ranks) {
        if (rank.ended || rank.pid < 0) continue;
        ::kill(rank.pid, SIGKILL);
        ::waitpid(rank.pid, &rank.status, 0);
        rank.ended = rank.killed_by_the_test = true;
        rank.ended_at = Clock::now();
      }
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Runs kRanks rank processes, `victim` with `victim_role` (die-before or die-during), and checks
// that the victim died of SIGKILL after the group worked, and that every survivor failed with an
// lmoe::Error naming it and exited within kExitBound of its death, having torn its group down.
void expect_survivors_fail_naming_the_killed_rank(int victim, const char* victim_role) {
  SCOPED_TRACE(std::string("rank ") + std::to_string(victim) + " " + victim_role);
  char dir_template[] = "/tmp/lmoe-killed-rank-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr) << std::strerror(errno);
  const std::string dir = dir_template;
  std::vector<RankProcess> ranks(kRanks);
  const Clock::time_point started = Clock::now();
  for (int r = 0; r < kRanks; ++r) {
    ranks[r].log_path = dir + "/rank" + std::to_string(r) + ".log";
    ranks[r].pid =
        start_rank(r, r == victim ? victim_role : "survive", dir + "/p2p-id", ranks[r].log_path);
  }
  wait_for_ranks(ranks, started);
  const RankProcess& killed = ranks[victim];
  for (int r = 0; r < kRanks; ++r) {
    const RankProcess& rank = ranks[r];
    const std::string log = read_file(rank.log_path);
    std::printf("[ p2p    ] rank %d (%s) ended %.1f s after the start%s; its output:\n%s", r,
                r == victim ? victim_role : "survive",
                std::chrono::duration<double>(rank.ended_at - started).count(),
                rank.killed_by_the_test ? ", killed by the test (it hung)" : "", log.c_str());
    EXPECT_FALSE(rank.killed_by_the_test)
        << "rank " << r << " still ran " << kRunBound << " s after the start";
    if (r == victim) {
      EXPECT_TRUE(WIFSIGNALED(rank.status) && WTERMSIG(rank.status) == SIGKILL)
          << "the victim did not die of its SIGKILL: " << log;
      continue;
    }
    EXPECT_TRUE(WIFEXITED(rank.status) && WEXITSTATUS(rank.status) == 10)
        << "rank " << r << " did not fail with an lmoe::Error: " << log;
    const std::string error = line_after(log, "error: ");
    EXPECT_NE(error.find("for rank " + std::to_string(victim)), std::string::npos)
        << "rank " << r << "'s error does not name the killed rank: " << log;
    EXPECT_GE(std::atoi(line_after(log, "collectives completed: ").c_str()), kDieAt)
        << "the group did not work before the kill: " << log;
    EXPECT_NE(log.find("teardown: done"), std::string::npos) << log;
    if (killed.ended && !killed.killed_by_the_test) {
      EXPECT_LT(std::chrono::duration<double>(rank.ended_at - killed.ended_at).count(), kExitBound)
          << "rank " << r << " exited too long after the kill";
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

TEST(P2pKilledRank, KilledInTheMiddleOfACollectiveFailsEverySurvivorNamingIt) {
  SKIP_WITHOUT_GPU();
  SKIP_UNLESS_P2P_CAN_RUN(kRanks);
  expect_survivors_fail_naming_the_killed_rank(1, "die-during");
}

// Rank 0 made the group's shared memory: its peers keep it mapped after it is gone.
TEST(P2pKilledRank, KilledBeforeEnteringACollectiveFailsEverySurvivorNamingIt) {
  SKIP_WITHOUT_GPU();
  SKIP_UNLESS_P2P_CAN_RUN(kRanks);
  expect_survivors_fail_naming_the_killed_rank(0, "die-before");
}

}  // namespace
