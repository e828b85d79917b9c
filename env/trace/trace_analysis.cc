#include "env/trace/trace_analysis.h"
