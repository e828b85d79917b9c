#include "env/live/schedule.h"

#include <algorithm>
#include <cassert>

namespace parapilot::live {

std::vector<PipeOp> one_f_one_b(int stage, int stages, int microbatches) {
  assert(stage >= 0 && stage < stages && microbatches >= 0);
  const int warmup = std::min(stages - 1 - stage, microbatches);
  std::vector<PipeOp> out;
  out.reserve(static_cast<std::size_t>(2 * microbatches));
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) out.push_back({PipeOp::Kind::forward, forward});
  while (forward < microbatches) {
    out.push_back({PipeOp::Kind::forward, forward++});
    out.push_back({PipeOp::Kind::backward, backward++});
  }
  while (backward < microbatches) out.push_back({PipeOp::Kind::backward, backward++});
  return out;
}

}  // namespace parapilot::live
