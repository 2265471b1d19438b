#include "lmoe/safetensors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "lmoe/error.hpp"

namespace lmoe {
namespace {

// `call` throws an lmoe::Error whose message contains `expected`.
template <typename Call>
void expect_error(Call call, const std::string& expected) {
  try {
    call();
    ADD_FAILURE() << "expected lmoe::Error containing: " << expected;
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), ::testing::HasSubstr(expected));
  }
}

using ::testing::HasSubstr;
using ::testing::Not;

constexpr const char* kSource = "bad.safetensors";

std::string le64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

// A file built by hand: length prefix, header text as given, then the data section.
std::string make_file(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

// One tensor entry's JSON text.
std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

SafetensorsFile parse(const std::string& file, const char* source = kSource) {
  // An exactly sized heap copy, so AddressSanitizer sees any read past the end.
  const std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(file.data()),
                                     reinterpret_cast<const std::byte*>(file.data()) + file.size());
  return parse_safetensors(bytes, source);
}

// The message of the lmoe::Error that parsing `file` throws; any other outcome fails the test.
std::string parse_error(const std::string& file) {
  try {
    parse(file);
  } catch (const Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "parsing did not throw lmoe::Error";
  return "<no error>";
}

HostTensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::mt19937& rng) {
  HostTensor tensor(dtype, std::move(shape));
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::byte& b : tensor.bytes()) b = static_cast<std::byte>(byte(rng));
  return tensor;
}

void expect_same_tensors(const std::map<std::string, HostTensor>& expected,
                         const std::map<std::string, HostTensor>& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [name, tensor] : expected) {
    SCOPED_TRACE(name);
    auto found = actual.find(name);
    ASSERT_NE(found, actual.end());
    EXPECT_EQ(found->second.dtype(), tensor.dtype());
    EXPECT_EQ(found->second.shape(), tensor.shape());
    ASSERT_EQ(found->second.nbytes(), tensor.nbytes());
    if (tensor.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(found->second.data(), tensor.data(), tensor.nbytes()), 0);
    }
  }
}

std::uint64_t header_length_of(const std::string& file) {
  std::uint64_t value = 0;
  for (int i = 0; i < 8; ++i) {
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
  }
  return value;
}

// A fresh directory under the test temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::path(::testing::TempDir()) /
            ("lmoe_st_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// ---- Round trips ----

TEST(Safetensors, RoundTripsRandomTensorsOfEveryDtypeAndRank) {
  std::mt19937 rng(1234);
  std::map<std::string, HostTensor> tensors;
  const std::vector<std::vector<std::int64_t>> shapes = {{7}, {3, 5}, {2, 3, 4}, {1}, {5, 1, 3}};
  int index = 0;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (const auto& shape : shapes) {
      tensors.emplace("t" + std::to_string(index++) + "." + std::string(dtype_name(dtype)),
                      random_tensor(dtype, shape, rng));
    }
  }
  const std::string file = serialize_safetensors(tensors);
  const SafetensorsFile parsed = parse(file);
  expect_same_tensors(tensors, parsed.tensors);
  EXPECT_TRUE(parsed.metadata.empty());
}

TEST(Safetensors, SerializesHeaderPaddedAndDataInNameOrder) {
  std::mt19937 rng(7);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("b", random_tensor(DType::f32, {3}, rng));
  tensors.emplace("a", random_tensor(DType::bf16, {1}, rng));  // 2 bytes: misaligns what follows
  tensors.emplace("c", random_tensor(DType::f16, {2, 2}, rng));
  const std::string file = serialize_safetensors(tensors);

  const std::uint64_t header_length = header_length_of(file);
  EXPECT_EQ((8 + header_length) % 8, 0u);
  const std::string header = file.substr(8, header_length);
  EXPECT_THAT(header, Not(HasSubstr("__metadata__")));
  const std::size_t json_end = header.rfind('}');
  ASSERT_NE(json_end, std::string::npos);
  EXPECT_EQ(header.find_first_not_of(' ', json_end + 1), std::string::npos);  // spaces only
  EXPECT_LT(header.size() - (json_end + 1), 8u);
  std::string expected_data;
  for (const auto& [name, tensor] : tensors) {
    expected_data.append(reinterpret_cast<const char*>(tensor.data()), tensor.nbytes());
  }
  EXPECT_EQ(file.substr(8 + header_length), expected_data);
  EXPECT_THAT(header, HasSubstr(R"("a":{"data_offsets":[0,2])"));
  EXPECT_THAT(header, HasSubstr(R"("b":{"data_offsets":[2,14])"));
  EXPECT_THAT(header, HasSubstr(R"("c":{"data_offsets":[14,22])"));
}

