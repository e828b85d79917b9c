// Writing a file so that a reader finds the old content or the new, never a mix: the one way
// the project writes its outputs (CLI results, job descriptions, run summaries, policy and
// training checkpoints).
//
// Thread-safety: a free function; concurrent writers of one path each leave a whole file.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

#include "core/status.h"

namespace parapilot {

/// Writes `path` through a temporary in the same directory (named with this process's id):
/// write, fsync, rename, then fsync of the directory. `write` fills the stream (binary-safe).
/// On failure returns kInvalidArgument "PATH: cannot write: REASON"; the temporary is removed
/// and `path` left as it was.
Status write_file_atomically(const std::string& path,
                             const std::function<void(std::ostream&)>& write);

}  // namespace parapilot
