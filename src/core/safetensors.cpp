#include "lmoe/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "core/quoted_text.hpp"
#include "lmoe/error.hpp"

namespace lmoe {
namespace {

using nlohmann::json;

constexpr std::size_t kLengthPrefixBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
// Real models use rank <= 5; the cap stops a hostile shape list from growing a vector several
// times larger than the header text that describes it.
constexpr std::size_t kMaxRank = 64;
// Keeps numel * dtype_size (and HostTensor's own size arithmetic) far from overflow even for
// zero-size tensors, whose other extents are not bounded by the data section.
constexpr std::uint64_t kMaxElements =
    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / 8;
std::string printable(std::string_view text) { return quoted_text(text); }

std::string byte_range(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

std::string system_message(int error_number) {
  return std::error_code(error_number, std::generic_category()).message();
}

std::uint64_t load_le64(const std::byte* bytes) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < 8; ++i) value |= static_cast<std::uint64_t>(bytes[i]) << (8 * i);
  return value;
}

std::string store_le64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xffu);
  return bytes;
}

// One tensor as the header describes it, before its data is read.
struct TensorEntry {
  DType dtype = DType::f32;  // when the dtype is one lmoe computes in
  std::string dtype_name;    // as the header spells it
  std::size_t element_size = 4;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct Header {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
};

// Builds the Header straight from SAX events rather than from a json DOM: a DOM of hostile input
// can be many times larger than the text, while here memory stays proportional to what we keep,
// nesting deeper than the format's three levels is rejected at once, and every error can name
// the tensor it belongs to.
// The format's dtypes other than lmoe's own three, with their element sizes: a header-only read
// (read_safetensors_header) accepts them, since a loader may convert them itself (MXFP4 blocks
// and scales are U8).
constexpr std::pair<std::string_view, std::size_t> kRawDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"U16", 2},
    {"I16", 2},  {"U32", 4}, {"I32", 4}, {"U64", 8},     {"I64", 8},     {"F64", 8}};

class HeaderReader {
 public:
  HeaderReader(std::string_view source, bool raw_dtypes = false)
      : source_(source), raw_dtypes_(raw_dtypes) {}

