// The training worker (libtorch): run_worker runs the phases of worker_run.h in order. The data
// is corpus.h, the model hybrid_model.h, the process groups collectives.h, everything that
// depends on the layout layout_state.h, one step's passes through the pipeline pipeline.h.
#include "env/live/worker.h"

#include <exception>

#include "core/error.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

namespace {

int run_or_throw(const WorkerOptions& o) {
  check(validate(o));
  at::set_num_threads(o.threads);
  WorkerRun run(o);
  load_inputs(run);
  if (const std::optional<int> failed = join_job(run)) return *failed;
  connect_to_agent(run);
  configure_plan(run);
  try {
    train(run);
    finish_training(run);
  } catch (const c10::Error& e) {
    run.failure = e.what_without_backtrace();
    run.exit_code = kWorkerCollectiveFailed;
  } catch (const std::exception& e) {
    run.failure = e.what();
    run.exit_code = 1;
  }
  return shut_down(run);
}

}  // namespace

StatusOr<int> run_worker(const WorkerOptions& o) {
  return catch_input_error([&] { return run_or_throw(o); });
}

}  // namespace parapilot::live
