#include "strategy/pipeline_schedule.h"

#include <algorithm>
#include <cassert>
#include <cstdio>

namespace parapilot {

std::vector<PassRef> schedule_order(const Strategy& s, int rank, int microbatches) {
  const int pp = s.pp;
  const int v = s.virtual_stages;
  const int m = microbatches;
  std::vector<PassRef> order;
  order.reserve(2 * static_cast<size_t>(m) * v);
  if (s.schedule == Schedule::kGPipe) {
    for (int mb = 0; mb < m; ++mb) order.push_back({rank, mb, true});
    for (int mb = 0; mb < m; ++mb) order.push_back({rank, mb, false});
    return order;
  }
  // 1F1B, and Megatron's interleaved 1F1B: unit k of a rank's forward (backward) sequence maps
  // to a virtual chunk and microbatch in groups of pp microbatches.
  const int units = m * v;
  auto forward_unit = [&](int k) {
    const int chunk_in_rank = (k / pp) % v;
    const int mb = (k / (pp * v)) * pp + k % pp;
    return PassRef{chunk_in_rank * pp + rank, mb, true};
  };
  auto backward_unit = [&](int k) {
    const int chunk_in_rank = v - 1 - (k / pp) % v;
    const int mb = (k / (pp * v)) * pp + k % pp;
    return PassRef{chunk_in_rank * pp + rank, mb, false};
  };
  const int warmup =
      v == 1 ? std::min(pp - rank - 1, m) : std::min((pp - rank - 1) * 2 + (v - 1) * pp, units);
  int f = 0, b = 0;
  for (; f < warmup; ++f) order.push_back(forward_unit(f));
  while (f < units) {
    order.push_back(forward_unit(f++));
    order.push_back(backward_unit(b++));
  }
  while (b < units) order.push_back(backward_unit(b++));
  return order;
}

std::vector<ScheduledOp> simulate_schedule(const Strategy& s, const PipelineTimings& t) {
  const int pp = s.pp;
  const int chunks = s.num_chunks();
  const int m = t.microbatches;
  std::vector<std::vector<PassRef>> orders(pp);
  for (int p = 0; p < pp; ++p) orders[p] = schedule_order(s, p, m);

  // Completion time of each pass, -1 until done.
  std::vector<double> fwd_done(static_cast<size_t>(chunks) * m, -1);
  std::vector<double> bwd_done(static_cast<size_t>(chunks) * m, -1);
  auto idx = [&](int chunk, int mb) { return static_cast<size_t>(chunk) * m + mb; };

  std::vector<size_t> next(pp, 0);
  std::vector<double> free_at(pp, 0);
  std::vector<ScheduledOp> ops;
  size_t remaining = 0;
  for (const auto& o : orders) remaining += o.size();
  ops.reserve(remaining);
  while (remaining > 0) {
    bool progressed = false;
    for (int p = 0; p < pp; ++p) {
      while (next[p] < orders[p].size()) {
        const PassRef& pass = orders[p][next[p]];
        double ready = 0;
        if (pass.forward) {
          if (pass.chunk > 0) {
            const double dep = fwd_done[idx(pass.chunk - 1, pass.microbatch)];
            if (dep < 0) break;
            ready = dep + t.p2p_s[pass.chunk - 1];
          }
        } else if (pass.chunk + 1 < chunks) {
          const double dep = bwd_done[idx(pass.chunk + 1, pass.microbatch)];
          if (dep < 0) break;
          ready = dep + t.p2p_s[pass.chunk];
        } else {
          const double dep = fwd_done[idx(pass.chunk, pass.microbatch)];
          if (dep < 0) break;
          ready = dep;
        }
        const double start = std::max(ready, free_at[p]);
        const double duration = pass.forward ? t.forward_s[pass.chunk] : t.backward_s[pass.chunk];
        const double end = start + duration;
        (pass.forward ? fwd_done : bwd_done)[idx(pass.chunk, pass.microbatch)] = end;
        free_at[p] = end;
        ops.push_back({p, pass.chunk, pass.microbatch, pass.forward, start, end});
        ++next[p];
        --remaining;
        progressed = true;
      }
    }
    assert(progressed && "pipeline schedule deadlocked");
    if (!progressed) break;
  }
  return ops;
}

namespace {

void event(std::ostream& out, bool& first, const char* name, const char* category, int pid, int tid,
           double start_s, double duration_s, const std::string& args = "") {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                "\"ts\":%.3f,\"dur\":%.3f%s%s}",
                first ? "" : ",", name, category, pid, tid, start_s * 1e6, duration_s * 1e6,
                args.empty() ? "" : ",\"args\":", args.c_str());
  out << buf;
  first = false;
}

void metadata(std::ostream& out, bool& first, const char* what, int pid, int tid,
              const std::string& name) {
  out << (first ? "" : ",") << "\n{\"name\":\"" << what << "\",\"ph\":\"M\",\"pid\":" << pid
      << ",\"tid\":" << tid << ",\"args\":{\"name\":\"" << name << "\"}}";
  first = false;
}

}  // namespace