  Header take(std::string_view text) {
    // nlohmann stops at a NUL byte as if the input ended there, which would let a header hide
    // trailing junk; JSON text never contains a raw NUL, so reject it outright.
    if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
      fail("header is not valid JSON: it contains a NUL byte at offset " + std::to_string(nul));
    }
    json::sax_parse(text.begin(), text.end(), this);
    // sax_parse in strict mode only returns after the whole object and nothing but whitespace;
    // the check guards against a future change in that contract.
    if (state_ != State::done) fail("header ended before the JSON object was complete");
    return std::move(header_);
  }

  // The nlohmann SAX interface.
  bool null() { return unexpected("null"); }
  bool boolean(bool) { return unexpected("a boolean"); }
  bool binary(json::binary_t&) { return unexpected("binary data"); }

  bool number_integer(json::number_integer_t value) {
    if (value >= 0) return number_unsigned(static_cast<json::number_unsigned_t>(value));
    if (state_ == State::shape) fail_tensor("shape has a negative extent " + std::to_string(value));
    if (state_ == State::offsets) {
      fail_tensor("data_offsets has a negative value " + std::to_string(value));
    }
    return unexpected("a number");
  }

  bool number_unsigned(json::number_unsigned_t value) {
    if (state_ == State::shape) {
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        fail_tensor("shape extent " + std::to_string(value) + " is too large");
      }
      if (entry_.shape.size() == kMaxRank) {
        fail_tensor("shape has more than " + std::to_string(kMaxRank) + " dimensions");
      }
      entry_.shape.push_back(static_cast<std::int64_t>(value));
      return true;
    }
    if (state_ == State::offsets) {
      if (offset_count_ == offsets_.size()) {
        fail_tensor("data_offsets must hold exactly two integers, found more");
      }
      offsets_[offset_count_++] = value;
      return true;
    }
    return unexpected("a number");
  }

  bool number_float(json::number_float_t, const json::string_t& text) {
    if (state_ == State::shape) fail_tensor("shape has a non-integer extent " + printable(text));
    if (state_ == State::offsets) {
      fail_tensor("data_offsets has a non-integer value " + printable(text));
    }
    return unexpected("a number");
  }

  bool string(json::string_t& value) {
    if (state_ == State::entry_value && field_ == "dtype") {
      bool known = false;
      for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
        if (value == safetensors_dtype_name(dtype)) {
          entry_.dtype = dtype;
          entry_.element_size = dtype_size(dtype);
          known = true;
        }
      }
      for (const auto& [name, size] : kRawDtypes) {
        if (raw_dtypes_ && value == name) {
          entry_.element_size = size;
          known = true;
        }
      }
      if (!known && raw_dtypes_) {
        fail_tensor("has dtype " + printable(value) + ", which is not a safetensors dtype");
      }
      if (!known) {
        fail_tensor("has dtype " + printable(value) +
                    ", which lmoe does not support (expected BF16, F16 or F32)");
      }
      entry_.dtype_name = value;
      has_dtype_ = true;
      state_ = State::entry;
      return true;
    }
    if (state_ == State::metadata_value) {
      header_.metadata.emplace(std::move(key_), std::move(value));
      state_ = State::metadata;
      return true;
    }
    return unexpected("a string");
  }

  bool start_object(std::size_t) {
    if (state_ == State::top) {
      state_ = State::root;
      return true;
    }
    if (state_ == State::root_value) {
      if (key_ == kMetadataKey) {
        state_ = State::metadata;
      } else {
        entry_ = TensorEntry{};
        has_dtype_ = has_shape_ = has_offsets_ = false;
        state_ = State::entry;
      }
      return true;
    }
    return unexpected("an object");
  }

  bool key(json::string_t& name) {
    switch (state_) {
      case State::root:
        if (name == kMetadataKey) {
          if (saw_metadata_) fail("header has more than one __metadata__ entry");
          saw_metadata_ = true;
        } else if (header_.tensors.contains(name)) {
          fail("header names tensor " + printable(name) + " more than once");
        }
        key_ = std::move(name);
        state_ = State::root_value;
        return true;
      case State::entry: {
        bool* seen = name == "dtype"          ? &has_dtype_
                     : name == "shape"        ? &has_shape_
                     : name == "data_offsets" ? &has_offsets_
                                              : nullptr;
        if (seen == nullptr) fail_tensor("has an unknown field " + printable(name));
        if (*seen) fail_tensor("has field " + printable(name) + " more than once");
        field_ = std::move(name);
        state_ = State::entry_value;
        return true;
      }
      case State::metadata:
        if (header_.metadata.contains(name)) {
          fail("__metadata__ has key " + printable(name) + " more than once");
        }
        key_ = std::move(name);
        state_ = State::metadata_value;
        return true;
      default: fail("unexpected key in the header");
    }
  }

  bool end_object() {
    switch (state_) {
      case State::root: state_ = State::done; return true;
      case State::metadata: state_ = State::root; return true;
      case State::entry:
        if (!has_dtype_) fail_tensor("is missing the field 'dtype'");
        if (!has_shape_) fail_tensor("is missing the field 'shape'");
        if (!has_offsets_) fail_tensor("is missing the field 'data_offsets'");
        header_.tensors.emplace(std::move(key_), std::move(entry_));
        state_ = State::root;
        return true;
      default: fail("unexpected end of object in the header");
    }
  }

  bool start_array(std::size_t) {
    if (state_ == State::entry_value && field_ == "shape") {
      has_shape_ = true;
      state_ = State::shape;
      return true;
    }
    if (state_ == State::entry_value && field_ == "data_offsets") {
      has_offsets_ = true;
      offset_count_ = 0;
      state_ = State::offsets;
      return true;
    }
    return unexpected("an array");
  }

  bool end_array() {
    if (state_ == State::shape) {
      state_ = State::entry;
      return true;
    }
    if (state_ == State::offsets) {
      if (offset_count_ != offsets_.size()) {
        fail_tensor("data_offsets must hold exactly two integers, found " +
                    std::to_string(offset_count_));
      }
      entry_.begin = offsets_[0];
      entry_.end = offsets_[1];
      state_ = State::entry;
      return true;
    }
    fail("unexpected end of array in the header");
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) {
    // The parser's message can echo a long hostile token; printable() caps it.
    fail("header is not valid JSON: " + printable(error.what()));
  }

 private:
  enum class State {
    top,             // before the root object
    root,            // in the root object, expecting a key or its end
    root_value,      // after a root key
    entry,           // in a tensor's object, expecting a field or its end
    entry_value,     // after a field name
    shape,           // in the shape array
    offsets,         // in the data_offsets array
    metadata,        // in __metadata__, expecting a key or its end
    metadata_value,  // after a metadata key
    done,
  };

  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(std::string(source_) + ": " + problem);
  }
  [[noreturn]] void fail_tensor(const std::string& problem) const {
    fail("tensor " + printable(key_) + " " + problem);
  }

  // A JSON value of the wrong kind for the place it appears in.
  [[noreturn]] bool unexpected(const std::string& found) const {
    const std::string suffix = " (found " + found + ")";
    switch (state_) {
      case State::top: fail("header is not a JSON object" + suffix);
      case State::root_value:
        if (key_ == kMetadataKey) fail("__metadata__ is not a JSON object" + suffix);
        fail_tensor("is not a JSON object" + suffix);
      case State::entry_value:
        if (field_ == "dtype") fail_tensor("has a dtype that is not a string" + suffix);
        if (field_ == "shape") fail_tensor("has a shape that is not an array" + suffix);
        fail_tensor("has data_offsets that are not an array" + suffix);
      case State::shape: fail_tensor("has a shape that is not an array of integers" + suffix);
      case State::offsets:
        fail_tensor("has data_offsets that are not two non-negative integers" + suffix);
      case State::metadata_value:
        fail("__metadata__ value for key " + printable(key_) + " is not a string" + suffix);
      default: fail("unexpected JSON value in the header" + suffix);
    }
  }

  std::string_view source_;
  bool raw_dtypes_;
  Header header_;
  State state_ = State::top;
  std::string key_;    // the current root key (tensor name) or metadata key
  std::string field_;  // the current field of a tensor entry
  TensorEntry entry_;
  bool has_dtype_ = false;
  bool has_shape_ = false;
  bool has_offsets_ = false;
  bool saw_metadata_ = false;
  std::array<std::uint64_t, 2> offsets_{};
  std::size_t offset_count_ = 0;
};

