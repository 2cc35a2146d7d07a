"""The coordinator's logic without Ray: requests and leases, the step, the
commands it sends ranks, and the consensus rules it reduces their reports by."""
