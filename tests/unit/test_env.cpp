// The configuration: every LOOM_* variable parsed once, range-checked, with messages that name the
// variable, the value and what is accepted; the documentation table equal to the code's; and the
// parsers of outside input (LOOM_* values, launcher variables) never crash on random input.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>

#include "loom/env.h"
#include "loom/config.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/world.h"

namespace {

std::string config_error_of(const loom::Environment& env) {
  try {
    loom::parse_config(env);
  } catch (const loom::ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST(Config, DefaultsApplyWhenUnset) {
  const loom::Config c = loom::parse_config({});
  EXPECT_EQ(c.timeout.count(), 600000);
  EXPECT_EQ(c.on_error, loom::OnError::Abort);
  EXPECT_EQ(c.abort_grace.count(), 2000);
  EXPECT_EQ(c.nccl, loom::DeviceCommMode::Auto);
  EXPECT_FALSE(c.device.has_value());
  EXPECT_EQ(c.log_level, loom::log::Level::warn);
  EXPECT_EQ(c.size_check_bytes, 256);
  EXPECT_EQ(c.fingerprint_interval, 1024);
  EXPECT_DOUBLE_EQ(c.stall_warning, 0.25);
  EXPECT_TRUE(c.timeline.empty());
}

TEST(Config, ParsesEveryVariable) {
  const loom::Config c = loom::parse_config({{"LOOM_TIMEOUT", "2.5"},
                                             {"LOOM_ON_ERROR", "raise"},
                                             {"LOOM_ABORT_GRACE", "0.5"},
                                             {"LOOM_CHECK_COLLECTIVES", "1"},
                                             {"LOOM_NCCL", "off"},
                                             {"LOOM_DEVICE", "3"},
                                             {"LOOM_LOG_LEVEL", "debug"},
                                             {"LOOM_SIZE_CHECK_BYTES", "0"},
                                             {"LOOM_FINGERPRINT_INTERVAL", "7"},
                                             {"LOOM_STALL_WARNING", "0"},
                                             {"LOOM_FLIGHT_RECORD", "64"},
                                             {"LOOM_TIMELINE", "/tmp/t"}});
  EXPECT_EQ(c.timeout.count(), 2500);
  EXPECT_EQ(c.on_error, loom::OnError::Raise);
  EXPECT_EQ(c.abort_grace.count(), 500);
  EXPECT_TRUE(c.check_collectives);
  EXPECT_EQ(c.nccl, loom::DeviceCommMode::Off);
  EXPECT_EQ(c.device, 3);
  EXPECT_EQ(c.log_level, loom::log::Level::debug);
  EXPECT_EQ(c.size_check_bytes, 0);
  EXPECT_EQ(c.fingerprint_interval, 7);
  EXPECT_DOUBLE_EQ(c.stall_warning, 0.0);
  EXPECT_EQ(c.flight_record, 64);
  EXPECT_EQ(c.timeline, "/tmp/t");
}

TEST(Config, MalformedValuesNameVariableValueAndRange) {
  loom::detail::set_job_rank(3);
  EXPECT_EQ(config_error_of({{"LOOM_TIMEOUT", "ten"}}),
            "[rank 3] environment variable: LOOM_TIMEOUT='ten': expected seconds between 0.001 and 86400");
  EXPECT_EQ(config_error_of({{"LOOM_TIMEOUT", "0"}}),
            "[rank 3] environment variable: LOOM_TIMEOUT='0': expected seconds between 0.001 and 86400");
  EXPECT_EQ(config_error_of({{"LOOM_ON_ERROR", "ignore"}}),
            "[rank 3] environment variable: LOOM_ON_ERROR='ignore': expected one of abort, raise");
  // Once read lazily at the first failure, where a bad value defeated the abort: now at parse time.
  EXPECT_EQ(config_error_of({{"LOOM_ABORT_GRACE", "abc"}}),
            "[rank 3] environment variable: LOOM_ABORT_GRACE='abc': expected seconds between 0 and 600");
  // Once a std::terminate at the first log line: now a ConfigError like the others.
  EXPECT_EQ(config_error_of({{"LOOM_LOG_LEVEL", "loud"}}),
            "[rank 3] environment variable: LOOM_LOG_LEVEL='loud': expected one of trace, debug, info, warn, error, off");
  EXPECT_EQ(config_error_of({{"LOOM_DEVICE", "-1"}}),
            "[rank 3] environment variable: LOOM_DEVICE='-1': expected an integer from 0 to 1023");
  EXPECT_EQ(config_error_of({{"LOOM_STALL_WARNING", "2"}}),
            "[rank 3] environment variable: LOOM_STALL_WARNING='2': expected a number from 0 to 1");
  EXPECT_EQ(config_error_of({{"LOOM_TIMEOUT", "nan"}}),
            "[rank 3] environment variable: LOOM_TIMEOUT='nan': expected seconds between 0.001 and 86400");
  loom::detail::set_job_rank(-1);
  EXPECT_EQ(config_error_of({{"LOOM_NCCL", "maybe"}}),
            "[rank ?] environment variable: LOOM_NCCL='maybe': expected one of auto, on, off");
}

TEST(Config, UndeclaredVariablesCannotBeRead) {
  EXPECT_THROW(loom::env::raw({}, "LOOM_NOT_DECLARED"), std::logic_error);
}

TEST(Config, MisspeltVariablesAreNamedWithTheClosestOne) {
  const loom::Environment env = {{"LOOM_TIMEOUTS", "30"},      {"LOOM_TIMEOUT", "30"},      {"LOOM_NCLL", "off"},
                                 {"LOOM_SOMETHING_ELSE", "1"}, {"LOOM_MPIRUN_FLAGS", "-x"}, {"LOOM_TEST_ENV", "1"},
                                 {"LOOM_RESTART_COUNT", "2"},  {"PATH", "/bin"}};
  const auto unknown = loom::env::unknown_variables(env);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"LOOM_NCLL", "LOOM_NCCL"}, {"LOOM_SOMETHING_ELSE", ""}, {"LOOM_TIMEOUTS", "LOOM_TIMEOUT"}};
  EXPECT_EQ(unknown, expected);
  EXPECT_TRUE(loom::env::unknown_variables({{"LOOM_TIMEOUT", "30"}, {"LOOM_DEVICE", "0"}}).empty());
}

TEST(Config, LoggingBeforeInitNeverThrowsOnABadLevel) {
  setenv("LOOM_LOG_LEVEL", "loud", 1);
  EXPECT_NO_THROW(LOOM_LOG(warn, "logged with a malformed LOOM_LOG_LEVEL"));
  unsetenv("LOOM_LOG_LEVEL");
}

// docs/environment.md's table must say what the code says: name, default, description, word for word.
TEST(Config, TheDocumentationTableIsTheCodesTable) {
  std::ifstream file(std::string(LOOM_SOURCE_DIR) + "/docs/environment.md");
  ASSERT_TRUE(file.good()) << "docs/environment.md is missing";
  std::map<std::string, std::pair<std::string, std::string>> documented;
  const std::regex row(R"(^\| `(LOOM_[A-Z_]+)` \| (?:`([^`]*)`|unset) \| (.*) \|$)");
  std::string line;
  while (std::getline(file, line)) {
    std::smatch m;
    if (std::regex_match(line, m, row)) documented[m[1]] = {m[2], m[3]};
  }
  for (const auto& v : loom::env::all_variables()) {
    auto it = documented.find(v.name);
    ASSERT_NE(it, documented.end()) << v.name << " is read by the library but has no row in docs/environment.md";
    EXPECT_EQ(it->second.first, v.default_value) << v.name << ": the documented default differs from the code's";
    EXPECT_EQ(it->second.second, v.description) << v.name << ": the documented description differs from the code's";
    documented.erase(it);
  }
  for (const auto& [name, row_text] : documented)
    ADD_FAILURE() << name << " is documented but not declared in src/core/env.cpp";
}

// Random values for every variable (fixed seed): parsing either succeeds or raises ConfigError
// naming the variable; nothing else escapes, nothing crashes.
TEST(Config, FuzzedValuesAreAcceptedOrRejectedWithAConfigError) {
  std::mt19937 random(1234);
  const std::vector<std::string> seeds = {"1",   "0",  "-1",  "600", "2.5", "1e9", "abort", "raise", "auto",
                                          "off", "on", "nan", "inf", "",    " 1",  "0x10",  "debug", "99999999999999999999"};
  const auto& variables = loom::env::all_variables();
  for (int trial = 0; trial < 3000; ++trial) {
    std::string value = seeds[random() % seeds.size()];
    const int edits = random() % 4;
    for (int e = 0; e < edits; ++e) {
      const size_t at = value.empty() ? 0 : random() % (value.size() + 1);
      switch (random() % 3) {
        case 0: value.insert(at, 1, static_cast<char>(1 + random() % 255)); break;
        case 1: if (!value.empty()) value.erase(at % value.size(), 1); break;
        default: if (!value.empty()) value[at % value.size()] = static_cast<char>(1 + random() % 255);
      }
    }
    const char* name = variables[random() % variables.size()].name;
    try {
      loom::parse_config({{name, value}});
    } catch (const loom::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

// The launcher's variables, mutated: a World or a ConfigError, never anything else.
TEST(Config, FuzzedLauncherEnvironmentsGiveAWorldOrAConfigError) {
  std::mt19937 random(99);
  const std::vector<std::pair<std::string, std::string>> base = {
      {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_STEP_ID", "0"},
      {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_TASKS_PER_NODE", "4(x2)"},
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "0"},
      {"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"PMIX_RANK", "0"}};
  for (int trial = 0; trial < 3000; ++trial) {
    loom::Environment env;
    for (const auto& [k, v] : base)
      if (random() % 3 == 0) env[k] = v;
    for (auto& [k, v] : env) {
      if (random() % 3) continue;
      switch (random() % 4) {
        case 0: v = std::to_string(static_cast<long long>(random()) - (1LL << 31)); break;  // 64-bit: no overflow
        case 1: v += static_cast<char>(32 + random() % 95); break;
        case 2: v = v.empty() ? "" : v.substr(0, random() % v.size()); break;
        default: v = "(x" + std::to_string(random() % 5) + ")," + v;
      }
    }
    try {
      const loom::World w = loom::world_from_environment(env, "host");
      EXPECT_GE(w.rank, 0);
      if (w.size_known) EXPECT_LT(w.rank, w.size);
      if (w.local_known) EXPECT_LT(w.local_rank, w.local_size);
    } catch (const loom::ConfigError&) {
    }
  }
}
