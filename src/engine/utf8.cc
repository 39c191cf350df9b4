#include "engine/utf8.h"

namespace kvslim::engine::utf8 {
namespace {

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Valid range of the second byte of a sequence led by `lead` (Unicode Table 3-7).
void second_byte_range(unsigned char lead, unsigned char& lo, unsigned char& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (lead == 0xE0) lo = 0xA0;
  else if (lead == 0xED) hi = 0x9F;
  else if (lead == 0xF0) lo = 0x90;
  else if (lead == 0xF4) hi = 0x8F;
}

// Length of the valid prefix of the sequence at s[i]: returns the full length when complete and
// valid, otherwise sets `complete` false and returns how many bytes form a valid (unfinished) prefix.
std::size_t valid_prefix(std::string_view s, std::size_t i, bool& complete) {
  const auto lead = static_cast<unsigned char>(s[i]);
  complete = true;
  if (lead < 0x80) return 1;
  const std::size_t need = sequence_length(lead);
  if (need == 1) {  // stray continuation byte, C0, C1 or F5..FF
    complete = false;
    return 0;
  }
  unsigned char lo, hi;
  second_byte_range(lead, lo, hi);
  std::size_t k = 1;
  for (; k < need; ++k) {
    if (i + k >= s.size()) break;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const bool ok = (k == 1) ? (b >= lo && b <= hi) : is_continuation(b);
    if (!ok) break;
  }
  if (k < need) complete = false;
  return k;
}

}  // namespace

std::size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 1;
}

std::size_t find_invalid(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    bool complete = false;
    const std::size_t n = valid_prefix(s, i, complete);
    if (!complete) return i;
    i += n;
  }
  return std::string_view::npos;
}

char32_t decode(std::string_view s, std::size_t i, std::size_t& len) {
  const auto lead = static_cast<unsigned char>(s[i]);
  len = sequence_length(lead);
  if (len == 1) return lead;
  char32_t cp = lead & (0xFF >> (len + 1));
  for (std::size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string repair(std::string_view bytes) {
  if (find_invalid(bytes) == std::string_view::npos) return std::string(bytes);
  std::string out;
  out.reserve(bytes.size() + 8);
  std::size_t i = 0;
  while (i < bytes.size()) {
    bool complete = false;
    const std::size_t n = valid_prefix(bytes, i, complete);
    if (complete) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subpart
      i += n == 0 ? 1 : n;
    }
  }
  return out;
}

std::size_t incomplete_tail(std::string_view bytes) {
  const std::size_t size = bytes.size();
  for (std::size_t k = 1; k <= 3 && k <= size; ++k) {
    const std::size_t start = size - k;
    const auto b = static_cast<unsigned char>(bytes[start]);
    if (is_continuation(b)) continue;  // keep looking for the lead byte
    if (b < 0x80) return 0;
    bool complete = false;
    const std::size_t n = valid_prefix(bytes, start, complete);
    // Unfinished only if every byte after the lead is a valid prefix and more are needed.
    return (!complete && n == k && sequence_length(b) > k) ? k : 0;
  }
  return 0;
}

bool is_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

}  // namespace kvslim::engine::utf8
