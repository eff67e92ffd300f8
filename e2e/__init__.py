"""The local Kubernetes stack (real control plane as processes) and its end-to-end harness."""
