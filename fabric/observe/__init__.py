"""What a person or a monitoring system reads: Prometheus metrics, histograms, the
CLI's result schema, progress lines."""
