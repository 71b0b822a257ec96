"""OpenTelemetry for Kiln: setup from the standard environment, span names, and per-batch-size forward time."""