TEST(Safetensors, RoundTripsMetadata) {
  std::mt19937 rng(99);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("w", random_tensor(DType::bf16, {4, 4}, rng));
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "quotes \" and\nnewlines, ünïcödé"}, {"empty", ""}};
  const std::string file = serialize_safetensors(tensors, metadata);
  EXPECT_THAT(file.substr(8, header_length_of(file)), HasSubstr("__metadata__"));
  const SafetensorsFile parsed = parse(file);
  EXPECT_EQ(parsed.metadata, metadata);
  expect_same_tensors(tensors, parsed.tensors);
}

TEST(Safetensors, RoundTripsZeroSizeAndScalarTensors) {
  std::mt19937 rng(5);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("empty1", HostTensor(DType::f32, {0}));
  tensors.emplace("empty3", HostTensor(DType::bf16, {3, 0, 2}));
  tensors.emplace("middle", random_tensor(DType::f16, {2, 3}, rng));
  tensors.emplace("scalar", random_tensor(DType::f32, {}, rng));
  const SafetensorsFile parsed = parse(serialize_safetensors(tensors));
  expect_same_tensors(tensors, parsed.tensors);
  EXPECT_EQ(parsed.tensors.at("empty3").numel(), 0);
  EXPECT_EQ(parsed.tensors.at("scalar").numel(), 1);
}

TEST(Safetensors, RoundTripsEmptyFile) {
  const std::string file = serialize_safetensors({});
  EXPECT_EQ(file.size() % 8, 0u);
  const SafetensorsFile parsed = parse(file);
  EXPECT_TRUE(parsed.tensors.empty());
  EXPECT_TRUE(parsed.metadata.empty());
}

TEST(Safetensors, ReadsHandWrittenFileWithTrailingSpacesAndZeroSizeTensor) {
  std::string data(8, '\0');
  const float values[2] = {1.5f, -2.0f};
  std::memcpy(data.data(), values, sizeof(values));
  const std::string header = R"({"z":)" + entry("BF16", "[4,0]", "[8,8]") + R"(,"x":)" +
                             entry("F32", "[2]", "[0,8]") + R"(,"__metadata__":{"k":"v"}}      )";
  const SafetensorsFile parsed = parse(make_file(header, data));
  ASSERT_EQ(parsed.tensors.size(), 2u);
  EXPECT_EQ(parsed.tensors.at("x").get(0), 1.5f);
  EXPECT_EQ(parsed.tensors.at("x").get(1), -2.0f);
  EXPECT_EQ(parsed.tensors.at("z").shape(), (std::vector<std::int64_t>{4, 0}));
  EXPECT_EQ(parsed.metadata.at("k"), "v");
}

