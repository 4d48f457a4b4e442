"""tinyserve: a textbook vLLM-style inference engine."""
