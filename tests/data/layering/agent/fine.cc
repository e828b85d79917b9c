#include "env/env.h"
