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
    if (!status.ok() && status_.ok()) status_ = status;
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (on_done_) on_done_(status_);
  finished_ = true;
  cv_.notify_all();
}

}  // namespace tierlift::io
