// Recorded sweeps: the JSON `lmoe bench --json` writes, and reading it back into BenchRecords so
// that tier tables can be derived from a sweep, and checked against one, on any machine
// (docs/bench.md has the fields, docs/tuning.md the offline workflow).
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <set>

#include "core/json_fields.hpp"
#include "core/text_file.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "lmoe/version.hpp"

namespace lmoe {

namespace {

using nlohmann::json;
using namespace json_fields;

json optional_json(const std::optional<std::string>& value) {
  return value ? json(*value) : json();
}

json record_json(const BenchRecord& record) {
  const bool ran = !record.declined;
  std::vector<double> iterations_us;
  for (double s : record.seconds) iterations_us.push_back(s * 1e6);
  const auto if_ran = [&](double value) { return ran ? json(value) : json(); };
  const auto if_checked = [&](auto value) { return record.checked ? json(value) : json(); };
  return {{"comm", record.comm},
          {"tokens", record.tokens},
          {"tier", tier_name(record.tier)},
          {"status", ran ? "ran" : "declined"},
          {"reason", optional_json(record.declined)},
          {"chosen", record.chosen},
          {"mode", ran ? json(bench_mode_name(record.mode)) : json()},
          {"mode_reason", ran ? json(record.mode_reason) : json()},
          {"bytes", record.bytes},
          {"bus_bytes", record.bus_bytes},
          {"median_us", if_ran(record.stats.median * 1e6)},
          {"p10_us", if_ran(record.stats.p10 * 1e6)},
          {"p90_us", if_ran(record.stats.p90 * 1e6)},
          {"min_us", if_ran(record.stats.min * 1e6)},
          {"max_us", if_ran(record.stats.max * 1e6)},
          {"algbw_gbps", if_ran(record.algbw_gbps)},
          {"busbw_gbps", if_ran(record.busbw_gbps)},
          {"checked", record.checked},
          {"elements", if_checked(record.comparison.elements)},
          {"wrong", if_checked(record.comparison.beyond_bound)},
          {"bit_mismatches_vs_contract", if_checked(record.comparison.bit_mismatches)},
          // JSON has no NaN or infinity: a non-finite error is written as null (and read back as
          // infinity; such an output is wrong either way).
          {"max_error_over_bound", if_checked(record.comparison.max_error_over_bound)},
          {"normwise_error_vs_fp64", if_checked(record.comparison.normwise_error)},
          {"normwise_tolerance", if_checked(record.comparison.normwise_tolerance)},
          {"ranks_identical", if_checked(record.ranks_identical)},
          {"ok", record.ok()},
          {"iterations_us", iterations_us}};
}

// An error ratio of a checked record: a finite number >= 0, or null for one that was not finite.
double error_field(const json& object, const std::string& key, const std::string& where) {
  if (field(object, key, where).is_null()) return std::numeric_limits<double>::infinity();
  return nonnegative_field(object, key, where);
}

BenchRecord read_record(const json& object, const std::string& where) {
  BenchRecord record;
  record.comm = text_field(object, "comm", where);
  record.tokens = integer_field(object, "tokens", where, 1);
  record.tier =
      parsed(member(where, "tier"), [&] { return parse_tier(text_field(object, "tier", where)); });
  const std::string status = text_field(object, "status", where);
  if (status != "ran" && status != "declined") {
    throw Error(member(where, "status") + ": expected \"ran\" or \"declined\", got \"" + status +
                "\"");
  }
  record.chosen = bool_field(object, "chosen", where);
  record.bytes = nonnegative_field(object, "bytes", where);
  record.bus_bytes = nonnegative_field(object, "bus_bytes", where);
  if (status == "declined") {
    record.declined = text_field(object, "reason", where);
  } else {
    record.mode = parsed(member(where, "mode"),
                         [&] { return parse_bench_mode(text_field(object, "mode", where)); });
    record.mode_reason = text_field(object, "mode_reason", where);
    record.stats.median = nonnegative_field(object, "median_us", where) / 1e6;
    record.stats.p10 = nonnegative_field(object, "p10_us", where) / 1e6;
    record.stats.p90 = nonnegative_field(object, "p90_us", where) / 1e6;
    record.stats.min = nonnegative_field(object, "min_us", where) / 1e6;
    record.stats.max = nonnegative_field(object, "max_us", where) / 1e6;
    record.algbw_gbps = nonnegative_field(object, "algbw_gbps", where);
    record.busbw_gbps = nonnegative_field(object, "busbw_gbps", where);
    const json& iterations = field(object, "iterations_us", where);
    if (!iterations.is_array()) {
      throw Error(member(where, "iterations_us") + ": expected an array of times, got " +
                  iterations.dump());
    }
    for (std::size_t i = 0; i < iterations.size(); ++i) {
      const json& value = iterations[i];
      if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0) {
        throw Error(member(where, "iterations_us") + "[" + std::to_string(i) +
                    "]: expected a finite number >= 0, got " + value.dump());
      }
      record.seconds.push_back(value.get<double>() / 1e6);
    }
  }
  record.checked = bool_field(object, "checked", where);
  if (record.checked) {
    // Files written before "elements" was recorded lack it.
    if (object.contains("elements") && !object["elements"].is_null()) {
      record.comparison.elements = integer_field(object, "elements", where, 0);
    }
    record.comparison.beyond_bound = integer_field(object, "wrong", where, 0);
    record.comparison.bit_mismatches =
        integer_field(object, "bit_mismatches_vs_contract", where, 0);
    record.comparison.max_error_over_bound = error_field(object, "max_error_over_bound", where);
    record.comparison.normwise_error = error_field(object, "normwise_error_vs_fp64", where);
    record.comparison.normwise_tolerance = nonnegative_field(object, "normwise_tolerance", where);
    record.ranks_identical = bool_field(object, "ranks_identical", where);
  } else if (!field(object, "wrong", where).is_null()) {
    throw Error(member(where, "wrong") + ": expected null (the record was not checked), got " +
                object["wrong"].dump());
  }
  // "ok" is what the file's readers (and `lmoe tune --from-sweep`) go by: it must say what the
  // fields say.
  const bool ok = bool_field(object, "ok", where);
  if (ok != record.ok()) {
    throw Error(member(where, "ok") + ": the record says " + (ok ? "true" : "false") +
                " but its fields say " + (record.ok() ? "true" : "false") + " (wrong " +
                field(object, "wrong", where).dump() + ", ranks_identical " +
                field(object, "ranks_identical", where).dump() + ")");
  }
  return record;
}

// A JSON array of strings or integers, each read by `read(element, where)`.
template <typename Read>
auto array_field(const json& object, const std::string& key, const std::string& where, Read read) {
  const json& array = field(object, key, where);
  if (!array.is_array())
    throw Error(member(where, key) + ": expected an array, got " + array.dump());
  std::vector<decltype(read(array[0], where))> values;
  for (std::size_t i = 0; i < array.size(); ++i) {
    values.push_back(read(array[i], member(where, key) + "[" + std::to_string(i) + "]"));
  }
  return values;
}

std::string text_of(const json& value, const std::string& where) {
  if (!value.is_string()) throw Error(where + ": expected a string, got " + value.dump());
  return value.get<std::string>();
}

}  // namespace

