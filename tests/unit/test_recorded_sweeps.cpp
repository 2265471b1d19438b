// Recorded sweeps (`lmoe bench --json`): written and read back identical, malformed files refused
// naming the field and the record, tier tables derived from a recording exactly as `lmoe tune`
// fits its own measurement (and refused for wrong rows, several comms, failed comms, tiers not
// timed), policies judged against a recording, and the real H200 recordings of tests/data/ (K3
// dims, tp 2, 2026-11-29): the ranges they give and the checks they pass and fail.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "lmoe/tools/tier_tuning.hpp"
#include "lmoe/version.hpp"
#include "tier_table_files.hpp"

namespace {

using lmoe::BenchRecord;
using lmoe::BenchSweep;
using lmoe::TailTier;
using lmoe::TierRange;
using lmoe::testing::error_message_of;
using ::testing::HasSubstr;

const std::string kDataDir = LMOE_TEST_DATA_DIR;

// Every field, compared exactly.
void expect_same_record(const BenchRecord& a, const BenchRecord& b, std::size_t index) {
  SCOPED_TRACE("record " + std::to_string(index));
  EXPECT_EQ(a.comm, b.comm);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.tier, b.tier);
  EXPECT_EQ(a.chosen, b.chosen);
  EXPECT_EQ(a.declined, b.declined);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.bus_bytes, b.bus_bytes);
  EXPECT_EQ(a.checked, b.checked);
  if (!a.declined) {
    EXPECT_EQ(a.mode, b.mode);
    EXPECT_EQ(a.mode_reason, b.mode_reason);
    EXPECT_EQ(a.seconds, b.seconds);
    EXPECT_EQ(a.stats.median, b.stats.median);
    EXPECT_EQ(a.stats.p10, b.stats.p10);
    EXPECT_EQ(a.stats.p90, b.stats.p90);
    EXPECT_EQ(a.stats.min, b.stats.min);
    EXPECT_EQ(a.stats.max, b.stats.max);
    EXPECT_EQ(a.algbw_gbps, b.algbw_gbps);
    EXPECT_EQ(a.busbw_gbps, b.busbw_gbps);
  }
  if (a.checked) {
    EXPECT_EQ(a.comparison.elements, b.comparison.elements);
    EXPECT_EQ(a.comparison.beyond_bound, b.comparison.beyond_bound);
    EXPECT_EQ(a.comparison.bit_mismatches, b.comparison.bit_mismatches);
    EXPECT_EQ(a.comparison.max_error_over_bound, b.comparison.max_error_over_bound);
    EXPECT_EQ(a.comparison.normwise_error, b.comparison.normwise_error);
    EXPECT_EQ(a.comparison.normwise_tolerance, b.comparison.normwise_tolerance);
    EXPECT_EQ(a.ranks_identical, b.ranks_identical);
  }
  EXPECT_EQ(a.ok(), b.ok());
}

void expect_same_sweep(const BenchSweep& a, const BenchSweep& b) {
  EXPECT_EQ(a.lmoe_version, b.lmoe_version);
  EXPECT_EQ(a.date_utc, b.date_utc);
  EXPECT_EQ(a.hostname, b.hostname);
  EXPECT_EQ(a.backend, b.backend);
  ASSERT_EQ(a.gpu.has_value(), b.gpu.has_value());
  if (a.gpu) {
    EXPECT_EQ(a.gpu->name, b.gpu->name);
    EXPECT_EQ(a.gpu->compute_capability, b.gpu->compute_capability);
    EXPECT_EQ(a.gpu->driver_version, b.gpu->driver_version);
    EXPECT_EQ(a.gpu->runtime_version, b.gpu->runtime_version);
    EXPECT_EQ(a.gpu->device_count, b.gpu->device_count);
  }
  EXPECT_EQ(a.nccl_version, b.nccl_version);
  EXPECT_EQ(a.driver_version, b.driver_version);
  EXPECT_EQ(a.preset, b.preset);
  EXPECT_EQ(a.dims.d_model, b.dims.d_model);
  EXPECT_EQ(a.dims.d_latent, b.dims.d_latent);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.eps, b.eps);
  EXPECT_EQ(a.tp, b.tp);
  EXPECT_EQ(a.comms, b.comms);
  EXPECT_EQ(a.tiers, b.tiers);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.warmup, b.warmup);
  EXPECT_EQ(a.iters, b.iters);
  EXPECT_EQ(a.cold_l2, b.cold_l2);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.settings, b.settings);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.check_max_tokens, b.check_max_tokens);
  EXPECT_EQ(a.fault_injected, b.fault_injected);
  EXPECT_EQ(a.tier_table, b.tier_table);
  ASSERT_EQ(a.result.comm_errors.size(), b.result.comm_errors.size());
  for (std::size_t i = 0; i < a.result.comm_errors.size(); ++i) {
    EXPECT_EQ(a.result.comm_errors[i].comm, b.result.comm_errors[i].comm);
    EXPECT_EQ(a.result.comm_errors[i].error, b.result.comm_errors[i].error);
  }
  ASSERT_EQ(a.result.records.size(), b.result.records.size());
  for (std::size_t i = 0; i < a.result.records.size(); ++i) {
    expect_same_record(a.result.records[i], b.result.records[i], i);
  }
}