TEST(Safetensors, WritesAndReadsFilesAtomically) {
  TempDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  std::mt19937 rng(42);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("layer.0.w", random_tensor(DType::bf16, {8, 16}, rng));
  tensors.emplace("layer.0.b", random_tensor(DType::f32, {16}, rng));
  tensors.emplace("layer.1.w", random_tensor(DType::f16, {2, 4, 8}, rng));
  const std::map<std::string, std::string> metadata = {{"model", "test"}};
  std::ofstream(path) << "old contents";  // overwritten by the rename
  write_safetensors(path, tensors, metadata);

  const SafetensorsFile read = read_safetensors(path);
  expect_same_tensors(tensors, read.tensors);
  EXPECT_EQ(read.metadata, metadata);
  std::ifstream in(path, std::ios::binary);
  const std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(on_disk, serialize_safetensors(tensors, metadata));
  int entries = 0;
  for ([[maybe_unused]] const auto& item : std::filesystem::directory_iterator(dir.path())) {
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "the temporary file was left behind";
}

TEST(Safetensors, HeaderReadsAcceptEveryFormatDtypeAndReadBytesInPlace) {
  TempDir dir;
  const std::string path = (dir.path() / "raw.safetensors").string();
  // U8 [2, 3] then BF16 [2]: 6 + 4 bytes; whole-file reads reject U8, header reads take it.
  const std::string header =
      "{\"a\":" + entry("U8", "[2,3]", "[0,6]") + ",\"b\":" + entry("BF16", "[2]", "[6,10]") + "}";
  std::ofstream(path, std::ios::binary)
      << make_file(header, std::string("\x01\x02\x03\x04\x05\x06\x80\x3f\x00\x40", 10));
  expect_error([&] { read_safetensors(path); }, "has dtype 'U8', which lmoe does not support");
  const SafetensorsHeader read = read_safetensors_header(path);
  ASSERT_EQ(read.tensors.size(), 2u);
  const SafetensorsTensorInfo& a = read.tensors.at("a");
  EXPECT_EQ(a.dtype, "U8");
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(a.offset, 8 + header.size());
  EXPECT_EQ(a.bytes, 6u);
  std::array<std::byte, 3> row{};
  read_safetensors_bytes(path, a.offset + 3, row);
  EXPECT_EQ(row[0], std::byte{4});
  EXPECT_EQ(row[2], std::byte{6});
  EXPECT_EQ(read.tensors.at("b").bytes, 4u);

  // Sizes are still checked, and a name the format does not define is still refused.
  std::ofstream(path, std::ios::binary)
      << make_file("{\"a\":" + entry("U16", "[2,3]", "[0,6]") + "}", std::string(6, '\0'));
  expect_error([&] { read_safetensors_header(path); }, "spanning 6 bytes, but U16 [2, 3] needs 12");
  std::ofstream(path, std::ios::binary)
      << make_file("{\"a\":" + entry("Q4", "[2]", "[0,1]") + "}", std::string(1, '\0'));
  expect_error([&] { read_safetensors_header(path); },
               "has dtype 'Q4', which is not a safetensors dtype");
}

// ---- Files and I/O errors ----

TEST(Safetensors, ReadRejectsMissingFileNamingThePath) {
  TempDir dir;
  const std::string path = (dir.path() / "missing.safetensors").string();
  try {
    read_safetensors(path);
    FAIL() << "expected lmoe::Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), HasSubstr(path));
    EXPECT_THAT(error.message(), HasSubstr("cannot read safetensors file"));
  }
}

TEST(Safetensors, ReadRejectsDirectory) {
  TempDir dir;
  try {
    read_safetensors(dir.path().string());
    FAIL() << "expected lmoe::Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), HasSubstr(dir.path().string()));
    EXPECT_THAT(error.message(), HasSubstr("not a regular file"));
  }
}

TEST(Safetensors, ReadReportsMalformedFileWithItsPath) {
  TempDir dir;
  const std::string path = (dir.path() / "short.safetensors").string();
  std::ofstream(path, std::ios::binary) << le64(1000) << "{}";
  try {
    read_safetensors(path);
    FAIL() << "expected lmoe::Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), HasSubstr(path));
    EXPECT_THAT(error.message(), HasSubstr("header length 1000 is larger than the 2 bytes"));
  }
}

TEST(Safetensors, WriteIntoMissingDirectoryNamesThePath) {
  TempDir dir;
  const std::string path = (dir.path() / "no_such_dir" / "out.safetensors").string();
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("w", HostTensor(DType::f32, {2}));
  try {
    write_safetensors(path, tensors);
    FAIL() << "expected lmoe::Error";
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), HasSubstr(path));
    EXPECT_THAT(error.message(), HasSubstr("No such file or directory"));
  }
}

