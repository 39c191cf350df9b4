// Tests for the safetensors loader: a round trip (single file and shards written here), and every
// error path naming the file and tensor.
#include "engine/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

#include "engine/loader_test_util.h"

namespace kvslim::engine {
namespace {

using testing::make_safetensors;
using testing::make_safetensors_from_header;
using testing::RawTensor;
using testing::TempDir;
using testing::expect_error;
using testing::write_file;

SafetensorsHeader parse(const std::string& bytes, const std::string& name = "test.safetensors") {
  return parse_safetensors_header(std::as_bytes(std::span(bytes.data(), bytes.size())), name);
}

std::vector<RawTensor> sample_tensors() {
  return {
      {"layers.0.weight", "F32", {2, 3}, testing::bytes_of(std::vector<float>{1, 2, 3, 4, 5, 6})},
      {"norm.weight", "BF16", {4}, testing::bytes_of(std::vector<std::uint16_t>{0x3F80, 0x4000, 0xBF80, 0x0000})},
      {"embed.weight", "F16", {2, 2}, testing::bytes_of(std::vector<std::uint16_t>{0x3C00, 0x4000, 0x4200, 0xC400})},
  };
}

TEST(Safetensors, SingleFileRoundTrip) {
  TempDir dir;
  write_file(dir / "model.safetensors", make_safetensors(sample_tensors(), {{"format", "pt"}}));
  const WeightStore store = WeightStore::open(dir.path());
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(store.names(), (std::vector<std::string>{"embed.weight", "layers.0.weight", "norm.weight"}));
  EXPECT_EQ(store.metadata().at("format"), "pt");

  const TensorInfo& w = store.get("layers.0.weight", {2, 3});
  EXPECT_EQ(w.type, WeightType::f32);
  EXPECT_EQ(w.nbytes, 24u);
  EXPECT_EQ(w.file, (dir / "model.safetensors").string());
  float values[6];
  std::memcpy(values, w.data, sizeof values);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[5], 6.0f);

  const TensorInfo& norm = store.get("norm.weight", {4});
  EXPECT_EQ(norm.type, WeightType::bf16);
  EXPECT_EQ(static_cast<const std::uint16_t*>(norm.data)[2], 0xBF80);
  EXPECT_EQ(store.get("embed.weight", {2, 2}).type, WeightType::f16);
  EXPECT_TRUE(store.has("norm.weight"));
  EXPECT_FALSE(store.has("norm.bias"));
  EXPECT_EQ(store.find("norm.bias"), nullptr);
}

TEST(Safetensors, OpenAcceptsAFilePath) {
  TempDir dir;
  write_file(dir / "weights.safetensors", make_safetensors(sample_tensors()));
  EXPECT_EQ(WeightStore::open(dir / "weights.safetensors").size(), 3u);
}

TEST(Safetensors, MoveKeepsMappingsAlive) {
  TempDir dir;
  write_file(dir / "model.safetensors", make_safetensors(sample_tensors()));
  WeightStore a = WeightStore::open(dir.path());
  const void* data = a.get("layers.0.weight", {2, 3}).data;
  WeightStore b = std::move(a);
  EXPECT_EQ(b.get("layers.0.weight", {2, 3}).data, data);
  float first;
  std::memcpy(&first, data, sizeof first);
  EXPECT_EQ(first, 1.0f);
  WeightStore c;
  EXPECT_EQ(c.size(), 0u);
  c = std::move(b);
  EXPECT_TRUE(c.has("norm.weight"));
}

TEST(Safetensors, MisalignedTensorIsCopiedAligned) {
  // A 1-element F16 tensor puts the F32 tensor after it at data offset 2.
  std::vector<RawTensor> tensors = {
      {"a", "F16", {1}, testing::bytes_of(std::vector<std::uint16_t>{0x3C00})},
      {"b", "F32", {2}, testing::bytes_of(std::vector<float>{7.5f, -2.0f})},
  };
  TempDir dir;
  write_file(dir / "model.safetensors", make_safetensors(tensors));
  const WeightStore store = WeightStore::open(dir.path());
  const TensorInfo& b = store.get("b", {2});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data) % 4, 0u);
  EXPECT_EQ(static_cast<const float*>(b.data)[0], 7.5f);
  EXPECT_EQ(static_cast<const float*>(b.data)[1], -2.0f);
}