// Seconds that are k·2^-20: their microseconds (k·15625·2^-14) and back are exact in binary, so a
// round trip through the file's microseconds must give the very same bits.
double exact_seconds(int k) { return std::ldexp(static_cast<double>(k), -20); }

BenchRecord ran_record(const std::string& comm, std::int64_t tokens, TailTier tier, int k) {
  BenchRecord r;
  r.comm = comm;
  r.tokens = tokens;
  r.tier = tier;
  r.mode = lmoe::BenchMode::graph;
  r.mode_reason = "capturable";
  r.bytes = 1024.0 * static_cast<double>(tokens);
  r.bus_bytes = 512.0 * static_cast<double>(tokens);
  r.seconds = {exact_seconds(k), exact_seconds(k + 2), exact_seconds(k + 1)};
  // As time_stats would give them, but each exact (its interpolated p10 and p90 would not be).
  r.stats = {exact_seconds(k + 1), exact_seconds(k), exact_seconds(k + 2), exact_seconds(k),
             exact_seconds(k + 2)};
  r.algbw_gbps = 0.5;
  r.busbw_gbps = 0.25;
  return r;
}

// A sweep of every kind of record: declined, checked and right, checked and wrong (an error that
// was not finite), ranks that differ, not checked; and a failed comm.
BenchSweep crafted_sweep() {
  BenchSweep s;
  s.lmoe_version = "0.1.0";
  s.date_utc = "2026-11-29T18:08:46Z";
  s.hostname = "gpu-host";
  s.backend = lmoe::Backend::cuda;
  s.gpu = lmoe::BenchEnvironment::Gpu{"NVIDIA H200", "9.0", 13000, 13000, 2};
  s.nccl_version = "2.28.3";
  s.driver_version = "580.159.04";
  s.preset = "kimi-k3";
  s.dims = {7168, 3584};
  s.dtype = lmoe::DType::bf16;
  s.eps = 1e-5f;
  s.tp = 2;
  s.comms = {"nccl", "p2p"};
  s.tiers = {lmoe::kAllTiers.begin(), lmoe::kAllTiers.end()};
  s.tokens = {1, 4096};
  s.warmup = 5;
  s.iters = 3;
  s.cold_l2 = true;  // not the default: the round trip must keep it
  s.layers = 8;      // likewise
  s.settings = {{"LMOE_FUSED_DECODE", "1"}, {"NCCL_ALGO", "Ring"}};
  s.seed = 18446744073709551557ull;  // above INT64_MAX: read back whole
  s.check_max_tokens = 256;
  s.fault_injected = false;
  s.tier_table = "tiers.json";
  BenchRecord declined;
  declined.comm = "nccl";
  declined.tokens = 1;
  declined.tier = TailTier::token;
  declined.declined = "T=1 < tp=2";
  declined.bytes = 21504;
  declined.bus_bytes = 21504;
  BenchRecord right = ran_record("nccl", 1, TailTier::column, 31);
  right.chosen = true;
  right.checked = true;
  right.comparison = {10752, 3, 0, 0.5, 1e-3, 1e-2};
  BenchRecord wrong = ran_record("nccl", 1, TailTier::overlap, 40);
  wrong.checked = true;
  wrong.comparison = {10752,
                      10752,
                      7,
                      std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::infinity(),
                      1e-2};
  BenchRecord differ = ran_record("nccl", 1, TailTier::fused, 50);
  differ.checked = true;
  differ.comparison = {10752, 0, 0, 0, 1e-3, 1e-2};
  differ.ranks_identical = false;
  BenchRecord unchecked = ran_record("nccl", 4096, TailTier::token, 600);
  unchecked.chosen = true;
  s.result.records = {declined, right, wrong, differ, unchecked};
  s.result.comm_errors = {{"p2p", "peer access is not supported"}};
  return s;
}

// ---- reading and writing ------------------------------------------------------------------------

TEST(BenchJson, WrittenAndReadBackIsIdentical) {
  const BenchSweep sweep = crafted_sweep();
  const std::string text = lmoe::write_bench_json(sweep);
  const BenchSweep read = lmoe::read_bench_json(text, "b.json");
  expect_same_sweep(sweep, read);
  EXPECT_EQ(lmoe::write_bench_json(read), text);
  EXPECT_TRUE(read.cold_l2);
  EXPECT_EQ(nlohmann::json::parse(text)["cold_l2"], true);
  EXPECT_EQ(read.layers, 8);
  EXPECT_EQ(nlohmann::json::parse(text)["layers"], 8);
  EXPECT_EQ(nlohmann::json::parse(text)["settings"]["LMOE_FUSED_DECODE"], "1");
  EXPECT_EQ(read.settings.size(), 2u);
  // The wrong records stay wrong, the others right.
  std::vector<bool> ok;
  for (const BenchRecord& r : read.result.records) ok.push_back(r.ok());
  EXPECT_EQ(ok, (std::vector<bool>{true, true, false, false, true}));
  EXPECT_FALSE(read.result.ok());
}