// The temporary file is made new: a symlink planted under its name is refused, and the file it
// points at is left as it was.
TEST(Safetensors, WriteRefusesASymlinkPlantedAtTheTemporaryName) {
  TempDir dir;
  const std::string path = (dir.path() / "out.safetensors").string();
  const std::string victim = (dir.path() / "victim").string();
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  std::ofstream(victim) << "keep";
  std::filesystem::create_symlink(victim, temporary);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("w", HostTensor(DType::f32, {2}));
  expect_error([&] { write_safetensors(path, tensors); },
               path + ": cannot create temporary file '" + temporary + "': File exists");
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "keep");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Safetensors, SerializeRejectsReservedNameAndEmptyTensor) {
  std::map<std::string, HostTensor> reserved;
  reserved.emplace("__metadata__", HostTensor(DType::f32, {1}));
  expect_error([&] { serialize_safetensors(reserved); }, "named __metadata__");
  std::map<std::string, HostTensor> hollow;
  hollow.emplace("hollow", HostTensor());  // shape [] means one element, but it has no bytes
  expect_error([&] { serialize_safetensors(hollow); }, "tensor 'hollow': it holds 0 bytes");
}

TEST(Safetensors, SerializeRejectsInvalidUtf8) {
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("bad\xff", HostTensor(DType::f32, {1}));
  expect_error([&] { serialize_safetensors(tensors); }, "cannot serialize safetensors header");
}

// ---- Malformed prefix and header ----

TEST(Safetensors, RejectsFileShorterThanLengthPrefix) {
  const std::string message = parse_error("abc");
  EXPECT_THAT(message, HasSubstr(kSource));
  EXPECT_THAT(message, HasSubstr("file is too short (3 bytes)"));
  EXPECT_THAT(parse_error(""), HasSubstr("file is too short (0 bytes)"));
}

TEST(Safetensors, RejectsHeaderLengthOverLimit) {
  const std::string file = le64(kMaxSafetensorsHeaderBytes + 1) + "{}";
  EXPECT_THAT(parse_error(file),
              HasSubstr("header length " + std::to_string(kMaxSafetensorsHeaderBytes + 1) +
                        " exceeds the limit"));
  EXPECT_THAT(parse_error(le64(std::numeric_limits<std::uint64_t>::max()) + "{}"),
              HasSubstr("exceeds the limit"));
}

TEST(Safetensors, RejectsHeaderLengthBeyondFile) {
  const std::string message = parse_error(le64(3) + "{}");
  EXPECT_THAT(message, HasSubstr(kSource));
  EXPECT_THAT(message, HasSubstr("header length 3 is larger than the 2 bytes"));
}

