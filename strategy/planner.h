// Planner: searches hybrid-parallel layouts (placeholder; see issue "Adaptive strategy generator").
#pragma once
