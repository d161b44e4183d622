"""Access to the Kubernetes API (the official client)."""
