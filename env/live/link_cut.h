// Cutting a worker's links to its peers, a fault the live cluster injects (parapilot launch
// --inject rank=R,link-cut,at=Nsteps; the worker's --link-cut-at-step). No libtorch here.
//
// Thread-safety: safe to call from any thread; it touches only the process's socket
// descriptors, and the threads that use them see their connections closed.
#pragma once

#include <vector>

#include "core/status.h"

namespace parapilot::live {

/// Shuts down (both directions) every connected TCP socket of this process whose local or
/// remote port is not in `keep_ports`: with the job's store and the agent's bus kept, that is
/// every connection of the rank's process groups. The process and the kept connections live
/// on; a listening socket is left alone. Its peers see the connections close, and this rank's
/// next collective over them fails. Returns how many sockets were cut; kUnavailable when the
/// process's descriptors cannot be listed.
StatusOr<int> cut_peer_links(const std::vector<int>& keep_ports);

}  // namespace parapilot::live
