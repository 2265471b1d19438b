#include "parser_targets.hpp"

#include <map>
#include <nlohmann/json.hpp>

#include "core/checkpoint_index.hpp"
#include "core/text_file.hpp"
#include "lmoe/error.hpp"
#include "lmoe/safetensors.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "lmoe/tools/tail_floor.hpp"
#include "lmoe/tools/tier_tuning.hpp"

namespace lmoe_fuzz {
namespace {

std::string as_text(std::span<const std::byte> input) {
  return {reinterpret_cast<const char*>(input.data()), input.size()};
}

// Each runs one parser and swallows only lmoe::Error, the failure the contract allows.
template <typename Parse>
bool keeping_the_contract(Parse&& parse) {
  try {
    parse();
    return true;
  } catch (const lmoe::Error&) {
    return false;
  }
}

bool parse_safetensors_bytes(std::span<const std::byte> input) {
  return keeping_the_contract([&] { (void)lmoe::parse_safetensors(input, "fuzz input"); });
}
bool parse_safetensors_header(std::span<const std::byte> input) {
  return keeping_the_contract([&] { (void)lmoe::parse_safetensors_header(input, "fuzz input"); });
}
// The folder need not exist: entries are checked against it as far as it resolves.
bool parse_checkpoint_index(std::span<const std::byte> input) {
  return keeping_the_contract(
      [&] { (void)lmoe::parse_checkpoint_index(as_text(input), "fuzz input", "fuzz-checkpoint"); });
}
bool parse_tier_table(std::span<const std::byte> input) {
  return keeping_the_contract([&] { (void)lmoe::read_tier_table(as_text(input), "fuzz input"); });
}
bool parse_tier_policy(std::span<const std::byte> input) {
  return keeping_the_contract([&] {
    lmoe::PolicyConfig config;
    lmoe::apply_tier_table(config, as_text(input), "fuzz input");
  });
}
bool parse_bench_json(std::span<const std::byte> input) {
  return keeping_the_contract([&] { (void)lmoe::read_bench_json(as_text(input), "fuzz input"); });
}
bool parse_machine_rates(std::span<const std::byte> input) {
  return keeping_the_contract([&] { (void)lmoe::parse_machine_rates(as_text(input)); });
}

constexpr ParserTarget kTargets[] = {
    {"safetensors", "parse_safetensors", parse_safetensors_bytes, false},
    {"safetensors_header", "parse_safetensors_header", parse_safetensors_header, false},
    {"checkpoint_index", "parse_checkpoint_index", parse_checkpoint_index, true},
    {"tier_table", "read_tier_table", parse_tier_table, true},
    {"tier_policy", "apply_tier_table", parse_tier_policy, true},
    {"bench_json", "read_bench_json", parse_bench_json, true},
    {"machine_rates", "parse_machine_rates", parse_machine_rates, false},
};

// A recorded sweep cut to a few records of a few iterations: small enough to mutate quickly, and
// every kind of field still present.
std::string small_sweep(const std::filesystem::path& data_dir) {
  nlohmann::json sweep =
      nlohmann::json::parse(lmoe::read_text_file(data_dir / "bench_k3_tp2.json", "recorded sweep"));
  nlohmann::json kept = nlohmann::json::array();
  for (const nlohmann::json& record : sweep["records"]) {
    if (kept.size() == 6) break;
    nlohmann::json copy = record;
    nlohmann::json& iterations = copy["iterations_us"];
    if (iterations.size() > 3) iterations.erase(iterations.begin() + 3, iterations.end());
    kept.push_back(std::move(copy));
  }
  sweep["records"] = std::move(kept);
  return sweep.dump(1);
}

// MXFP4 blocks and scales (U8) and a dtype lmoe does not compute in: what only the header-only
// reader accepts.
Bytes raw_dtype_safetensors() {
  const std::string header = R"({"w_packed":{"dtype":"U8","shape":[2,16],"data_offsets":[0,32]},)"
                             R"("w_scale":{"dtype":"U8","shape":[2,1],"data_offsets":[32,34]},)"
                             R"("i":{"dtype":"I64","shape":[1],"data_offsets":[34,42]}})";
  std::string file(8, '\0');
  for (std::size_t i = 0; i < 8; ++i)
    file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return to_bytes(file + header + std::string(42, '\x11'));
}

// A sharded checkpoint's index, as the Hugging Face tools write it.
std::string checkpoint_index() {
  return R"({"metadata": {"total_size": 1024}, "weight_map": {)"
         R"("layers.0.moe.router.weight": "model-00001-of-00002.safetensors",)"
         R"("layers.0.moe.latent_up.weight": "model-00002-of-00002.safetensors",)"
         R"("layers.0.moe.experts.0.up.weight_packed": "shards/../model-00002-of-00002.safetensors"}})";
}

Bytes small_safetensors() {
  lmoe::HostTensor weight(lmoe::DType::bf16, {4, 8});
  lmoe::HostTensor bias(lmoe::DType::f32, {3});
  lmoe::HostTensor empty(lmoe::DType::f16, {0, 5});
  for (std::int64_t i = 0; i < weight.numel(); ++i)
    weight.set(i, 0.25f * static_cast<float>(i) - 3.0f);
  for (std::int64_t i = 0; i < bias.numel(); ++i) bias.set(i, static_cast<float>(i));
  return to_bytes(
      lmoe::serialize_safetensors({{"w", weight}, {"b", bias}, {"e", empty}}, {{"eps", "1e-6"}}));
}

}  // namespace

Bytes to_bytes(std::string_view text) {
  const auto* first = reinterpret_cast<const std::byte*>(text.data());
  return {first, first + text.size()};
}

std::span<const ParserTarget> parser_targets() { return kTargets; }

const ParserTarget& parser_target(std::string_view name) {
  for (const ParserTarget& target : kTargets) {
    if (target.name == name) return target;
  }
  std::string names;
  for (const ParserTarget& target : kTargets)
    names += (names.empty() ? "" : ", ") + std::string(target.name);
  throw lmoe::Error("no fuzz target '" + std::string(name) + "' (have: " + names + ")");
}

std::vector<Bytes> parser_seeds(const ParserTarget& target, const std::filesystem::path& data_dir) {
  std::vector<Bytes> seeds;
  if (target.name == "safetensors") {
    seeds.push_back(small_safetensors());
  } else if (target.name == "safetensors_header") {
    seeds.push_back(small_safetensors());
    seeds.push_back(raw_dtype_safetensors());
  } else if (target.name == "checkpoint_index") {
    seeds.push_back(to_bytes(checkpoint_index()));
  } else if (target.name == "tier_table" || target.name == "tier_policy") {
    for (const lmoe::ShippedTierTable& shipped : lmoe::shipped_tier_tables())
      seeds.push_back(to_bytes(shipped.json));
    seeds.push_back(to_bytes(lmoe::read_text_file(data_dir / "tiers_k3_tp2.json", "tier table")));
    // A hand-written table of version 1 (breakpoints only): the policy reads it, read_tier_table
    // (measured tables, versions 2 and 3) refuses it.
    if (target.name == "tier_policy")
      seeds.push_back(to_bytes(
          R"({"format": "lmoe-tier-table", "version": 1, "breakpoints": )"
          R"({"fused_max_tokens": 16, "overlap_max_tokens": 200, "column_max_tokens": null}})"));
  } else if (target.name == "bench_json") {
    seeds.push_back(to_bytes(small_sweep(data_dir)));
  } else if (target.name == "machine_rates") {
    seeds.push_back(to_bytes("450,4270,790"));
    seeds.push_back(to_bytes("0.5,1e3,12.25"));
  }
  return seeds;
}

}  // namespace lmoe_fuzz
