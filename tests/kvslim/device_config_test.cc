// Where a cache lives: KVCacheConfig.device, and the memory-space checks every cache makes (these
// run everywhere; tests/cuda holds the GPU tests).
#include <gtest/gtest.h>

#include <vector>

#include "kvslim/cuda.h"
#include "kvslim/errors.h"
#include "kvslim/kvslim.h"
#include "kvslim/methods.h"

namespace kvslim {
namespace {

TEST(DeviceConfig, DeviceFieldParsesAndValidates) {
  KVCacheConfig c;
  EXPECT_EQ(c.device_index(), -1);
  c.set("device", "cuda");
  EXPECT_EQ(c.device_index(), 0);
  c.set("device", "cuda:3");
  EXPECT_EQ(c.device_index(), 3);
  c.validate();
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x", "CUDA"}) {
    c.device = bad;
    EXPECT_THROW(c.validate(), ConfigError) << bad;
  }
}

// The registry's `cuda` column decides which methods a device takes; validate() says so on any
// machine, naming the ones it does take.
TEST(DeviceConfig, AMethodWithoutADeviceStorageIsAConfigErrorNamingTheOnesThatHave) {
  for (const MethodInfo& m : method_registry()) {
    KVCacheConfig c;
    c.method = std::string(m.name);
    c.device = "cuda";
    if (m.cuda) {
      EXPECT_NO_THROW(c.validate()) << m.name;
      continue;
    }
    try {
      c.validate();
      ADD_FAILURE() << m.name << " accepted on cuda";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("no CUDA storage"), std::string::npos) << what;
      EXPECT_NE(what.find("full, streaming, h2o, squeeze, pyramidkv, zipcache, kivi"), std::string::npos) << what;
    }
  }
}

// The CUDA zipcache storage's rules, named by validate() on any machine: 2-, 4- or 8-bit codes,
// groups of whole 32-row units, a window, saliency by key norm.
TEST(DeviceConfig, ACudaZipcacheNamesTheFieldItCannotHold) {
  const auto refused = [](void (*set)(KVCacheConfig&), const char* field) {
    KVCacheConfig c;
    c.method = "zipcache";
    c.device = "cuda";
    set(c);
    try {
      c.validate();
      ADD_FAILURE() << field << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused([](KVCacheConfig& c) { c.zipcache_lo_bits = 3; }, "zipcache_lo_bits");
  refused([](KVCacheConfig& c) { c.zipcache_hi_bits = 6; }, "zipcache_hi_bits");
  refused([](KVCacheConfig& c) { c.zipcache_value_bits = 1; }, "zipcache_value_bits");
  refused([](KVCacheConfig& c) { c.zipcache_group_size = 48, c.zipcache_staging = 96; }, "zipcache_group_size");
  refused([](KVCacheConfig& c) { c.zipcache_staging = 0; }, "zipcache_staging");
  refused([](KVCacheConfig& c) { c.zipcache_saliency = "attention_normalized"; }, "zipcache_saliency");
  KVCacheConfig ok;
  ok.method = "zipcache";
  ok.device = "cuda";
  ok.zipcache_hi_bits = 8;
  ok.zipcache_lo_bits = 4;
  ok.zipcache_value_bits = 2;
  ok.zipcache_group_size = 64;
  EXPECT_NO_THROW(ok.validate());
}

TEST(DeviceConfig, ACudaCacheWithoutAGpuIsAClearConfigError) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  KVCacheConfig c;
  c.device = "cuda";
  try {
    KVCacheFactory::create(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda"), std::string::npos) << what;
  }
}

TEST(DeviceConfig, CpuCachesRefuseDeviceBlocksAndQueries) {
  for (const char* method : {"full", "kivi", "zipcache", "h2o"}) {
    KVCacheConfig c;
    c.method = method;
    auto cache = KVCacheFactory::create(c);
    std::vector<float> k(2 * 4 * 64, 0.5f);
    KVBlock dev{k.data(), DType::f32, 1, 2, 4, 64, MemorySpace::cuda, nullptr};
    EXPECT_THROW(cache->append(dev, dev), InputError) << method;
    const KVBlock host = make_block(k.data(), 1, 2, 4, 64);
    cache->append(host, host);
    std::vector<float> q(4 * 64), out(4 * 64);
    const std::vector<std::int64_t> qp{3};
    EXPECT_THROW(cache->attend(QueryBlock{q.data(), 1, 1, 4, 64, 0.f, MemorySpace::cuda, nullptr}, qp, out.data()),
                 InputError)
        << method;
  }
}

// An observation marked as device memory never reaches a CPU cache's reads (it would be read as
// host memory): every cache that reads probs says where they are.
TEST(DeviceConfig, CpuCachesRefuseDeviceObservations) {
  for (const char* method : {"h2o", "pyramidkv", "squeeze"}) {
    KVCacheConfig c;
    c.method = method;
    auto cache = KVCacheFactory::create(c);
    std::vector<float> k(2 * 40 * 64, 0.5f);
    const KVBlock host = make_block(k.data(), 1, 2, 40, 64);
    cache->append(host, host);
    const std::size_t rows = cache->rows();
    std::vector<float> probs(2 * rows, 1.f / static_cast<float>(rows));
    const std::vector<std::int64_t> qp{39};
    try {
      cache->observe_attention(AttentionObservation{probs.data(), 1, 2, 1, rows, rows, qp, MemorySpace::cuda, nullptr});
      ADD_FAILURE() << method << " read a device observation";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("cuda memory"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kvslim
