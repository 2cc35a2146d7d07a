"""A rank's data plane: its KV pools, the producer that fills new KV, and the
worker that applies the coordinator's commands. The only torch importers."""
