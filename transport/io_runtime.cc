#include "transport/io_runtime.h"

#include <pthread.h>

#include <cstdio>
#include <mutex>

namespace parapilot::transport {

IoRuntime::IoRuntime(std::size_t threads) : impl_(std::make_unique<Impl>()) {
  impl_->guard.emplace(impl_->ctx.get_executor());
  if (threads == 0) threads = 1;
  for (std::size_t i = 0; i < threads; ++i) {
    impl_->threads.emplace_back([ctx = &impl_->ctx] {
      pthread_setname_np(pthread_self(), "pp-client-io");
      ctx->run();
    });
  }
}

IoRuntime::~IoRuntime() {
  // Clients that used this runtime are stopped by now; their cancelled operations drain and
  // run() returns once no work is left.
  impl_->guard.reset();
  for (auto& t : impl_->threads) t.join();
}

Logger stderr_logger(LogLevel min_level) {
  return [min_level](LogLevel level, std::string_view line) {
    if (level < min_level) return;
    static std::mutex mu;
    static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
    std::lock_guard lk(mu);
    std::fprintf(stderr, "[transport %s] %.*s\n", kNames[static_cast<int>(level)],
                 static_cast<int>(line.size()), line.data());
  };
}

}  // namespace parapilot::transport