TEST(BenchJson, ACpuSweepReadsBackToTheSameTimes) {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cpu;
  options.dims = {64, 32};
  options.tp = 2;
  options.tokens = {1, 5};
  options.warmup = 0;
  options.iters = 3;
  options.check_max_tokens = 1;
  const BenchSweep sweep = lmoe::bench_sweep_of(
      options, "tiny", lmoe::bench_environment(lmoe::Backend::cpu), lmoe::run_tail_bench(options));
  ASSERT_TRUE(sweep.result.ok());
  EXPECT_FALSE(sweep.cold_l2);
  EXPECT_FALSE(lmoe::read_bench_json(lmoe::write_bench_json(sweep), "b.json").cold_l2);
  // The sweep records the option as given (a cuda sweep's; the cpu backend cannot run it).
  options.cold_l2 = true;
  EXPECT_TRUE(lmoe::bench_sweep_of(options, "tiny", {}, {}).cold_l2);
  EXPECT_EQ(sweep.comms, std::vector<std::string>{"threads"});  // as the sweep resolved them
  const BenchSweep read = lmoe::read_bench_json(lmoe::write_bench_json(sweep), "b.json");
  ASSERT_EQ(read.result.records.size(), sweep.result.records.size());
  for (std::size_t i = 0; i < read.result.records.size(); ++i) {
    const BenchRecord& a = sweep.result.records[i];
    const BenchRecord& b = read.result.records[i];
    EXPECT_EQ(a.checked, b.checked);
    EXPECT_EQ(a.declined, b.declined);
    ASSERT_EQ(a.seconds.size(), b.seconds.size());
    // Microseconds in the file: seconds·1e6 / 1e6 is the same number to the last bit or two.
    for (std::size_t j = 0; j < a.seconds.size(); ++j) {
      EXPECT_NEAR(a.seconds[j], b.seconds[j], 4e-16 * a.seconds[j]);
    }
    EXPECT_NEAR(a.stats.median, b.stats.median, 4e-16 * a.stats.median);
  }
}

class BenchJsonErrors : public ::testing::Test {
 protected:
  // The crafted sweep's JSON with `edit` applied, read as "b.json".
  std::string read_error(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json doc = nlohmann::json::parse(lmoe::write_bench_json(crafted_sweep()));
    edit(doc);
    return error_message_of([&] { lmoe::read_bench_json(doc.dump(), "b.json"); });
  }
};

TEST_F(BenchJsonErrors, AMissingOrGarbledFieldIsNamedWithItsRecord) {
  EXPECT_EQ(read_error([](auto& d) { d["records"][1].erase("median_us"); }),
            "b.json: records[1]: missing \"median_us\"");
  EXPECT_EQ(read_error([](auto& d) { d["records"][4]["p90_us"] = "fast"; }),
            "b.json: records[4].p90_us: expected a finite number >= 0, got \"fast\"");
  EXPECT_EQ(read_error([](auto& d) { d["records"][1]["iterations_us"][2] = -1; }),
            "b.json: records[1].iterations_us[2]: expected a finite number >= 0, got -1");
  EXPECT_THAT(read_error([](auto& d) { d["records"][2]["tier"] = "warp"; }),
              HasSubstr("b.json: records[2].tier: unknown tier 'warp'"));
  EXPECT_EQ(read_error([](auto& d) { d["records"][0]["status"] = "skipped"; }),
            "b.json: records[0].status: expected \"ran\" or \"declined\", got \"skipped\"");
  EXPECT_EQ(read_error([](auto& d) { d["records"][0].erase("reason"); }),
            "b.json: records[0]: missing \"reason\"");
  EXPECT_EQ(read_error([](auto& d) { d["records"][3]["chosen"] = 1; }),
            "b.json: records[3].chosen: expected true or false, got 1");
  EXPECT_EQ(read_error([](auto& d) { d["records"][4]["wrong"] = 3; }),
            "b.json: records[4].wrong: expected null (the record was not checked), got 3");
  EXPECT_EQ(read_error([](auto& d) { d["records"][1]["wrong"] = nullptr; }),
            "b.json: records[1].wrong: expected an integer >= 0, got null");
  // "ok" must say what the fields say: a wrong row cannot pass for a right one.
  EXPECT_THAT(read_error([](auto& d) { d["records"][2]["ok"] = true; }),
              HasSubstr("b.json: records[2].ok: the record says true but its fields say false"));
  EXPECT_THAT(read_error([](auto& d) { d["records"][1]["wrong"] = 2; }),
              HasSubstr("b.json: records[1].ok: the record says true but its fields say false"));
  // Records of a comm, tier or T the sweep does not list.
  EXPECT_EQ(read_error([](auto& d) { d["records"][1]["comm"] = "threads"; }),
            "b.json: records[1].comm: 'threads' is not one of the sweep's \"comms\"");
  EXPECT_EQ(read_error([](auto& d) { d["records"][1]["tokens"] = 7; }),
            "b.json: records[1].tokens: 7 is not one of the sweep's \"tokens\"");
  EXPECT_EQ(read_error([](auto& d) {
              d["tiers"] = {"column", "overlap", "fused"};
            }),
            "b.json: records[0].tier: token is not one of the sweep's \"tiers\"");
}