using NamedEntry = std::pair<const std::string, TensorEntry>;

// Checks every tensor against the data section and returns them in file order. The format asks
// for tensors that tile the data section exactly, so overlaps and holes are both rejected.
std::vector<const NamedEntry*> check_layout(const Header& header, std::uint64_t data_bytes,
                                            std::string_view source) {
  auto fail = [&](const std::string& name, const std::string& problem) {
    throw Error(std::string(source) + ": tensor " + printable(name) + " " + problem);
  };
  std::vector<const NamedEntry*> order;
  order.reserve(header.tensors.size());
  for (const NamedEntry& named : header.tensors) {
    const auto& [name, entry] = named;
    std::uint64_t numel = 1;
    for (std::int64_t extent : entry.shape) {
      const auto uextent = static_cast<std::uint64_t>(extent);
      // Zero extents are checked too: a [2^40, 2^40, 0] tensor is empty but absurd.
      if (uextent != 0 && numel > kMaxElements / uextent) {
        fail(name, "has shape " + shape_string(entry.shape) + " whose element count overflows");
      }
      numel = uextent == 0 ? 0 : numel * uextent;
    }
    const std::string offsets = byte_range(entry.begin, entry.end);
    if (entry.begin > entry.end)
      fail(name, "has data_offsets " + offsets + " that end before they begin");
    if (entry.end > data_bytes) {
      fail(name, "has data_offsets " + offsets + " that reach beyond the data section (" +
                     std::to_string(data_bytes) + " bytes)");
    }
    const std::uint64_t expected = numel * entry.element_size;
    if (entry.end - entry.begin != expected) {
      fail(name, "has data_offsets " + offsets + " spanning " +
                     std::to_string(entry.end - entry.begin) + " bytes, but " + entry.dtype_name +
                     " " + shape_string(entry.shape) + " needs " + std::to_string(expected));
    }
    order.push_back(&named);
  }
  std::sort(order.begin(), order.end(), [](const NamedEntry* a, const NamedEntry* b) {
    return std::pair(a->second.begin, a->second.end) < std::pair(b->second.begin, b->second.end);
  });
  std::uint64_t covered = 0;  // the data section's bytes [0, covered) belong to earlier tensors
  const NamedEntry* previous = nullptr;
  for (const NamedEntry* named : order) {
    const TensorEntry& entry = named->second;
    if (entry.begin < covered) {
      fail(named->first, "at bytes " + byte_range(entry.begin, entry.end) + " overlaps tensor " +
                             printable(previous->first) + " at bytes " +
                             byte_range(previous->second.begin, previous->second.end));
    }
    if (entry.begin > covered) {
      throw Error(std::string(source) + ": bytes " + byte_range(covered, entry.begin) +
                  " of the data section belong to no tensor (the format allows no holes)");
    }
    covered = entry.end;
    previous = named;
  }
  if (covered != data_bytes) {
    throw Error(std::string(source) + ": bytes " + byte_range(covered, data_bytes) +
                " of the data section belong to no tensor (the format allows no holes)");
  }
  return order;
}

