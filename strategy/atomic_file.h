// Writing a file so that a reader finds the old content or the new, never a mix: the one way
// the project writes its outputs (CLI results, job descriptions, run summaries, checkpoints).
//
// Thread-safety: a free function; concurrent writers of one path each leave a whole file.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

namespace parapilot {

/// Writes `path` through a temporary in the same directory (named with this process's id),
/// fsync and rename. `write` fills the stream. Throws InputError "PATH: cannot write: REASON"
/// when the file cannot be written; the temporary is removed and `path` left as it was.
void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write);

}  // namespace parapilot