BenchSweep bench_sweep_of(const BenchOptions& options, const std::string& preset,
                          const BenchEnvironment& environment, BenchResult result) {
  BenchSweep sweep;
  sweep.lmoe_version = kVersion;
  sweep.date_utc = environment.date_utc;
  sweep.hostname = environment.hostname;
  sweep.backend = options.backend;
  sweep.gpu = environment.gpu;
  sweep.nccl_version = environment.nccl_version;
  sweep.driver_version = environment.driver_version;
  sweep.preset = preset;
  sweep.dims = options.dims;
  sweep.dtype = options.dtype;
  sweep.eps = options.eps;
  sweep.tp = options.tp;
  // As run_tail_bench resolves them.
  sweep.comms = options.comms.empty() ? comm_backends(options.backend, options.tp) : options.comms;
  sweep.tiers = options.tiers;
  sweep.tokens = options.tokens;
  sweep.warmup = options.warmup;
  sweep.iters = options.iters;
  sweep.cold_l2 = options.cold_l2;
  sweep.layers = options.layers;
  sweep.settings = environment.settings;
  sweep.seed = options.seed;
  sweep.check_max_tokens = options.check_max_tokens;
  sweep.fault_injected = options.inject_fault;
  sweep.tier_table = options.policy.table_path;
  sweep.result = std::move(result);
  return sweep;
}