// Validates the length prefix against the file size; returns the header length.
std::uint64_t check_header_length(std::uint64_t header_bytes, std::uint64_t file_bytes,
                                  std::string_view source) {
  if (file_bytes < kLengthPrefixBytes) {
    throw Error(std::string(source) + ": file is too short (" + std::to_string(file_bytes) +
                " bytes) to hold the 8-byte header length");
  }
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    throw Error(std::string(source) + ": header length " + std::to_string(header_bytes) +
                " exceeds the limit of " + std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (header_bytes > file_bytes - kLengthPrefixBytes) {
    throw Error(std::string(source) + ": header length " + std::to_string(header_bytes) +
                " is larger than the " + std::to_string(file_bytes - kLengthPrefixBytes) +
                " bytes that follow the length prefix");
  }
  return header_bytes;
}

// The padded JSON header for `tensors` laid out in name order.
std::string build_header(const std::map<std::string, HostTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == kMetadataKey) {
      throw Error("cannot serialize a tensor named __metadata__: the name is reserved");
    }
    std::uint64_t numel = 1;
    for (std::int64_t extent : tensor.shape()) numel *= static_cast<std::uint64_t>(extent);
    // A default-constructed HostTensor has shape [] (one element) but no bytes.
    if (numel * dtype_size(tensor.dtype()) != tensor.nbytes()) {
      throw Error("cannot serialize tensor " + printable(name) + ": it holds " +
                  std::to_string(tensor.nbytes()) + " bytes but its shape " +
                  tensor.shape_string() + " needs " +
                  std::to_string(numel * dtype_size(tensor.dtype())));
    }
    json entry = json::object();
    entry["dtype"] = safetensors_dtype_name(tensor.dtype());
    entry["shape"] = tensor.shape();
    entry["data_offsets"] = json::array({offset, offset + tensor.nbytes()});
    header[name] = std::move(entry);
    offset += tensor.nbytes();
  }
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& error) {
    // Tensor names and metadata must be valid UTF-8 to be stored in JSON.
    throw Error("cannot serialize safetensors header: " + printable(error.what()));
  }
  // With the 8-byte prefix, a header padded to a multiple of 8 keeps the data section aligned.
  text.append((kLengthPrefixBytes - text.size() % kLengthPrefixBytes) % kLengthPrefixBytes, ' ');
  return text;
}

