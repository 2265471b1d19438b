#include "core/checkpoint_index.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/quoted_text.hpp"
#include "lmoe/error.hpp"

namespace lmoe {
namespace {

namespace fs = std::filesystem;

// True when `path` is `root` or lies below it (both absolute and normal).
bool lies_within(const fs::path& path, const fs::path& root) {
  const fs::path relative = path.lexically_relative(root);
  return !relative.empty() && *relative.begin() != "..";
}

// A shard must be a file inside the checkpoint's folder: an index is input from outside, and
// without this check it could make the loader read any file the process can (and echo its bytes
// in an error message).
std::string shard_path(const std::string& file, const std::string& dir, const std::string& entry) {
  const std::string names = entry + " names " + quoted_text(file);
  if (file.empty() || file.find('\0') != std::string::npos)
    throw Error(entry + " is not a file name");
  const fs::path relative(file);
  if (relative.has_root_path()) {
    throw Error(names + ", an absolute path (shards must lie in the checkpoint's folder)");
  }
  const fs::path normal = relative.lexically_normal();
  if (normal.empty() || normal == "." || *normal.begin() == "..") {
    throw Error(names + ", which leaves the checkpoint's folder");
  }
  // Symlinks are resolved as far as the path exists; a shard that is missing fails later, when
  // it is opened, with its own message.
  std::error_code error;
  const fs::path root = fs::weakly_canonical(fs::absolute(dir, error), error);
  const fs::path resolved = error ? fs::path() : fs::weakly_canonical(root / normal, error);
  if (error) throw Error(names + ", which cannot be resolved: " + error.message());
  if (!lies_within(resolved, root) || resolved == root) {
    throw Error(names + ", which resolves to " + quoted_text(resolved.string()) +
                ", outside the checkpoint's folder");
  }
  return (fs::path(dir) / normal).string();
}

}  // namespace

std::map<std::string, std::string> parse_checkpoint_index(std::string_view text,
                                                          const std::string& source,
                                                          const std::string& dir) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& parse_error) {
    // The parser's message quotes the token it stopped at, which a hostile file makes huge.
    throw Error(source + ": not valid JSON: " + quoted_text(parse_error.what()));
  }
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    throw Error(source + ": has no \"weight_map\" object");
  }
  std::map<std::string, std::string> file_of;
  for (const auto& [name, file] : doc["weight_map"].items()) {
    const std::string entry = source + ": weight_map entry for tensor " + quoted_text(name);
    if (!file.is_string()) throw Error(entry + " is not a file name");
    file_of[name] = shard_path(file.get<std::string>(), dir, entry);
  }
  return file_of;
}

}  // namespace lmoe
