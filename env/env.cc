#include "env/env.h"

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "core/error.h"

namespace parapilot::env {

// A fixed pool that runs one parallel-for at a time.
struct VectorEnv::Pool {
  explicit Pool(int threads) {
    for (int i = 0; i < threads; ++i) workers.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    wake.notify_all();
    for (auto& w : workers) w.join();
  }
  void parallel_for(int n, const std::function<void(int)>& fn) {
    std::unique_lock lock(mutex);
    job = &fn;
    count = n;
    next = 0;
    done = 0;
    ++generation;
    wake.notify_all();
    finished.wait(lock, [&] { return done == count; });
    job = nullptr;
  }
  void work() {
    uint64_t seen = 0;
    std::unique_lock lock(mutex);
    while (true) {
      wake.wait(lock, [&] { return stop || (generation != seen && next < count); });
      if (stop) return;
      while (next < count) {
        const int i = next++;
        const std::function<void(int)>* fn = job;
        lock.unlock();
        (*fn)(i);
        lock.lock();
        if (++done == count) finished.notify_all();
      }
      seen = generation;
    }
  }
  std::vector<std::thread> workers;
  std::mutex mutex;
  std::condition_variable wake, finished;
  const std::function<void(int)>* job = nullptr;
  int count = 0, next = 0, done = 0;
  uint64_t generation = 0;
  bool stop = false;
};

VectorEnv::VectorEnv(std::vector<std::unique_ptr<Env>> envs, int threads)
    : envs_(std::move(envs)), next_seed_(envs_.size(), 0),
      pool_(std::make_unique<Pool>(std::max(1, threads))) {}

VectorEnv::~VectorEnv() = default;

namespace {

// The first failure in env order, or OK.
Status first_error(const std::vector<Status>& statuses) {
  for (const Status& s : statuses)
    if (!s.ok()) return s;
  return {};
}

}  // namespace

StatusOr<std::vector<Observation>> VectorEnv::reset(uint64_t base_seed) {
  std::vector<Observation> out(envs_.size());
  std::vector<Status> failed(envs_.size());
  pool_->parallel_for(size(), [&](int i) {
    auto first = envs_[i]->reset(base_seed + static_cast<uint64_t>(i));
    if (first.ok()) out[i] = *first;
    else failed[i] = first.status();
    // Later episodes of env i use seeds base + i + k * size, so no two envs share one.
    next_seed_[i] = base_seed + static_cast<uint64_t>(i) + envs_.size();
  });
  if (Status s = first_error(failed); !s.ok()) return s;
  return out;
}

StatusOr<std::vector<StepResult>> VectorEnv::step(const std::vector<int>& actions) {
  if (actions.size() != envs_.size()) throw std::logic_error("VectorEnv::step: one action per env");
  std::vector<StepResult> out(envs_.size());
  std::vector<Status> failed(envs_.size());
  pool_->parallel_for(size(), [&](int i) {
    out[i] = envs_[i]->step(actions[i]);
    if (out[i].terminated || out[i].truncated) {
      auto next = envs_[i]->reset(next_seed_[i]);
      if (next.ok()) out[i].observation = *next;
      else failed[i] = next.status();
      next_seed_[i] += envs_.size();
    }
  });
  if (Status s = first_error(failed); !s.ok()) return s;
  return out;
}

}  // namespace parapilot::env
