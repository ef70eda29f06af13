#include "core/io/io_error.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>

namespace tierlift::io {

namespace {

// What to do about running out of file descriptors: the limit itself is what users must change.
std::string descriptor_limit_hint(int err) {
  struct rlimit rl {};
  std::string limit = "unknown";
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    limit = rl.rlim_cur == RLIM_INFINITY ? "unlimited" : std::to_string(rl.rlim_cur);
  }
  if (err == EMFILE) {
    return "; this process has reached its limit on open files (RLIMIT_NOFILE = " + limit +
           "): raise it with `ulimit -n` (or resource.setrlimit) or close files";
  }
  return "; the system-wide table of open files is full (fs.file-max; this process's "
         "RLIMIT_NOFILE, `ulimit -n`, is " +
         limit + ")";
}

}  // namespace

std::string IoStatus::message(const char* op) const {
  std::string why = err == kErrEof
                        ? std::string("read past end of file")
                        : std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  if (err == EMFILE || err == ENFILE) why += descriptor_limit_hint(err);
  return std::string(op) + " of '" + path + "' at offset " + std::to_string(offset) +
         " failed: " + why;
}

}  // namespace tierlift::io