TEST(Safetensors, EmptyTensorIsAllowed) {
  const auto header = parse(make_safetensors({{"empty", "F32", {0, 4}, ""}, {"x", "F32", {1}, testing::bytes_of(std::vector<float>{1})}}));
  ASSERT_EQ(header.tensors.size(), 2u);
}

TEST(Safetensors, TruncatedFile) {
  expect_error([] { parse(std::string("\x10\x00\x00", 3), "short.safetensors"); }, {"short.safetensors", "truncated"});
  TempDir dir;
  write_file(dir / "model.safetensors", "");
  expect_error([&] { WeightStore::open(dir.path()); }, {"model.safetensors", "truncated"});
}

TEST(Safetensors, HeaderLengthPastEnd) {
  std::string file = make_safetensors(sample_tensors());
  file[6] = 1;  // header length now around 2^48
  expect_error([&] { parse(file, "big.safetensors"); }, {"big.safetensors", "header length", "past the end"});
}

TEST(Safetensors, TruncatedData) {
  const std::string file = make_safetensors(sample_tensors());
  // Cut the last tensor's data short; the header still promises all of it.
  expect_error([&] { parse(file.substr(0, file.size() - 3), "cut.safetensors"); }, {"cut.safetensors", "past the end of the data"});
}

TEST(Safetensors, BadJson) {
  expect_error([] { parse(make_safetensors_from_header("{\"a\": [1, 2", ""), "bad.safetensors"); },
               {"bad.safetensors", "invalid JSON"});
  // nlohmann reports an overflowing number as out_of_range, not parse_error (found by fuzzing).
  expect_error([] { parse(make_safetensors_from_header(R"({"w": 1e999})", ""), "num.safetensors"); },
               {"num.safetensors", "invalid JSON"});
  expect_error([] { parse(make_safetensors_from_header("[1, 2]", ""), "arr.safetensors"); },
               {"arr.safetensors", "JSON object"});
  expect_error([] { parse(make_safetensors_from_header(R"({"t": 3})", ""), "x.safetensors"); },
               {"x.safetensors", "'t'", "object"});
  expect_error([] { parse(make_safetensors_from_header(R"({"t": {"dtype": "F32", "shape": [1]}})", "1234")); },
               {"tensor 't'", "data_offsets", "missing"});
  expect_error([] { parse(make_safetensors_from_header(R"({"__metadata__": {"k": 1}})", "")); }, {"__metadata__", "string"});
}

TEST(Safetensors, UnsupportedDtypeNamesTensorAndDtype) {
  expect_error([] { parse(make_safetensors({{"tok.weight", "I8", {4}, "abcd"}}), "q.safetensors"); },
               {"q.safetensors", "tok.weight", "I8"});
}

TEST(Safetensors, OffsetsOutOfBounds) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}})";
  expect_error([&] { parse(make_safetensors_from_header(header, std::string(8, '\0')), "oob.safetensors"); },
               {"oob.safetensors", "'w'", "80"});
}

TEST(Safetensors, OffsetsNotOrdered) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})";
  expect_error([&] { parse(make_safetensors_from_header(header, std::string(8, '\0'))); }, {"'w'", "ordered"});
  const std::string negative = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})";
  expect_error([&] { parse(make_safetensors_from_header(negative, std::string(8, '\0'))); }, {"'w'", "ordered"});
}

TEST(Safetensors, OverlappingOffsets) {
  const std::string header = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  expect_error([&] { parse(make_safetensors_from_header(header, std::string(12, '\0')), "ov.safetensors"); },
               {"ov.safetensors", "'a'", "'b'", "overlap"});
}

TEST(Safetensors, SizeMustMatchShapeTimesDtype) {
  const std::string header = R"({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}})";
  expect_error([&] { parse(make_safetensors_from_header(header, std::string(8, '\0'))); }, {"'w'", "[3, 2]", "12", "8"});
  const std::string huge = R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})";
  expect_error([&] { parse(make_safetensors_from_header(huge, std::string(8, '\0'))); }, {"'w'", "needs"});
  const std::string negative = R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})";
  expect_error([&] { parse(make_safetensors_from_header(negative, std::string(8, '\0'))); }, {"'w'", "negative"});
}

