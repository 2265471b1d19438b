// `lmoe env`: every LMOE_* setting (lmoe/settings.hpp) with its value here, where that came from,
// its range and meaning; a warning for each LMOE_* variable set here that lmoe does not read.
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "common.hpp"
#include "lmoe/settings.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct EnvCommand {
  bool json = false;

  void execute() const {
    const EnvLookup env = process_environment();
    nlohmann::json doc = nlohmann::json::array();
    Table table({"name", "value", "from", "range", "applies"});
    table.align_left({true, true, true, true, true});
    for (const SettingSpec& spec : settings_table()) {
      // A presence setting is on even when set to "": show it as set.
      const std::optional<std::string> raw = env(spec.name);
      const bool set =
          spec.type == SettingType::presence ? raw.has_value() : raw.has_value() && !raw->empty();
      const std::string value = set ? *raw : spec.fallback;
      const std::string from = set ? "environment" : "default";
      nlohmann::json row = {{"name", spec.name},
                            {"value", value},
                            {"source", from},
                            {"type", std::string(setting_type_name(spec.type))},
                            {"range", setting_range_text(spec)},
                            {"default", spec.fallback},
                            {"meaning", spec.meaning},
                            {"applies", spec.applies}};
      if (spec.type == SettingType::integer || spec.type == SettingType::milliseconds ||
          spec.type == SettingType::nanoseconds || spec.type == SettingType::tokens) {
        row["min"] = spec.min;
        row["max"] = spec.max;
      }
      doc.push_back(row);
      table.add_row({spec.name, set && value.empty() ? "(empty)" : value, from,
                     setting_range_text(spec), spec.applies},
                    spec.meaning);
    }
    if (json) {
      std::cout << nlohmann::json{{"settings", doc}}.dump(2) << "\n";
    } else {
      table.print(std::cout);
    }
    for (const std::string& warning : unknown_setting_warnings(environment_lmoe_names())) {
      std::cerr << "lmoe: warning: " << warning << "\n";
    }
  }
};

}  // namespace

void add_env_command(CLI::App& app) {
  auto command = std::make_shared<EnvCommand>();
  CLI::App* sub = app.add_subcommand(
      "env", "list every LMOE_* setting: its value here, default, range and meaning");
  sub->add_flag("--json", command->json, "print the table as JSON on stdout");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli
