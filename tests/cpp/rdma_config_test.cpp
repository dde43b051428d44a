// RdmaBackendConfig validation (MORI-IO's messages, word for word) and the
// clear error of create_backend(RDMA) where no RDMA device can be used. Runs
// on any machine: the config is checked before any device is opened.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <dirent.h>

#include "backends/rdma/rdma_config.h"
#include "backends/rdma/rdma_device.h"
#include "core/engine.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::Contains;

class RdmaConfigTest : public ::testing::Test {
 protected:
  Engine engine_{"rdma-config-test", EngineConfig{}};
};

TEST_F(RdmaConfigTest, InvalidValuesRaiseTheReferenceMessages) {
  struct Case {
    BackendConfig cfg;
    const char* msg;
  };
  const Case cases[] = {
      {{{"notif_per_qp", 0}}, "Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled"},
      {{{"max_chunks_per_transfer", 0}}, "Invalid RDMA config: maxChunksPerTransfer must be >= 1"},
      {{{"max_chunks_per_transfer", -3}}, "Invalid RDMA config: maxChunksPerTransfer must be >= 1"},
      {{{"num_nics_per_transfer", 0}}, "Invalid RDMA config: numNicsPerTransfer must be >= 1"},
      {{{"enable_transfer_chunking", 1}, {"chunk_bytes", 4095}},
       "Invalid RDMA config: chunkBytes must be >= 4096 when chunking is enabled"},
  };
  for (const auto& c : cases) {
    auto e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, c.cfg); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()), c.msg);
    EXPECT_EQ(e->code(), StatusCode::ERR_BAD_STATE);  // RuntimeError in Python, as MORI-IO raises
  }
  EXPECT_FALSE(engine_.HasBackend(BackendType::RDMA));
}

TEST_F(RdmaConfigTest, ValuesAllowedByTheReferenceAreNotRejectedAsInvalid) {
  // notif_per_qp 0 without notifications, small chunk_bytes without chunking:
  // both valid; creation may then only fail for want of a device.
  const BackendConfig ok[] = {{{"enable_notification", 0}, {"notif_per_qp", 0}},
                              {{"enable_transfer_chunking", 0}, {"chunk_bytes", 16}},
                              {{"enable_transfer_chunking", 1}, {"chunk_bytes", 4096}}};
  setenv("MORI_TORCH_RDMA_DEVICES", "no_such_rdma_device", 1);
  for (const auto& cfg : ok) {
    auto e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, cfg); });
    ASSERT_TRUE(e);
    EXPECT_TRUE(Contains(e->what(), "no active RDMA device/port found")) << e->what();
  }
  unsetenv("MORI_TORCH_RDMA_DEVICES");
}

TEST_F(RdmaConfigTest, OutOfRangeAndUnknownFieldsAreNamed) {
  auto e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, {{"qp_per_transfer", 0}}); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(e->what(), "qp_per_transfer=0")) << e->what();
  e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, {{"poll_cq_mode", 2}}); });
  ASSERT_TRUE(e);
  EXPECT_TRUE(Contains(e->what(), "poll_cq_mode=2")) << e->what();
  e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, {{"qps", 1}}); });
  ASSERT_TRUE(e);
  EXPECT_TRUE(Contains(e->what(), "unknown field 'qps'")) << e->what();
}

bool HostHasRdmaDevices() {
  DIR* d = opendir("/sys/class/infiniband");
  if (!d) return false;
  bool any = false;
  while (dirent* e = readdir(d)) any = any || e->d_name[0] != '.';
  closedir(d);
  return any;
}

TEST(RdmaConfigEnvTest, MoriIoEnvironmentOverridesReplaceFieldsBeforeValidation) {
  using rdma::RdmaConfig;
  {
    testing_util::ScopedEnv qp("MORI_IO_QP_PER_TRANSFER", "4"), mode("MORI_IO_POLL_CQ_MODE", "event"),
        notif("MORI_IO_ENABLE_NOTIFICATION", "off"), batch("MORI_IO_POST_BATCH_SIZE", "-1"),
        chunk("MORI_IO_ENABLE_CHUNKING", "true"), bytes("MORI_IO_CHUNK_BYTES", "8192");
    RdmaConfig c = RdmaConfig::FromMap({{"qp_per_transfer", 1}, {"post_batch_size", 16}});
    EXPECT_EQ(c.qp_per_transfer, 4);  // the environment wins over the config, as in MORI-IO
    EXPECT_EQ(c.poll_cq_mode, rdma::PollCqMode::EVENT);
    EXPECT_FALSE(c.enable_notification);
    EXPECT_EQ(c.post_batch_size, -1);
    EXPECT_TRUE(c.enable_transfer_chunking);
    EXPECT_EQ(c.chunk_bytes, 8192);
  }
  EXPECT_EQ(RdmaConfig::FromMap({}).qp_per_transfer, 1);  // unset again: the default
  {
    // Overridden values are validated like configured ones.
    testing_util::ScopedEnv chunk("MORI_IO_ENABLE_CHUNKING", "1"), bytes("MORI_IO_CHUNK_BYTES", "100");
    auto e = CatchError([&] { RdmaConfig::FromMap({}); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()), "Invalid RDMA config: chunkBytes must be >= 4096 when chunking is enabled");
  }
  const std::pair<const char*, const char*> bad[] = {{"MORI_IO_QP_PER_TRANSFER", "0"},
                                                     {"MORI_IO_QP_PER_TRANSFER", "four"},
                                                     {"MORI_IO_ENABLE_NOTIFICATION", "maybe"},
                                                     {"MORI_IO_POLL_CQ_MODE", "SPIN"},
                                                     {"MORI_IO_POST_BATCH_SIZE", "12x"}};
  for (const auto& [var, value] : bad) {
    testing_util::ScopedEnv env(var, value);
    auto e = CatchError([&] { RdmaConfig::FromMap({}); });
    ASSERT_TRUE(e) << var << "=" << value;
    EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_TRUE(Contains(e->what(), std::string(var) + "='" + value + "'")) << e->what();
  }
}

