#include <stdexcept>
#include <string>

#include "kvslim/cache.h"

namespace kvslim {

double CacheStats::figure(std::string_view name) const {
  for (const auto& [key, value] : figures) {
    if (key == name) return value;
  }
  throw std::out_of_range(method + " cache has no figure \"" + std::string(name) + "\"");
}

bool CacheStats::has_figure(std::string_view name) const {
  for (const auto& [key, value] : figures) {
    if (key == name) return true;
  }
  return false;
}

}  // namespace kvslim
