#include "env/env.h"
#include "agent/deploy/agent.h"