std::string write_bench_json(const BenchSweep& sweep) {
  json records = json::array();
  for (const BenchRecord& record : sweep.result.records) records.push_back(record_json(record));
  json comm_errors = json::array();
  for (const BenchCommError& error : sweep.result.comm_errors) {
    comm_errors.push_back({{"comm", error.comm}, {"error", error.error}});
  }
  json gpu;
  if (sweep.gpu) {
    gpu = {{"name", sweep.gpu->name},
           {"compute_capability", sweep.gpu->compute_capability},
           {"driver_version", sweep.gpu->driver_version},
           {"runtime_version", sweep.gpu->runtime_version},
           {"device_count", sweep.gpu->device_count}};
  }
  std::vector<std::string> tier_names;
  for (TailTier tier : sweep.tiers) tier_names.emplace_back(tier_name(tier));
  const json doc = {{"command", "bench"},
                    {"tool", "lmoe"},
                    {"version", sweep.lmoe_version},
                    {"date", sweep.date_utc},
                    {"hostname", sweep.hostname},
                    {"backend", backend_name(sweep.backend)},
                    {"gpu", gpu},
                    {"nccl_version", optional_json(sweep.nccl_version)},
                    {"driver_version", optional_json(sweep.driver_version)},
                    {"preset", sweep.preset},
                    {"d_model", sweep.dims.d_model},
                    {"d_latent", sweep.dims.d_latent},
                    {"dtype", dtype_name(sweep.dtype)},
                    {"eps", sweep.eps},
                    {"tp", sweep.tp},
                    {"comms", sweep.comms},
                    {"tiers", tier_names},
                    {"tokens", sweep.tokens},
                    {"warmup", sweep.warmup},
                    {"iters", sweep.iters},
                    {"cold_l2", sweep.cold_l2},
                    {"layers", sweep.layers},
                    {"settings", sweep.settings},
                    {"seed", sweep.seed},
                    {"check_max_tokens", sweep.check_max_tokens},
                    {"fault_injected", sweep.fault_injected},
                    {"records", records},
                    {"comm_errors", comm_errors},
                    {"tier_table", optional_json(sweep.tier_table)}};
  return doc.dump(2) + "\n";
}

