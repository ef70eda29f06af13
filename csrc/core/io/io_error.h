// Errors of the I/O engine: every failed read or write carries the errno, the file and the byte
// offset where it failed, so the binding layer can raise an exception that names all three.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace tierlift::io {

// errno value used for "the file ended before the request did" (a read past end of file).
constexpr int kErrEof = -1;

struct IoStatus {
  int err = 0;  // 0: ok; >0: errno; kErrEof: end of file
  std::string path;
  uint64_t offset = 0;
  bool ok() const { return err == 0; }
  std::string message(const char* op) const;
};

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string path, uint64_t offset, const std::string& what)
      : std::runtime_error(what), err_(err), path_(std::move(path)), offset_(offset) {}
  static IoError from(const IoStatus& s, const char* op) {
    return IoError(s.err, s.path, s.offset, s.message(op));
  }
  int err() const { return err_; }  // errno, or kErrEof
  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }

 private:
  int err_;
  std::string path_;
  uint64_t offset_;
};

}  // namespace tierlift::io
