// Recorded-trace import and analysis (placeholder until it lands).
#pragma once
