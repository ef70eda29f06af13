// Helpers shared by the I/O engine tests.
#pragma once

#include <stdlib.h>

#include <random>
#include <string>
#include <vector>

namespace tierlift::io::iotest {

// A fresh directory under `base`, or "" when it cannot be made.
inline std::string make_temp_dir(const char* base) {
  std::string tmpl = std::string(base) + "/tierlift_io_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  return buf.data();
}

inline std::vector<unsigned char> random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

}  // namespace tierlift::io::iotest
