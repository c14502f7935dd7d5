"""Fleet simulator: vLLM engine models driven by the decision core and baseline routers (see README)."""
