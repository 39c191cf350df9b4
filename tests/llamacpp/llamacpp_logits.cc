// Helper for llamacpp_test: runs token ids through llama.cpp (the pinned build, linked against
// its libllama) and writes the logits of every position as little-endian f32 [n, vocab].
//   llamacpp_logits MODEL.gguf OUT.f32 KV_TYPE(f32|f16) ID ID ...
// Only llama.h is used, so it builds against any llama.cpp of the pinned API.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 f32|f16 ID...\n", argv[0]);
    return 2;
  }
  std::vector<llama_token> ids;
  for (int i = 4; i < argc; ++i) ids.push_back(static_cast<llama_token>(std::atoi(argv[i])));
  llama_log_set([](ggml_log_level level, const char* text, void*) {
    if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
  }, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(ids.size() < 64 ? 64 : ids.size());
  cp.n_batch = cp.n_ubatch = cp.n_ctx;
  cp.n_threads = cp.n_threads_batch = 2;
  cp.type_k = cp.type_v = std::strcmp(argv[3], "f16") == 0 ? GGML_TYPE_F16 : GGML_TYPE_F32;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "llama.cpp could not create a context\n");
    return 1;
  }
  llama_batch batch = llama_batch_init(static_cast<int32_t>(ids.size()), 0, 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    batch.token[i] = ids[i];
    batch.pos[i] = static_cast<llama_pos>(i);
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = static_cast<int32_t>(ids.size());
  if (llama_decode(ctx, batch) != 0) {
    std::fprintf(stderr, "llama_decode failed\n");
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  FILE* out = std::fopen(argv[2], "wb");
  if (out == nullptr) return 1;
  for (size_t i = 0; i < ids.size(); ++i) std::fwrite(llama_get_logits_ith(ctx, static_cast<int32_t>(i)), sizeof(float), vocab, out);
  std::fclose(out);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
