// Portable path: the fp32-state and compact-state Adam bodies on width-1 lanes (any CPU).
#include "core/optim/adam_compact_impl.h"
#include "core/optim/adam_impl.h"

namespace tierlift {

void adam_range_scalar(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  using adam_detail::ScalarVec;
  adam_detail::dispatch<ScalarVec, ScalarVec>(s, t, begin, end);
}

void adam_compact_range_scalar(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                               int64_t end) {
  using adam_detail::ScalarVec;
  adam_detail::compact_dispatch<ScalarVec, ScalarVec>(s, t, begin, end);
}

}  // namespace tierlift
