// libFuzzer target: tokenizer.json parsing, then encoding and decoding a fixed string. Malformed
// input must end in ModelFileError (or kvslim::InputError from a regex that hits its match
// limit), never a crash or a hang.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/tokenizer.h"
#include "kvslim/errors.h"

namespace {
constexpr std::string_view kText =
    "Hello, world! I'm 12345 caf\xC3\xA9 e\xCC\x81 \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87\r\n\t  "
    "<|bos|>special<|eos|> <mask> text";
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvslim::engine;
  try {
    const Tokenizer tok = Tokenizer::from_json_text(std::string_view(reinterpret_cast<const char*>(data), size));
    const std::vector<int> ids = tok.encode(kText);
    (void)tok.decode(ids);
    StreamDecoder stream(tok, true);
    for (int id : ids) (void)stream.push(id);
    (void)stream.flush();
    (void)tok.bos_id();
  } catch (const ModelFileError&) {
  } catch (const kvslim::InputError&) {
  }
  return 0;
}