TEST(Safetensors, MissingTensorAndShapeMismatch) {
  TempDir dir;
  write_file(dir / "model.safetensors", make_safetensors(sample_tensors()));
  const WeightStore store = WeightStore::open(dir.path());
  expect_error([&] { store.get("lm_head.weight", {4, 2}); }, {"lm_head.weight", "not found", "model.safetensors"});
  expect_error([&] { store.get("layers.0.weight", {3, 2}); },
               {"model.safetensors", "layers.0.weight", "[2, 3]", "expected [3, 2]"});
  expect_error([&] { store.get("norm.weight", {4, 1}); }, {"norm.weight", "[4]"});
}

TEST(Safetensors, NoModelFiles) {
  TempDir dir;
  expect_error([&] { WeightStore::open(dir.path()); }, {dir.path().string(), "model.safetensors.index.json"});
  expect_error([&] { WeightStore::open(dir / "nope"); }, {"nope", "not found"});
}

// A sharded model written here: two shards and an index.
void write_sharded(const TempDir& dir) {
  auto tensors = sample_tensors();
  write_file(dir / "model-00001-of-00002.safetensors", make_safetensors({tensors[0], tensors[1]}));
  write_file(dir / "model-00002-of-00002.safetensors", make_safetensors({tensors[2]}));
  nlohmann::json index = {{"metadata", {{"total_size", 40}}},
                          {"weight_map",
                           {{"layers.0.weight", "model-00001-of-00002.safetensors"},
                            {"norm.weight", "model-00001-of-00002.safetensors"},
                            {"embed.weight", "model-00002-of-00002.safetensors"}}}};
  write_file(dir / "model.safetensors.index.json", index.dump(2));
}

TEST(Safetensors, ShardedRoundTrip) {
  TempDir dir;
  write_sharded(dir);
  const WeightStore store = WeightStore::open(dir.path());
  EXPECT_EQ(store.names(), (std::vector<std::string>{"embed.weight", "layers.0.weight", "norm.weight"}));
  EXPECT_EQ(store.get("embed.weight", {2, 2}).file, (dir / "model-00002-of-00002.safetensors").string());
  EXPECT_EQ(store.get("norm.weight", {4}).file, (dir / "model-00001-of-00002.safetensors").string());
  EXPECT_EQ(static_cast<const std::uint16_t*>(store.get("embed.weight", {2, 2}).data)[3], 0xC400);
  float w[6];
  std::memcpy(w, store.get("layers.0.weight", {2, 3}).data, sizeof w);
  EXPECT_EQ(w[4], 5.0f);
}

TEST(Safetensors, MissingShard) {
  TempDir dir;
  write_sharded(dir);
  std::filesystem::remove(dir / "model-00002-of-00002.safetensors");
  expect_error([&] { WeightStore::open(dir.path()); },
               {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing", "embed.weight"});
}

TEST(Safetensors, IndexNamesTensorAbsentFromShard) {
  TempDir dir;
  write_sharded(dir);
  nlohmann::json index = {{"weight_map",
                           {{"layers.0.weight", "model-00001-of-00002.safetensors"},
                            {"ghost.weight", "model-00001-of-00002.safetensors"}}}};
  write_file(dir / "model.safetensors.index.json", index.dump());
  expect_error([&] { WeightStore::open(dir.path()); }, {"model-00001-of-00002.safetensors", "ghost.weight"});
}

TEST(Safetensors, BadIndex) {
  TempDir dir;
  write_file(dir / "model.safetensors.index.json", "{\"weight_map\": ");
  expect_error([&] { WeightStore::open(dir.path()); }, {"model.safetensors.index.json", "invalid JSON"});
  write_file(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  expect_error([&] { WeightStore::open(dir.path()); }, {"model.safetensors.index.json", "weight_map", "missing"});
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": "../../etc/x.safetensors"}})");
  expect_error([&] { WeightStore::open(dir.path()); }, {"model.safetensors.index.json", "'a'", "inside the model directory"});
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": 5}})");
  expect_error([&] { WeightStore::open(dir.path()); }, {"weight_map.a", "string"});
}

}  // namespace
}  // namespace kvslim::engine
