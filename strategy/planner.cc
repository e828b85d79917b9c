#include "strategy/planner.h"
