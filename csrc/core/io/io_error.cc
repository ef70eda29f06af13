#include "core/io/io_error.h"

#include <cstring>

namespace tierlift::io {

std::string IoStatus::message(const char* op) const {
  std::string why = err == kErrEof
                        ? std::string("read past end of file")
                        : std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  return std::string(op) + " of '" + path + "' at offset " + std::to_string(offset) +
         " failed: " + why;
}

}  // namespace tierlift::io
