"""Driver tools: workloads and how they are driven, the chaos harness, what-if
simulation, the live view, conversations with a model."""
