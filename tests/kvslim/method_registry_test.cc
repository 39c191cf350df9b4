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

// kvslim eval's variants are rows of their method (engine/eval/method_grid.cc only reads them).
TEST(MethodRegistry, EvalVariantsBelongToTheirMethodsRow) {
  std::size_t total = 0;
  for (const MethodInfo& m : method_registry()) {
    if (m.kind == MethodKind::dense) { EXPECT_TRUE(m.variants.empty()) << m.name << ": the eval's reference has no variants"; }
    for (const EvalVariant& v : m.variants) {
      ++total;
      EXPECT_EQ(v.method, m.name) << v.name;
      EXPECT_EQ(find_variant(v.name), &v) << v.name << ": a variant name appears once";
      KVCacheConfig c;
      ASSERT_NO_THROW(c = v.config()) << v.name;
      EXPECT_EQ(c.method, std::string(m.name)) << v.name;
      EXPECT_EQ(v.composed(), c.storage != "fp16") << v.name;
      if (v.composed()) { EXPECT_EQ(m.kind, MethodKind::eviction) << v.name << ": only a policy goes over a storage"; }
      if (find_method(v.name) != nullptr) {  // a variant named like a method is that method at its defaults
        EXPECT_EQ(v.name, m.name);
        EXPECT_EQ(c.fields(), config_from_spec(m.name).fields()) << v.name;
      }
      if (!v.compares_to.empty()) {
        const EvalVariant* base = find_variant(v.compares_to);
        ASSERT_NE(base, nullptr) << v.name << " compares to " << v.compares_to;
        EXPECT_EQ(base->method, v.method) << v.name;
      }
      if (v.recent_window_fraction != 0) { EXPECT_TRUE(m.budgeted()) << v.name; }
    }
  }
  EXPECT_EQ(eval_variants().size(), total);
  // Every variant over fp16 rows before the first composed one.
  bool composed = false;
  for (const EvalVariant* v : eval_variants()) {
    if (composed) { EXPECT_TRUE(v->composed()) << v->name; }
    composed = composed || v->composed();
  }
  EXPECT_EQ(find_variant("kivo"), nullptr);
}

TEST(MethodRegistry, SpecsNameEvalVariants) {
  const EvalVariant* kivi4 = find_variant("kivi4");
  ASSERT_NE(kivi4, nullptr);
  EXPECT_EQ(config_from_spec("kivi4").fields(), kivi4->config().fields());
  EXPECT_EQ(config_from_spec("kivi4").kivi_bits, 4);
  const KVCacheConfig g = config_from_spec("kivi4@kivi_group_size=64");
  EXPECT_EQ(g.kivi_bits, 4);
  EXPECT_EQ(g.kivi_group_size, 64);
  KVCacheConfig base;
  base.h2o_budget = 77;
  const KVCacheConfig composed = config_from_spec("h2o+kivi3_g64", base);
  EXPECT_EQ(composed.method, "h2o");
  EXPECT_EQ(composed.storage, "kivi");
  EXPECT_EQ(composed.kivi_bits, 3);
  EXPECT_EQ(composed.h2o_budget, 77);
  // Eval-only data (a budget-proportional window, reconstruction scores) has no config: refused.
  for (const EvalVariant* v : eval_variants()) {
    if (v->eval_only()) { EXPECT_THROW(config_from_spec(v->name), ConfigError) << v->name; }
  }
  EXPECT_THROW(config_from_spec("h2o_recent"), ConfigError);
  EXPECT_THROW(config_from_spec("kivi4@"), ConfigError);
  EXPECT_THROW(config_from_spec("kivi4@kivi_bits=9"), ConfigError);
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