// Closes the descriptor and removes the temporary file unless released.
class TempFile {
 public:
  TempFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!released_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  // Closes explicitly, since close() can report a failed write-back.
  int close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result;
  }
  void release() { released_ = true; }

 private:
  std::string path_;
  int fd_;
  bool released_ = false;
};

void write_all(int fd, const std::byte* data, std::size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t written = ::write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw Error(path + ": cannot write: " + system_message(errno));
    }
    data += written;
    size -= static_cast<std::size_t>(written);
  }
}

void read_all(int fd, std::uint64_t offset, std::byte* data, std::size_t size,
              const std::string& path) {
  while (size > 0) {
    const ssize_t got = ::pread(fd, data, size, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(path + ": cannot read: " + system_message(errno));
    }
    if (got == 0) throw Error(path + ": file ended early (was it changed while being read?)");
    data += got;
    offset += static_cast<std::uint64_t>(got);
    size -= static_cast<std::size_t>(got);
  }
}

// Closes a descriptor on every path out of read_safetensors.
struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

}  // namespace

SafetensorsFile parse_safetensors(std::span<const std::byte> file_bytes, std::string_view source) {
  const std::uint64_t file_size = file_bytes.size();
  const std::uint64_t header_bytes = check_header_length(
      file_size >= kLengthPrefixBytes ? load_le64(file_bytes.data()) : 0, file_size, source);
  const std::byte* header_begin = file_bytes.data() + kLengthPrefixBytes;
  const std::string_view text(reinterpret_cast<const char*>(header_begin), header_bytes);
  Header header = HeaderReader(source).take(text);
  const std::byte* data = header_begin + header_bytes;
  const std::uint64_t data_bytes = file_size - kLengthPrefixBytes - header_bytes;

  SafetensorsFile file;
  for (const NamedEntry* named : check_layout(header, data_bytes, source)) {
    const TensorEntry& entry = named->second;
    HostTensor tensor(entry.dtype, entry.shape);
    if (tensor.nbytes() > 0) std::memcpy(tensor.data(), data + entry.begin, tensor.nbytes());
    file.tensors.emplace(named->first, std::move(tensor));
  }
  file.metadata = std::move(header.metadata);
  return file;
}

namespace {

// An open file with its checked header; data_start is the file offset of the data section.
struct OpenedFile {
  int fd = -1;
  Header header;
  std::uint64_t data_start = 0;
  std::vector<const NamedEntry*> order;  // tensors in file order
  ~OpenedFile() {
    if (fd >= 0) ::close(fd);
  }
};

void open_checked(const std::string& path, bool raw_dtypes, OpenedFile& file) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw Error(path + ": cannot read safetensors file: " +
                (error ? error.message() : std::string("not a regular file")));
  }
  const std::uint64_t file_size = std::filesystem::file_size(path, error);
  if (error) throw Error(path + ": cannot read safetensors file: " + error.message());

  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd < 0) throw Error(path + ": cannot open safetensors file: " + system_message(errno));

  std::array<std::byte, kLengthPrefixBytes> prefix{};
  if (file_size >= kLengthPrefixBytes) read_all(file.fd, 0, prefix.data(), prefix.size(), path);
  const std::uint64_t header_bytes = check_header_length(load_le64(prefix.data()), file_size, path);
  std::string text(header_bytes, '\0');
  read_all(file.fd, kLengthPrefixBytes, reinterpret_cast<std::byte*>(text.data()), text.size(),
           path);
  file.header = HeaderReader(path, raw_dtypes).take(text);
  file.data_start = kLengthPrefixBytes + header_bytes;
  file.order = check_layout(file.header, file_size - file.data_start, path);
}

}  // namespace

