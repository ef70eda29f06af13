// Portable path: the Adam body on width-1 lanes (runs on any CPU).
#include "core/optim/adam_impl.h"

namespace tierlift {

void adam_range_scalar(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  using adam_detail::ScalarVec;
  adam_detail::dispatch<ScalarVec, ScalarVec>(s, t, begin, end);
}

}  // namespace tierlift
