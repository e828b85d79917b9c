#include "env/dp/split_model.h"

#include <cstdarg>
#include <cstdio>

namespace parapilot::env::dp {

std::string reason_text(const char* format, ...) {
  char text[320];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

}  // namespace parapilot::env::dp