double write_chrome_trace(const CostModel& cost, const Strategy& s, const Conditions& c,
                          std::ostream& out) {
  const PipelineTimings t = cost.pipeline_timings(s, c);
  const std::vector<ScheduledOp> ops = simulate_schedule(s, t);
  std::vector<double> rank_end(s.pp, 0);
  for (const auto& op : ops) rank_end[op.rank] = std::max(rank_end[op.rank], op.end_s);

  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (int p = 0; p < s.pp; ++p) {
    std::string gpus;
    for (int i = 0; i < s.tp && i < 8; ++i) {
      if (i) gpus += ',';
      gpus += std::to_string(s.gpu_of_rank(t.replica, p, i));
    }
    if (s.tp > 8) gpus += ",...";
    metadata(out, first, "process_name", p, 0,
             "stage " + std::to_string(p) + " (replica " + std::to_string(t.replica) + ", GPUs " +
                 gpus + ")");
    metadata(out, first, "thread_name", p, 0, "compute");
    metadata(out, first, "thread_name", p, 1, "communication");
  }
  char name[64];
  char args[128];
  for (const auto& op : ops) {
    std::snprintf(name, sizeof name, "%s mb%d", op.forward ? "F" : "B", op.microbatch);
    std::snprintf(args, sizeof args, "{\"microbatch\":%d,\"chunk\":%d}", op.microbatch, op.chunk);
    event(out, first, name, op.forward ? "forward" : "backward", op.rank, 0, op.start_s,
          op.end_s - op.start_s, args);
    // The pass's output travels to the neighbouring chunk after it ends.
    const bool sends = op.forward ? op.chunk + 1 < s.num_chunks() : op.chunk > 0;
    if (sends) {
      const double p2p = op.forward ? t.p2p_s[op.chunk] : t.p2p_s[op.chunk - 1];
      std::snprintf(name, sizeof name, "%s mb%d", op.forward ? "send act" : "send grad",
                    op.microbatch);
      event(out, first, name, "p2p", op.rank, 1, op.end_s, p2p);
    }
  }
  double pipeline_end = 0;
  for (double e : rank_end) pipeline_end = std::max(pipeline_end, e);
  double dp_end = pipeline_end;
  for (int p = 0; p < s.pp; ++p) {
    const double exposed = p < static_cast<int>(t.dp_exposed_s.size()) ? t.dp_exposed_s[p] : 0;
    if (exposed > 0) {
      event(out, first, "dp grad reduce (exposed)", "dp", p, 1, rank_end[p], exposed);
      dp_end = std::max(dp_end, rank_end[p] + exposed);
    }
  }
  for (int p = 0; p < s.pp; ++p) {
    event(out, first, "optimizer step", "optimizer", p, 0, dp_end, t.optimizer_s);
  }
  out << "\n]}\n";
  return dp_end + t.optimizer_s;
}

}  // namespace parapilot
