// Internal (not installed, not for users): the Asio side of IoRuntime, shared by the TCP client
// and server sources. Keeps Boost.Asio out of the public headers.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include <optional>
#include <thread>
#include <vector>

#include "transport/bus.h"

namespace parapilot::transport {

struct IoRuntime::Impl {
  boost::asio::io_context ctx{1};
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guard;
  std::vector<std::thread> threads;
};

}  // namespace parapilot::transport
