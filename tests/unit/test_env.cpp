// The environment-variable table: typed parsing with range checks, and the documentation
// (docs/environment.md) lists every variable the library reads.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/env.h"
#include "loom/error.h"
#include "loom/log.h"

namespace env = loom::env;

TEST(Env, DefaultsApplyWhenUnset) {
  unsetenv("LOOM_TIMEOUT");
  EXPECT_EQ(env::seconds_as_duration("LOOM_TIMEOUT", 0.001, 86400).count(), 600000);
  unsetenv("LOOM_ON_ERROR");
  EXPECT_EQ(env::choice("LOOM_ON_ERROR", {"abort", "raise"}), "abort");
}

TEST(Env, ParsesAndRangeChecks) {
  setenv("LOOM_TIMEOUT", "2.5", 1);
  EXPECT_EQ(env::seconds_as_duration("LOOM_TIMEOUT", 0.001, 86400).count(), 2500);
  setenv("LOOM_TIMEOUT", "ten", 1);
  try {
    env::seconds_as_duration("LOOM_TIMEOUT", 0.001, 86400);
    FAIL() << "expected ConfigError";
  } catch (const loom::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_TIMEOUT='ten': expected seconds between"), std::string::npos)
        << e.what();
  }
  setenv("LOOM_TIMEOUT", "-1", 1);
  EXPECT_THROW(env::seconds_as_duration("LOOM_TIMEOUT", 0.001, 86400), loom::ConfigError);
  unsetenv("LOOM_TIMEOUT");

  setenv("LOOM_ON_ERROR", "ignore", 1);
  try {
    env::choice("LOOM_ON_ERROR", {"abort", "raise"});
    FAIL() << "expected ConfigError";
  } catch (const loom::ConfigError& e) {
    EXPECT_STREQ(e.what(), "environment variable LOOM_ON_ERROR='ignore': expected one of abort, raise");
  }
  unsetenv("LOOM_ON_ERROR");
}

TEST(Env, UndeclaredVariablesCannotBeRead) {
  EXPECT_THROW(env::raw("LOOM_NOT_DECLARED"), std::logic_error);
}

TEST(Env, LogLevelParsing) {
  EXPECT_EQ(loom::log::parse_level("debug", "LOOM_LOG_LEVEL"), loom::log::Level::debug);
  EXPECT_THROW(loom::log::parse_level("loud", "LOOM_LOG_LEVEL"), loom::ConfigError);
}

TEST(Env, EveryVariableIsDocumented) {
  std::ifstream file(std::string(LOOM_SOURCE_DIR) + "/docs/environment.md");
  ASSERT_TRUE(file.good()) << "docs/environment.md is missing";
  std::stringstream text;
  text << file.rdbuf();
  for (const auto& v : env::all_variables())
    EXPECT_NE(text.str().find(std::string("`") + v.name + "`"), std::string::npos)
        << v.name << " is read by the library but not documented in docs/environment.md";
}
