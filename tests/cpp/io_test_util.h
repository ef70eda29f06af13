// Helpers shared by the I/O engine tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/io/backend.h"

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

// A test per backend ("uring" or "threads", its parameter), skipped where io_uring is not
// available, with a fresh directory dir_ removed afterwards.
class BackendDirTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "uring") {
      const std::string why = uring_unavailable_reason();
      if (!why.empty()) GTEST_SKIP() << "io_uring unavailable: " << why;
    }
    dir_ = make_temp_dir("/tmp");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    if (!dir_.empty()) {
      std::string cmd = "rm -rf '" + dir_ + "'";
      ASSERT_EQ(std::system(cmd.c_str()), 0);
    }
  }
  std::string dir_;
};

}  // namespace tierlift::io::iotest