TEST_F(RdmaConfigTest, NoUsableDeviceIsAClearErrorAndTheEngineKeepsWorking) {
  setenv("MORI_TORCH_RDMA_DEVICES", "no_such_rdma_device", 1);
  auto e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, {}); });
  unsetenv("MORI_TORCH_RDMA_DEVICES");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(e->what(), "no active RDMA device/port found")) << e->what();
  EXPECT_FALSE(engine_.HasBackend(BackendType::RDMA));
  // Without the filter: a machine without RDMA (CI: its kernel has none)
  // gets the same clear error; one with a device gets the backend.
  if (HostHasRdmaDevices()) {
    engine_.CreateBackend(BackendType::RDMA, {});
    EXPECT_TRUE(engine_.HasBackend(BackendType::RDMA));
  } else {
    e = CatchError([&] { engine_.CreateBackend(BackendType::RDMA, {}); });
    ASSERT_TRUE(e);
    EXPECT_TRUE(Contains(e->what(), "no active RDMA device/port found")) << e->what();
    EXPECT_FALSE(engine_.HasBackend(BackendType::RDMA));
  }
  engine_.CreateBackend(BackendType::TCP, {});  // a failed creation leaves nothing behind
  EXPECT_TRUE(engine_.HasBackend(BackendType::TCP));
}

// Device selection as MORI reads MORI_RDMA_DEVICES (SGLang sets it per rank).
TEST(RdmaDeviceFilterTest, ListedDevicesAreUsedInTheListedOrder) {
  const auto f = rdma::ParseDeviceFilter(" mlx5_2, mlx5_0 ,,mlx5_2", "MORI_RDMA_DEVICES");
  EXPECT_FALSE(f.exclude);
  EXPECT_EQ(f.names, (std::vector<std::string>{"mlx5_2", "mlx5_0"}));
  std::string filtered, missing;
  EXPECT_EQ(rdma::SelectDevices(f, {"mlx5_0", "mlx5_1", "mlx5_2"}, &filtered, &missing),
            (std::vector<std::string>{"mlx5_2", "mlx5_0"}));
  EXPECT_EQ(filtered, " mlx5_1 (not in MORI_RDMA_DEVICES)");
  EXPECT_EQ(missing, "");
  filtered.clear();
  EXPECT_EQ(
      rdma::SelectDevices(rdma::ParseDeviceFilter("mlx5_9,mlx5_1", "X"), {"mlx5_1", "mlx5_0"}, &filtered, &missing),
      (std::vector<std::string>{"mlx5_1"}));
  EXPECT_EQ(missing, " mlx5_9 (no such device)");
}

TEST(RdmaDeviceFilterTest, CaretExcludesAndTheRestAreInNameOrder) {
  const auto f = rdma::ParseDeviceFilter("^bnxt_re0,bnxt_re3", "MORI_RDMA_DEVICES");
  EXPECT_TRUE(f.exclude);
  std::string filtered, missing;
  EXPECT_EQ(rdma::SelectDevices(f, {"bnxt_re3", "bnxt_re2", "bnxt_re0", "bnxt_re1"}, &filtered, &missing),
            (std::vector<std::string>{"bnxt_re1", "bnxt_re2"}));
  EXPECT_EQ(filtered, " bnxt_re0 (excluded by MORI_RDMA_DEVICES) bnxt_re3 (excluded by MORI_RDMA_DEVICES)");
  EXPECT_EQ(missing, "");
  // No filter: every device, in name order (the same rails on every engine of a host).
  EXPECT_EQ(rdma::SelectDevices(rdma::ParseDeviceFilter("", ""), {"b", "a"}, &filtered, &missing),
            (std::vector<std::string>{"a", "b"}));
}

TEST(RdmaDeviceFilterTest, OursThenMorisThenTheEarlierName) {
  for (const char* v : {"MORI_TORCH_RDMA_DEVICES", "MORI_RDMA_DEVICES", "MORI_RDMA_DEVICE"}) unsetenv(v);
  EXPECT_TRUE(rdma::DeviceFilterFromEnv().names.empty());
  setenv("MORI_RDMA_DEVICE", "old0", 1);
  EXPECT_EQ(rdma::DeviceFilterFromEnv().source, "MORI_RDMA_DEVICE");
  setenv("MORI_RDMA_DEVICES", "^mori0", 1);
  auto f = rdma::DeviceFilterFromEnv();
  EXPECT_EQ(f.source, "MORI_RDMA_DEVICES");
  EXPECT_TRUE(f.exclude);
  setenv("MORI_TORCH_RDMA_DEVICES", "ours0", 1);
  f = rdma::DeviceFilterFromEnv();
  EXPECT_EQ(f.source, "MORI_TORCH_RDMA_DEVICES");
  EXPECT_EQ(f.names, (std::vector<std::string>{"ours0"}));
  for (const char* v : {"MORI_TORCH_RDMA_DEVICES", "MORI_RDMA_DEVICES", "MORI_RDMA_DEVICE"}) unsetenv(v);
}

}  // namespace
}  // namespace mori_torch
