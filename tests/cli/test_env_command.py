"""End-to-end tests of `lmoe env`: the table of settings with each value's source, its JSON, and
the warning for an LMOE_* variable lmoe does not read. Usage: test_env_command.py PATH_TO_LMOE"""

import json
import unittest

import cli_support
from cli_support import lmoe


class EnvCommand(unittest.TestCase):
    def test_table_lists_every_setting_with_its_source(self):
        result = lmoe("env", env={"LMOE_P2P_TIMEOUT_MS": "2500"})
        lines = result.stdout.splitlines()
        self.assertEqual(lines[0].split()[:5], ["name", "value", "from", "range", "applies"])
        row = next(line for line in lines if line.split()[0] == "LMOE_P2P_TIMEOUT_MS")
        self.assertEqual(row.split()[1:4], ["2500", "environment", "[1,"])
        self.assertIn("[1, 86400000]", row)
        default_row = next(line for line in lines if line.split()[0] == "LMOE_TOKEN_CHUNKS")
        self.assertIn(" default ", default_row)
        self.assertIn("[1, 8]", default_row)
        self.assertEqual(len(lines), 1 + 26)  # a header, then one row per setting
        self.assertEqual(result.stderr, "")

    def test_json_has_every_field_and_the_bounds(self):
        doc = json.loads(lmoe("env", "--json", env={"LMOE_TIER": "column"}).stdout)
        settings = {row["name"]: row for row in doc["settings"]}
        self.assertEqual(len(settings), 26)
        self.assertEqual(list(settings), sorted(settings))
        tier = settings["LMOE_TIER"]
        self.assertEqual((tier["value"], tier["source"], tier["type"]),
                         ("column", "environment", "tier"))
        self.assertEqual(tier["default"], "auto")
        timeout = settings["LMOE_P2P_TIMEOUT_MS"]
        self.assertEqual((timeout["value"], timeout["source"]), ("10000", "default"))
        self.assertEqual((timeout["min"], timeout["max"], timeout["type"]),
                         (1, 86400000, "milliseconds"))
        for row in doc["settings"]:
            for key in ["name", "value", "source", "type", "range", "default", "meaning",
                        "applies"]:
                self.assertTrue(row[key] != "" or key == "value", (row["name"], key))
            if "max" in row:
                self.assertLessEqual(row["min"], row["max"], row["name"])

    def test_unknown_variable_is_warned_with_the_closest_name(self):
        result = lmoe("env", env={"LMOE_P2P_TIMEOUT": "5", "LMOE_QQQQQQQQQQQQQQQQ": "1"})
        self.assertEqual(result.returncode, 0)
        self.assertIn(
            "lmoe: warning: LMOE_P2P_TIMEOUT is not a setting lmoe reads "
            "(did you mean LMOE_P2P_TIMEOUT_MS?)\n",
            result.stderr,
        )
        self.assertIn("lmoe: warning: LMOE_QQQQQQQQQQQQQQQQ is not a setting lmoe reads\n",
                      result.stderr)
        self.assertEqual(result.stderr.count("warning"), 2)
        # The JSON on stdout stays clean; the warning goes to stderr there too.
        result = lmoe("env", "--json", env={"LMOE_FUSED_DECOD": "0"})
        json.loads(result.stdout)
        self.assertIn("(did you mean LMOE_FUSED_DECODE?)", result.stderr)


if __name__ == "__main__":
    cli_support.main()