TEST_F(BenchJsonErrors, TheTopLevelIsNamedToo) {
  EXPECT_EQ(read_error([](auto& d) { d.erase("tp"); }), "b.json: missing \"tp\"");
  EXPECT_EQ(read_error([](auto& d) { d["tp"] = "2"; }),
            "b.json: tp: expected an integer >= 1, got \"2\"");
  EXPECT_EQ(read_error([](auto& d) { d["gpu"].erase("compute_capability"); }),
            "b.json: gpu: missing \"compute_capability\"");
  EXPECT_THAT(read_error([](auto& d) { d["dtype"] = "fp8"; }), HasSubstr("b.json: dtype: "));
  EXPECT_EQ(read_error([](auto& d) { d["tokens"][1] = 0; }),
            "b.json: tokens[1]: expected a token count >= 1, got 0");
  EXPECT_EQ(read_error([](auto& d) { d["comm_errors"][0].erase("error"); }),
            "b.json: comm_errors[0]: missing \"error\"");
  EXPECT_EQ(read_error([](auto& d) { d["cold_l2"] = "yes"; }),
            "b.json: cold_l2: expected true or false, got \"yes\"");
  EXPECT_EQ(read_error([](auto& d) { d["layers"] = 0; }),
            "b.json: layers: expected an integer >= 1, got 0");
  EXPECT_EQ(read_error([](auto& d) { d["settings"] = "LMOE_FUSED_DECODE=1"; }),
            "b.json: settings: expected an object of strings, got \"LMOE_FUSED_DECODE=1\"");
  EXPECT_EQ(read_error([](auto& d) { d["settings"]["NCCL_ALGO"] = 1; }),
            "b.json: settings.NCCL_ALGO: expected a string, got 1");
  EXPECT_EQ(read_error([](auto& d) { d["command"] = "run"; }),
            "b.json: is the JSON of `lmoe run`, not a recorded sweep of `lmoe bench --json`");
  EXPECT_EQ(read_error([](auto& d) {
              d = {{"format", "lmoe-tier-table"}, {"version", 3}};
            }),
            "b.json: is a tier table, not a recorded sweep (record one with `lmoe bench --json "
            "FILE`)");
  EXPECT_THAT(error_message_of([] { lmoe::read_bench_json("{\"records\": [", "b.json"); }),
              HasSubstr("b.json: not valid JSON"));
  EXPECT_EQ(error_message_of([] { lmoe::read_bench_file("/nonexistent/b.json"); }),
            "cannot read the sweep file '/nonexistent/b.json'");
  // Files from before the kernel driver, the elements, cold_l2 and layers were recorded still read
  // (cold_l2 as false: those sweeps were warm; layers as 1).
  nlohmann::json doc = nlohmann::json::parse(lmoe::write_bench_json(crafted_sweep()));
  ASSERT_EQ(doc["cold_l2"], true);
  doc.erase("driver_version");
  doc.erase("cold_l2");
  doc.erase("layers");
  doc.erase("settings");
  for (auto& record : doc["records"]) record.erase("elements");
  const BenchSweep old = lmoe::read_bench_json(doc.dump(), "b.json");
  EXPECT_FALSE(old.driver_version.has_value());
  EXPECT_EQ(old.result.records[1].comparison.elements, 0);
  EXPECT_FALSE(old.cold_l2);
  EXPECT_EQ(old.layers, 1);
  EXPECT_TRUE(old.settings.empty());
}

// ---- tables derived from a recording ------------------------------------------------------------

lmoe::BenchOptions tiny_options() {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cpu;
  options.dims = {64, 32};
  options.eps = 1e-6f;
  options.tp = 2;
  options.tokens = {1, 4, 16};
  options.comms = {"threads"};
  options.warmup = 0;
  options.iters = 2;
  options.check_max_tokens = 4;  // T=16 is not checked: its timings are used all the same
  return options;
}

// A CPU sweep as `lmoe bench --json` would have recorded it.
BenchSweep cpu_sweep() {
  const lmoe::BenchOptions options = tiny_options();
  BenchSweep sweep = lmoe::bench_sweep_of(
      options, "tiny", lmoe::bench_environment(lmoe::Backend::cpu), lmoe::run_tail_bench(options));
  EXPECT_TRUE(sweep.result.ok());
  return sweep;
}

// ... and read back from its JSON.
BenchSweep recorded_cpu_sweep() {
  return lmoe::read_bench_json(lmoe::write_bench_json(cpu_sweep()), "sweep.json");
}

