// The method registry (kvslim/methods.h): one table that names every method; what reads it
// (validation, the factory, method specs, the fuzz corpus) agrees with it.
#include "kvslim/methods.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "kvslim/errors.h"
#include "kvslim/factory.h"

namespace kvslim {
namespace {

TEST(MethodRegistry, NamesAreTheRegistryInOrder) {
  const auto& names = method_names();
  ASSERT_EQ(names.size(), method_registry().size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(names[i], method_registry()[i].name);
    EXPECT_EQ(find_method(names[i]), &method_registry()[i]);
  }
  EXPECT_EQ(find_method("kivo"), nullptr);
  EXPECT_THROW(method_info("kivo"), ConfigError);
}

TEST(MethodRegistry, EveryMethodBuildsAtItsDefaults) {
  for (const MethodInfo& m : method_registry()) {
    KVCacheConfig c;
    c.method = std::string(m.name);
    EXPECT_NO_THROW(KVCacheFactory::create(c)) << m.name;
    EXPECT_EQ(m.budgeted(), m.kind == MethodKind::eviction) << m.name;
    if (m.budgeted()) {
      EXPECT_EQ(config_field_name(m.budget), std::string(m.name) + "_budget");
      EXPECT_EQ(config_field_name(m.n_sink), std::string(m.name) + "_n_sink");
    }
    for (const std::string& f : m.fields()) EXPECT_EQ(f.rfind(std::string(m.field_prefix), 0), 0u) << f;
  }
}

TEST(MethodRegistry, StoragesAreFp16AndTheQuantizers) {
  std::vector<std::string> expected{"fp16"};
  for (const MethodInfo& m : method_registry()) {
    if (m.kind == MethodKind::quantizer) expected.emplace_back(m.name);
  }
  EXPECT_EQ(storage_names(), expected);
}

TEST(MethodRegistry, SpecsSetTheMethodAndItsFields) {
  const KVCacheConfig c = config_from_spec("kivi@kivi_bits=4,kivi_group_size=64");
  EXPECT_EQ(c.method, "kivi");
  EXPECT_EQ(c.kivi_bits, 4);
  EXPECT_EQ(c.kivi_group_size, 64);
  KVCacheConfig base;
  base.h2o_budget = 77;
  EXPECT_EQ(config_from_spec("h2o", base).h2o_budget, 77);
  EXPECT_THROW(config_from_spec("kivo"), ConfigError);
  EXPECT_THROW(config_from_spec("kivi@bits"), ConfigError);
  EXPECT_THROW(config_from_spec("kivi@kivi_bits=9"), ConfigError);
}

// The fuzz corpus holds a seed per registered method (fuzz/corpus/config/NAME.txt, method=NAME).
TEST(MethodRegistry, FuzzCorpusSeedsEveryMethod) {
  const char* root = std::getenv("KVSLIM_SOURCE_DIR");
  if (root == nullptr) GTEST_SKIP() << "KVSLIM_SOURCE_DIR unset";
  for (const MethodInfo& m : method_registry()) {
    std::ifstream in(std::string(root) + "/fuzz/corpus/config/" + std::string(m.name) + ".txt");
    ASSERT_TRUE(in) << "no fuzz seed for method " << m.name;
    std::string first;
    std::getline(in, first);
    EXPECT_EQ(first, "method=" + std::string(m.name));
  }
}

}  // namespace
}  // namespace kvslim
