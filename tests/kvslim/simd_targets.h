// Runs a check once per Highway target this CPU supports (the kernels are dispatched at run time,
// so each instruction set the build compiled and the machine has is tested, not only the best).
#pragma once
#include <gtest/gtest.h>

#include <hwy/targets.h>

#include <cstdint>

namespace kvslim::testing {

template <class F>
void for_each_target(F check) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    check();
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the best target
}

}  // namespace kvslim::testing