TEST(Safetensors, RejectsHeaderThatIsNotJson) {
  EXPECT_THAT(parse_error(make_file(R"({"a": )")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(parse_error(make_file("")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(parse_error(make_file("{}x")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(parse_error(make_file(std::string("{}\0junk", 7))),
              HasSubstr("header is not valid JSON: it contains a NUL byte at offset 2"));
  EXPECT_THAT(parse_error(make_file("{\"bad\xff\":1}")), HasSubstr("header is not valid JSON"));
}

TEST(Safetensors, RejectsHeaderThatIsNotAnObject) {
  EXPECT_THAT(parse_error(make_file("[1,2]")),
              HasSubstr("header is not a JSON object (found an array)"));
  EXPECT_THAT(parse_error(make_file("\"text\"")),
              HasSubstr("header is not a JSON object (found a string)"));
  EXPECT_THAT(parse_error(make_file("12")),
              HasSubstr("header is not a JSON object (found a number)"));
}

TEST(Safetensors, RejectsEntryThatIsNotAnObject) {
  EXPECT_THAT(parse_error(make_file(R"({"w": 5})")),
              HasSubstr("tensor 'w' is not a JSON object (found a number)"));
  EXPECT_THAT(parse_error(make_file(R"({"w": [1]})")),
              HasSubstr("tensor 'w' is not a JSON object (found an array)"));
}

TEST(Safetensors, RejectsMissingFields) {
  EXPECT_THAT(parse_error(make_file(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", "abcd")),
              HasSubstr("tensor 'w' is missing the field 'dtype'"));
  EXPECT_THAT(parse_error(make_file(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", "abcd")),
              HasSubstr("tensor 'w' is missing the field 'shape'"));
  EXPECT_THAT(parse_error(make_file(R"({"w":{"dtype":"F32","shape":[1]}})", "abcd")),
              HasSubstr("tensor 'w' is missing the field 'data_offsets'"));
}

TEST(Safetensors, RejectsMistypedFields) {
  EXPECT_THAT(
      parse_error(make_file(R"({"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", "abcd")),
      HasSubstr("tensor 'w' has a dtype that is not a string (found a number)"));
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "\"1\"", "[0,4]") + "}", "abcd")),
              HasSubstr("tensor 'w' has a shape that is not an array (found a string)"));
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[1]", "{}") + "}", "abcd")),
              HasSubstr("tensor 'w' has data_offsets that are not an array (found an object)"));
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "null", "[0,4]") + "}", "abcd")),
              HasSubstr("tensor 'w' has a shape that is not an array (found null)"));
}

TEST(Safetensors, RejectsUnknownAndRepeatedFields) {
  EXPECT_THAT(parse_error(make_file(
                  R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", "abcd")),
              HasSubstr("tensor 'w' has an unknown field 'extra'"));
  EXPECT_THAT(
      parse_error(make_file(
          R"({"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcd")),
      HasSubstr("tensor 'w' has field 'dtype' more than once"));
}

TEST(Safetensors, RejectsDuplicateTensorNames) {
  const std::string header =
      R"({"w":)" + entry("F32", "[1]", "[0,4]") + R"(,"w":)" + entry("F32", "[1]", "[4,8]") + "}";
  EXPECT_THAT(parse_error(make_file(header, std::string(8, 'x'))),
              HasSubstr("header names tensor 'w' more than once"));
}

TEST(Safetensors, RejectsUnsupportedDtypesNamingTensorAndDtype) {
  for (const char* dtype : {"F64", "I32", "U8", "F8_E4M3", "BOOL", "bf16", "garbage", ""}) {
    SCOPED_TRACE(dtype);
    const std::string message =
        parse_error(make_file(R"({"weights.0":)" + entry(dtype, "[1]", "[0,8]") + "}", "12345678"));
    EXPECT_THAT(message, HasSubstr(kSource));
    EXPECT_THAT(message, HasSubstr("tensor 'weights.0' has dtype '" + std::string(dtype) +
                                   "', which lmoe does not support"));
  }
}

TEST(Safetensors, RejectsNegativeExtent) {
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[2,-1]", "[0,0]") + "}")),
              HasSubstr("tensor 'w' shape has a negative extent -1"));
}

TEST(Safetensors, RejectsNonIntegerExtents) {
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[2.5]", "[0,10]") + "}")),
              HasSubstr("tensor 'w' shape has a non-integer extent '2.5'"));
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[1e1]", "[0,40]") + "}")),
              HasSubstr("tensor 'w' shape has a non-integer extent '1e1'"));
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", R"(["3"])", "[0,12]") + "}")),
      HasSubstr("tensor 'w' has a shape that is not an array of integers (found a string)"));
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", "[[3]]", "[0,12]") + "}")),
      HasSubstr("tensor 'w' has a shape that is not an array of integers (found an array)"));
  // Beyond uint64, nlohmann reports the number as floating point.
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", "[99999999999999999999]", "[0,0]") + "}")),
      HasSubstr("tensor 'w' shape has a non-integer extent '99999999999999999999'"));
}

