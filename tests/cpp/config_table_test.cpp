// The configuration table's readers: values checked against the declared
// kind and range, errors that name the setting and the value, defaults when
// unset, and undeclared names refused.
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

#include "base/config_table.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::ScopedEnv;

TEST(ConfigTableTest, EveryNameIsDeclaredOncePerScopeWithASaneEntry) {
  std::set<std::string> seen;
  for (const config::Entry& e : config::Table()) {
    EXPECT_TRUE(seen.insert(std::string(e.scope) + "." + e.name).second) << e.scope << " " << e.name;
    EXPECT_GT(std::string(e.doc).size(), 5u) << e.name;
    if (e.kind == config::Kind::Int) EXPECT_LE(e.min, e.max) << e.name;
    if (e.kind == config::Kind::Choice) EXPECT_NE(std::string(e.choices), "") << e.name;
    const std::string overrides = e.overrides;
    if (!overrides.empty()) {
      // An override names a declared key of the config it replaces.
      const auto dot = overrides.find('.');
      ASSERT_NE(dot, std::string::npos) << overrides;
      EXPECT_NO_THROW(config::Lookup(overrides.substr(0, dot).c_str(), overrides.substr(dot + 1))) << overrides;
    }
  }
}

TEST(ConfigTableTest, EnvIntReadsTheValueOrTheDefaultAndRejectsBadOnesByName) {
  {
    ScopedEnv unset("MORI_TORCH_DOORBELL_SPIN_US", nullptr);
    EXPECT_FALSE(config::EnvIsSet("MORI_TORCH_DOORBELL_SPIN_US"));
    EXPECT_EQ(config::EnvInt("MORI_TORCH_DOORBELL_SPIN_US"), 2000);
  }
  {
    ScopedEnv empty("MORI_TORCH_DOORBELL_SPIN_US", "");  // empty counts as unset
    EXPECT_FALSE(config::EnvIsSet("MORI_TORCH_DOORBELL_SPIN_US"));
  }
  {
    ScopedEnv set("MORI_TORCH_DOORBELL_SPIN_US", "17");
    EXPECT_TRUE(config::EnvIsSet("MORI_TORCH_DOORBELL_SPIN_US"));
    EXPECT_EQ(config::EnvInt("MORI_TORCH_DOORBELL_SPIN_US"), 17);
  }
  for (const char* bad : {"-1", "10000001", "12us", "x", "99999999999999999999999"}) {
    ScopedEnv set("MORI_TORCH_DOORBELL_SPIN_US", bad);
    auto e = CatchError([] { config::EnvInt("MORI_TORCH_DOORBELL_SPIN_US"); });
    ASSERT_TRUE(e) << bad;
    EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_EQ(std::string(e->what()),
              std::string("MORI_TORCH_DOORBELL_SPIN_US='") + bad + "' is not an integer in [0, 10000000]");
  }
}

TEST(ConfigTableTest, ChoicesAndBooleansTakeTheirNamesInAnyCaseOrTheIndex) {
  {
    ScopedEnv set("MORI_IO_POLL_CQ_MODE", "Event");
    EXPECT_EQ(config::EnvInt("MORI_IO_POLL_CQ_MODE"), 1);
  }
  {
    ScopedEnv set("MORI_IO_POLL_CQ_MODE", "0");
    EXPECT_EQ(config::EnvInt("MORI_IO_POLL_CQ_MODE"), 0);
  }
  {
    ScopedEnv set("MORI_IO_POLL_CQ_MODE", "spin");
    auto e = CatchError([] { config::EnvInt("MORI_IO_POLL_CQ_MODE"); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()), "MORI_IO_POLL_CQ_MODE='spin' is not one of POLLING, EVENT");
  }
  for (const char* on : {"1", "TRUE", "yes", "On"}) {
    ScopedEnv set("MORI_IO_ENABLE_CHUNKING", on);
    EXPECT_TRUE(config::EnvBool("MORI_IO_ENABLE_CHUNKING")) << on;
  }
  {
    ScopedEnv set("MORI_IO_ENABLE_CHUNKING", "maybe");
    auto e = CatchError([] { config::EnvBool("MORI_IO_ENABLE_CHUNKING"); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()),
              "MORI_IO_ENABLE_CHUNKING='maybe' is not a boolean (1/0, true/false, yes/no, on/off)");
  }
  ScopedEnv unset("MORI_TORCH_IBVERBS_LIB", nullptr);
  EXPECT_EQ(config::EnvText("MORI_TORCH_IBVERBS_LIB"), "libibverbs.so.1");
}

TEST(ConfigTableTest, UndeclaredNamesAndWrongKindsAreProgrammingErrors) {
  EXPECT_THROW(config::EnvInt("MORI_TORCH_NO_SUCH_SETTING"), std::logic_error);
  EXPECT_THROW(config::EnvBool("MORI_TORCH_DOORBELL_SPIN_US"), std::logic_error);  // an Int
  EXPECT_THROW(config::Value({}, "TcpBackendConfig", "no_such_key"), std::logic_error);
}

TEST(ConfigTableTest, ConfigKeysTakeTheDefaultAndAreRangeChecked) {
  EXPECT_EQ(config::Value({}, "TcpBackendConfig", "num_data_conns"), 8);
  EXPECT_EQ(config::Value({{"num_data_conns", 3}}, "TcpBackendConfig", "num_data_conns"), 3);
  auto e = CatchError([] { config::Value({{"num_data_conns", 65}}, "TcpBackendConfig", "num_data_conns"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()), "TcpBackendConfig config: num_data_conns=65 out of range [1, 64]");
  e = CatchError([] { config::Value({{"poll_cq_mode", 2}}, "RdmaBackendConfig", "poll_cq_mode"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()), "RdmaBackendConfig config: poll_cq_mode=2 out of range [0, 1]");
  e = CatchError([] { config::CheckKnownKeys({{"num_streams", 1}, {"nope", 1}}, "XgmiBackendConfig"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()), "XgmiBackendConfig config: unknown field 'nope'");
}

}  // namespace
}  // namespace mori_torch