BenchSweep read_bench_json(const std::string& json_text, const std::string& origin) {
  const json doc = parse_object(json_text, origin);
  if (doc.value("format", json()) == "lmoe-tier-table") {
    throw Error(origin +
                ": is a tier table, not a recorded sweep (record one with `lmoe bench --json "
                "FILE`)");
  }
  // The top level: fields are named "b.json: tp", records "b.json: records[3].median_us".
  const std::string where = origin + ": ";
  const std::string tool = text_field(doc, "tool", where);
  const std::string command = text_field(doc, "command", where);
  if (tool != "lmoe" || command != "bench") {
    throw Error(origin + ": is the JSON of `" + tool + " " + command +
                "`, not a recorded sweep of `lmoe bench --json`");
  }
  BenchSweep sweep;
  sweep.lmoe_version = text_field(doc, "version", where);
  sweep.date_utc = text_field(doc, "date", where);
  sweep.hostname = text_field(doc, "hostname", where);
  sweep.backend = parsed(member(where, "backend"),
                         [&] { return parse_backend(text_field(doc, "backend", where)); });
  const json& gpu = field(doc, "gpu", where);
  if (!gpu.is_null()) {
    const std::string at = member(where, "gpu");
    sweep.gpu = BenchEnvironment::Gpu{
        text_field(gpu, "name", at), text_field(gpu, "compute_capability", at),
        int_field(gpu, "driver_version", at, 0), int_field(gpu, "runtime_version", at, 0),
        int_field(gpu, "device_count", at, 0)};
  }
  sweep.nccl_version = optional_text(doc, "nccl_version", where);
  // Files written before the kernel driver was recorded lack it.
  if (doc.contains("driver_version"))
    sweep.driver_version = optional_text(doc, "driver_version", where);
  sweep.preset = text_field(doc, "preset", where);
  sweep.dims.d_model = integer_field(doc, "d_model", where, 1);
  sweep.dims.d_latent = integer_field(doc, "d_latent", where, 1);
  sweep.dtype =
      parsed(member(where, "dtype"), [&] { return parse_dtype(text_field(doc, "dtype", where)); });
  sweep.eps = static_cast<float>(nonnegative_field(doc, "eps", where));
  sweep.tp = int_field(doc, "tp", where, 1);
  sweep.comms = array_field(doc, "comms", where, text_of);
  sweep.tiers = array_field(doc, "tiers", where, [](const json& value, const std::string& at) {
    return parsed(at, [&] { return parse_tier(text_of(value, at)); });
  });
  sweep.tokens = array_field(doc, "tokens", where, [](const json& value, const std::string& at) {
    if (!value.is_number_integer() || value.get<std::int64_t>() < 1) {
      throw Error(at + ": expected a token count >= 1, got " + value.dump());
    }
    return value.get<std::int64_t>();
  });
  sweep.warmup = int_field(doc, "warmup", where, 0);
  sweep.iters = int_field(doc, "iters", where, 1);
  // Files written before it was recorded lack it: they were measured warm.
  sweep.cold_l2 = doc.contains("cold_l2") && bool_field(doc, "cold_l2", where);
  // Likewise: one tail a timed iteration.
  sweep.layers = doc.contains("layers") ? int_field(doc, "layers", where, 1) : 1;
  if (doc.contains("settings")) sweep.settings = text_map_field(doc, "settings", where);
  const json& seed = field(doc, "seed", where);
  if (!seed.is_number_unsigned() && !(seed.is_number_integer() && seed.get<std::int64_t>() >= 0)) {
    throw Error(member(where, "seed") + ": expected an integer >= 0, got " + seed.dump());
  }
  sweep.seed = seed.get<std::uint64_t>();
  sweep.check_max_tokens = integer_field(doc, "check_max_tokens", where, 0);
  sweep.fault_injected = bool_field(doc, "fault_injected", where);
  sweep.tier_table = optional_text(doc, "tier_table", where);

  const json& errors = field(doc, "comm_errors", where);
  if (!errors.is_array()) throw Error(member(where, "comm_errors") + ": expected an array");
  for (std::size_t i = 0; i < errors.size(); ++i) {
    const std::string at = member(where, "comm_errors[" + std::to_string(i) + "]");
    sweep.result.comm_errors.push_back(
        {text_field(errors[i], "comm", at), text_field(errors[i], "error", at)});
  }

  const json& records = field(doc, "records", where);
  if (!records.is_array()) throw Error(member(where, "records") + ": expected an array of records");
  const std::set<std::string> comms(sweep.comms.begin(), sweep.comms.end());
  const std::set<TailTier> tiers(sweep.tiers.begin(), sweep.tiers.end());
  const std::set<std::int64_t> tokens(sweep.tokens.begin(), sweep.tokens.end());
  for (std::size_t i = 0; i < records.size(); ++i) {
    const std::string at = member(where, "records[" + std::to_string(i) + "]");
    BenchRecord record = read_record(records[i], at);
    // A record of a comm, tier or T the sweep does not list is a garbled or hand-merged file.
    if (!comms.count(record.comm)) {
      throw Error(member(at, "comm") + ": '" + record.comm +
                  "' is not one of the sweep's \"comms\"");
    }
    if (!tiers.count(record.tier)) {
      throw Error(member(at, "tier") + ": " + std::string(tier_name(record.tier)) +
                  " is not one of the sweep's \"tiers\"");
    }
    if (!tokens.count(record.tokens)) {
      throw Error(member(at, "tokens") + ": " + std::to_string(record.tokens) +
                  " is not one of the sweep's \"tokens\"");
    }
    sweep.result.records.push_back(std::move(record));
  }
  return sweep;
}

BenchSweep read_bench_file(const std::string& path) {
  return read_bench_json(read_text_file(path, "sweep file"), path);
}

}  // namespace lmoe
