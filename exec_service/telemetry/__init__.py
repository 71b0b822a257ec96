"""The execute service's own telemetry: forward time per batch size, the request spans, and their assembly."""