TEST(TuneFromSweep, FitsTheRecordsAsTuneFitsItsOwn) {
  const BenchSweep measured = cpu_sweep();
  const BenchSweep sweep = lmoe::read_bench_json(lmoe::write_bench_json(measured), "sweep.json");
  const lmoe::TuneResult result = lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json");
  ASSERT_TRUE(result.ok());
  const lmoe::TierTable& table = result.table;
  // What tune_tiers does with the records it measured: the comm's grid, find_ranges,
  // find_breakpoints.
  const std::vector<lmoe::GridPoint> grid =
      lmoe::grid_from_records(measured.result.records, "threads");
  ASSERT_EQ(table.grid.size(), grid.size());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    EXPECT_EQ(table.grid[i].tokens, grid[i].tokens);
    for (TailTier tier : lmoe::kAllTiers) {
      EXPECT_EQ(table.grid[i][tier].status, grid[i][tier].status);
      EXPECT_NEAR(table.grid[i][tier].median_us, grid[i][tier].median_us,
                  4e-16 * grid[i][tier].median_us);
      EXPECT_NEAR(table.grid[i][tier].p90_us, grid[i][tier].p90_us, 4e-16 * grid[i][tier].p90_us);
    }
  }
  EXPECT_EQ(table.ranges, lmoe::find_ranges(grid).ranges);
  EXPECT_EQ(table.breakpoints, lmoe::find_breakpoints(grid).breakpoints);
  EXPECT_EQ(result.range_fit.total_regret, 0);
  // The same table as from the records before they went through the file.
  const lmoe::TierTable direct = lmoe::tune_from_sweep(measured, std::nullopt, "sweep.json").table;
  EXPECT_EQ(direct.ranges, table.ranges);
  EXPECT_EQ(direct.breakpoints, table.breakpoints);
  const auto grid_json = [](const lmoe::TierTable& t) {
    return nlohmann::json::parse(lmoe::write_tier_table(t))["grid"].dump();
  };
  EXPECT_EQ(grid_json(direct), grid_json(table));
  // The unchecked T=16 is in the grid.
  EXPECT_EQ(table.grid.back().tokens, 16);
  EXPECT_TRUE(table.grid.back()[TailTier::column].ran());

  // The provenance is the sweep's, and says where the table came from.
  const lmoe::TableProvenance& p = table.provenance;
  EXPECT_EQ(p.backend, lmoe::Backend::cpu);
  EXPECT_EQ(p.comm, "threads");
  EXPECT_EQ(p.tp, 2);
  EXPECT_EQ(p.dims.d_model, 64);
  EXPECT_EQ(p.dims.d_latent, 32);
  EXPECT_EQ(p.eps, 1e-6f);
  EXPECT_EQ(p.preset, "tiny");
  EXPECT_EQ(p.mode, "eager");
  EXPECT_EQ((std::pair{p.warmup, p.iters}), (std::pair{0, 2}));
  EXPECT_EQ(p.date_utc, sweep.date_utc);
  EXPECT_EQ(p.hostname, sweep.hostname);
  EXPECT_EQ(p.lmoe_version, lmoe::kVersion);
  ASSERT_TRUE(p.derived_from.has_value());
  EXPECT_EQ(p.derived_from->path, "sweep.json");
  EXPECT_EQ(p.derived_from->date_utc, sweep.date_utc);
  EXPECT_EQ(p.derived_from->derived_utc.size(), std::string("2026-11-29T18:08:46Z").size());

  // Written and read, the table keeps all of it, and is matched like a measured one.
  const lmoe::TierTable read = lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json");
  EXPECT_TRUE(read.provenance == p);
  EXPECT_EQ(read.ranges, table.ranges);
  EXPECT_TRUE(lmoe::match_tier_table(read.provenance,
                                     lmoe::running_config(lmoe::Backend::cpu, 2, {64, 32},
                                                          lmoe::DType::bf16, "threads"),
                                     "t.json")
                  .empty());
  EXPECT_THAT(error_message_of([&] {
                lmoe::match_tier_table(read.provenance,
                                       lmoe::running_config(lmoe::Backend::cpu, 4, {64, 32},
                                                            lmoe::DType::bf16, "threads"),
                                       "t.json");
              }),
              HasSubstr("tp is 2 in the table, 4 here"));
}

TEST(TuneFromSweep, TheTableSaysWhetherTheSweepWasCold) {
  BenchSweep sweep = recorded_cpu_sweep();
  const lmoe::TableProvenance warm =
      lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json").table.provenance;
  EXPECT_FALSE(warm.cold_l2);
  sweep.cold_l2 = true;
  const lmoe::TierTable table = lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json").table;
  EXPECT_TRUE(table.provenance.cold_l2);
  // Otherwise the same provenance: a cold table is not equal to a warm one.
  lmoe::TableProvenance as_warm = table.provenance;
  as_warm.derived_from = warm.derived_from;  // the derivation's time may differ
  EXPECT_FALSE(as_warm == warm);
  as_warm.cold_l2 = false;
  EXPECT_TRUE(as_warm == warm);
  // The table file keeps it.
  const lmoe::TierTable read = lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json");
  EXPECT_TRUE(read.provenance.cold_l2);
  EXPECT_TRUE(read.provenance == table.provenance);
}

