// Positions never wrap past INT64_MAX in a cache (issue 13, item 10): the position after the last
// one seen was computed as last + 1, which wrapped to INT64_MIN and let positions go backwards.
#include <gtest/gtest.h>

#include <limits>

#include "kvslim/errors.h"
#include "kvslim/factory.h"
#include "test_util.h"

namespace kvslim {
namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

TEST(PositionLimit, NoPositionMayReachInt64Max) {
  for (const char* method : {"full", "h2o", "zipcache"}) {
    SCOPED_TRACE(method);
    const auto cache = KVCacheFactory::create(testing::config_for(method));
    const testing::KV one(1, 2, 1, 8, 1), two(1, 2, 2, 8, 2);
    const std::vector<std::int64_t> at_max = {kMax}, ends_at_max = {kMax - 1, kMax};
    EXPECT_THROW(cache->update_and_fetch(one.keys(), one.values(), at_max), InputError);
    EXPECT_THROW(cache->update_and_fetch(two.keys(), two.values(), ends_at_max), InputError);
    EXPECT_EQ(cache->stats().tokens_seen, 0u);  // rejected calls change nothing
    const std::vector<std::int64_t> below = {kMax - 1};
    const CacheView v = cache->update_and_fetch(one.keys(), one.values(), below);
    EXPECT_EQ(v.position(0, 0, 0), kMax - 1);
    // Continuing without positions would take INT64_MAX and then wrap.
    EXPECT_THROW(cache->update_and_fetch(one.keys(), one.values()), InputError);
    EXPECT_EQ(cache->stats().tokens_seen, 1u);
  }
}

}  // namespace
}  // namespace kvslim
