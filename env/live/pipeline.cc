#include "env/live/pipeline.h"

#include <chrono>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "env/live/schedule.h"

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What a forward pass leaves for its backward pass.
struct InFlight {
  at::Tensor input;   // the received activation (a leaf that requires grad); undefined on stage 0
  at::Tensor output;  // the activation sent on, or the scaled loss on the last stage
};

// A TP all-reduce that failed during a pass (hybrid_model.h), as the step's Status.
Status tp_status(const TensorParallelGroup* tp) {
  if (!tp || tp->failure.ok()) return {};
  return Status::collective_failed("tensor-parallel all-reduce failed: " + tp->failure.message());
}

StatusOr<PipelineStepStats> run_step(StageModel& model, PointToPoint* pipe,
                                     TensorParallelGroup* tp, const PipelineStepOptions& o,
                                     const std::function<at::Tensor(int)>& batch) {
  if (Status st = tp_status(tp); !st.ok()) return st;
  PipelineStepStats s;
  const int stage = pipe ? pipe->rank() : 0;
  const int stages = pipe ? pipe->size() : 1;
  std::vector<InFlight> live(static_cast<std::size_t>(o.microbatches));
  auto tag = [&](int microbatch, int direction) {
    return o.tag_base + static_cast<std::uint32_t>(microbatch) * 2 +
           static_cast<std::uint32_t>(direction);
  };
  // Times one pass, less its TP all-reduces, and stretches it under an injected slowdown.
  auto timed = [&](auto&& pass) {
    const double tp_before = tp ? tp->all_reduce_ms : 0;
    const auto t0 = Clock::now();
    pass();
    double ms = ms_since(t0) - (tp ? tp->all_reduce_ms - tp_before : 0);
    if (o.slow_factor > 1) {
      std::this_thread::sleep_for(
          std::chrono::duration<double, std::milli>((o.slow_factor - 1) * ms));
      ms *= o.slow_factor;
    }
    s.compute_ms += std::max(0.0, ms);
  };
  auto send = [&](const at::Tensor& t, int peer, std::uint32_t tg) -> Status {
    const at::Tensor c = t.detach().contiguous();
    s.p2p_bytes +=
        static_cast<std::uint64_t>(c.numel()) * static_cast<std::uint64_t>(c.element_size());
    s.p2p_calls += 1;
    const auto t0 = Clock::now();
    Status st = pipe->send(c, peer, tg);
    s.p2p_ms += ms_since(t0);
    return st;
  };
  auto recv = [&](at::Tensor& t, int peer, std::uint32_t tg) -> Status {
    s.p2p_calls += 1;
    const auto t0 = Clock::now();
    Status st = pipe->recv(t, peer, tg);
    s.p2p_ms += ms_since(t0);
    return st;
  };

  for (const PipeOp& op : one_f_one_b(stage, stages, o.microbatches)) {
    InFlight& f = live[static_cast<std::size_t>(op.microbatch)];
    if (op.kind == PipeOp::Kind::forward) {
      if (!model.first_stage()) {
        at::Tensor in = at::empty(model.activation_shape(o.sequences), at::kFloat);
        if (Status st = recv(in, stage - 1, tag(op.microbatch, 0)); !st.ok()) return st;
        f.input = in.set_requires_grad(true);
      }
      timed([&] {
        f.output = model.forward(f.input, batch(op.microbatch));
        if (model.last_stage()) {
          f.output = f.output / o.loss_divisor;
          s.loss += f.output.item<double>();
        }
      });
      if (Status st = tp_status(tp); !st.ok()) return st;
      if (!model.last_stage())
        if (Status st = send(f.output, stage + 1, tag(op.microbatch, 0)); !st.ok()) return st;
    } else {
      at::Tensor grad_out;
      if (!model.last_stage()) {
        grad_out = at::empty(f.output.sizes(), at::kFloat);
        if (Status st = recv(grad_out, stage + 1, tag(op.microbatch, 1)); !st.ok()) return st;
      }
      timed([&] {
        if (model.last_stage())
          f.output.backward();
        else
          torch::autograd::backward({f.output}, {grad_out});
      });
      if (Status st = tp_status(tp); !st.ok()) return st;
      if (!model.first_stage())
        if (Status st = send(f.input.grad(), stage - 1, tag(op.microbatch, 1)); !st.ok()) return st;
      f = InFlight{};
    }
  }
  if (pipe) {
    const auto t0 = Clock::now();
    if (Status st = pipe->wait_sends(); !st.ok()) return st;
    s.p2p_ms += ms_since(t0);
  }
  return s;
}

}  // namespace

StatusOr<PipelineStepStats> run_pipeline_step(StageModel& model, PointToPoint* pipe,
                                              TensorParallelGroup* tp,
                                              const PipelineStepOptions& options,
                                              const std::function<at::Tensor(int)>& batch) {
  return run_step(model, pipe, tp, options, batch);
}

}  // namespace parapilot::live