TEST(Safetensors, RejectsOversizedExtentAndRank) {
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", "[9223372036854775808]", "[0,0]") + "}")),
      HasSubstr("tensor 'w' shape extent 9223372036854775808 is too large"));
  std::string shape = "[1";
  for (int i = 0; i < 64; ++i) shape += ",1";
  shape += "]";
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", shape, "[0,4]") + "}", "abcd")),
              HasSubstr("tensor 'w' shape has more than 64 dimensions"));
}

TEST(Safetensors, RejectsShapeWhoseElementCountOverflows) {
  // 2^32 * 2^32 elements wraps to 0 in 64-bit arithmetic: a naive check would accept [0, 0].
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", "[4294967296,4294967296]", "[0,0]") + "}")),
      HasSubstr("tensor 'w' has shape [4294967296, 4294967296] whose element count overflows"));
  // Empty because of the trailing 0, but the running count overflows first.
  EXPECT_THAT(parse_error(make_file(R"({"w":)" +
                                    entry("BF16", "[4294967296,4294967296,0]", "[0,0]") + "}")),
              HasSubstr("whose element count overflows"));
}

TEST(Safetensors, RejectsMalformedDataOffsets) {
  auto with_offsets = [](const std::string& offsets) {
    return parse_error(make_file(R"({"w":)" + entry("F32", "[1]", offsets) + "}", "abcd"));
  };
  EXPECT_THAT(with_offsets("[4]"),
              HasSubstr("tensor 'w' data_offsets must hold exactly two integers, found 1"));
  EXPECT_THAT(with_offsets("[]"), HasSubstr("must hold exactly two integers, found 0"));
  EXPECT_THAT(with_offsets("[0,4,8]"), HasSubstr("must hold exactly two integers, found more"));
  EXPECT_THAT(with_offsets("[-4,0]"), HasSubstr("tensor 'w' data_offsets has a negative value -4"));
  EXPECT_THAT(with_offsets("[0,4.0]"),
              HasSubstr("tensor 'w' data_offsets has a non-integer value '4.0'"));
  EXPECT_THAT(with_offsets("[0,\"4\"]"),
              HasSubstr("tensor 'w' has data_offsets that are not two non-negative integers"));
}

TEST(Safetensors, RejectsDataOffsetsThatEndBeforeTheyBegin) {
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[0]", "[4,0]") + "}", "abcd")),
              HasSubstr("tensor 'w' has data_offsets [4, 0) that end before they begin"));
}

TEST(Safetensors, RejectsDataOffsetsBeyondDataSection) {
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("F32", "[2]", "[0,8]") + "}", "abcd")),
              HasSubstr("tensor 'w' has data_offsets [0, 8) that reach beyond the data section "
                        "(4 bytes)"));
  EXPECT_THAT(
      parse_error(make_file(
          R"({"w":)" + entry("F32", "[1]", "[18446744073709551612,18446744073709551615]") + "}",
          "abcd")),
      HasSubstr("reach beyond the data section"));
}

TEST(Safetensors, RejectsByteCountThatDoesNotMatchShape) {
  EXPECT_THAT(
      parse_error(make_file(R"({"w":)" + entry("F32", "[3]", "[0,8]") + "}", "12345678")),
      HasSubstr("tensor 'w' has data_offsets [0, 8) spanning 8 bytes, but F32 [3] needs 12"));
  EXPECT_THAT(parse_error(make_file(R"({"w":)" + entry("BF16", "[2,0]", "[0,4]") + "}", "abcd")),
              HasSubstr("spanning 4 bytes, but BF16 [2, 0] needs 0"));
}

TEST(Safetensors, RejectsOverlappingTensors) {
  const std::string header =
      R"({"a":)" + entry("F32", "[2]", "[0,8]") + R"(,"b":)" + entry("F32", "[2]", "[4,12]") + "}";
  EXPECT_THAT(parse_error(make_file(header, std::string(12, 'x'))),
              HasSubstr("tensor 'b' at bytes [4, 12) overlaps tensor 'a' at bytes [0, 8)"));
  const std::string same =
      R"({"a":)" + entry("F32", "[1]", "[0,4]") + R"(,"b":)" + entry("F32", "[1]", "[0,4]") + "}";
  EXPECT_THAT(parse_error(make_file(same, "abcd")),
              HasSubstr("tensor 'b' at bytes [0, 4) overlaps tensor 'a' at bytes [0, 4)"));
}

