# Highway from python/third_party (headers + libhwy.so.1 copied from a Debian 12 machine by
# python/vendor_deps.sh), for machines that have a compiler but no libhwy-dev (the GPU machine).
# libhwy.so.1 needs only glibc 2.14 and GLIBCXX_3.4.21, so Debian's build runs on newer distributions.
set(_hwy_root ${PROJECT_SOURCE_DIR}/python/third_party)
if(NOT EXISTS ${_hwy_root}/include/hwy/highway.h OR NOT EXISTS ${_hwy_root}/lib/libhwy.so.1)
  message(FATAL_ERROR "Highway not found: install libhwy-dev (Debian/Ubuntu) or run python/vendor_deps.sh "
                      "on a Debian 12 machine that has it and bring python/third_party along.")
endif()
add_library(hwy::hwy SHARED IMPORTED)
set_target_properties(hwy::hwy PROPERTIES
  IMPORTED_LOCATION ${_hwy_root}/lib/libhwy.so.1
  INTERFACE_INCLUDE_DIRECTORIES ${_hwy_root}/include)
set(KVSLIM_HWY_VENDORED ${_hwy_root}/lib/libhwy.so.1)
message(STATUS "Highway: vendored copy in ${_hwy_root}")
