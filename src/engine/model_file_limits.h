// Upper bounds on the model files the loaders read into memory. The weights are mmap'ed, never
// read, and their tensors are bounded by the file; these bound everything that is parsed into
// memory, so a config.json that is a link to /dev/zero, a FIFO or a 10 GB file gets an error
// naming it instead of filling memory or hanging. Each bound is far above what real models ship
// (sizes of the largest seen in brackets).
#pragma once
#include <cstdint>

namespace kvslim::engine::limits {

// config.json, generation_config.json (~2 KB; 50 KB with a long chat template list).
inline constexpr std::uint64_t kConfigJsonBytes = std::uint64_t{16} << 20;
// model.safetensors.index.json (~200 KB for a 400B-parameter model).
inline constexpr std::uint64_t kIndexJsonBytes = std::uint64_t{64} << 20;
// tokenizer.json (~35 MB: Gemma's 256K vocabulary).
inline constexpr std::uint64_t kTokenizerJsonBytes = std::uint64_t{256} << 20;
// The JSON header of one .safetensors file (the safetensors format's own limit is 100 MB).
inline constexpr std::uint64_t kSafetensorsHeaderBytes = 100'000'000;

// Nesting of any parsed JSON document (arrays and objects; real files: under 10 levels). A
// deeper document is refused before it is parsed (issue 26: a 0.8 MB tokenizer.json of nested
// Sequence post-processors took 3.9 GB, then crashed).
inline constexpr int kJsonDepth = 128;
// Nesting of tokenizer.json's Sequence steps (normalizer, pre_tokenizer, post_processor,
// decoder; real files: one Sequence of a few steps).
inline constexpr int kTokenizerSequenceDepth = 8;

}  // namespace kvslim::engine::limits