TEST(Safetensors, RejectsHolesInDataSection) {
  const std::string gap =
      R"({"a":)" + entry("F32", "[1]", "[0,4]") + R"(,"b":)" + entry("F32", "[1]", "[8,12]") + "}";
  EXPECT_THAT(parse_error(make_file(gap, std::string(12, 'x'))),
              HasSubstr("bytes [4, 8) of the data section belong to no tensor"));
  const std::string leading = R"({"a":)" + entry("F32", "[1]", "[4,8]") + "}";
  EXPECT_THAT(parse_error(make_file(leading, std::string(8, 'x'))),
              HasSubstr("bytes [0, 4) of the data section belong to no tensor"));
  const std::string trailing = R"({"a":)" + entry("F32", "[1]", "[0,4]") + "}";
  EXPECT_THAT(parse_error(make_file(trailing, std::string(6, 'x'))),
              HasSubstr("bytes [4, 6) of the data section belong to no tensor"));
  EXPECT_THAT(parse_error(make_file("{}", "x")),
              HasSubstr("bytes [0, 1) of the data section belong to no tensor"));
}

TEST(Safetensors, RejectsMalformedMetadata) {
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":[]})")),
              HasSubstr("__metadata__ is not a JSON object (found an array)"));
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":"x"})")),
              HasSubstr("__metadata__ is not a JSON object (found a string)"));
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":{"n":1}})")),
              HasSubstr("__metadata__ value for key 'n' is not a string (found a number)"));
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":{"n":null}})")),
              HasSubstr("__metadata__ value for key 'n' is not a string (found null)"));
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":{"n":{"deep":"x"}}})")),
              HasSubstr("__metadata__ value for key 'n' is not a string (found an object)"));
  EXPECT_THAT(parse_error(make_file(R"({"__metadata__":{},"__metadata__":{}})")),
              HasSubstr("more than one __metadata__"));
}

TEST(Safetensors, EscapesAndTruncatesHostileNamesInMessages) {
  const std::string message =
      parse_error(make_file("{\"evil\\n" + std::string(1000, 'n') + "\": 1}"));
  EXPECT_THAT(message, HasSubstr("tensor 'evil\\x0a"));
  EXPECT_THAT(message, HasSubstr("(1005 bytes)"));
  EXPECT_LT(message.size(), 400u);
}

// A megabyte of header that is not JSON: the parser's message quotes the token it stopped at,
// and the error carries only its first bytes.
TEST(Safetensors, CapsAHugeBadHeaderInTheMessage) {
  const std::string header = "{\"a\": " + std::string(1 << 20, 'x') + "}";
  const std::string message = parse_error(make_file(header));
  EXPECT_THAT(message, HasSubstr("bad.safetensors: header is not valid JSON: '"));
  EXPECT_THAT(message, HasSubstr("... ("));
  EXPECT_LT(message.size(), 400u);
  const std::string file = make_file(header);
  try {
    parse_safetensors_header(std::as_bytes(std::span(file.data(), file.size())), "h");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_LT(error.message().size(), 400u);
  }
}