SafetensorsFile read_safetensors(const std::string& path) {
  OpenedFile opened;
  open_checked(path, false, opened);
  // Tensors are read one by one straight into their own buffers, so a model is never held twice.
  SafetensorsFile file;
  for (const NamedEntry* named : opened.order) {
    const TensorEntry& entry = named->second;
    HostTensor tensor(entry.dtype, entry.shape);
    read_all(opened.fd, opened.data_start + entry.begin, tensor.data(), tensor.nbytes(), path);
    file.tensors.emplace(named->first, std::move(tensor));
  }
  file.metadata = std::move(opened.header.metadata);
  return file;
}

namespace {

SafetensorsHeader header_info(Header& checked, std::uint64_t data_start, std::string path) {
  SafetensorsHeader header;
  header.path = std::move(path);
  for (const auto& [name, entry] : checked.tensors) {
    header.tensors.emplace(
        name, SafetensorsTensorInfo{entry.dtype_name, entry.shape, data_start + entry.begin,
                                    entry.end - entry.begin});
  }
  header.metadata = std::move(checked.metadata);
  return header;
}

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path) {
  OpenedFile opened;
  open_checked(path, true, opened);
  return header_info(opened.header, opened.data_start, path);
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_bytes,
                                           std::string_view source) {
  const std::uint64_t file_size = file_bytes.size();
  const std::uint64_t header_bytes = check_header_length(
      file_size >= kLengthPrefixBytes ? load_le64(file_bytes.data()) : 0, file_size, source);
  const std::string_view text(reinterpret_cast<const char*>(file_bytes.data()) + kLengthPrefixBytes,
                              header_bytes);
  Header header = HeaderReader(source, true).take(text);
  const std::uint64_t data_start = kLengthPrefixBytes + header_bytes;
  (void)check_layout(header, file_size - data_start, source);
  return header_info(header, data_start, std::string(source));
}

void read_safetensors_bytes(const std::string& path, std::uint64_t offset,
                            std::span<std::byte> out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open safetensors file: " + system_message(errno));
  const FdCloser closer{fd};
  read_all(fd, offset, out.data(), out.size(), path);
}

std::string serialize_safetensors(const std::map<std::string, HostTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  const std::string header = build_header(tensors, metadata);
  std::size_t total = kLengthPrefixBytes + header.size();
  for (const auto& entry : tensors) total += entry.second.nbytes();
  std::string file;
  file.reserve(total);
  file += store_le64(header.size());
  file += header;
  for (const auto& entry : tensors) {
    file.append(reinterpret_cast<const char*>(entry.second.data()), entry.second.nbytes());
  }
  return file;
}

void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string header = build_header(tensors, metadata);
  const std::string header_length = store_le64(header.size());
  const std::string temp_path = path + ".tmp-" + std::to_string(::getpid());

  // A new file (O_EXCL, no symlink followed): nothing planted under the temporary name is written
  // through.
  const int fd =
      ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error(path + ": cannot create temporary file " + printable(temp_path) + ": " +
                system_message(errno));
  }
  TempFile temp(temp_path, fd);
  write_all(fd, reinterpret_cast<const std::byte*>(header_length.data()), header_length.size(),
            path);
  write_all(fd, reinterpret_cast<const std::byte*>(header.data()), header.size(), path);
  // Streamed tensor by tensor so that a large model is not copied into one buffer first.
  for (const auto& entry : tensors) write_all(fd, entry.second.data(), entry.second.nbytes(), path);
  // Without fsync a crash after the rename could leave a complete-looking name over lost data.
  if (::fsync(fd) != 0) throw Error(path + ": cannot flush: " + system_message(errno));
  if (temp.close() != 0) throw Error(path + ": cannot write: " + system_message(errno));
  if (::rename(temp_path.c_str(), path.c_str()) != 0) {
    throw Error(path + ": cannot rename " + printable(temp_path) +
                " into place: " + system_message(errno));
  }
  temp.release();
}

}  // namespace lmoe