// The timing settings a sweep ran with (lmoe/timing_settings.hpp) go into the table derived from
// it, and a table loaded under other settings warns with both values; the same settings, no
// warning.
TEST(TuneFromSweep, TheTableKeepsTheSweepsTimingSettingsAndLoadingUnderOthersWarns) {
  BenchSweep sweep = recorded_cpu_sweep();
  sweep.settings = {{"LMOE_FUSED_DECODE", "1"}};
  const lmoe::TierTable table = lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json").table;
  EXPECT_EQ(table.provenance.settings, sweep.settings);
  const lmoe::TierTable read = lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json");
  EXPECT_EQ(read.provenance.settings, sweep.settings);
  lmoe::RunningConfig running = lmoe::running_config_of(sweep, table.provenance.comm);
  EXPECT_TRUE(lmoe::match_tier_table(read.provenance, running, "t.json").empty());
  running.settings = lmoe::TimingSettings{{"NCCL_PROTO", "LL"}};
  const std::vector<std::string> warnings =
      lmoe::match_tier_table(read.provenance, running, "t.json");
  EXPECT_EQ(warnings,
            (std::vector<std::string>{
                "tier table t.json: LMOE_FUSED_DECODE is '1' in the table, unset here; the "
                "table is used, but its measurements may not hold",
                "tier table t.json: NCCL_PROTO is unset in the table, 'LL' here; the table "
                "is used, but its measurements may not hold"}));
  // Unset running settings: not compared (a caller that does not know them).
  running.settings.reset();
  EXPECT_TRUE(lmoe::match_tier_table(read.provenance, running, "t.json").empty());
  // The cache state the same way: a warm table judged on a cold sweep warns, unset does not.
  EXPECT_EQ(lmoe::running_config_of(sweep, table.provenance.comm).cold_l2, false);
  running.cold_l2 = true;
  EXPECT_EQ(
      lmoe::match_tier_table(read.provenance, running, "t.json"),
      (std::vector<std::string>{"tier table t.json: cold_l2 is false in the table, true here; "
                                "the table is used, but its measurements may not hold"}));
  // And tails timed one to a graph against several (--layers).
  running.cold_l2.reset();
  EXPECT_EQ(lmoe::running_config_of(sweep, table.provenance.comm).layers, 1);
  running.layers = 8;
  EXPECT_EQ(
      lmoe::match_tier_table(read.provenance, running, "t.json"),
      (std::vector<std::string>{"tier table t.json: layers is 1 in the table, 8 here; the table "
                                "is used, but its measurements may not hold"}));
}

