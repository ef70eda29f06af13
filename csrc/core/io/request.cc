#include "core/io/request.h"

namespace tierlift::io {

IoStatus IoRequest::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return finished_.load(); });
  return status_;
}

void IoRequest::complete_one(const IoStatus& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Blocks finish in any order: keep the failure nearest the start of the file, so the same
    // request always reports the same error (e.g. where a short file ends).
    if (!status.ok() && (status_.ok() || status.offset < status_.offset)) status_ = status;
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  cv_.notify_all();
}

}  // namespace tierlift::io
