// Planner benchmark (placeholder until the planner lands).
int main() { return 0; }
