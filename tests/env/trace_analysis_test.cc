// Trace analysis tests (placeholder until they land).