TEST(TuneFromSweep, AWrongRowIsRefusedByName) {
  BenchSweep sweep = recorded_cpu_sweep();
  std::size_t index = 0;
  for (; index < sweep.result.records.size(); ++index) {
    const BenchRecord& r = sweep.result.records[index];
    if (r.tokens == 4 && r.tier == TailTier::column) break;
  }
  ASSERT_LT(index, sweep.result.records.size());
  sweep.result.records[index].comparison.beyond_bound = 3;
  const std::string message =
      error_message_of([&] { lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json"); });
  EXPECT_THAT(message, HasSubstr("sweep.json: comm threads: records[" + std::to_string(index) +
                                 "] (T=4 column): 3 element(s) beyond the numerics contract"));
  EXPECT_THAT(message, HasSubstr("no table is derived from a sweep with a wrong output"));
  // Ranks that differ are wrong too.
  sweep.result.records[index].comparison.beyond_bound = 0;
  sweep.result.records[index].ranks_identical = false;
  EXPECT_THAT(error_message_of([&] { lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json"); }),
              HasSubstr("(T=4 column): ranks' outputs differ;"));
}

TEST(TuneFromSweep, SeveralCommsNeedOneNamed) {
  BenchSweep sweep = recorded_cpu_sweep();
  sweep.comms = {"threads", "p2p"};
  const std::vector<BenchRecord> threads = sweep.result.records;
  for (BenchRecord record : threads) {
    record.comm = "p2p";
    record.stats.median *= 2;
    sweep.result.records.push_back(record);
  }
  EXPECT_EQ(error_message_of([&] { lmoe::tune_from_sweep(sweep, std::nullopt, "sweep.json"); }),
            "sweep.json: the sweep has records of several comms (threads, p2p); say which with "
            "--comm");
  EXPECT_EQ(lmoe::tune_from_sweep(sweep, "p2p", "sweep.json").table.provenance.comm, "p2p");
  EXPECT_EQ(error_message_of([&] { lmoe::tune_from_sweep(sweep, "nccl", "sweep.json"); }),
            "sweep.json: no records of comm 'nccl' (the sweep has threads, p2p)");
  // A comm that failed in the sweep gives no table; the other one still does.
  sweep.result.comm_errors = {{"p2p", "peer access is not supported"}};
  EXPECT_EQ(error_message_of([&] { lmoe::tune_from_sweep(sweep, "p2p", "sweep.json"); }),
            "sweep.json: comm p2p failed in the sweep (peer access is not supported); its records "
            "are not a whole sweep");
  EXPECT_EQ(lmoe::tune_from_sweep(sweep, "threads", "sweep.json").table.provenance.comm, "threads");
}

TEST(TuneFromSweep, EveryTierMustHaveBeenTimedAtEveryT) {
  BenchSweep sweep = recorded_cpu_sweep();
  BenchSweep fewer = sweep;
  fewer.tiers = {TailTier::overlap, TailTier::column};
  EXPECT_THAT(error_message_of([&] { lmoe::tune_from_sweep(fewer, std::nullopt, "sweep.json"); }),
              HasSubstr("sweep.json: tiers: the sweep timed overlap, column; a table is fitted "
                        "over every tier"));
  BenchSweep missing = sweep;
  std::erase_if(missing.result.records,
                [](const BenchRecord& r) { return r.tokens == 16 && r.tier == TailTier::fused; });
  EXPECT_EQ(error_message_of([&] { lmoe::tune_from_sweep(missing, std::nullopt, "sweep.json"); }),
            "sweep.json: no record of comm threads at T=16 for fused (the sweep lists that T and "
            "tier)");
  BenchSweep repeated = sweep;
  repeated.result.records.push_back(repeated.result.records.front());
  EXPECT_THAT(
      error_message_of([&] { lmoe::tune_from_sweep(repeated, std::nullopt, "sweep.json"); }),
      HasSubstr("repeats records[0] of comm threads"));
}

// ---- judging a policy against a recording -------------------------------------------------------

TEST(ChooseAgain, ThePolicyChoosesAmongWhatTheRecordsCouldRun) {
  const BenchSweep sweep = crafted_sweep();
  // token preferred everywhere: at T=1 it is declined (T < tp), so column stands in.
  const lmoe::PolicyConfig token_everywhere =
      lmoe::policy_from(std::vector<TierRange>{{std::nullopt, TailTier::token}}, "t.json");
  const std::vector<BenchRecord> chosen =
      lmoe::choose_again(sweep.result.records, token_everywhere);
  ASSERT_EQ(chosen.size(), sweep.result.records.size());
  std::vector<bool> flags;
  for (const BenchRecord& r : chosen) flags.push_back(r.chosen);
  // declined token, column, overlap, fused at T=1; token at T=4096.
  EXPECT_EQ(flags, (std::vector<bool>{false, true, false, false, true}));
  // A tier without a record counts as able to run: preferring it leaves nothing chosen, and the
  // check says the choice was not timed.
  const lmoe::PolicyConfig overlap_everywhere =
      lmoe::policy_from(std::vector<TierRange>{{std::nullopt, TailTier::overlap}}, "t.json");
  const std::vector<lmoe::ChoiceCheck> checks =
      lmoe::check_choices(lmoe::choose_again(sweep.result.records, overlap_everywhere));
  ASSERT_EQ(checks.size(), 2u);
  EXPECT_EQ(checks[0].chosen, TailTier::overlap);
  EXPECT_EQ(checks[1].verdict, lmoe::ChoiceCheck::Verdict::not_timed);
}

// ---- the H200 recordings (tests/data/) ----------------------------------------------------------

BenchSweep h200_sweep(const std::string& name) {
  return lmoe::read_bench_file(kDataDir + "/" + name);
}

lmoe::PolicyConfig policy_of_file(const std::string& path) {
  return lmoe::load_policy_config(lmoe_test::fake_env({}), path);
}

class H200Recordings : public lmoe_test::TierTableFiles {};

TEST_F(H200Recordings, TheNcclSweepGivesColumnOverlapToken) {
  const BenchSweep sweep = h200_sweep("bench_k3_tp2.json");
  EXPECT_EQ(sweep.comms, (std::vector<std::string>{"nccl", "p2p", "cuda-threads"}));
  EXPECT_FALSE(sweep.cold_l2);  // recorded before cold_l2 was: measured warm
  EXPECT_THAT(
      error_message_of([&] { lmoe::tune_from_sweep(sweep, std::nullopt, "bench_k3_tp2.json"); }),
      HasSubstr("several comms (nccl, p2p, cuda-threads); say which with --comm"));
  const lmoe::TuneResult result = lmoe::tune_from_sweep(sweep, "nccl", "bench_k3_tp2.json");
  // Column at 1 and 16, overlap at 128 and 256, token from 1024: boundaries where the medians
  // cross between 16 and 128 (76) and between 256 and 1024 (648), interpolated linearly in T.
  EXPECT_EQ(result.table.ranges, (std::vector<TierRange>{{76, TailTier::column},
                                                         {648, TailTier::overlap},
                                                         {std::nullopt, TailTier::token}}));
  EXPECT_EQ(result.range_fit.total_regret, 0);
  // The breakpoints cannot put overlap after column: column up to the column/token crossing.
  EXPECT_FALSE(result.table.breakpoints.column_max_tokens == std::nullopt);
  EXPECT_GT(result.breakpoint_fit.total_regret, 0.2);
  const lmoe::TableProvenance& p = result.table.provenance;
  ASSERT_TRUE(p.gpu.has_value());
  EXPECT_EQ(*p.gpu, (lmoe::TableGpu{"NVIDIA H200", "9.0", 13000, 13000}));
  EXPECT_EQ(p.backend, lmoe::Backend::cuda);
  EXPECT_EQ(p.nccl_version, "2.28.3");
  EXPECT_EQ(p.driver_version, std::nullopt);  // not recorded by the bench of that day
  EXPECT_EQ((std::tuple{p.tp, p.dims.d_model, p.dims.d_latent, p.dtype, p.comm}),
            (std::tuple{2, std::int64_t{7168}, std::int64_t{3584}, lmoe::DType::bf16,
                        std::string("nccl")}));
  EXPECT_EQ((std::tuple{p.mode, p.warmup, p.iters, p.date_utc}),
            (std::tuple{std::string("graph"), 5, 50, std::string("2026-11-29T18:08:46Z")}));
  EXPECT_FALSE(p.cold_l2);
  // The other comms derive tables too.
  EXPECT_EQ(lmoe::tune_from_sweep(sweep, "p2p", "b").table.provenance.comm, "p2p");
  EXPECT_EQ(lmoe::tune_from_sweep(sweep, "cuda-threads", "b").table.provenance.mode, "eager");

  // Checked against the second sweep recorded the same day, every choice is the fastest.
  const BenchSweep check = h200_sweep("check_k3_tp2.json");
  const std::string path = write("tiers.json", lmoe::write_tier_table(result.table));
  const lmoe::PolicyConfig policy = policy_of_file(path);
  EXPECT_TRUE(
      lmoe::match_tier_table(policy.table->provenance, lmoe::running_config_of(check, "nccl"), path)
          .empty());
  const std::vector<lmoe::ChoiceCheck> checks =
      lmoe::check_choices(lmoe::choose_again(check.result.records, policy));
  ASSERT_EQ(checks.size(), 7u);
  for (const lmoe::ChoiceCheck& c : checks) {
    EXPECT_EQ(c.verdict, lmoe::ChoiceCheck::Verdict::fastest) << "T=" << c.tokens;
  }
}

// A breakpoint table's check, done on the GPU, recorded its choices and verdicts: judged here
// from the recording, they come out the same (T=128 SLOWER: the breakpoints could not express it).
TEST_F(H200Recordings, ABreakpointTablesRecordedChoicesAndVerdictsAreReproduced) {
  const BenchSweep check = h200_sweep("check_k3_tp2.json");
  const std::string path = kDataDir + "/tiers_k3_tp2.json";
  const lmoe::PolicyConfig policy = policy_of_file(path);
  // Only software versions differ (the kernel driver was not recorded by the sweep): warnings.
  const std::vector<std::string> warnings = lmoe::match_tier_table(
      policy.table->provenance, lmoe::running_config_of(check, "nccl"), path);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("driver_version is '580.159.04' in the table, none here"));

  const std::vector<BenchRecord> chosen = lmoe::choose_again(check.result.records, policy);
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    EXPECT_EQ(chosen[i].chosen, check.result.records[i].chosen) << "record " << i;
  }
  std::ifstream file(kDataDir + "/check_k3_tp2.json");
  std::stringstream text;
  text << file.rdbuf();
  const nlohmann::json recorded = nlohmann::json::parse(text.str())["policy_check"];
  const std::vector<lmoe::ChoiceCheck> checks = lmoe::check_choices(chosen);
  ASSERT_EQ(checks.size(), recorded.size());
  for (std::size_t i = 0; i < checks.size(); ++i) {
    EXPECT_EQ(checks[i].tokens, recorded[i]["tokens"].get<std::int64_t>());
    EXPECT_EQ(lmoe::verdict_name(checks[i].verdict), recorded[i]["verdict"].get<std::string>())
        << "T=" << checks[i].tokens;
    EXPECT_EQ(checks[i].ok(), recorded[i]["ok"].get<bool>());
  }
  EXPECT_EQ(checks[2].tokens, 128);
  EXPECT_EQ(checks[2].verdict, lmoe::ChoiceCheck::Verdict::slower);
}

TEST(H200RecordingsMismatch, ASweepOfAnotherConfigurationIsRefusedByField) {
  const BenchSweep bench = h200_sweep("bench_k3_tp2.json");
  const lmoe::TierTable table = lmoe::tune_from_sweep(bench, "nccl", "b.json").table;
  BenchSweep other = h200_sweep("check_k3_tp2.json");
  other.tp = 4;
  other.dims.d_model = 4096;
  const std::string message = error_message_of([&] {
    lmoe::match_tier_table(table.provenance, lmoe::running_config_of(other, "nccl"), "t.json");
  });
  EXPECT_THAT(message, HasSubstr("tp is 2 in the table, 4 here"));
  EXPECT_THAT(message, HasSubstr("d_model is 7168 in the table, 4096 here"));
  other = h200_sweep("check_k3_tp2.json");
  other.gpu->name = "NVIDIA B200";
  EXPECT_THAT(error_message_of([&] {
                lmoe::match_tier_table(table.provenance, lmoe::running_config_of(other, "nccl"),
                                       "t.json");
              }),
              HasSubstr("gpu.name is 'NVIDIA H200' in the table, 'NVIDIA B200' here"));
  EXPECT_THAT(error_message_of([&] {
                lmoe::match_tier_table(table.provenance, lmoe::running_config_of(bench, "p2p"),
                                       "t.json");
              }),
              HasSubstr("comm is 'nccl' in the table, 'p2p' here"));
}

}  // namespace
