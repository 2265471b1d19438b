// The launch environment of one process per GPU (RANK, WORLD_SIZE, LOCAL_RANK) and the record rank
// 0 hands to the others through a file: parsed values, the messages of bad ones, an atomic
// hand-over between a writer and a waiting reader, stale and foreign files, and the bounded wait.
#include "comm/process_launch.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "error_message.hpp"
#include "lmoe/error.hpp"

namespace {

using lmoe::testing::error_message_of;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

lmoe::EnvLookup env_of(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    const auto found = values.find(name);
    if (found == values.end()) return std::nullopt;
    return found->second;
  };
}

TEST(LaunchRank, ReadsWhatTorchrunSets) {
  const auto launch =
      lmoe::launch_rank_from_env(env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}}));
  ASSERT_TRUE(launch.has_value());
  EXPECT_EQ(launch->rank, 3);
  EXPECT_EQ(launch->world_size, 8);
  EXPECT_EQ(launch->local_rank, 1);
  const auto without_local =
      lmoe::launch_rank_from_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  ASSERT_TRUE(without_local.has_value());
  EXPECT_FALSE(without_local->local_rank.has_value());
  EXPECT_FALSE(lmoe::launch_rank_from_env(env_of({})).has_value());
}

TEST(LaunchRank, BadValuesNameTheVariable) {
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"RANK", "1"}}));
            }),
            "WORLD_SIZE is not set but RANK is: a launcher sets both (torchrun does)");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"WORLD_SIZE", "2"}}));
            }),
            "RANK is not set but WORLD_SIZE is: a launcher sets both (torchrun does)");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}));
            }),
            "RANK=2: expected less than WORLD_SIZE=2");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}));
            }),
            "RANK='x': expected an integer >= 0");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}));
            }),
            "WORLD_SIZE='0': expected an integer >= 1");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(
                  env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}}));
            }),
            "LOCAL_RANK='-1': expected an integer >= 0");
  EXPECT_EQ(error_message_of([] {
              lmoe::launch_rank_from_env(env_of({{"RANK", "1 "}, {"WORLD_SIZE", "2"}}));
            }),
            "RANK='1 ': expected an integer >= 0");
}

class LaunchRecord : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ =
        std::filesystem::temp_directory_path() /
        ("lmoe-launch-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(directory_);
    path_ = (directory_ / "nccl.id").string();
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  static std::vector<std::byte> payload(std::size_t size, int salt) {
    std::vector<std::byte> bytes(size);
    for (std::size_t i = 0; i < size; ++i)
      bytes[i] = static_cast<std::byte>((i * 7 + static_cast<std::size_t>(salt)) & 0xffu);
    return bytes;
  }

  // What a reader for 4 ranks, already waiting when rank 0 publishes `id`, gets.
  std::vector<std::byte> read_while_published(const std::vector<std::byte>& id) const {
    std::vector<std::byte> got;
    std::thread reader([&] { got = lmoe::await_launch_record(path_, 4, 128, 10s); });
    std::this_thread::sleep_for(50ms);
    lmoe::publish_launch_record(path_, 4, id);
    reader.join();
    return got;
  }

  std::filesystem::path directory_;
  std::string path_;
};

TEST_F(LaunchRecord, AReaderWaitingBeforeTheWriterGetsTheWholePayload) {
  const std::vector<std::byte> id = payload(128, 1);
  EXPECT_EQ(read_while_published(id), id);
  // Nothing but the record is left beside it (the temporary file was renamed, not copied).
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(directory_))
    files += entry.is_regular_file();
  EXPECT_EQ(files, 1u);
  lmoe::remove_launch_record(path_);
  EXPECT_FALSE(std::filesystem::exists(path_));
  lmoe::remove_launch_record(path_);  // already gone: not an error
}

TEST_F(LaunchRecord, ARecordForAnotherWorldSizeIsWaitedPastThenReported) {
  lmoe::publish_launch_record(path_, 2, payload(128, 2));  // left by an earlier launch of 2 ranks
  const std::vector<std::byte> id = payload(128, 3);
  EXPECT_EQ(read_while_published(id), id);

  lmoe::publish_launch_record(path_, 2, payload(128, 4));
  const std::string message =
      error_message_of([&] { lmoe::await_launch_record(path_, 4, 128, 100ms); });
  EXPECT_THAT(message, HasSubstr("waited 100 ms for rank 0 to write '" + path_ + "'"));
  EXPECT_THAT(message, HasSubstr("a record for WORLD_SIZE=2, left by an earlier launch?"));
}

