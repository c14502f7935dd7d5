"""Ray-managed vLLM replicas: launch, health, metrics, weight updates, and the vLLM plugin."""
