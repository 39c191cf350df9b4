// Small UTF-8 helpers shared by the tokenizer: validation, decoding one code point, lossy repair
// (as Rust's String::from_utf8_lossy does it) and the length of an unfinished trailing character.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvslim::engine::utf8 {

// Byte offset of the first invalid sequence, or npos when `s` is valid UTF-8.
std::size_t find_invalid(std::string_view s);

// Decodes the code point starting at s[i] (which must be valid UTF-8); sets `len` to its length.
char32_t decode(std::string_view s, std::size_t i, std::size_t& len);

// Length of the character whose lead byte is `lead` (1 for a continuation or invalid byte).
std::size_t sequence_length(unsigned char lead);

void append(std::string& out, char32_t cp);

// Replaces each maximal invalid subsequence with U+FFFD (Rust from_utf8_lossy / WHATWG rules).
std::string repair(std::string_view bytes);

// Number of bytes at the end of `bytes` that begin a valid but unfinished character (0..3).
std::size_t incomplete_tail(std::string_view bytes);

// Rust char::is_whitespace (the Unicode White_Space property).
bool is_whitespace(char32_t cp);

}  // namespace kvslim::engine::utf8
