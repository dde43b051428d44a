// Which engines are in this process: by incarnation, not by pid and node id
// (those repeat across containers of one host).
#include <gtest/gtest.h>

#include <unistd.h>

#include <memory>

#include "core/engine.h"
#include "core/local_engines.h"

namespace mori_torch {
namespace {

EngineDesc DescOf(int32_t pid, Incarnation incarnation) {
  EngineDesc d;
  d.key = "x";
  d.pid = pid;
  d.incarnation = incarnation;
  return d;
}

TEST(LocalEngines, AMarkLastsAsLongAsItsOwner) {
  const auto self = static_cast<int32_t>(getpid());
  const Incarnation inc = 0x5eed5eed12345678ULL;
  EXPECT_FALSE(InThisProcess(DescOf(self, inc)));
  {
    LocalEngineMark mark(inc);
    EXPECT_TRUE(InThisProcess(DescOf(self, inc)));
    // Same pid, another incarnation: another process's engine (e.g. in a
    // container whose pid namespace repeats our pid).
    EXPECT_FALSE(InThisProcess(DescOf(self, inc + 1)));
    // Our incarnation but another pid: not ours either.
    EXPECT_FALSE(InThisProcess(DescOf(self + 1, inc)));
    {
      LocalEngineMark twin(inc);  // a (vanishingly unlikely) repeat is counted, not lost
    }
    EXPECT_TRUE(InThisProcess(DescOf(self, inc)));
  }
  EXPECT_FALSE(InThisProcess(DescOf(self, inc)));
}

TEST(LocalEngines, EnginesMarkThemselves) {
  EngineDesc desc;
  {
    Engine e("local-engines-test", EngineConfig{"127.0.0.1", 0});
    desc = e.Desc();
    EXPECT_TRUE(InThisProcess(desc));
    EngineDesc same_pid_other_engine = desc;
    same_pid_other_engine.incarnation ^= 1;
    EXPECT_FALSE(InThisProcess(same_pid_other_engine));
  }
  EXPECT_FALSE(InThisProcess(desc));  // gone with its engine
}

}  // namespace
}  // namespace mori_torch
