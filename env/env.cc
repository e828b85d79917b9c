#include "env/env.h"

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "env/template_env.h"
#include "strategy/error.h"

namespace parapilot::env {

namespace {

std::map<std::string, EnvFactory>& registry() {
  static std::map<std::string, EnvFactory> factories;
  return factories;
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

void ensure_builtins() {
  static std::once_flag once;
  std::call_once(once, register_builtin_envs);
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

}  // namespace

EnvId parse_env_id(const std::string& id) {
  EnvId out;
  if (id.size() > 5 && id.compare(id.size() - 5, 5, ".toml") == 0) {
    out.name = "sim";
    out.variant = id;
    return out;
  }
  const auto colon = id.find(':');
  const auto paren = id.find('(');
  out.name = trim(id.substr(0, std::min(colon, paren)));
  if (out.name.empty()) throw InputError("env \"" + id + "\": missing a name (e.g. sim:straggler)");
  if (colon != std::string::npos && (paren == std::string::npos || colon < paren)) {
    out.variant = trim(id.substr(colon + 1, paren == std::string::npos ? std::string::npos
                                                                         : paren - colon - 1));
  }
  if (paren != std::string::npos) {
    if (id.back() != ')') throw InputError("env \"" + id + "\": parameters must end with ')'");
    const std::string inner = id.substr(paren + 1, id.size() - paren - 2);
    size_t start = 0;
    while (start <= inner.size()) {
      const auto comma = inner.find(',', start);
      const std::string item = trim(inner.substr(start, comma - start));
      if (!item.empty()) {
        const auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0) {
          throw InputError("env \"" + id + "\": parameter \"" + item + "\" is not key=value");
        }
        out.params[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
      }
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

void register_env(const std::string& name, EnvFactory factory) {
  std::lock_guard lock(registry_mutex());
  if (!registry().emplace(name, std::move(factory)).second) {
    throw std::logic_error("env \"" + name + "\" registered twice");
  }
}

std::vector<std::string> registered_envs() {
  ensure_builtins();
  std::lock_guard lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& [name, factory] : registry()) names.push_back(name);
  return names;
}

std::unique_ptr<Env> make_env(const std::string& id) {
  ensure_builtins();
  const EnvId parsed = parse_env_id(id);
  EnvFactory factory;
  {
    std::lock_guard lock(registry_mutex());
    auto it = registry().find(parsed.name);
    if (it == registry().end()) {
      std::string known;
      for (const auto& [name, f] : registry()) known += (known.empty() ? "" : ", ") + name;
      throw InputError("env \"" + id + "\": unknown env \"" + parsed.name + "\" (registered: " +
                       known + ")");
    }
    factory = it->second;
  }
  return factory(parsed);
}

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

std::vector<Observation> VectorEnv::reset(uint64_t base_seed) {
  std::vector<Observation> out(envs_.size());
  pool_->parallel_for(size(), [&](int i) {
    out[i] = envs_[i]->reset(base_seed + static_cast<uint64_t>(i));
    // Later episodes of env i use seeds base + i + k * size, so no two envs share one.
    next_seed_[i] = base_seed + static_cast<uint64_t>(i) + envs_.size();
  });
  return out;
}

std::vector<StepResult> VectorEnv::step(const std::vector<int>& actions) {
  if (actions.size() != envs_.size()) throw std::logic_error("VectorEnv::step: one action per env");
  std::vector<StepResult> out(envs_.size());
  pool_->parallel_for(size(), [&](int i) {
    out[i] = envs_[i]->step(actions[i]);
    if (out[i].terminated || out[i].truncated) {
      out[i].observation = envs_[i]->reset(next_seed_[i]);
      next_seed_[i] += envs_.size();
    }
  });
  return out;
}

}  // namespace parapilot::env