TEST_F(LaunchRecord, NoFileTimesOutWithAHint) {
  EXPECT_EQ(error_message_of([&] { lmoe::await_launch_record(path_, 2, 128, 50ms); }),
            "waited 50 ms for rank 0 to write '" + path_ +
                "' (no file there): did rank 0 start, and is the path on a filesystem every node "
                "shares?");
}

TEST_F(LaunchRecord, AForeignFileOrAnotherPayloadSizeFailsAtOnce) {
  std::ofstream(path_) << "not a record";
  EXPECT_THAT(error_message_of([&] { lmoe::await_launch_record(path_, 2, 128, 10s); }),
              HasSubstr("is not an lmoe launch record (12 bytes without its tag)"));
  lmoe::publish_launch_record(path_, 2, payload(64, 5));
  EXPECT_THAT(error_message_of([&] { lmoe::await_launch_record(path_, 2, 128, 10s); }),
              HasSubstr("holds a payload of 64 bytes, expected 128"));
}

TEST_F(LaunchRecord, AnUnwritableDirectoryIsReported) {
  const std::string missing = (directory_ / "no-such-dir" / "nccl.id").string();
  EXPECT_THAT(error_message_of([&] { lmoe::publish_launch_record(missing, 2, payload(128, 6)); }),
              HasSubstr("cannot create '" + missing + ".tmp-"));
}

// Nothing planted where rank 0 writes is written through: a symlink at the temporary name is
// refused and its target left alone.
TEST_F(LaunchRecord, ASymlinkPlantedAtTheTemporaryNameIsRefused) {
  const std::string temporary = path_ + ".tmp-" + std::to_string(::getpid());
  const std::string victim = (directory_ / "victim").string();
  std::ofstream(victim) << "keep";
  std::filesystem::create_symlink(victim, temporary);
  EXPECT_EQ(error_message_of([&] { lmoe::publish_launch_record(path_, 2, payload(128, 7)); }),
            "cannot create '" + temporary + "': File exists");
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "keep");
  EXPECT_FALSE(std::filesystem::exists(path_));
}

// A reader takes its record only from a plain file: a symlink at the path fails at once.
TEST_F(LaunchRecord, ASymlinkAtTheRecordsPathIsRefused) {
  const std::string elsewhere = (directory_ / "elsewhere").string();
  lmoe::publish_launch_record(elsewhere, 2, payload(128, 8));
  std::filesystem::create_symlink(elsewhere, path_);
  EXPECT_EQ(error_message_of([&] { lmoe::await_launch_record(path_, 2, 128, 10s); }),
            "'" + path_ +
                "' is a symbolic link: a launch record is read only from a plain file (point the "
                "variable at a path of its own)");
}

// A record left by a rank 0 of this node that has exited is waited past, then named.
TEST_F(LaunchRecord, ARecordWhoseWriterHasExitedIsWaitedPastThenReported) {
  const pid_t writer = ::fork();
  if (writer == 0) {
    try {
      lmoe::publish_launch_record(path_, 2, payload(128, 9));
    } catch (...) {
      ::_exit(1);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(writer, &status, 0), writer);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(error_message_of([&] { lmoe::await_launch_record(path_, 2, 128, 100ms); }),
            "waited 100 ms for rank 0 to write '" + path_ + "' (a record written by pid " +
                std::to_string(writer) +
                " on this node, which has exited: left by an earlier launch?): did rank 0 start, "
                "and is the path on a filesystem every node shares?");
  // A live rank 0 that publishes over it is read.
  const std::vector<std::byte> id = payload(128, 10);
  std::vector<std::byte> got;
  std::thread reader([&] { got = lmoe::await_launch_record(path_, 2, 128, 10s); });
  std::this_thread::sleep_for(50ms);
  lmoe::publish_launch_record(path_, 2, id);
  reader.join();
  EXPECT_EQ(got, id);
}

}  // namespace
