// The CUDA path's A/B switches (cuda/env_switch.h), on any machine: unset or empty is the default,
// "1" and "0" switch, anything else is refused with the variable's name.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda/env_switch.h"
#include "kvslim/errors.h"

namespace kvslim {
namespace {

constexpr const char* kName = "KVSLIM_TEST_ENV_SWITCH";

TEST(EnvSwitch, UnsetOrEmptyIsTheDefaultAndZeroOrOneSwitch) {
  unsetenv(kName);
  EXPECT_TRUE(cuda::env_switch(kName, true));
  EXPECT_FALSE(cuda::env_switch(kName, false));
  setenv(kName, "", 1);
  EXPECT_TRUE(cuda::env_switch(kName, true));
  EXPECT_FALSE(cuda::env_switch(kName, false));
  setenv(kName, "0", 1);
  EXPECT_FALSE(cuda::env_switch(kName, true));
  setenv(kName, "1", 1);
  EXPECT_TRUE(cuda::env_switch(kName, false));
  unsetenv(kName);
}

TEST(EnvSwitch, AnythingElseIsNamedNotGuessed) {
  for (const char* bad : {"yes", "2", " 1", "on", "true"}) {
    setenv(kName, bad, 1);
    try {
      cuda::env_switch(kName, true);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const InputError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(kName), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
    }
  }
  unsetenv(kName);
}

}  // namespace
}  // namespace kvslim