// The header-only reader on bytes in memory (a fuzz target) checks what read_safetensors_header
// checks and accepts the format's other dtypes.
TEST(Safetensors, HeaderOnlyParseOfBytesInMemory) {
  const std::string file =
      make_file(R"({"p":{"dtype":"U8","shape":[2,3],"data_offsets":[0,6]}})", "abcdef");
  const std::span<const std::byte> bytes = std::as_bytes(std::span(file.data(), file.size()));
  const SafetensorsHeader header = parse_safetensors_header(bytes, "mem");
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.tensors.at("p").dtype, "U8");
  EXPECT_EQ(header.tensors.at("p").offset, file.size() - 6);
  EXPECT_EQ(header.path, "mem");
  const std::string holey =
      make_file(R"({"p":{"dtype":"U8","shape":[2,3],"data_offsets":[0,6]}})", "abcdefg");
  try {
    parse_safetensors_header(std::as_bytes(std::span(holey.data(), holey.size())), "mem");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("mem: bytes [6, 7) of the data section belong to no "
                                           "tensor"));
  }
}

TEST(Safetensors, RejectsDeepNestingWithoutRecursing) {
  // A DOM parser would build (and later destroy) a million nested arrays.
  const std::string deep = R"({"__metadata__":{"k":)" + std::string(1000000, '[') + "}}";
  EXPECT_THAT(parse_error(make_file(deep)),
              HasSubstr("__metadata__ value for key 'k' is not a string (found an array)"));
}

// ---- Fuzzing ----

// Seeded mutations of a valid file: each must parse or throw lmoe::Error, never anything else.
TEST(Safetensors, SurvivesMutatedFiles) {
  std::mt19937 rng(20240607);
  std::map<std::string, HostTensor> tensors;
  tensors.emplace("a.weight", random_tensor(DType::bf16, {3, 2}, rng));
  tensors.emplace("b.bias", random_tensor(DType::f32, {2}, rng));
  tensors.emplace("c.empty", HostTensor(DType::f16, {0, 4}));
  tensors.emplace("d.cube", random_tensor(DType::f16, {2, 1, 2}, rng));
  const std::string valid = serialize_safetensors(tensors, {{"format", "pt"}});
  ASSERT_NO_THROW(parse(valid));
  const std::size_t header_end = 8 + header_length_of(valid);

  constexpr int kMutations = 4000;
  const std::string json_chars = "{}[]\":,0123456789-.eE \\ntfu";
  int accepted = 0;
  int rejected = 0;
  for (int iteration = 0; iteration < kMutations; ++iteration) {
    std::string file = valid;
    const int kind = iteration % 5;
    auto position = [&](std::size_t limit) {
      return std::uniform_int_distribution<std::size_t>(0, limit - 1)(rng);
    };
    if (kind == 0) {  // random bytes anywhere
      const int flips = 1 + static_cast<int>(position(4));
      for (int i = 0; i < flips; ++i) file[position(file.size())] = static_cast<char>(rng());
    } else if (kind == 1) {  // JSON-significant characters inside the header
      const int edits = 1 + static_cast<int>(position(3));
      for (int i = 0; i < edits; ++i) {
        file[8 + position(header_end - 8)] = json_chars[position(json_chars.size())];
      }
    } else if (kind == 2) {  // truncation
      file.resize(position(file.size()));
    } else if (kind == 3) {  // a different length prefix
      const std::uint64_t length = position(2) ? header_end - 8 + position(17) - 8
                                               : static_cast<std::uint64_t>(rng()) << position(40);
      file.replace(0, 8, le64(length));
    } else {  // one digit of an offset or extent changed
      std::size_t at = 8 + position(header_end - 8);
      while (at < header_end && (file[at] < '0' || file[at] > '9')) ++at;
      if (at < header_end) file[at] = static_cast<char>('0' + position(10));
    }
    try {
      const SafetensorsFile parsed = parse(file, "fuzz");
      ++accepted;
      std::size_t total = 0;
      for (const auto& [name, tensor] : parsed.tensors) total += tensor.nbytes();
      EXPECT_LE(total, file.size()) << "iteration " << iteration;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& error) {
      ADD_FAILURE() << "iteration " << iteration << " threw a non-lmoe exception: " << error.what();
    }
  }
  // Both outcomes must occur, or the mutations are not exercising the parser.
  EXPECT_GT(accepted, 50);
  EXPECT_GT(rejected, kMutations / 2);
}

}  // namespace
}  // namespace lmoe
